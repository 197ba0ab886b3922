"""Transport benchmark: paraminit's STREAM and upload paths against the transport's own ceiling, in one run.

Rows: a bare gRPC server (separate process) streaming raw byte chunks of the
client's chunk size, a plain TCP socket, Client.materialize and
materialize_to_file (durable and not) against a `paraminit-server` subprocess,
the disk itself (write + fsync of the same bytes), a bare gRPC client stream
of the same bytes and Client.upload_payload. Targets: materialize >= 0.8x the
bare stream, materialize_to_file >= 0.7x, upload >= 0.5x the bare client stream.
Each row is the best of --repeat runs; the median is printed too.

    python bench/transport.py [--mib 256] [--repeat 5] [--chunk-mib 1]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import serve

BARE_SERVER = textwrap.dedent("""
    import sys, grpc
    from concurrent import futures
    def stream(req, ctx):
        n, size = map(int, req.split(b","))
        payload = b"x" * size
        for _ in range(n):
            yield payload
    def sink(it, ctx):
        return str(sum(len(x) for x in it)).encode()
    h = grpc.method_handlers_generic_handler("bare.Bare", {"S": grpc.unary_stream_rpc_method_handler(stream),
                                                           "U": grpc.stream_unary_rpc_method_handler(sink)})
    s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
    s.add_generic_rpc_handlers((h,))
    print(s.add_insecure_port("127.0.0.1:0"), flush=True); s.start(); sys.stdin.read()
""")


def bare_grpc(nbytes: int, chunk: int, repeat: int) -> tuple[list[float], list[float]]:
    """A bare server-stream and a bare client-stream of nbytes in chunk-sized messages (seconds per run)."""
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            down = ch.unary_stream("/bare.Bare/S")
            up = ch.stream_unary("/bare.Bare/U")
            payload = b"x" * chunk
            request = f"{nbytes // chunk},{chunk}".encode()
            stream = runs(lambda: sum(len(x) for x in down(request)), repeat)
            upload = runs(lambda: up(bytes(payload) for _ in range(nbytes // chunk)), repeat)
            return stream, upload
    finally:
        proc.kill()


def runs(fn: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None) -> list[float]:
    """Seconds of each call; `before` runs outside the timed part."""
    out = []
    for _ in range(repeat):
        before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def disk(nbytes: int, directory: str, repeat: int) -> list[float]:
    """The disk's own speed for the same file size: write and fsync."""
    block = b"x" * (1 << 20)

    def write() -> None:
        path = Path(directory) / "disk.bin"
        with open(path, "wb") as f:
            for _ in range(nbytes >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    return runs(write, repeat)


def tcp_socket(nbytes: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = b"x" * (1 << 20)

    def send() -> None:
        for _ in range(3):
            conn, _ = srv.accept()
            with conn:
                for _ in range(nbytes >> 20):
                    conn.sendall(payload)

    threading.Thread(target=send, daemon=True).start()
    buf = bytearray(1 << 20)

    def receive() -> None:
        with socket.create_connection(srv.getsockname()) as c:
            got = 0
            while got < nbytes:
                n = c.recv_into(buf)
                if not n:
                    break
                got += n

    return runs(receive, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--backend", default="cpu", help="the server's backend: cpu, or cupy for a GPU server's stream")
    args = ap.parse_args()
    nbytes = args.mib << 20
    chunk = int(args.chunk_mib * (1 << 20)) // 8 * 8
    from paraminit_client import Client, param, plan_of

    plan = plan_of([param("w", [nbytes // 4], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
    values = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    bare_stream, bare_upload = bare_grpc(nbytes, chunk, args.repeat)
    rows = [("bare gRPC stream", bare_stream), ("TCP socket", tcp_socket(nbytes))]
    # Uploaded payloads expire after 0.5 s here, so each timed upload lands in memory the server has just freed,
    # as a trainer's one upload does, not in a heap grown by the earlier runs.
    env = {"PARAMINIT_PAYLOAD_TTL": "0.5", "PARAMINIT_MAX_PAYLOAD_BYTES": "4GiB", "PARAMINIT_BACKEND": args.backend}
    with serve(env=env) as target, Client(target) as c, tempfile.TemporaryDirectory(dir=".") as tmp:
        c.materialize(plan_of([param("w", [1024], {"zeros": {}})]))
        rows.append(("Client.materialize", runs(lambda: c.materialize(plan, chunk_bytes=chunk), args.repeat)))
        out = Path(tmp) / "w.safetensors"
        rows.append(("materialize_to_file, durable", runs(lambda: c.materialize_to_file(plan, out, chunk_bytes=chunk),
                                                          args.repeat)))
        rows.append(("materialize_to_file, page cache", runs(
            lambda: c.materialize_to_file(plan, out, chunk_bytes=chunk, durable=False), args.repeat)))
        rows.append(("disk: write + fsync", disk(nbytes, tmp, args.repeat)))
        rows.append(("bare gRPC client stream", bare_upload))
        rows.append(("Client.upload_payload", runs(lambda: c.upload_payload(values, chunk_bytes=chunk), args.repeat,
                                                   lambda: (time.sleep(0.6), c.validate(plan_of([]))))))
    with Client() as c:
        c.materialize(plan_of([param("w", [1024], {"zeros": {}})]))
        rows.append(("Client.materialize (in process)", runs(lambda: c.materialize(plan), args.repeat)))
    print(f"transport: {args.mib} MiB float32 uniform plan, {chunk} B messages, {args.backend} server, best and median "
          f"of {args.repeat}")
    best = {name: min(t) for name, t in rows}
    head = f"{'what':<36} {'best GB/s':>10} {'median GB/s':>12} {'x bare stream':>14} {'x bare upload':>14}"
    print(head)
    print("-" * len(head))
    for name, t in rows:
        print(f"{name:<36} {nbytes / min(t) / 1e9:>10.2f} {nbytes / statistics.median(t) / 1e9:>12.2f} "
              f"{best['bare gRPC stream'] / min(t):>14.2f} {best['bare gRPC client stream'] / min(t):>14.2f}")


if __name__ == "__main__":
    main()
