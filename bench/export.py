"""Zero-copy handoff benchmark, in one run on a 1 GiB plan.

Rows: local generation alone (the CPU backend filling a fresh buffer), SHM
export + client mapping (a `paraminit serve` subprocess fills a segment, the
client maps it and touches every page), and STREAM (Client.materialize).
Targets: SHM <= 1.25x generation alone, and >= 5x faster than STREAM.

    python bench/export.py [--mib 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_of, serve, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    nbytes = args.mib << 20
    from paraminit_client import Client, param, plan_of
    from paraminit_server.backends.cpu import CpuBackend
    from paraminit_server.plane import engine, layout
    from paraminit_server.plans.validation import check

    p = plan_of([param("w", [nbytes // 4], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
    backend = CpuBackend()
    backend.warm_up()
    lay = layout.export_layout(check(p).params)

    def generate() -> None:
        engine.fill_all(backend, lay, np.empty(lay.data_bytes, np.uint8))

    rows = [("generation alone (fresh buffer)", best_of(generate, args.repeat))]
    held: list[Any] = []

    def handoff(c: Any) -> None:
        """Export and map; the release is timed apart (it frees pages, after the trainer is done)."""
        lease = c.export(p)
        w = lease.arrays["w"]
        assert float(w[::1024].view(np.uint32).max()) > 0  # read one value per 4 KiB page
        held.append(lease)

    def timed_handoff(c: Any) -> tuple[float, float]:
        handoffs, releases = [], []
        for _ in range(args.repeat):
            handoffs.append(best_of(lambda: handoff(c), 1))
            releases.append(best_of(lambda: held.pop().release(), 1))
        return min(handoffs), min(releases)

    with serve() as target, Client(target, timeout=600) as c:
        shm, release = timed_handoff(c)
        rows.append(("SHM export + client mapping", shm))
        rows.append(("  SHM release (apart)", release))
        rows.append(("STREAM (Client.materialize)", best_of(lambda: c.materialize(p), max(1, args.repeat - 1))))
    with serve(env={"PARAMINIT_SHM_POOL_BYTES": str(2 * nbytes)}) as target, Client(target, timeout=600) as c:
        shm, release = timed_handoff(c)
        rows.append(("SHM export + mapping, segment pool on", shm))
        rows.append(("  SHM release to the pool (apart)", release))
    print(f"export: {args.mib} MiB float32 uniform plan")
    table(rows, nbytes, ["generation alone (fresh buffer)", "STREAM (Client.materialize)"])


if __name__ == "__main__":
    main()
