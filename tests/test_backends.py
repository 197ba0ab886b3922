"""The CPU backend's threading: numba's workqueue layer by default, launches serialized, an explicit choice kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import threading, numba, numpy as np
    from paraminit_client import param, plan_of
    from paraminit_server.plans import plan as planlib
    from paraminit_server.backends.cpu import CpuBackend
    b = CpuBackend()
    p = planlib.resolve(plan_of([param("w", [1 << 20], {"normal": {"std": 1.0, "seed": 3}})]))[0]
    want = np.empty(1 << 20, np.float32); b.fill(p, want)
    outs = [np.full(1 << 20, np.nan, np.float32) for _ in range(8)]
    threads = [threading.Thread(target=b.fill, args=(p, o)) for o in outs]  # concurrent callers
    [t.start() for t in threads]; [t.join() for t in threads]
    assert all(o.tobytes() == want.tobytes() for o in outs)
    print(numba.threading_layer())
""")


@pytest.mark.parametrize("env,layer", [({}, "workqueue"), ({"NUMBA_THREADING_LAYER": "omp"}, "omp")])
def test_threading_layer(env: dict[str, str], layer: str) -> None:
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 and layer == "omp" and "No threading layer" in done.stderr:
        pytest.skip("no OpenMP runtime here")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == layer
