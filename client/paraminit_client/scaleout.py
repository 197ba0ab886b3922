"""Splitting one plan across several workers and reassembling the bytes in place.

Values depend only on (seed, global index), so a parameter cut into row
regions and computed on different workers reassembles into exactly the bytes
one worker would give. Parts run concurrently; a part whose worker fails with
a transport error is retried on another worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from paraminit.hostmem import receive_buffer
from paraminit.regions import box_of
from paraminit.v1 import plan_pb2
from paraminit_client.errors import ParaminitError

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
}
DEFAULT_SPLIT_BYTES = 64 << 20
_ALIGN = 64  # each output array starts on a cache line


@dataclass(frozen=True)
class Part:
    """A sub-plan and, per parameter in it, (plan index, row slice of the parameter's region)."""

    plan: plan_pb2.Plan
    pieces: tuple[tuple[int, int, int], ...]  # (param index, first row, stop row) relative to the region
    nbytes: int


def split_plan(plan: plan_pb2.Plan, param_bytes: Sequence[int], n_parts: int, split_bytes: int = DEFAULT_SPLIT_BYTES) -> list[Part]:
    """Parameters in balanced groups; one larger than split_bytes is cut into row regions first."""
    units: list[tuple[int, int, int, int]] = []  # (index, row0, row1, bytes)
    for i, p in enumerate(plan.params):
        region = box_of(p)
        size = param_bytes[i]
        rows = region[0][1] - region[0][0] if region else 1
        pieces = min(rows, max(1, -(-size // split_bytes))) if region and size > split_bytes else 1
        for k in range(pieces):
            r0, r1 = rows * k // pieces, rows * (k + 1) // pieces
            units.append((i, r0, r1, size * (r1 - r0) // max(rows, 1)))
    groups: list[list[tuple[int, int, int, int]]] = [[] for _ in range(max(1, n_parts))]
    loads = [0] * len(groups)
    for unit in sorted(units, key=lambda u: -u[3]):  # greedy balance, largest first
        g = loads.index(min(loads))
        groups[g].append(unit)
        loads[g] += unit[3]
    parts = []
    for group, load in zip(groups, loads, strict=True):
        if not group:
            continue
        sub = plan_pb2.Plan()
        for i, r0, r1, _ in sorted(group):
            q = sub.params.add()
            q.CopyFrom(plan.params[i])
            region = box_of(plan.params[i])
            if region:
                del q.region[:]
                first = region[0][0]
                q.region.add(start=first + r0, stop=first + r1)
                for start, stop in region[1:]:
                    q.region.add(start=start, stop=stop)
            q.name = f"{q.name}#{r0}"  # unique within the part even when two pieces share a worker
        parts.append(Part(sub, tuple((i, r0, r1) for i, r0, r1, _ in sorted(group)), load))
    return parts


def run_parts(parts: Sequence[Part], workers: Sequence[Any], fetch: Callable[[Any, Part], None]) -> None:
    """Run every part concurrently (`fetch(worker, part)` lands it in place), retrying retryable failures on the
    other workers. A retried part is written again whole: its bytes are the same whichever worker computes them."""
    alive = list(range(len(workers)))
    lock = threading.Lock()
    tried: dict[int, set[int]] = {k: set() for k in range(len(parts))}

    def pick(k: int) -> int:
        with lock:
            fresh = [w for w in alive if w not in tried[k]] or list(alive)
            if not fresh:
                raise ParaminitError(grpc.StatusCode.UNAVAILABLE, "every worker failed")
            w = fresh[k % len(fresh)]
            tried[k].add(w)
            return w

    with ThreadPoolExecutor(max_workers=max(1, min(len(parts), 4 * len(workers)))) as pool:
        submitted: dict[Future[None], int] = {}
        for k in range(len(parts)):
            submitted[pool.submit(fetch, workers[pick(k)], parts[k])] = k
        pending = set(submitted)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    f.result()
                except ParaminitError as err:
                    if err.code not in RETRYABLE:
                        for other in pending:
                            other.cancel()
                        raise
                    k = submitted[f]
                    with lock:
                        if len(alive) > 1:  # one balanced channel (dns:///) stays; its retries re-balance
                            for dead in [w for w in alive if w in tried[k]]:
                                alive.remove(dead)
                    nf = pool.submit(fetch, workers[pick(k)], parts[k])
                    submitted[nf] = k
                    pending.add(nf)


def assemble(
    plan: plan_pb2.Plan, param_bytes: Sequence[int], dtypes: Sequence[np.dtype[Any]]
) -> tuple[dict[str, np.ndarray[Any, Any]], Callable[[Part], dict[str, np.ndarray[Any, Any]]]]:
    """The plan's output arrays, views of one host buffer (as a single stream's are), and for a part the views its
    pieces land in: sub-plan name -> the rows of the output it covers, so every stream writes in place.

    Args:
        plan: the validated plan.
        param_bytes: each parameter's materialized bytes (the validation report's).
        dtypes: each parameter's numpy dtype.

    Returns:
        (parameter name -> array of its region's shape, part -> {sub-plan name: view}).
    """
    offsets, total = [], 0
    for n in param_bytes:
        offsets.append(total)
        total += -(-int(n) // _ALIGN) * _ALIGN
    buf = receive_buffer(total)  # as one stream's (GrpcTransport)
    out = {
        p.name: buf[o : o + int(n)].view(dt).reshape(tuple(b - a for a, b in box_of(p)))
        for p, o, n, dt in zip(plan.params, offsets, param_bytes, dtypes, strict=True)
    }
    names = [p.name for p in plan.params]

    def views(part: Part) -> dict[str, np.ndarray[Any, Any]]:
        got = {}
        for q, (i, r0, r1) in zip(part.plan.params, part.pieces, strict=True):
            whole = out[names[i]]
            got[q.name] = whole[r0:r1] if whole.ndim else whole
        return got

    return out, views
