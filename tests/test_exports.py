"""Zero-copy SHM exports and leases against a real server on loopback."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit import hostmem, times
from paraminit.peers import is_local_peer
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ClientClosed, ParaminitError, cli, param, plan_of
from paraminit_server import errors
from paraminit_server.backends import shm
from paraminit_server.backends.shm import ShmSegment
from paraminit_server.plane.budget import MemoryBudget
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.exports import BufferPool
from paraminit_server.rpc.server import Running
from support import fake_madvise, run_cli, running_server, serve_subprocess, server_fixture, target_of, wait_until


def segments() -> set[str]:
    """This process's segments (servers in this process share its instance tag); other processes' are not ours to
    judge, and test runs in parallel on one host must not see each other's."""
    prefix = f"paraminit-{shm.instance_tag()}-"
    return {f for f in os.listdir("/dev/shm") if f.startswith(prefix)}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


server = server_fixture(max_leases_per_client=4, max_leased_bytes=256 << 20)


def plan_small() -> pb.Plan:  # type: ignore[name-defined]
    return plan_of(
        [
            param("w", [300, 70], {"kaimingUniformForShape": {"seed": 5}}),
            param("e", [33, 8], {"normal": {"std": 0.02, "seed": 6}}, "bfloat16"),
            param("h", [5], {"uniform": {"lo": -2, "hi": 2, "seed": 7}}, "float16"),
            param("d", [3, 3], {"ones": {}}, "float64"),
        ]
    )


def test_other_process_reads_the_streamed_bytes(client: Client) -> None:
    plan = plan_small()
    streamed = client.materialize(plan)
    with client.export(plan) as lease:
        assert oct(os.stat(f"/dev/shm/{lease.info.shm.segment_name}").st_mode & 0o777) == "0o600"
        assert len(lease.info.shm.segment_name) >= 32 + len("paraminit-")
        for t in lease.info.tensors:
            assert t.offset % 64 == 0
        code = textwrap.dedent(f"""
            import hashlib, mmap, os, sys
            fd = os.open('/dev/shm/{lease.info.shm.segment_name}', os.O_RDONLY)
            m = mmap.mmap(fd, {lease.info.shm.size}, prot=mmap.PROT_READ)
            for off, n in {[(t.offset, t.nbytes) for t in lease.info.tensors]}:
                print(hashlib.sha256(m[off:off + n]).hexdigest())
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        import hashlib

        assert out == [hashlib.sha256(streamed[t.name].tobytes()).hexdigest() for t in lease.info.tensors]
        for name, arr in streamed.items():
            assert lease.arrays[name].tobytes() == arr.tobytes()
            assert not lease.arrays[name].flags.owndata  # a view of the mapping, not a copy


def test_release_is_idempotent_and_unknown_is_not_found(client: Client) -> None:
    lease = client.export(plan_small())
    name = lease.info.shm.segment_name
    assert name in segments()
    assert lease.release() is True
    assert name not in segments()
    assert client.release(lease.lease_id) is False
    with pytest.raises(ParaminitError) as info:
        client.release("f" * 32)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_expiry_frees_and_renew_extends(client: Client, server: Running) -> None:
    lease = client.export(plan_small(), ttl_seconds=0.5)
    kept = client.export(plan_small(), ttl_seconds=0.5)
    kept.renew(30)
    name = lease.info.shm.segment_name
    assert wait_until(lambda: name not in segments(), 5)
    assert kept.info.shm.segment_name in segments()
    with pytest.raises(ParaminitError) as info:
        lease.renew()
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    statuses = client.leases()
    assert [s.lease.lease_id for s in statuses] == [kept.lease_id]
    assert statuses[0].lease.nbytes == kept.info.shm.size and statuses[0].owner == f"uid:{os.geteuid()}"
    kept.release()


def test_lease_limits(client: Client) -> None:
    held = [client.export(plan_small()) for _ in range(4)]
    with pytest.raises(ParaminitError) as info:
        client.export(plan_small())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for lease in held:
        lease.release()
    with pytest.raises(ParaminitError) as info:
        client.export(plan_of([param("big", [80 << 20], {"zeros": {}})]))  # 320 MiB > 256 MiB leasable
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not segments()


def test_apply_reinitializes_in_place_or_changes_nothing(client: Client) -> None:
    plan = plan_small()
    with client.export(plan) as lease:
        before = {k: v.copy() for k, v in lease.arrays.items()}
        mismatched = plan_small()
        mismatched.params[1].shape[0] = 34
        mismatched.params[0].init.uniform.lo = 1  # also invalid: lo > hi
        mismatched.params[0].init.uniform.hi = 0
        with pytest.raises(ParaminitError) as info:
            lease.apply(mismatched)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        renamed = plan_small()
        renamed.params[2].name = "other"
        with pytest.raises(ParaminitError):
            lease.apply(renamed)
        for k, v in before.items():
            assert lease.arrays[k].tobytes() == v.tobytes()
        reseeded = plan_small()
        reseeded.params[0].init.kaiming_uniform_for_shape.seed = 99
        lease.apply(reseeded)
        assert lease.arrays["w"].tobytes() == client.materialize(reseeded)["w"].tobytes()
        assert lease.arrays["w"].tobytes() != before["w"].tobytes()
        assert lease.arrays["e"].tobytes() == before["e"].tobytes()


def test_many_cycles_leave_nothing_behind(client: Client) -> None:
    plan = plan_of([param("w", [1 << 20], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])  # 4 MiB
    for _ in range(5):
        client.export(plan).release()
    baseline = rss_bytes()
    for i in range(200):
        with client.export(plan) as lease:
            assert lease.arrays["w"][i] != 0 or lease.arrays["w"][i + 1] != 0
    assert not segments()
    assert rss_bytes() - baseline < 64 << 20


def test_peer_locality() -> None:
    assert is_local_peer("ipv4:127.0.0.1:5000") and is_local_peer("ipv6:[::1]:5000") and is_local_peer("unix:/x")
    assert not is_local_peer("ipv4:10.1.2.3:5000") and not is_local_peer("ipv6:[2001:db8::1]:5000")


def test_remote_caller_is_refused_by_the_data_plane(server: Running) -> None:
    with pytest.raises(errors.FailedPrecondition, match="this host only"):
        server.plane.export(plan_small(), "shm", Caller(local=False))
    assert not segments() and server.plane.leases.leased_bytes() == 0


REMOTE_CALL = textwrap.dedent("""
    import grpc
    from paraminit_client import Client, ParaminitError, param, plan_of
    from paraminit_server.config import ServerConfig
    from paraminit_server.rpc.server import start
    running = start(ServerConfig(host="0.0.0.0", port=0, backend="cpu"), warm_up_async=False)
    with Client(f"192.0.2.1:{running.port}") as c:  # not loopback: this namespace's own test address
        assert len(c.materialize(plan_of([param("w", [4], {"ones": {}})]))["w"]) == 4  # STREAM works
        try:
            c.export(plan_of([param("w", [4], {"ones": {}})]))
        except ParaminitError as err:
            assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
            print("refused:", err.message)
        else:
            raise SystemExit("a remote peer got a shared-memory segment")
    running.stop(grace=0)
""")


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None, reason="needs unshare and ip")
def test_remote_peers_are_refused() -> None:
    """A real call from a non-loopback address: a network namespace of this test's own with 192.0.2.1 on lo."""
    setup = "ip link set lo up && ip addr add 192.0.2.1/32 dev lo"
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", setup], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable, REMOTE_CALL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "this host only" in done.stdout


def test_shutdown_frees_all_leases() -> None:
    with running_server() as running, Client(target_of(running)) as c:
        lease = c.export(plan_small())
        name = lease.info.shm.segment_name
        assert name in segments()
        running.stop(grace=0)
        assert name not in segments()
        np.asarray(lease.arrays["w"]).sum()  # the mapping itself stays valid for the client


def test_segment_pool_reuses_released_segments() -> None:
    with running_server(shm_pool_bytes=1 << 20, memory_budget=64 << 20) as running:
        with Client(target_of(running)) as c:
            plan = plan_small()
            first = c.export(plan)
            old = first.info.shm.segment_name
            first.release()
            assert old not in segments() and len(segments()) == 1  # pooled under a fresh name
            pooled = running.plane.exports.pool.nbytes
            assert pooled > 0 and running.plane.admission.host.reserved == pooled
            again = c.export(plan)
            assert again.info.shm.segment_name not in (old,) and len(segments()) == 1
            assert again.arrays["w"].tobytes() == c.materialize(plan)["w"].tobytes()
            other = plan_of([param("x", [8], {"ones": {}})])  # another size: a new segment
            with c.export(other) as lease:
                assert len(segments()) == 2 and lease.arrays["x"].tolist() == [1.0] * 8
            again.release()
        running.stop(grace=0)
        assert not segments() and running.plane.admission.host.reserved == 0


def test_a_view_kept_past_release_never_aliases_the_next_export() -> None:
    """With a pool, a numpy view kept past release() once wrote into the next export (a zeros export read 7.0):
    the client now sends Release only when its last view is gone, and the server recycles a segment only when no
    other process maps or holds it (a client that sends Release while mapping it anyway is quarantined)."""
    proc, target = serve_subprocess({"PARAMINIT_SHM_POOL_BYTES": str(1 << 20)})
    try:
        plan = plan_of([param("w", [256], {"zeros": {}})])
        with Client(target) as c:
            first = c.export(plan, "shm")
            view = first.arrays["w"]
            first.release()  # the view lives on: Release waits for it
            second = c.export(plan, "shm")
            view[:] = 7.0  # writes only into the first segment, which nobody else is lent
            assert not second.arrays["w"].any() and first.lease_id in {s.lease.lease_id for s in c.leases()}
            del view
            assert wait_until(lambda: first.lease_id not in {s.lease.lease_id for s in c.leases()}, timeout=10)
            second.release()
            # a holder that sends Release while still mapping the segment: the server looks, and does not pool it
            third = c.export(plan, "shm")
            name = third.info.shm.segment_name
            fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
            kept = mmap.mmap(fd, 0)
            os.close(fd)
            c._transport.release(third.lease_id, None)
            fourth = c.export(plan, "shm")
            assert fourth.info.shm.segment_name != name
            kept[:8] = b"\x07" * 8
            assert not fourth.arrays["w"].any()
            kept.close()
            fourth.release()
            third.release()  # its own mapping (Release again is a no-op on the server)
    finally:
        proc.terminate()
        proc.wait(30)


def test_segment_pool_never_crosses_identities() -> None:
    pool = BufferPool(1 << 20, MemoryBudget(1 << 20))
    seg = ShmSegment(4096)
    pool.give("token:alice", seg)
    assert pool.take("token:bob", 4096) is None
    assert pool.take("token:alice", 8192) is None
    assert pool.take("token:alice", 4096) is seg
    seg.close()
    pool.close()
    assert not segments()


MiB = 1 << 20


# -- lease limits are reserved before allocation -------------------------------------


def test_concurrent_exports_cannot_overshoot_lease_limits() -> None:
    """8 concurrent 16 MiB exports against 2 leases per client and 64 MiB: at most 2 are granted."""
    with running_server(max_leases_per_client=2, max_leased_bytes=64 * MiB, max_concurrent=8) as r, Client(target_of(r)) as c:
        plan = plan_of([param("w", [4 * MiB], {"ones": {}})])  # 16 MiB
        start = threading.Barrier(8)

        def one(_: int) -> Any:
            start.wait()
            try:
                return c.export(plan)
            except ParaminitError as err:
                return err

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        leases = [x for x in results if not isinstance(x, ParaminitError)]
        refused = [x for x in results if isinstance(x, ParaminitError)]
        try:
            assert len(leases) == 2, [str(e) for e in refused]
            assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
            assert r.plane.leases.leased_bytes() == 2 * 16 * MiB
            assert all(np.all(lease.arrays["w"] == 1.0) for lease in leases)
        finally:
            for lease in leases:
                lease.release()
        assert wait_until(lambda: r.plane.leases.leased_bytes() == 0)
        c.export(plan).release()  # the slots of refused exports were given back


# -- only explicitly released segments are pooled --------------------------------------


def test_expired_lease_memory_is_never_lent_again() -> None:
    plan = plan_of([param("w", [64 * 1024], {"uniform": {"lo": -1, "hi": 1, "seed": 3}})])  # 256 KiB
    with running_server(shm_pool_bytes=64 * MiB) as r, Client(target_of(r)) as a, Client(target_of(r)) as b:
        held = a.export(plan, ttl_seconds=0.2)
        mine = held.arrays["w"]  # A keeps its mapping past the expiry
        assert wait_until(lambda: not r.plane.leases.list(), 10)
        assert r.plane.exports.pool.nbytes == 0  # expired: closed, not pooled
        other = b.export(plan)
        try:
            theirs = other.arrays["w"]
            before = theirs.copy()
            mine[:] = 12345.0  # A writes through its stale mapping
            assert np.array_equal(theirs, before)  # B does not see it
            assert other.info.shm.segment_name != held.info.shm.segment_name
        finally:
            theirs = np.empty(0)  # no view of B's segment outlives its release (one would hold the Release back)
            other.release()
        # an explicit Release does pool the buffer (the optimisation still works)
        assert wait_until(lambda: r.plane.exports.pool.nbytes == other.info.shm.size)
        del mine, theirs
        held.stop_renewing()


def test_lock_file_goes_with_the_server() -> None:
    proc, target = serve_subprocess()
    try:
        with Client(target) as c:
            lease = c.export(plan_of([param("w", [1024], {"ones": {}})]))
            tag = lease.info.shm.segment_name.split("-")[1]
            lease.release()
        lock = Path(f"/dev/shm/.paraminit-locks-{os.geteuid()}/{tag}.lock")
        assert lock.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not lock.exists()


EXITS_HOLDING = textwrap.dedent("""
    import sys
    from paraminit_client import Client, param, plan_of
    c = Client(sys.argv[1])
    lease = c.export(plan_of([param("w", [4096], {"ones": {}})]))
    print(lease.info.shm.segment_name, flush=True)
    # exits holding the lease and the client: nothing released by hand
""")


def test_remote_client_releases_its_leases_at_exit() -> None:
    proc, target = serve_subprocess()
    try:
        names = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", EXITS_HOLDING, target], capture_output=True, text=True, timeout=120, check=True)
            names.append(Path("/dev/shm") / out.stdout.strip())
        assert wait_until(lambda: not any(n.exists() for n in names), 10), names  # the TTL is 300 s
        with Client(target) as c:
            assert c.leases() == []
    finally:
        proc.terminate()
        proc.wait(60)


def test_killed_client_lease_expires_and_segment_goes() -> None:
    proc, target = serve_subprocess()
    try:
        code = textwrap.dedent(f"""
            import os
            from paraminit_client import Client, param, plan_of
            c = Client({target!r})
            lease = c.export(plan_of([param("w", [1024], {{"ones": {{}}}})]), ttl_seconds=1.0)
            print(lease.info.shm.segment_name, flush=True)
            os.kill(os.getpid(), 9)
        """)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert child.returncode == -signal.SIGKILL
        name = child.stdout.strip()
        assert name.startswith("paraminit-") and os.path.exists(f"/dev/shm/{name}")
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{name}"), 10)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_segments_of_a_killed_server_go_at_the_next_start() -> None:
    """SIGKILL leaves five leased segments behind; the next server removes them, never a live server's."""
    live, live_target = serve_subprocess()
    proc, target = serve_subprocess()
    try:
        with Client(live_target) as other:
            kept = other.export(plan_of([param("k", [1024], {"ones": {}})]))
            with Client(target) as c:
                leases = [c.export(plan_of([param("w", [1024], {"ones": {}})])) for _ in range(5)]
                names = [f"/dev/shm/{x.info.shm.segment_name}" for x in leases]
                proc.kill()
                proc.wait(30)
                for x in leases:
                    x.stop_renewing()
            assert all(os.path.exists(n) for n in names)
            proc, target = serve_subprocess()  # the next start
            assert wait_until(lambda: not any(os.path.exists(n) for n in names), 30)
            assert os.path.exists(f"/dev/shm/{kept.info.shm.segment_name}")  # the live server's is untouched
            assert np.all(kept.arrays["k"] == 1.0)
            kept.release()
    finally:
        for p in (proc, live):
            p.terminate()
            p.wait(30)


# -- leases from the shell ------------------------------------------------------------------------------------------


def test_leases_list_renew_release_from_the_shell(capsys: pytest.CaptureFixture[str]) -> None:
    with running_server() as server, Client(target_of(server)) as c:
        target = target_of(server)
        code, out, _ = run_cli(capsys, "leases", "--target", target)
        assert code == 0 and "no live leases" in out
        lease = c.export(plan_of([param("w", [1024], {"ones": {}})]), ttl_seconds=60)
        code, out, err = run_cli(capsys, "leases", "--target", target)
        assert code == 0, err
        assert lease.lease_id in out and "shm" in out and "4.0 KiB" in out and "1 lease," in out
        assert all(len(line) <= 100 for line in out.splitlines())
        code, out, _ = run_cli(capsys, "leases", "--json", "--target", target)
        doc = json.loads(out)
        (row,) = doc["leases"]
        assert doc["ok"] is True and doc["exit_code"] == 0
        assert row["lease_id"] == lease.lease_id and row["nbytes"] == 4096 and 0 < row["expires_in_s"] <= 60
        code, out, err = run_cli(capsys, "leases", "renew", lease.lease_id, "--ttl", "600", "--target", target)
        assert code == 0 and "renewed" in out, err
        code, out, err = run_cli(capsys, "leases", "renew", lease.lease_id, "--ttl", "900", "--json", "--target", target)
        (renewed,) = json.loads(out)["leases"]
        assert code == 0 and renewed["lease_id"] == lease.lease_id and 600 < renewed["expires_in_s"] <= 900, err
        (status,) = c.leases()
        assert times.epoch(status.lease.expires_at) - time.time() > 300
        code, out, err = run_cli(capsys, "leases", "release", lease.lease_id, "--target", target)
        assert code == 0 and f"{lease.lease_id}: released" in out, err
        assert c.leases() == []
        code, _, err = run_cli(capsys, "leases", "release", "--target", target)
        assert code == cli.EXIT_USAGE and "LEASE_ID" in err
        code, _, err = run_cli(capsys, "leases")
        assert code == cli.EXIT_USAGE and "--target" in err
        lease.stop_renewing()


def test_the_lock_directory_must_be_this_users_and_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user who made the lock directory first could swap a live server's lock file and make the next
    server sweep its segments: an existing directory is used only when it is a real directory, this user's, 0700."""
    d = tmp_path / "locks"
    shm.own_lock_dir(str(d))
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    shm.own_lock_dir(str(d))  # again: the same directory is fine
    os.chmod(d, 0o777)
    with pytest.raises(shm.UnsafeLockDir, match="mode 0777, not 0700"):
        shm.own_lock_dir(str(d))
    os.rmdir(d)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    d.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(shm.UnsafeLockDir, match="not a directory"):
        shm.own_lock_dir(str(d))
    d.unlink()
    d.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # as if another user owned it
    with pytest.raises(shm.UnsafeLockDir, match="owned by uid"):
        shm.own_lock_dir(str(d))
    monkeypatch.undo()
    # a server whose lock directory is unsafe starts anyway for streams, refusing SHM exports with the reason
    monkeypatch.setattr(shm, "lock_dir", lambda: str(tmp_path / "elsewhere-link"))
    (tmp_path / "elsewhere-link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(shm, "_instance", None)
    with pytest.raises(errors.FailedPrecondition, match=r"shared memory is unavailable: the lock directory .*elsewhere-link exists"):
        shm.instance_tag()  # a permanent state: FAILED_PRECONDITION naming the path, not a retryable RESOURCE_EXHAUSTED
    assert shm.sweep() == []


class _LeavingContext:
    """A servicer context of a local caller who leaves once the export's answer is being sent."""

    def __init__(self) -> None:
        self.active = True

    def time_remaining(self) -> float:
        return 60.0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def auth_context(self) -> dict[str, Any]:
        return {}

    def is_active(self) -> bool:
        return self.active

    def cancel(self) -> None:
        self.active = False

    def abort_with_status(self, status: Any) -> None:
        self.status = status
        raise _Aborted(status.code)


class _Aborted(Exception):
    """What grpc's abort raises inside a handler."""


def test_an_export_whose_caller_leaves_before_the_answer_is_released_at_once() -> None:
    """The lease id only ever reaches the caller in the answer: if the caller is gone by the time the export is
    made, nobody can release or renew it, so it goes now instead of at its TTL. A caller that hangs up after
    the answer was sent may hold it: that lease stays."""
    with running_server() as r:
        request = pb.MaterializeRequest(plan=plan_of([param("w", [1024], {"ones": {}})]), delivery=pb.DELIVERY_SHM)
        context = _LeavingContext()
        answers = r.servicer.Materialize(request, context)  # type: ignore[arg-type]
        first = next(answers)
        assert first.WhichOneof("msg") == "export" and len(r.plane.leases.list()) == 1
        context.active = False  # sent, then the caller hangs up: it has the lease id, the lease stays
        answers.close()
        assert [lease.lease_id for lease in r.plane.leases.list()] == [first.export.lease.lease_id]
        r.plane.leases.release(first.export.lease.lease_id, r.plane.leases.list()[0].owner)
        gone = _LeavingContext()
        real = r.plane.export

        def slow_export(*args: Any, **kwargs: Any) -> Any:
            done = real(*args, **kwargs)
            gone.active = False  # the caller leaves while the export is being made
            return done

        r.plane.export = slow_export  # type: ignore[method-assign]
        try:
            with pytest.raises(_Aborted):
                list(r.servicer.Materialize(request, gone))  # type: ignore[arg-type]
        finally:
            del r.plane.export
        assert gone.status.code == grpc.StatusCode.CANCELLED
        assert r.plane.leases.list() == []


def test_an_export_too_large_for_one_answer_is_refused_before_it_is_made() -> None:
    """An ExportInfo cannot be split: past a stock client's 4 MiB the export was made and leased, and its caller
    got RESOURCE_EXHAUSTED and no lease id. Now the bound is checked first and nothing is leased."""
    from paraminit_server.rpc import service

    names = [f"model.layers.{i}.mixture.experts.{i}.down_proj.weight" for i in range(70_000)]
    plan = plan_of([param(n, [2, 2], {"zeros": {}}) for n in names])
    assert service.export_info_bound(plan) > service.MAX_ANSWER_BYTES
    with running_server() as r, Client(target_of(r)) as c:
        with pytest.raises(ParaminitError) as err:
            c.export(plan, "shm")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "use STREAM" in err.value.message
        assert r.plane.leases.list() == [] and r.plane.leases.leased_bytes() == 0
        small = plan_of([param(n, [2, 2], {"zeros": {}}) for n in names[:1000]])
        info = pb.ExportInfo(plan_digest="0" * 64)
        info.tensors.extend(pb.TensorInfo(name=n, dtype=1, shape=[2, 2], offset=1 << 40, nbytes=16) for n in names[:1000])
        assert info.ByteSize() < service.export_info_bound(small)  # the bound is one


def test_leases_of_a_closed_client_are_released_at_exit() -> None:
    """The documented `with Client(target) as client:` pattern closes the client while its SHM tensors live on;
    the channel stays open for their Release, sent at exit (it failed silently on the closed channel before,
    and the lease and its segment were held until the TTL). A closed client refuses new calls all the same."""
    with running_server() as r:
        code = textwrap.dedent(f"""
            from paraminit_client import Client, ClientClosed, param, plan_of
            plan = plan_of([param("w", [4096], {{"ones": {{}}}})])
            with Client({target_of(r)!r}) as client:
                lease = client.export(plan, "shm", ttl_seconds=600)
            assert float(lease.arrays["w"].sum()) == 4096.0
            try:
                client.validate(plan)
            except ClientClosed:
                print("refused", flush=True)
            print(lease.lease_id, flush=True)
            import sys; sys.stdin.readline()  # the parent looks at the server's leases, then lets this exit
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "refused"
            lease_id = proc.stdout.readline().strip()
            assert [x.lease_id for x in r.plane.leases.list()] == [lease_id]
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(60) == 0
        finally:
            proc.kill()
        assert wait_until(lambda: r.plane.leases.list() == [], 10)


class _ViewsLiveOn:
    """Stands in for a CUDA IPC mapping whose views outlive release() (CudaMapping.close returns False and runs
    `then` when the last view goes): the one case where a lease is released but its Release is not yet sent."""

    def __init__(self) -> None:
        self.then: Any = None

    def close(self, then: Any = None) -> bool:
        self.then = then
        return False


def test_a_release_waiting_for_its_last_view_outlives_the_clients_close() -> None:
    """`with c.export(plan, "cuda_ipc") as lease:` inside `with Client(target) as c:`, with torch views kept past
    both: the lease owes the server its Release until the last view goes. The closed client keeps its channel open
    for it, and for its renewals; the Release then lands (on a device the lease stayed until its TTL)."""
    with running_server() as r:
        c = Client(target_of(r))
        lease = c.export(plan_of([param("w", [64], {"ones": {}})]), "shm", ttl_seconds=600)
        views = lease._cuda = _ViewsLiveOn()  # type: ignore[assignment]
        assert lease.release() is False and lease.released and lease.owes_release  # deferred to the last view
        c.close()
        with pytest.raises(ParaminitError):
            c.validate(plan_of([]))  # closed: new calls are refused
        before = lease.expires_at
        time.sleep(0.01)
        assert lease.renew(900) > before  # renewals go on until the last view goes
        assert [x.lease_id for x in r.plane.leases.list()] == [lease.lease_id]
        views.then()  # the last view goes: Release from a background thread, over the closed client's channel
        assert wait_until(lambda: r.plane.leases.list() == [], 10)
        assert not lease.owes_release
        with pytest.raises(ClientClosed):  # nothing is owed any more: the channel is gone, and so is the lease
            lease.renew(900)


HOLDS_MAPPING = textwrap.dedent("""
    import mmap, os, sys
    fd = os.open("/dev/shm/" + sys.argv[1], os.O_RDWR)
    m = mmap.mmap(fd, int(sys.argv[2]))
    os.close(fd)
    print(m[0:4].hex(), flush=True)
    sys.stdin.readline()  # holds the mapping until told
""")


def test_an_expired_segment_still_mapped_stays_charged_until_unmapped() -> None:
    """A lease that expires while another process maps its segment: the pages stay with that process, so the
    bytes stay charged to the memory budget (and the segment named) until it unmaps, then both go."""
    plan = plan_of([param("w", [1 << 20], {"ones": {}})])  # 4 MiB
    with running_server() as r, Client(target_of(r)) as c:
        base = r.plane.admission.host.reserved
        lease = c.export(plan, ttl_seconds=0.3)
        name, size = lease.info.shm.segment_name, lease.info.shm.size
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDS_MAPPING, name, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "0000803f"  # 1.0f
            lease.stop_renewing()
            assert wait_until(lambda: not r.plane.leases.list(), 10)  # expired
            time.sleep(2.5)  # past a quarantine look
            assert r.plane.exports.quarantined_bytes() == size
            assert r.plane.admission.host.reserved - base >= size and os.path.exists(f"/dev/shm/{name}")
            assert holder.stdin is not None
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(30) == 0
        finally:
            holder.kill()
        # the watcher takes the segment off its list, then unlinks it and gives its bytes back: wait for all three
        assert wait_until(
            lambda: (
                r.plane.exports.quarantined_bytes() == 0
                and r.plane.admission.host.reserved == base
                and not os.path.exists(f"/dev/shm/{name}")
            ),
            15,
        )


def test_close_waits_for_a_quarantined_segment_being_freed() -> None:
    """A quarantine watcher takes a segment off its list before it unlinks it: a close() that comes in between
    (a server stopping, an in-process Client leaving its `with`) returns only once that segment is gone too, as
    close() promises (it found the list empty and returned with the segment still named, now and then under load)."""
    from types import SimpleNamespace

    from paraminit_server.backends import HOST
    from paraminit_server.plane.exports import Exports
    from paraminit_server.plane.leases import LeaseTable

    freeing, freed = threading.Event(), threading.Event()

    class Segment:  # a segment nobody else maps, slow to unlink
        def unmap(self) -> None:
            pass

        def mapped_elsewhere(self) -> bool:
            return False

        def close(self) -> None:
            freeing.set()
            time.sleep(0.3)
            freed.set()

    budget = MemoryBudget(1 << 20)
    exports = Exports(SimpleNamespace(memory=HOST), LeaseTable(1 << 20, 4, 60.0, 60.0, reap_interval=3600), budget)
    exports._quarantine(Segment(), budget.reserve(4096), "someone")
    assert freeing.wait(10)  # the watcher has taken it off the list and is unlinking it
    exports.close()
    assert freed.is_set() and budget.reserved == 0 and exports.leases.ledger.claims("someone") == 0


def test_a_segment_takes_its_memory_before_any_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment's pages are populated (or, where the kernel cannot, reserved by fallocate) when it is made, so a
    full /dev/shm is RESOURCE_EXHAUSTED then, with no segment left behind, never SIGBUS in the middle of a fill."""
    fallocated: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (fallocated.append(n), real(fd, off, n))[1])
    seg = ShmSegment(3 << 20)
    assert os.stat(seg.path).st_blocks * 512 >= 3 << 20  # tmpfs holds every page already
    assert fallocated in ([], [3 << 20])
    seg.close()

    monkeypatch.setattr(hostmem, "_madvise", lambda: fake_madvise(errno.EINVAL))  # an older kernel
    fallocated.clear()
    ShmSegment(1 << 20).close()
    assert fallocated == [1 << 20]
    monkeypatch.setattr(hostmem, "_madvise", lambda: fake_madvise(errno.EFAULT))  # tmpfs is full
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(errors.ResourceExhausted, match="1048576-byte shared-memory segment: no memory left"):
        ShmSegment(1 << 20)
    assert set(os.listdir("/dev/shm")) == before


def test_apply_stops_at_the_requests_end() -> None:
    """Apply fills a live lease in place, asking the request's stop as an export does: a request that ended (a
    deadline, a cancellation, the server's drain) stops the fill and says the lease holds partly new values."""
    from paraminit_server.plane.caller import Caller

    plan = plan_of([param(f"w{i}", [1 << 16], {"normal": {"std": 1.0, "seed": i}}) for i in range(16)])
    again = plan_of([param(f"w{i}", [1 << 16], {"normal": {"std": 2.0, "seed": i}}) for i in range(16)])
    with running_server() as r:
        caller = Caller()
        first = r.plane.check(plan, caller)
        export = r.plane.exports.export(first.params, first.digest, "shm", caller)
        second = r.plane.check(again, caller)
        asked: list[int] = []
        with pytest.raises(errors.Cancelled, match="partly new values"):
            r.plane.exports.apply(
                export.lease.lease_id, second.params, second.digest, caller, lambda: bool(asked.append(1)) or len(asked) > 2
            )
        assert len(asked) > 2  # asked while filling, not only at the end
        assert export.lease.plan_digest == first.digest  # the lease is not said to hold the new plan
        r.plane.exports.apply(export.lease.lease_id, second.params, second.digest, caller)
        assert export.lease.plan_digest == second.digest
        for c in (first, second):
            c.close()


def test_segments_held_elsewhere_are_found_in_one_pass(tmp_path: Path) -> None:
    """A segment another process maps, and one it only holds open (a descriptor keeps the pages as a mapping
    does), are both held; the quarantine's settle round looks them all up in one pass over /proc."""
    paths = []
    for i in range(3):
        p = f"/dev/shm/paraminit-test-held-{os.getpid()}-{i}"
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
        paths.append(p)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import mmap, os, sys
                fd = os.open({paths[0]!r}, os.O_RDWR)
                m = mmap.mmap(fd, 4096)
                os.close(fd)
                held = os.open({paths[1]!r}, os.O_RDONLY)
                print("ready", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert shm.held_by_others(set(paths)) == {paths[0], paths[1]}
        assert shm.mapped_by_others(paths[1]) and not shm.mapped_by_others(paths[2])
    finally:
        holder.communicate("", timeout=30)
        for p in paths:
            os.unlink(p)


def test_segments_another_process_still_maps_count_among_the_owners_leases() -> None:
    """Segments released (or expired) while another process still maps them stay charged and quarantined; they
    also count among their owner's leases, so an owner cannot pile up more of them than --max-leases-per-client."""
    plan = plan_of([param("w", [1024], {"ones": {}})])
    with running_server(max_leases_per_client=2) as r, Client(target_of(r)) as c:
        holders = []
        try:
            for _ in range(2):
                lease = c.export(plan, ttl_seconds=0.3)
                name, size = lease.info.shm.segment_name, lease.info.shm.size
                holder = subprocess.Popen(
                    [sys.executable, "-c", HOLDS_MAPPING, name, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
                assert holder.stdout is not None and holder.stdout.readline().strip() == "0000803f"
                holders.append(holder)
                lease.stop_renewing()
                lease.release()  # ours goes; the holder's mapping stays
            assert wait_until(lambda: not r.plane.leases.list() and r.plane.exports.quarantined_bytes() > 0, 10)
            with pytest.raises(ParaminitError, match=r"client holds 2 leases \(expired ones whose memory it still maps count\)"):
                c.export(plan)
        finally:
            for holder in holders:
                holder.communicate("\n", timeout=30)
        assert wait_until(lambda: r.plane.exports.quarantined_bytes() == 0, 15)
        with c.export(plan) as again:  # their slots came back with their segments
            assert again.arrays["w"].tolist() == [1.0] * 1024
