"""Transport benchmark: paraminit's STREAM delivery against the transport's own ceiling, in one run.

Rows: a bare gRPC server (separate process) streaming raw 1 MiB byte chunks, a
plain TCP socket, and Client.materialize / materialize_to_file against a
`paraminit serve` subprocess. Target: materialize >= 0.8x the bare gRPC stream.

    python bench/transport.py [--mib 256]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_of, serve, table

BARE_SERVER = textwrap.dedent("""
    import sys, grpc
    from concurrent import futures
    payload = b"x" * (1 << 20)
    def handler(req, ctx):
        for _ in range(int(req)):
            yield payload
    h = grpc.method_handlers_generic_handler("bare.Bare", {"S": grpc.unary_stream_rpc_method_handler(handler)})
    s = grpc.server(futures.ThreadPoolExecutor(4)); s.add_generic_rpc_handlers((h,))
    print(s.add_insecure_port("127.0.0.1:0"), flush=True); s.start(); sys.stdin.read()
""")


def bare_grpc(n_chunks: int) -> float:
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            call = ch.unary_stream("/bare.Bare/S")
            return best_of(lambda: sum(len(x) for x in call(str(n_chunks).encode())))
    finally:
        proc.kill()


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

    return best_of(receive)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    nbytes = args.mib << 20
    from paraminit_client import Client, param, plan_of

    plan = plan_of([param("w", [nbytes // 4], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
    rows = [("bare gRPC stream, 1 MiB chunks", bare_grpc(nbytes >> 20)), ("TCP socket", tcp_socket(nbytes))]
    with serve() as target, Client(target) as c, tempfile.TemporaryDirectory() as tmp:
        c.materialize(plan_of([param("w", [1024], {"zeros": {}})]))
        rows.append(("Client.materialize (serve subprocess)", best_of(lambda: c.materialize(plan))))
        out = Path(tmp) / "w.safetensors"
        rows.append(("Client.materialize_to_file", best_of(lambda: c.materialize_to_file(plan, out))))
    with Client() as c:
        rows.append(("Client.materialize (embedded, one process)", best_of(lambda: c.materialize(plan))))
    print(f"transport: {args.mib} MiB float32 uniform plan")
    table(rows, nbytes, ["bare gRPC stream, 1 MiB chunks"])


if __name__ == "__main__":
    main()
