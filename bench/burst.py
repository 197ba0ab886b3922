"""Burst: N callers x M calls (STREAM and SHM alternating) at once against a `paraminit serve` subprocess with a
small --max-concurrent, every call with a long deadline; every call must be served with the right bytes.

This is a fleet starting up: more callers than slots, all arriving together. Calls queue for a slot within their
deadline instead of being refused. Prints served/refused counts, wall time and per-call latency.

    python bench/burst.py --callers 8 --calls 6 --mib 64 --max-concurrent 2 --timeout 120
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--mib", type=int, default=64, help="MiB per call")
    ap.add_argument("--max-concurrent", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0, help="each call's deadline (seconds)")
    args = ap.parse_args()
    import numpy as np

    from paraminit_client import Client, ParaminitError, param, plan_of

    n = args.mib * (1 << 20) // 4
    plans = [plan_of([param("w", [n], {"uniform": {"lo": -1, "hi": 1, "seed": 100 + i}})]) for i in range(args.callers)]

    def digest(a: Any) -> str:
        return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()

    with Client() as local:  # the reference bytes: the same data plane in this process
        expected = [digest(local.materialize(p)["w"]) for p in plans]
    assert len(set(expected)) == args.callers

    lock = threading.Lock()
    outcomes: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    go = threading.Barrier(args.callers)

    def caller(i: int, target: str) -> None:
        with Client(target, timeout=args.timeout) as c:
            go.wait()
            for k in range(args.calls):
                kind = "stream" if (i + k) % 2 == 0 else "shm"
                t = time.perf_counter()
                try:
                    if kind == "stream":
                        ok = digest(c.materialize(plans[i])["w"]) == expected[i]
                    else:
                        with c.export(plans[i]) as lease:
                            ok = digest(lease.arrays["w"]) == expected[i]
                    outcome = f"{kind}:{'OK' if ok else 'WRONG_BYTES'}"
                except ParaminitError as err:
                    outcome = f"{kind}:{err.code.name}"
                with lock:
                    outcomes[outcome] += 1
                    latencies.append(time.perf_counter() - t)

    with serve(env={"PARAMINIT_MAX_CONCURRENT": str(args.max_concurrent)}) as target:
        threads = [threading.Thread(target=caller, args=(i, target)) for i in range(args.callers)]
        started = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.monotonic() - started
    lat = sorted(latencies)
    served = sum(v for k, v in outcomes.items() if k.endswith(":OK"))
    total = args.callers * args.calls
    print(
        f"burst: {args.callers} callers x {args.calls} calls of {args.mib} MiB, --max-concurrent "
        f"{args.max_concurrent}, {args.timeout:.0f} s deadlines: {served}/{total} served with correct bytes "
        f"in {elapsed:.1f} s"
    )
    for k, v in sorted(outcomes.items()):
        print(f"  {k:<28} {v}")
    if lat:
        print(f"  latency p50 {lat[len(lat) // 2]:.2f} s  p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.2f} s  max {lat[-1]:.2f} s")
    sys.exit(0 if served == total else 1)


if __name__ == "__main__":
    main()
