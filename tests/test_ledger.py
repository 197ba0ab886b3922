"""One reservation mechanism (paraminit_server.ledger): claims are released or committed once, whatever races."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from paraminit_server import errors
from paraminit_server.ledger import Claim, Ledger, Refusal
from paraminit_server.plane.budget import MemoryBudget
from paraminit_server.plane.leases import LeaseTable
from paraminit_server.plans.payloads import ValueSources


def limit(most: int) -> Refusal:
    def refusal(ledger: Ledger, n: int, holder: str) -> errors.ResourceExhausted | None:
        return None if ledger.total + n <= most else errors.ResourceExhausted(f"{n} bytes do not fit")

    return refusal


def test_release_is_idempotent_and_counts_once() -> None:
    ledger = Ledger()
    a, b = ledger.claim(100, "x"), ledger.claim(30, "x")
    assert (ledger.total, ledger.pending, ledger.claims("x")) == (130, 130, 2)
    assert a.release() is True
    assert a.release() is False
    assert (ledger.total, ledger.claims("x")) == (30, 1)
    assert b.commit() is True  # a pending claim commits (its bytes stay counted)
    assert (ledger.pending, ledger.committed) == (0, 30)
    assert b.release() is True and b.release() is False
    assert (ledger.total, ledger.pending, ledger.committed, ledger.claims("x")) == (0, 0, 0, 0)


def test_commit_is_idempotent_and_runs_its_record_once() -> None:
    ledger = Ledger()
    claim = ledger.claim(64, "owner")
    records: list[int] = []
    assert claim.commit(lambda: records.append(1)) is True
    assert claim.commit(lambda: records.append(2)) is False
    assert records == [1] and (ledger.pending, ledger.committed) == (0, 64)
    claim.release()
    assert claim.commit(lambda: records.append(3)) is False  # a released claim never commits
    assert records == [1] and ledger.total == 0


def test_a_failing_record_leaves_the_claim_pending() -> None:
    ledger = Ledger()
    claim = ledger.claim(8, "owner")

    def broken() -> None:
        raise KeyError("no room")

    with pytest.raises(KeyError):
        claim.commit(broken)
    assert claim.state == "pending" and ledger.pending == 8
    assert claim.release() and ledger.total == 0


def test_a_block_gives_back_what_it_did_not_commit() -> None:
    ledger = Ledger()
    with pytest.raises(RuntimeError), ledger.claim(10, "a"):
        raise RuntimeError("work failed")
    assert ledger.total == 0
    with ledger.claim(10, "a") as kept:
        kept.commit()
    with ledger.claim(5, "a"):
        pass
    assert (ledger.total, ledger.committed, ledger.claims("a")) == (10, 10, 1)


def test_concurrent_releases_and_commits_settle_each_claim_once() -> None:
    ledger = Ledger()
    claims = [ledger.claim(1 + i % 7, f"h{i % 3}") for i in range(400)]
    wins: list[tuple[int, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def race(worker: int) -> None:
        start.wait()
        for i, c in enumerate(claims):
            if (i + worker) % 2:
                done, what = c.release(), "release"
            else:
                done, what = c.commit(), "commit"
            if done:
                with lock:
                    wins.append((i, what))

    threads = [threading.Thread(target=race, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    releases = [i for i, what in wins if what == "release"]
    assert sorted(releases) == list(range(400))  # every claim given back exactly once
    assert len([i for i, what in wins if what == "commit"]) == len({i for i, what in wins if what == "commit"})
    assert (ledger.total, ledger.pending, ledger.committed) == (0, 0, 0)
    assert all(ledger.claims(f"h{k}") == 0 for k in range(3))


def test_a_refused_claim_takes_nothing_and_a_waiting_one_gets_freed_bytes() -> None:
    ledger = Ledger()
    first = ledger.claim(90, "a", limit(100))
    with pytest.raises(errors.ResourceExhausted):
        ledger.claim(20, "b", limit(100))
    assert (ledger.total, ledger.claims("b")) == (90, 0)
    got: list[Claim] = []
    waiter = threading.Thread(target=lambda: got.append(ledger.claim(20, "b", limit(100), wait=60)))
    waiter.start()
    first.release()
    waiter.join()
    assert len(got) == 1 and ledger.total == 20 and ledger.claims("b") == 1


def test_memory_budget_is_a_ledger_of_claims() -> None:
    budget = MemoryBudget(1000, "host")
    with pytest.raises(errors.ResourceExhausted, match="budget is 1000"):
        budget.reserve(1001)
    a = budget.reserve(600)
    with pytest.raises(errors.ResourceExhausted) as refused:
        budget.reserve(500)
    assert refused.value.reason == "memory" and refused.value.retry_after
    assert budget.reserved == 600
    a.release()
    a.release()
    assert budget.reserved == 0


def test_lease_slots_count_per_owner_until_the_lease_is_freed() -> None:
    table = LeaseTable(max_bytes=1000, max_per_owner=2, default_ttl=60, max_ttl=60, reap_interval=3600)
    try:
        freed: list[bool] = []
        s1, s2 = table.reserve("alice", 300), table.reserve("alice", 300)
        with pytest.raises(errors.ResourceExhausted, match="limit is 2"):
            table.reserve("alice", 1)
        with pytest.raises(errors.ResourceExhausted, match="leasable bytes"):
            table.reserve("bob", 401)
        rec = table.add(s1, "shm", 60, "d", freed.append)
        with pytest.raises(RuntimeError, match="used twice"):
            table.add(s1, "shm", 60, "d", freed.append)
        assert table.leased_bytes() == 600 and [r.lease_id for r in table.list("alice")] == [rec.lease_id]
        s2.release()
        s2.release()
        with pytest.raises(RuntimeError, match="used twice"):
            table.add(s2, "shm", 60, "d", freed.append)  # a released slot never becomes a lease
        assert table.leased_bytes() == 300
        assert table.release(rec.lease_id, "alice") is True
        assert table.release(rec.lease_id, "alice") is False
        assert freed == [True] and table.leased_bytes() == 0 and table.ledger.claims("alice") == 0
    finally:
        table.close()


def test_payload_store_gives_back_bytes_on_every_failure_and_on_expiry() -> None:
    sources = ValueSources(64, ttl=3600)
    ticket = sources.reserve(40)
    with pytest.raises(errors.ResourceExhausted, match="uploads in flight count"):
        sources.reserve(40)
    with pytest.raises(errors.InvalidRequest, match="larger than reserved"):
        sources.store("me", 0, 16, np.zeros(64, dtype=np.uint8), ticket)  # 64 bytes on a 40-byte ticket
    assert ticket.released and sources.used_bytes() == 0
    data = np.arange(32, dtype=np.uint8)
    pid, payload = sources.store("me", 0, 8, data)
    assert sources.used_bytes() == 32 and payload.claim is not None and payload.claim.state == "committed"
    with pytest.raises(errors.InvalidRequest, match="already used"):
        sources.store("me", 0, 8, data, payload.claim)
    assert sources.used_bytes() == 32 and sources.payload(pid, "me") is payload  # the failure took nothing back
    payload.expires_at = 0.0
    assert sources.payload(pid, "me") is None and sources.used_bytes() == 0


def test_a_failed_export_leaves_no_slot_and_no_memory_held(monkeypatch: pytest.MonkeyPatch) -> None:
    from paraminit_client import param, plan_of
    from paraminit_server.backends import choice
    from paraminit_server.config import ServerConfig
    from paraminit_server.plane import engine
    from paraminit_server.plane.caller import Caller
    from paraminit_server.plane.materializer import Materializer

    plane = Materializer(ServerConfig(backend="cpu", metrics_port=0, max_leases_per_client=2, shm_pool_bytes=0), choice.create("cpu"))
    plan = plan_of([param("w", [4096], {"zeros": {}})])

    def broken(*args: object, **kwargs: object) -> None:
        raise MemoryError("fill failed")

    try:
        monkeypatch.setattr(engine, "fill_all", broken)
        for _ in range(3):  # more failures than the per-client lease limit would allow if slots leaked
            with pytest.raises(MemoryError):
                plane.export(plan, "shm", Caller("alice"))
        assert plane.leases.leased_bytes() == 0 and plane.leases.ledger.claims("alice") == 0
        assert plane.admission.host.reserved == 0 and plane.admission.in_flight == 0
        monkeypatch.undo()
        export = plane.export(plan, "shm", Caller("alice"))
        assert plane.leases.ledger.claims("alice") == 1 and plane.leases.leased_bytes() == export.size > 0
        assert plane.release(export.lease.lease_id, Caller("alice"))
        assert plane.leases.leased_bytes() == 0 and plane.admission.host.reserved == 0
    finally:
        plane.close()


def test_a_lease_in_use_does_not_hold_up_the_expiry_of_the_others() -> None:
    """The reaper frees expired leases; one whose lock an Apply holds (a long fill) is freed when the Apply ends,
    on its own thread, and every other expired lease goes at once."""
    import time

    from paraminit_server.plane.leases import LeaseTable

    table = LeaseTable(1 << 30, 64, 60.0, 60.0, reap_interval=3600)
    freed: list[str] = []
    try:
        busy = table.add(table.reserve("a", 10), "shm", 0.0, "d", lambda explicit: freed.append("busy"))
        idle = table.add(table.reserve("b", 10), "shm", 0.0, "d", lambda explicit: freed.append("idle"))
        assert busy.lease_id != idle.lease_id
        busy.lock.acquire()  # an Apply is filling it
        try:
            time.sleep(0.01)
            assert table.reap() == 2
            assert freed == ["idle"]
        finally:
            busy.lock.release()
        deadline = time.monotonic() + 10
        while freed != ["idle", "busy"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert freed == ["idle", "busy"] and table.leased_bytes() == 0
    finally:
        table.close()
