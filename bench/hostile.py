"""Hostile load: slow, stalled and cancelling callers of one identity beside a well-behaved one, against a
`paraminit serve` subprocess with two concurrency slots, a 256 MiB memory budget and --max-stall 3.

Identity "bad" (its own bearer token) keeps stalled readers (a stream read up to its header, then never
again), slow readers (0.3 s per message), callers that cancel right after starting, and stalled uploads
(one piece, then nothing) going. Identity "good" makes plain STREAM calls with a deadline all the while.
Prints, per kind of caller, the calls and their status codes; how long a good call waited at most; how
soon a stalled caller's slot came back (time from its stall to the next good call's start); and the
server's peak RSS against its budget. Targets: every good call served, no INTERNAL anywhere, peak RSS
within the budget plus the server's idle RSS.

    python bench/hostile.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import collections
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
from paraminit_client import param, plan_of

BUDGET = 256 << 20
STALL = 3.0


def rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    print(host_line())
    codes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    waits: list[float] = []
    stop = threading.Event()

    def count(kind: str, code: str) -> None:
        with lock:
            codes[kind][code] += 1

    with tempfile.NamedTemporaryFile("w", suffix=".tokens") as tokens:
        tokens.write("good:good-token-0123456789\nbad:bad-token-0123456789\n")
        tokens.flush()
        env = {
            "PARAMINIT_MAX_CONCURRENT": "2",
            "PARAMINIT_MEMORY_BUDGET": str(BUDGET),
            "PARAMINIT_MAX_STALL": str(STALL),
            "PARAMINIT_AUTH_TOKENS_FILE": tokens.name,
            "PARAMINIT_SLAB_BYTES": str(4 << 20),
        }
        with serve(env=env) as target:
            pid = PIDS[target]
            idle_rss = rss_kib(pid)[0] << 10
            big = plan_of([param("w", [(64 << 20) // 4], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
            small = plan_of([param("w", [(4 << 20) // 4], {"normal": {"std": 1.0, "seed": 2}})])
            bad_md = (("authorization", "Bearer bad-token-0123456789"),)
            channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
            stub = pb_grpc.InitServiceStub(channel)
            upload = channel.stream_unary(
                "/paraminit.v1.InitService/UploadPayload", request_serializer=bytes, response_deserializer=pb.PayloadRef.FromString
            )

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
                        n = sum(
                            1
                            for _ in good.Materialize(
                                pb.MaterializeRequest(plan=small), metadata=(("authorization", "Bearer good-token-0123456789"),), timeout=60
                            )
                        )
                        count("good: stream", "OK" if n else "EMPTY")
                        with lock:
                            waits.append(time.monotonic() - t)
                    except grpc.RpcError as exc:
                        count("good: stream", exc.code().name)
                good_channel.close()

            kinds = ["stream, stalled", "stream, stalled", "stream, slow reader", "cancel at once", "upload, stalled"]
            threads = [threading.Thread(target=bad_loop, args=(k,), daemon=True) for k in kinds]
            threads.append(threading.Thread(target=good_loop, daemon=True))
            for t in threads:
                t.start()
            peak = 0
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                peak = max(peak, rss_kib(pid)[0] << 10)
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(70)
            hwm = rss_kib(pid)[1] << 10
            channel.close()
    print(
        f"{args.seconds:.0f} s, server: 2 slots, budget {BUDGET >> 20} MiB, --max-stall {STALL:.0f} s; "
        "identity bad: 2 stalled readers, a slow reader, a caller cancelling at once, a stalled upload"
    )
    print(f"{'caller':<28} {'calls':>6}  status codes")
    for kind, counter in sorted(codes.items()):
        print(f"{kind:<28} {sum(counter.values()):>6}  {dict(counter)}")
    internal = sum(c["INTERNAL"] + c["UNKNOWN"] for c in codes.values())
    good = codes["good: stream"]
    served = good["OK"] == sum(good.values()) and good["OK"] > 0
    longest = max(waits) if waits else float("inf")
    within = peak <= BUDGET + idle_rss
    print(
        f"good calls: {good['OK']} of {sum(good.values())} served; longest {longest:.2f} s "
        f"(a slot held by a stalled reader comes back within --max-stall + its check: {STALL * 1.25:.2f} s)"
    )
    print(f"server RSS: idle {idle_rss >> 20} MiB, peak sampled {peak >> 20} MiB, VmHWM {hwm >> 20} MiB; budget {BUDGET >> 20} MiB")
    print("targets")
    for name, ok in (
        ("every good call served", served),
        ("no INTERNAL or UNKNOWN anywhere", internal == 0),
        ("good calls wait at most the stall limit and one call", longest <= STALL * 1.25 + 5.0),
        ("peak RSS within budget + idle RSS", within),
    ):
        print(f"  {name:<56} {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
