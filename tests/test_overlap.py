"""paraminit.overlap: work behind the receiving thread, in order, stopping at the first error."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from paraminit import overlap


@pytest.mark.parametrize("threaded", [True, False])
def test_results_come_in_order_and_run_where_asked(threaded: bool) -> None:
    where: set[int] = set()

    def work(i: int) -> int:
        where.add(threading.get_ident())
        return i * i

    assert list(overlap.behind(range(50), work, depth=3, threaded=threaded)) == [i * i for i in range(50)]
    assert (threading.get_ident() in where) is not threaded


@pytest.mark.parametrize("threaded", [True, False])
def test_an_error_stops_the_source_and_drops_pending_work(threaded: bool) -> None:
    closed, done = threading.Event(), []

    def source() -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.set()

    def work(i: int) -> int:
        if i == 5:
            raise ValueError("bad piece 5")
        done.append(i)
        return i

    with pytest.raises(ValueError, match="bad piece 5"):
        list(overlap.behind(source(), work, depth=4, threaded=threaded))
    assert closed.is_set()
    assert max(done) < 5 + 4 + 2  # nothing far past the failure ran


def test_a_consumer_that_stops_early_closes_the_source() -> None:
    closed = threading.Event()

    def source() -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.set()

    it = overlap.behind(source(), lambda i: i, threaded=True)
    assert next(it) == 0
    it.close()
    assert closed.is_set()


def test_helper_pays_only_with_enough_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert not overlap.helper_pays()
    monkeypatch.setattr(overlap.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert overlap.helper_pays()
