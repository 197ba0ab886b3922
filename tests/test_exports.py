"""Zero-copy SHM exports and leases against a real server on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest

from conftest import running_server, server_fixture, target_of, wait_until
from paraminit.peers import is_local_peer
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import errors
from paraminit_server.admission import MemoryBudget
from paraminit_server.caller import Caller
from paraminit_server.exports import BufferPool
from paraminit_server.server import Running
from paraminit_server.shm import ShmSegment


def _listing() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("paraminit-")}


_BEFORE = _listing()  # segments some other process left: not ours to judge


def segments() -> set[str]:
    """This test run's segments."""
    return _listing() - _BEFORE


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


server = server_fixture(max_leases_per_client=4, max_leased_bytes=256 << 20)


def plan_small() -> pb.Plan:  # type: ignore[name-defined]
    return plan_of([param("w", [300, 70], {"kaimingUniformForShape": {"seed": 5}}),
                    param("e", [33, 8], {"normal": {"std": 0.02, "seed": 6}}, "bfloat16"),
                    param("h", [5], {"uniform": {"lo": -2, "hi": 2, "seed": 7}}, "float16"),
                    param("d", [3, 3], {"ones": {}}, "float64")])


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
    from paraminit_server.server import start
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
    done = subprocess.run(["unshare", "-rn", "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable, REMOTE_CALL],
                          capture_output=True, text=True, timeout=300)
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
