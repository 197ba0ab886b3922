"""Soak: N concurrent clients for T seconds against a `paraminit serve` subprocess on loopback.

Each client loops over a mix of streamed plans, SHM exports (held briefly, then
released) and invalid plans. Prints requests/s, bytes/s, p50/p99 latency overall
and per client (fairness: the spread of per-client p50/p99), counts by status
code, refusals by reason and the queue waits from the server's metrics, and the
server's RSS and /dev/shm usage before and after (after should return to the
baseline). `--identities` gives every client its own bearer token, so the
server's round-robin across identities applies. Bounded in time and count.

    python bench/soak.py --clients 16 --seconds 120
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import PIDS, serve


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def shm_bytes() -> int:
    return sum(os.path.getsize(f"/dev/shm/{f}") for f in os.listdir("/dev/shm") if f.startswith("paraminit-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """The server's paraminit_* samples (name{labels} -> value) from its metrics port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(paraminit_\S+)\s+(\S+)$", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-requests", type=int, default=1_000_000)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before the baseline")
    ap.add_argument("--max-concurrent", type=int, default=0, help="server's PARAMINIT_MAX_CONCURRENT (0: default)")
    ap.add_argument("--timeout", type=float, default=60, help="each call's deadline (seconds)")
    ap.add_argument("--identities", action="store_true", help="one bearer-token identity per client")
    args = ap.parse_args()
    from paraminit_client import Client, ParaminitError, param, plan_of

    plans = [
        plan_of(
            [
                param("w", [512, 1024], {"uniform": {"lo": -1, "hi": 1, "seed": s}}),
                param("e", [1024, 256], {"normal": {"std": 0.02, "seed": s + 1}}, "bfloat16"),
            ]
        )
        for s in range(4)
    ]
    invalid = plan_of([param("w", [4], {"uniform": {"lo": 1, "hi": 0}}), param("w", [2], {"flat": {"values": [1]}})])
    lock = threading.Lock()
    codes: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    per_client: dict[int, list[float]] = collections.defaultdict(list)
    total_bytes = [0]
    stop_at = float("inf")
    budget = [args.max_requests]

    def worker(seed: int, target: str) -> None:
        rng = random.Random(seed)
        token = f"soak-client-token-{seed:04d}" if args.identities else None
        with Client(target, timeout=args.timeout, token=token) as c:
            while time.monotonic() < stop_at:
                with lock:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                kind = rng.choices(["stream", "shm", "invalid"], [5, 3, 2])[0]
                t = time.perf_counter()
                nbytes = 0
                try:
                    if kind == "stream":
                        arrays = c.materialize(rng.choice(plans))
                        nbytes = sum(a.nbytes for a in arrays.values())
                    elif kind == "shm":
                        with c.export(rng.choice(plans), ttl_seconds=30) as lease:
                            nbytes = sum(a.nbytes for a in lease.arrays.values())
                            time.sleep(rng.uniform(0, 0.05))
                    else:
                        c.materialize(invalid)
                    code = "OK"
                except ParaminitError as err:
                    code = err.code.name
                dt = time.perf_counter() - t
                with lock:
                    codes[f"{kind}:{code}"] += 1
                    latencies.append(dt)
                    per_client[seed].append(dt)
                    total_bytes[0] += nbytes

    env = {"PARAMINIT_MAX_CONCURRENT": str(args.max_concurrent)} if args.max_concurrent else {}
    metrics_port = free_port()
    env["PARAMINIT_METRICS_PORT"] = str(metrics_port)
    if args.identities:
        env["PARAMINIT_AUTH_TOKENS"] = ",".join(f"client-{i}:soak-client-token-{i:04d}" for i in range(args.clients))
    with serve(env=env) as target:
        pid = PIDS[target]

        def run(seconds: float) -> float:
            nonlocal stop_at
            started = time.monotonic()
            stop_at = started + seconds
            threads = [threading.Thread(target=worker, args=(i, target)) for i in range(args.clients)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return time.monotonic() - started

        run(args.warmup)  # the same load first: thread pools, allocator arenas and caches reach steady state
        time.sleep(1.0)
        codes.clear()
        latencies.clear()
        per_client.clear()
        total_bytes[0] = 0
        rss0, shm0 = rss(pid), shm_bytes()
        m0 = scrape(metrics_port)
        elapsed = run(args.seconds)
        time.sleep(1.0)
        rss1, shm1 = rss(pid), shm_bytes()
        m1 = scrape(metrics_port)
    lat = sorted(latencies)
    n = len(lat)
    print(f"soak: {args.clients} clients, {elapsed:.1f} s")
    print(f"  requests      {n}  ({n / elapsed:.1f}/s)")
    print(f"  bytes         {total_bytes[0] / 2**30:.2f} GiB  ({total_bytes[0] / elapsed / 2**20:.1f} MiB/s)")
    if n:
        print(f"  latency p50   {lat[n // 2] * 1000:.1f} ms   p99 {lat[min(n - 1, int(n * 0.99))] * 1000:.1f} ms")
    for k, v in sorted(codes.items()):
        print(f"  {k:<28} {v}")
    delta = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    refusals = {k: v for k, v in delta.items() if k.startswith("paraminit_refusals_total") and v}
    print(
        f"  refusals      {int(sum(refusals.values()))}"
        + "".join(f"\n    {k[len('paraminit_refusals_total') :]} {int(v)}" for k, v in sorted(refusals.items()))
    )
    waits = delta.get("paraminit_queue_wait_seconds_count", 0.0)
    if waits:
        immediate = delta.get('paraminit_queue_wait_seconds_bucket{le="0.0"}', 0.0)
        print(
            f"  queue wait    {int(waits)} admitted, {int(waits - immediate)} waited, mean "
            f"{delta.get('paraminit_queue_wait_seconds_sum', 0.0) / waits * 1000:.1f} ms"
        )
        for le in ("0.1", "1.0", "5.0", "30.0"):
            bucket = 'paraminit_queue_wait_seconds_bucket{le="' + le + '"}'
            print(f"    <= {le:>4} s  {int(delta.get(bucket, 0.0))}")
    if per_client:
        p50s = [pct(v, 0.5) * 1000 for v in per_client.values()]
        p99s = [pct(v, 0.99) * 1000 for v in per_client.values()]
        print("  per client    requests  p50 ms  p99 ms")
        for i, v in sorted(per_client.items()):
            print(f"    {i:>3}       {len(v):>8}  {pct(v, 0.5) * 1000:>6.1f}  {pct(v, 0.99) * 1000:>6.1f}")
        print(
            f"  spread        p50 {min(p50s):.1f}-{max(p50s):.1f} ms, p99 {min(p99s):.1f}-{max(p99s):.1f} ms, "
            f"requests {min(len(v) for v in per_client.values())}-{max(len(v) for v in per_client.values())}"
        )
    print(f"  server RSS    before {rss0 / 2**20:.1f} MiB  after {rss1 / 2**20:.1f} MiB")
    print(f"  /dev/shm      before {shm0} B  after {shm1} B")


if __name__ == "__main__":
    main()
