"""Checkpoint writing at disk speed in bounded memory: a plan of --gib GiB of float32 parameters (by default more
than this machine's memory) written as sharded safetensors (5 GB shards) and as a DCP directory, in process, each
in a fresh subprocess whose peak RSS (VmHWM) is read when it ends, against a plain sequential write of the same
bytes to the same directory (`dd`-style: 64 MiB blocks of one buffer, through the page cache then fsync, and with O_DIRECT).

Rows: seconds, GB/s, the ratio to the sequential write, peak RSS. Targets: peak RSS within 2 GiB whatever the
plan's size (a bounded window), sharded safetensors at least 0.5x the faster sequential write. Needs --gib GiB free
in --dir (each output is removed before the next).

    python bench/checkpoint_write.py [--gib 32] [--dir /tmp] [--layer-mib 256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import host_line

WRITER = """
import json, sys, time
from pathlib import Path
from paraminit_client import Client, param, plan_of
gib, layer_mib, out, fmt = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = layer_mib * (1 << 20) // 4 // 4096
n = int(gib * 1024 / layer_mib)
plan = plan_of([param(f"layers.{k}.weight", [rows, 4096], {"normal": {"std": 0.02, "seed": k}}) for k in range(n)])
with Client() as c:
    c.validate(plan)  # kernels loaded before the clock starts
    t = time.perf_counter()
    if fmt == "dcp":
        h = c.materialize_to_file(plan, out, format="dcp")
    else:
        h = c.materialize_to_file(plan, out, max_shard_size="5GB")
    seconds = time.perf_counter() - t
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": seconds, "bytes": h.data_bytes, "hwm_kib": int(hwm)}))
"""


def sequential_write(path: Path, nbytes: int, direct: bool) -> float:
    """Seconds to write nbytes in 64 MiB blocks of one buffer and fsync (`dd bs=64M conv=fsync`), or with
    O_DIRECT from an aligned buffer (`dd oflag=direct`): the disk's sequential rate, through the page cache
    or around it."""
    block = mmap.mmap(-1, 64 << 20)
    block.write(os.urandom(1 << 20) * 64)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(block)[: min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=32.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--layer-mib", type=int, default=256)
    args = ap.parse_args()
    print(host_line())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    work = Path(tempfile.mkdtemp(prefix="paraminit-ckpt-", dir=args.dir))
    rows = []
    try:
        nbytes = int(args.gib * (1 << 30)) // (args.layer_mib << 20) * (args.layer_mib << 20)
        for direct in (False, True):
            try:
                took = sequential_write(work / "seq.bin", nbytes, direct)
            except OSError:  # a file system without O_DIRECT
                continue
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(work / "seq.bin")
            rows.append(("sequential, O_DIRECT" if direct else "sequential, page cache + fsync", took, 0))
        seq = min(r[1] for r in rows)  # the disk's rate: the faster way to it
        for fmt in ("sharded", "dcp"):
            out = work / fmt
            argv = [sys.executable, "-c", WRITER, str(args.gib), str(args.layer_mib), str(out), fmt]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-2000:])
                raise SystemExit(f"{fmt} writer failed")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            assert r["bytes"] == nbytes, (r["bytes"], nbytes)
            rows.append((f"{'sharded safetensors (5 GB)' if fmt == 'sharded' else 'DCP'}", r["seconds"], r["hwm_kib"] << 10))
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"plan: {nbytes / 2**30:.1f} GiB of float32 normal, {args.layer_mib} MiB tensors; machine memory {mem / 2**30:.1f} GiB")
    print(f"{'what':<30} {'seconds':>8} {'GB/s':>6} {'x seq':>6} {'peak RSS':>10}")
    for name, seconds, hwm in rows:
        rss = f"{hwm / 2**20:.0f} MiB" if hwm else "-"
        print(f"{name:<30} {seconds:>8.1f} {nbytes / seconds / 1e9:>6.2f} {seq / seconds:>6.2f} {rss:>10}")
    print("targets")
    for name, ok in (
        ("peak RSS within 2 GiB (both formats)", all(h <= 2 << 30 for _, _, h in rows if h)),
        ("sharded safetensors >= 0.5x the faster sequential write", seq / next(r[1] for r in rows if r[0].startswith("sharded")) >= 0.5),
    ):
        print(f"  {name:<52} {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
