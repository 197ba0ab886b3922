"""GPU generation throughput, in one run on >= 1 GiB outputs, timed with CUDA events.

Rows: a device-to-device copy (GB/s counts bytes read + written), torch's
uniform_/normal_ on the device (when torch is present), and paraminit's
kernels for each initializer and dtype (GB/s counts bytes written), plus a
region shard and a whole many-parameter plan in one launch. Ratios are against
torch uniform_ / normal_ float32 and the copy. Targets: uniform, xavier and
kaiming float32 >= 1.0x torch uniform_ and >= 0.5x the copy; normal float32
>= 0.5x torch normal_. Both ends of every output are checked against
reference.py, so a fast wrong kernel cannot pass. Each paraminit row times its launch alone
(`prepare_fill`/`prepare_jobs` pack and upload first), as torch's rows time its kernels.

    python bench/gpu.py [--gib 1] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for sub in ("proto", "server", "client", "tests"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

import reference  # noqa: E402  (tests/reference.py)

from paraminit import dtypes  # noqa: E402
from paraminit.v1 import plan_pb2  # noqa: E402
from paraminit_server.plans.plan import Formula, ResolvedParam, resolve_unchecked  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_param  # noqa: E402

COLS = 4096
SAMPLE = 1 << 15  # elements compared with reference.py at each end of every output
NORMAL_SAMPLE = 1 << 12  # normal's reference evaluates log and cos in mpmath, about 0.1 ms an element


def time_events(cp: Any, fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of fn on the current stream (after one untimed run)."""
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(statistics.median(times))


def time_torch(torch: Any, fn: Callable[[], object], repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(statistics.median(times))


def time_copy(cp: Any, nbytes: int, repeat: int) -> float:
    src = cp.empty(nbytes, dtype=cp.uint8)
    src.fill(1)
    dst = cp.empty(nbytes, dtype=cp.uint8)
    return time_events(cp, functools.partial(dst.data.copy_from_device_async, src.data, nbytes), repeat)


def make_param(init: str, dt: dtypes.DTypeInfo, rows: int, region: tuple[tuple[int, int], ...] = ()) -> ResolvedParam:
    name = {"xavier": "xavier_uniform_for_shape", "kaiming": "kaiming_uniform_for_shape"}.get(init, init)
    return resolve_unchecked(0, bench_param(name, dt.enum, rows, COLS, region))


def reference_window(p: ResolvedParam, l_begin: int, n: int) -> np.ndarray[Any, Any]:
    """reference.py's values for local elements [l_begin, l_begin + n) of a region, in storage dtype."""
    local = np.unravel_index(np.arange(l_begin, l_begin + n, dtype=np.int64), p.out_shape)
    g = np.ravel_multi_index(tuple(ix + a for ix, (a, _) in zip(local, p.region, strict=True)), p.shape)
    window = SimpleNamespace(
        formula=p.formula,
        p0=p.p0,
        p1=p.p1,
        key=p.key,
        values=p.values,
        lo=p.lo,
        hi=p.hi,
        seed=p.seed,
        global_indices=lambda: np.asarray(g, dtype=np.int64),
    )
    return reference.cast(reference.values_f64(cast(ResolvedParam, window)), p.dtype)


def check_sample(gpu: Any, p: ResolvedParam, out: Any) -> str:
    """Compare both ends of a filled GPU output with reference.py: every element bit for bit (log and cos in
    normal are correctly rounded on both sides, docs/SAMPLER.md section 2.1).

    reference.py, not the CPU backend, so the bench needs no numba compile.
    """
    n = p.numel
    ub = f"u{p.dtype.itemsize}"
    sample = NORMAL_SAMPLE if p.formula == Formula.NORMAL else SAMPLE
    for l_begin in sorted({0, max(0, n - sample)}):
        m = min(sample, n - l_begin)
        got = np.asarray(gpu.to_host(out[l_begin : l_begin + m])).view(ub)
        want = reference_window(p, l_begin, m).view(ub)
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise SystemExit(f"MISMATCH: {p.name} differs from reference.py at element {l_begin + int(bad[0])}")
    return "exact"


def gpt_like_plan(total_bytes: int) -> list[ResolvedParam]:
    """Many differently shaped float32/bfloat16 parameters (a transformer's mix), about total_bytes in all."""
    d = 2048
    layer: list[tuple[str, list[int], str]] = [
        ("ln1", [d], "ones"),
        ("qkv", [3 * d, d], "xavier"),
        ("proj", [d, d], "kaiming"),
        ("ln2", [d], "ones"),
        ("fc1", [4 * d, d], "normal"),
        ("fc2", [d, 4 * d], "uniform"),
        ("b", [4 * d], "zeros"),
    ]
    per_layer = sum(int(np.prod(s)) for _, s, _ in layer) * 4
    out: list[ResolvedParam] = []
    for li in range(max(1, total_bytes // per_layer)):
        for name, shape, init in layer:
            dt = dtypes.FLOAT32 if li % 2 == 0 else dtypes.BFLOAT16
            p = plan_pb2.Param(name=f"l{li}.{name}", shape=shape, dtype=dt.enum)  # type: ignore[arg-type]
            i = p.init
            if init == "ones":
                i.ones.SetInParent()
            elif init == "zeros":
                i.zeros.SetInParent()
            elif init == "xavier":
                i.xavier_uniform_for_shape.seed = li
            elif init == "kaiming":
                i.kaiming_uniform_for_shape.seed = li
            elif init == "normal":
                i.normal.mean, i.normal.std, i.normal.seed = 0.0, 0.02, li
            else:
                i.uniform.lo, i.uniform.hi, i.uniform.seed = -0.01, 0.01, li
            out.append(resolve_unchecked(len(out), p))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="output size of each row (>= 1 for the targets)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    import cupy as cp

    from paraminit_server.backends import cupy_backend as cb
    from paraminit_server.backends.cupy_backend import CupyBackend

    gpu = CupyBackend(0)
    gpu.warm_up()
    dev = gpu.device()
    nbytes = int(args.gib * (1 << 30)) // (COLS * 8) * (COLS * 8)
    print(
        f"device: {dev.name} ({dev.uuid}), {dev.memory_total / 2**30:.0f} GiB; outputs of {nbytes / 2**30:.2f} GiB, median of {args.repeat}"
    )
    rows: list[dict[str, Any]] = []

    def row(name: str, seconds: float, moved: int, check: str = "") -> None:
        rows.append({"name": name, "seconds": seconds, "gbps": moved / seconds / 1e9, "check": check})
        print(f"  {name:<40} {moved / seconds / 1e9:9.1f} GB/s  {seconds * 1e3:8.3f} ms  {check}", flush=True)

    row("copy (device to device, read + write)", time_copy(cp, nbytes, args.repeat), 2 * nbytes)

    torch: Any = None
    try:
        import torch as torch_module

        if not torch_module.cuda.is_available():
            raise ImportError("torch has no CUDA device")
        torch = torch_module
    except ImportError as exc:
        print(f"  torch rows skipped: {exc}")
    if torch is not None:
        for tdt, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            t = torch.empty(nbytes // torch.tensor([], dtype=tdt).element_size(), dtype=tdt, device="cuda")
            row(f"torch uniform_ {name}", time_torch(torch, functools.partial(t.uniform_, -0.05, 0.05), args.repeat), nbytes)
            row(f"torch normal_ {name}", time_torch(torch, functools.partial(t.normal_, 0.0, 0.02), args.repeat), nbytes)
            del t
        torch.cuda.empty_cache()

    arena = gpu.scratch(nbytes)
    for init in ("uniform", "xavier", "kaiming", "normal", "zeros"):
        for dt in dtypes.SUPPORTED:
            p = make_param(init, dt, nbytes // dt.itemsize // COLS)
            out = arena.view(dt.storage)
            seconds = time_events(cp, gpu.prepare_fill(p, out), args.repeat)  # the kernel, not the host's packing
            row(f"paraminit {init} {dt.name}", seconds, nbytes, check_sample(gpu, p, out))
    # a column shard (tensor parallel): many runs, the division path
    for init in ("uniform", "normal"):
        rows_ = nbytes // 4 // (COLS // 2)
        p = make_param(init, dtypes.FLOAT32, rows_, ((0, rows_), (COLS // 4, 3 * COLS // 4)))
        out = arena.view(np.float32)[: p.numel]
        seconds = time_events(cp, gpu.prepare_fill(p, out), args.repeat)
        row(f"paraminit {init} float32 column shard", seconds, p.nbytes, check_sample(gpu, p, out))
    plan = gpt_like_plan(nbytes)
    offsets, pos = [], 0
    for p in plan:
        offsets.append(pos)
        pos += -(-p.nbytes // 256) * 256
    del arena
    plan_arena = gpu.scratch(pos)
    moved = sum(p.nbytes for p in plan)
    views = [plan_arena[o : o + p.nbytes].view(p.dtype.storage) for p, o in zip(plan, offsets, strict=True)]

    launches = [gpu.prepare_fill(p, v) for p, v in zip(plan, views, strict=True)]

    def per_param() -> None:
        for launch in launches:
            launch()

    jobs = [cb.Job(p, int(off)) for p, off in zip(plan, offsets, strict=True)]
    row(f"paraminit fill_plan, {len(plan)} params, 1 launch", time_events(cp, cb.prepare_jobs(jobs, plan_arena), args.repeat), moved)
    row(f"paraminit fill per param, {len(plan)} launches", time_events(cp, per_param, args.repeat), moved)

    by = {r["name"]: r for r in rows}
    copy_bw = by["copy (device to device, read + write)"]["gbps"]
    tu, tn = by.get("torch uniform_ float32"), by.get("torch normal_ float32")
    print("\nratios (float32 rows; higher is better)")
    ok = True
    for init in ("uniform", "xavier", "kaiming", "normal"):
        r = by[f"paraminit {init} float32"]
        parts = [f"{r['gbps'] / copy_bw:5.2f}x copy"]
        if init != "normal":
            ok &= r["gbps"] >= 0.5 * copy_bw
        ref = tn if init == "normal" else tu
        if ref is not None:
            parts.append(f"{r['gbps'] / ref['gbps']:5.2f}x torch {'normal_' if init == 'normal' else 'uniform_'}")
            ok &= r["gbps"] >= (0.5 if init == "normal" else 1.0) * ref["gbps"]
        print(f"  {init:<8} " + ", ".join(parts))
    print(
        "targets (uniform/xavier/kaiming >= 1.0x torch uniform_ and >= 0.5x copy; normal >= 0.5x torch normal_): "
        + ("MET" if ok else "NOT MET")
    )
    # every row was checked at both ends against reference.py (a mismatch stops the bench with MISMATCH first)
    for init in ("uniform", "xavier", "kaiming", "normal", "zeros"):
        exact = [dt.name for dt in dtypes.SUPPORTED if by[f"paraminit {init} {dt.name}"]["check"] == "exact"]
        print(f"parity {init}: {' '.join(exact)} bit-exact with reference.py")
    if args.json:
        args.json.write_text(json.dumps({"device": dev.name, "bytes": nbytes, "rows": rows, "targets_met": ok}, indent=1))


if __name__ == "__main__":
    main()
