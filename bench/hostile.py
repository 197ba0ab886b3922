"""Hostile load: slow, stalled, silent and bomb-carrying callers of one identity beside a well-behaved one,
against a `paraminit serve` subprocess with two concurrency slots, a 256 MiB memory budget, --max-stall 3,
a pool of released SHM segments and --drain-seconds 2.

Identity "bad" (its own bearer token) keeps going: stalled readers (a stream read up to its header, then
never again), slow readers (0.3 s per message), callers that cancel right after starting, stalled uploads
(one piece, then nothing), 64 header-only calls (headers on every InitService method, health and
reflection, and never a body), orthogonal bombs (a 35-byte plan: one [4096, 4096] orthogonal matrix, a 1x1
region), patch bombs (1,024 single-column patches over a 16 MiB tensor), violation bombs (Validate of 24
parameters with 1,005-character names and 4,096 empty patches each) and SHM exports whose views it keeps
and writes 7.0 into after releasing them. Identity "good" makes STREAM calls, Validate, GetInfo and SHM
exports of zeros (each checked: every element 0.0) all the while, and a prober checks health every 0.2 s.
At the end SIGTERM goes to the server while all of that still runs, and the time to its exit is measured.
Targets: every good call served (exports read only zeros), health within 1 s throughout, no INTERNAL
anywhere, peak RSS within the budget plus the server's idle RSS plus a stated margin (MARGIN), the memory the
calls made (anonymous and shared, over idle) within the budget plus that margin, exit within the drain time
plus 5 s.

    python bench/hostile.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _common import PIDS, host_line, serve

from paraminit import wire
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import init_service_pb2_grpc as pb_grpc
from paraminit.v1 import plan_pb2
from paraminit_client import Client, param, plan_of

BUDGET = 256 << 20
STALL = 3.0
DRAIN = 2.0
# What the budget does not count: gRPC's buffers of messages in flight (a stalled reader's window, uploads being
# received), the Python objects of hundreds of calls, glibc's arenas of 48 worker threads, and the code pages
# (kernels, LLVM) first touched after the idle reading.
MARGIN = 64 << 20
GOOD = "good-token-0123456789"
BAD = "bad-token-0123456789"
SILENT_PATHS = [f"/paraminit.v1.InitService/{m}" for m in ("Validate", "GetInfo", "Materialize", "UploadPayload", "Apply")] + [
    "/grpc.health.v1.Health/Check",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
]


def bombs() -> dict[str, plan_pb2.Plan]:
    """The plans of the bad identity's bombs."""
    ortho = plan_of([param("q", [4096, 4096], {"orthogonal": {"gain": 1.0, "seed": 1}}, region=[(0, 1), (0, 1)])])
    patched = param("p", [4096, 1024], {"zeros": {}})
    for col in range(1024):
        q = patched.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
        q.box.add(start=0, stop=4096)
        q.box.add(start=col, stop=col + 1)
    violations = []
    for k in range(24):
        v = param(f"{k:05d}" + "n" * 1000, [8, 8], {"zeros": {}})
        for _ in range(4096):
            q = v.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
            q.box.add(start=3, stop=3)
            q.box.add(start=0, stop=8)
        violations.append(v)
    return {"orthogonal bomb": ortho, "patch bomb": plan_of([patched]), "violation bomb": plan_of(violations)}


def exited_within(pid: int, seconds: float) -> float | None:
    """Seconds until the process is gone or a zombie (its parent reaps it later), None if not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return time.monotonic() - started
        if state in ("Z", "X"):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def rss_parts_kib(pid: int) -> tuple[int, int]:
    """(anonymous, shared-memory) resident KiB: exports' segments are RssShmem, everything else RssAnon."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["RssAnon"].split()[0]), int(fields["RssShmem"].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--only", action="append", help="run only the bad callers whose kind contains this (repeatable)")
    args = ap.parse_args()

    def chosen(kind: str) -> bool:
        return not args.only or any(word in kind for word in args.only)

    print(host_line())
    codes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    waits: list[float] = []
    stop = threading.Event()

    terminated = threading.Event()  # counts stop at the SIGTERM: what comes after is the drain's, counted apart
    late: collections.Counter[str] = collections.Counter()

    def count(kind: str, code: str) -> None:
        with lock:
            (late if terminated.is_set() else codes[kind])[code] += 1

    with tempfile.NamedTemporaryFile("w", suffix=".tokens") as tokens:
        tokens.write(f"good:{GOOD}\nbad:{BAD}\n")
        tokens.flush()
        env = {
            "PARAMINIT_MAX_CONCURRENT": "2",
            "PARAMINIT_MEMORY_BUDGET": str(BUDGET),
            "PARAMINIT_MAX_STALL": str(STALL),
            "PARAMINIT_AUTH_TOKENS_FILE": tokens.name,
            "PARAMINIT_SLAB_BYTES": str(4 << 20),
            "PARAMINIT_SHM_POOL_BYTES": str(64 << 20),
            "PARAMINIT_DRAIN_SECONDS": str(DRAIN),
        }
        health_worst = [0.0]
        exit_seconds: float | None = None
        with serve(env=env) as target:
            pid = PIDS[target]
            idle_rss = rss_kib(pid)[0] << 10
            idle_anon = rss_parts_kib(pid)[0] << 10
            big = plan_of([param("w", [(64 << 20) // 4], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
            small = plan_of([param("w", [(4 << 20) // 4], {"normal": {"std": 1.0, "seed": 2}})])
            bad_md = (("authorization", f"Bearer {BAD}"),)
            good_md = (("authorization", f"Bearer {GOOD}"),)
            plans = bombs()
            zeros = plan_of([param("z", [256, 1024], {"zeros": {}})])
            sevens = plan_of([param("s", [256, 1024], {"ones": {}})])
            channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
            stub = pb_grpc.InitServiceStub(channel)
            upload = channel.stream_unary(
                "/paraminit.v1.InitService/UploadPayload", request_serializer=bytes, response_deserializer=pb.PayloadRef.FromString
            )

            def silent_loop() -> None:
                """Keep 64 header-only calls open; each ends at the stall limit and is opened again."""
                ch = grpc.insecure_channel(target)
                gate = threading.Event()

                def never() -> Any:
                    gate.wait(120)
                    yield from ()

                open_calls: list[Any] = []
                k = 0
                while not stop.is_set():
                    for c in [c for c in open_calls if c.done()]:
                        count("header-only calls", c.code().name)
                    open_calls = [c for c in open_calls if not c.done()]
                    while len(open_calls) < 64:
                        path = SILENT_PATHS[k % len(SILENT_PATHS)]
                        k += 1
                        call = ch.stream_stream(path, request_serializer=bytes, response_deserializer=bytes)
                        open_calls.append(call(never(), metadata=bad_md))
                    time.sleep(0.1)
                gate.set()
                for c in open_calls:
                    c.cancel()
                ch.close()

            def bomb_loop(kind: str) -> None:
                with Client(target, token=BAD, timeout=60) as c:
                    while not stop.is_set():
                        try:
                            if kind == "violation bomb":
                                report = c.stub.Validate(pb.ValidateRequest(plan=plans[kind]), metadata=bad_md, timeout=60)
                                count(kind, f"OK ({len(report.violations)} listed, {report.omitted_violations} omitted)")
                            elif kind == "pooled export, kept view":
                                lease = c.export(sevens)
                                view = lease.arrays["s"]
                                c.release(lease.lease_id)  # the raw Release, views still mapped
                                time.sleep(0.05)
                                view[:] = 7.0  # a kept view written after release: must never reach another export
                                count(kind, "OK")
                            else:
                                for _ in c.stub.Materialize(pb.MaterializeRequest(plan=plans[kind]), metadata=bad_md, timeout=60):
                                    pass
                                count(kind, "OK")
                        except grpc.RpcError as exc:
                            count(kind, exc.code().name)
                            time.sleep(0.2)
                        except Exception as exc:  # the client's own error type carries the code
                            code = getattr(exc, "code", None)
                            count(kind, code.name if code is not None else type(exc).__name__)
                            time.sleep(0.2)

            def health_loop() -> None:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                with grpc.insecure_channel(target) as ch:
                    hs = health_pb2_grpc.HealthStub(ch)
                    while not stop.is_set():
                        t = time.monotonic()
                        try:
                            hs.Check(health_pb2.HealthCheckRequest(), timeout=5)
                            count("health probe", "OK")
                        except grpc.RpcError as exc:
                            count("health probe", exc.code().name)
                        if not terminated.is_set():
                            health_worst[0] = max(health_worst[0], time.monotonic() - t)
                        time.sleep(0.2)

            def good_others() -> None:
                with Client(target, token=GOOD, timeout=60) as c:
                    while not stop.is_set():
                        for kind, fn in (
                            ("good: validate", lambda: c.validate(small).ok),
                            ("good: info", lambda: bool(c.info().version)),
                            ("good: export zeros", lambda: _zeros_ok(c, zeros)),
                        ):
                            try:
                                count(kind, "OK" if fn() else "WRONG")
                            except Exception as exc:
                                code = getattr(exc, "code", None)
                                count(kind, code.name if code is not None else type(exc).__name__)
                        time.sleep(0.05)

            def bad_loop(kind: str) -> None:
                while not stop.is_set():
                    try:
                        if kind == "upload, stalled":
                            gate = threading.Event()

                            def pieces(gate: threading.Event = gate) -> Any:
                                yield wire.encode_payload_chunk(memoryview(bytes(1 << 20)), 1, 1 << 20)
                                gate.wait(60)

                            try:
                                upload(pieces(), metadata=bad_md, timeout=60)
                            finally:
                                gate.set()
                            count(kind, "OK")
                            continue
                        call = stub.Materialize(pb.MaterializeRequest(plan=big), metadata=bad_md, timeout=60)
                        if kind == "cancel at once":
                            call.cancel()
                            count(kind, "CANCELLED (by the caller)")
                            time.sleep(0.05)
                            continue
                        for n, _ in enumerate(call):
                            if kind == "stream, stalled" and n == 0:
                                time.sleep(3 * STALL)  # reads nothing for a while: the server must cancel it
                            elif kind == "stream, slow reader":
                                time.sleep(0.3)
                                if stop.is_set():
                                    call.cancel()
                                    break
                        count(kind, "OK")
                    except grpc.RpcError as exc:
                        count(kind, exc.code().name)
                        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            time.sleep(0.2)

            def good_loop() -> None:
                good_channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
                good = pb_grpc.InitServiceStub(good_channel)
                while not stop.is_set():
                    t = time.monotonic()
                    try:
                        n = sum(1 for _ in good.Materialize(pb.MaterializeRequest(plan=small), metadata=good_md, timeout=60))
                        count("good: stream", "OK" if n else "EMPTY")
                        with lock:
                            waits.append(time.monotonic() - t)
                    except grpc.RpcError as exc:
                        count("good: stream", exc.code().name)
                good_channel.close()

            kinds = [
                k for k in ["stream, stalled", "stream, stalled", "stream, slow reader", "cancel at once", "upload, stalled"] if chosen(k)
            ]
            threads = [threading.Thread(target=bad_loop, args=(k,), daemon=True) for k in kinds]
            threads.append(threading.Thread(target=good_loop, daemon=True))
            threads += [threading.Thread(target=f, daemon=True) for f in (health_loop, good_others)]
            threads += [threading.Thread(target=silent_loop, daemon=True)] if chosen("header-only calls") else []
            threads += [
                threading.Thread(target=bomb_loop, args=(k,), daemon=True) for k in (*plans, "pooled export, kept view") if chosen(k)
            ]
            for t in threads:
                t.start()
            peak = 0
            parts_at_peak = (0, 0)
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                now = rss_kib(pid)[0] << 10
                if now > peak:
                    peak, parts_at_peak = now, rss_parts_kib(pid)
                time.sleep(0.2)
            hwm = rss_kib(pid)[1] << 10
            terminated.set()
            os.kill(pid, signal.SIGTERM)  # under the whole load: drain, then exit
            exit_seconds = exited_within(pid, DRAIN + 60)
            stop.set()
            for t in threads:
                t.join(70)
            channel.close()
    print(
        f"{args.seconds:.0f} s, server: 2 slots, budget {BUDGET >> 20} MiB, --max-stall {STALL:.0f} s, --drain-seconds {DRAIN:.0f}; "
        "identity bad: 2 stalled readers, a slow reader, a caller cancelling at once, a stalled upload, 64 header-only "
        "calls, orthogonal, patch and violation bombs, pooled exports written after release"
    )
    print(f"{'caller':<28} {'calls':>6}  status codes")
    for kind, counter in sorted(codes.items()):
        print(f"{kind:<28} {sum(counter.values()):>6}  {dict(counter)}")
    print(f"{'after SIGTERM (all callers)':<28} {sum(late.values()):>6}  {dict(late)}")
    internal = sum(c["INTERNAL"] + c["UNKNOWN"] for c in (*codes.values(), late))
    good = codes["good: stream"]
    goods = [k for k in codes if k.startswith("good")]
    served = all(codes[k]["OK"] == sum(codes[k].values()) > 0 for k in goods)
    longest = max(waits) if waits else float("inf")
    within = peak <= BUDGET + idle_rss + MARGIN
    print(
        f"good calls: {good['OK']} of {sum(good.values())} served; longest {longest:.2f} s "
        f"(a slot held by a stalled reader comes back within --max-stall + its check: {STALL * 1.25:.2f} s)"
    )
    print(f"server RSS: idle {idle_rss >> 20} MiB, peak sampled {peak >> 20} MiB, VmHWM {hwm >> 20} MiB; budget {BUDGET >> 20} MiB")
    anon_growth = (parts_at_peak[0] << 10) - idle_anon
    print(
        f"  at the peak: anonymous {parts_at_peak[0] >> 10} MiB ({anon_growth >> 20} MiB over idle's {idle_anon >> 20} MiB), "
        f"shared memory (exports) {parts_at_peak[1] >> 10} MiB; the rest is code and data files mapped since idle"
    )
    print(f"health: slowest answer {health_worst[0]:.3f} s")
    exit_text = "did not exit" if exit_seconds is None else f"{exit_seconds:.2f} s"
    print(f"exit after SIGTERM under load: {exit_text} (--drain-seconds {DRAIN:.0f})")
    print("targets")
    for name, ok in (
        ("every good call served, exports read only zeros", served),
        ("health answered within 1 s throughout", health_worst[0] < 1.0 and set(codes["health probe"]) == {"OK"}),
        ("exit within the drain time plus 5 s", exit_seconds is not None and exit_seconds <= DRAIN + 5.0),
        ("no INTERNAL or UNKNOWN anywhere", internal == 0),
        ("good calls wait at most the stall limit and one call", longest <= STALL * 1.25 + 5.0),
        (f"peak RSS within budget + idle RSS + {MARGIN >> 20} MiB", within),
        (
            f"memory the calls made (anonymous + shared, over idle) within budget + {MARGIN >> 20} MiB",
            anon_growth + (parts_at_peak[1] << 10) <= BUDGET + MARGIN,
        ),
    ):
        print(f"  {name:<56} {'ok' if ok else 'MISSED'}")


def _zeros_ok(c: Client, zeros: plan_pb2.Plan) -> bool:
    """An SHM export of zeros reads only zeros (a recycled segment must never carry another caller's writes)."""
    with c.export(zeros) as lease:
        return not lease.arrays["z"].any()


if __name__ == "__main__":
    main()
