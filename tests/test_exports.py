"""Zero-copy SHM exports and leases against a real server on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.config import ServerConfig
from paraminit_server.exports import is_local_peer
from paraminit_server.server import Running, start


def _listing() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("paraminit-")}


_BEFORE = _listing()  # segments some other process left: not ours to judge


def segments() -> set[str]:
    """This test run's segments."""
    return _listing() - _BEFORE


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    running = start(ServerConfig(host="127.0.0.1", port=0, backend="numpy", max_leases_per_client=4,
                                 max_leased_bytes=256 << 20), warm_up_async=False)
    yield running
    running.stop(grace=0)


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


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
    assert client._call(client.stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id)).released is False
    with pytest.raises(ParaminitError) as info:
        client._call(client.stub.Release, pb.ReleaseRequest(lease_id="f" * 32))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_expiry_frees_and_renew_extends(client: Client, server: Running) -> None:
    lease = client.export(plan_small(), ttl_seconds=0.5)
    kept = client.export(plan_small(), ttl_seconds=0.5)
    kept.renew(30)
    name = lease.info.shm.segment_name
    deadline = time.monotonic() + 5
    while name in segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert name not in segments()
    assert kept.info.shm.segment_name in segments()
    with pytest.raises(ParaminitError) as info:
        lease.renew()
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    statuses = client.leases()
    assert [s.lease.lease_id for s in statuses] == [kept.lease_id]
    assert statuses[0].lease.nbytes == kept.info.shm.size and statuses[0].owner == "anonymous"
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


def test_remote_peers_are_refused() -> None:
    assert is_local_peer("ipv4:127.0.0.1:5000") and is_local_peer("ipv6:[::1]:5000") and is_local_peer("unix:/x")
    assert not is_local_peer("ipv4:10.1.2.3:5000") and not is_local_peer("ipv6:[2001:db8::1]:5000")


def test_shutdown_frees_all_leases() -> None:
    running = start(ServerConfig(host="127.0.0.1", port=0), warm_up_async=False)
    with Client(f"127.0.0.1:{running.port}") as c:
        lease = c.export(plan_small())
        name = lease.info.shm.segment_name
        assert name in segments()
        running.stop(grace=0)
        assert name not in segments()
        np.asarray(lease.arrays["w"]).sum()  # the mapping itself stays valid for the client


def test_segment_pool_reuses_released_segments() -> None:
    running = start(ServerConfig(host="127.0.0.1", port=0, shm_pool_bytes=1 << 20, memory_budget=64 << 20),
                    warm_up_async=False)
    try:
        with Client(f"127.0.0.1:{running.port}") as c:
            plan = plan_small()
            first = c.export(plan)
            old = first.info.shm.segment_name
            first.release()
            assert old not in segments() and len(segments()) == 1  # pooled under a fresh name
            pooled = running.servicer.exports.pool.nbytes
            assert pooled > 0 and running.servicer.admission.memory.reserved == pooled
            again = c.export(plan)
            assert again.info.shm.segment_name not in (old,) and len(segments()) == 1
            assert again.arrays["w"].tobytes() == c.materialize(plan)["w"].tobytes()
            other = plan_of([param("x", [8], {"ones": {}})])  # another size: a new segment
            with c.export(other) as lease:
                assert len(segments()) == 2 and lease.arrays["x"].tolist() == [1.0] * 8
            again.release()
        running.stop(grace=0)
        assert not segments() and running.servicer.admission.memory.reserved == 0
    finally:
        running.stop(grace=0)


def test_segment_pool_never_crosses_identities() -> None:
    from paraminit_server.exports import SegmentPool, ShmSegment

    pool = SegmentPool(1 << 20)
    seg = ShmSegment(4096)
    pool.give("token:alice", seg, None)
    assert pool.take("token:bob", 4096) is None
    assert pool.take("token:alice", 8192) is None
    assert pool.take("token:alice", 4096) is seg
    seg.close()
    pool.close()
    assert not segments()
