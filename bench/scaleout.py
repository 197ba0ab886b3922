"""Scale-out benchmark: one plan split across 1, 2 and 3 local `paraminit serve` workers.

On a machine with fewer cores than workers the workers share CPUs, so this
measures the splitting overhead as much as the speed-up; on separate hosts each
worker adds its own generation and network bandwidth. Every worker's stream lands
in place in the one output buffer (paraminit_client.scaleout.assemble).

    python bench/scaleout.py [--mib 512]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_of, host_line, serve, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args()
    nbytes = args.mib << 20
    from paraminit_client import Client, param, plan_of

    quarter = nbytes // 4
    plan = plan_of(
        [
            param("emb", [quarter // 2048, 1024], {"normal": {"std": 0.02, "seed": 1}}, "bfloat16"),
            param("w1", [quarter // 4096, 1024], {"kaimingUniformForShape": {"seed": 2}}),
            param("w2", [quarter // 4096, 1024], {"uniform": {"lo": -1, "hi": 1, "seed": 3}}),
            param("w3", [quarter // 4096, 1024], {"xavierUniformForShape": {"seed": 4}}),
        ]
    )
    rows = []
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(serve()) for _ in range(3)]
        for n in (1, 2, 3):
            with Client(targets[:n] if n > 1 else targets[0], split_bytes=32 << 20) as c:
                c.materialize(plan_of([param("x", [8], {"zeros": {}})]))
                rows.append((f"{n} worker(s)", best_of(lambda c=c: c.materialize(plan), 2)))
    print(f"scale-out: {args.mib} MiB plan (bf16 normal + float32 uniform family)")
    table(rows, nbytes, ["1 worker(s)"])
    print(host_line())


if __name__ == "__main__":
    main()
