"""End-to-end integrity: one bit flipped on the wire (by a TCP proxy) in the stream header or in a chunk's data
is DATA_LOSS on every client path, before anything is written."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from paraminit import overlap
from paraminit.header_checksum import header_crc32c
from paraminit_client import Client, ParaminitError, param, plan_of
from support import digest_of, running_server, target_of

# -- the stream header's checksum ------------------------------------------------------


class FlipProxy:
    """A TCP proxy that flips one bit of the first server-to-client occurrence of `pattern` (at `at`)."""

    def __init__(self, upstream: int, pattern: bytes, at: int) -> None:
        self.upstream, self.pattern, self.at = upstream, pattern, at
        self.flipped = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                i = data.find(self.pattern) if flip and not self.flipped.is_set() else -1
                if i >= 0:
                    b = bytearray(data)
                    b[i + self.at] ^= 0x01
                    data = bytes(b)
                    self.flipped.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


HEADER_PLAN = plan_of([param("weight_one", [8, 8], {"uniform": {"lo": -1, "hi": 1, "seed": 1}}), param("bias_two", [8], {"zeros": {}})])


@pytest.mark.parametrize("where", ["prefix", "name", "digest", "offset"])
def test_corrupted_stream_header_is_data_loss_before_anything_is_written(where: str, tmp_path: Path) -> None:
    digest = digest_of(HEADER_PLAN)
    patterns = {
        "prefix": (b'"__metadata__"', 3),  # still JSON, a renamed key
        "name": (b"weight_one", 0),  # the first occurrence is the tensor table's
        "digest": (digest[:16].encode(), 5),
        "offset": (b'"data_offsets":[0,', 16),
    }  # "[0," -> "[1,"
    pattern, at = patterns[where]
    with running_server() as r:
        proxy = FlipProxy(r.port, pattern, at)
        try:
            with Client(f"127.0.0.1:{proxy.port}", timeout=30) as c:
                with pytest.raises(ParaminitError) as info:
                    c.materialize_to_file(HEADER_PLAN, tmp_path / "out.safetensors")
                assert proxy.flipped.is_set()
                assert info.value.code == grpc.StatusCode.DATA_LOSS and "header checksum" in info.value.message
                assert list(tmp_path.iterdir()) == []  # not even a temporary file
        finally:
            proxy.close()
        with Client(target_of(r)) as c:  # the same stream unproxied is fine and carries the checksum
            header, chunks = c.stream(HEADER_PLAN)
            list(chunks)
            assert header.header_crc32c == header_crc32c(header) != 0


MARKED = np.arange(1, 4097, dtype=np.float32) + np.float32(0.25)  # no value is zero; the marker sits mid-chunk
MARKED_PLAN = plan_of([param("w", [4096], {"flat": {"values": [float(v) for v in MARKED]}})])


@pytest.mark.parametrize("threaded", [True, False], ids=["land-thread", "land-inline"])
@pytest.mark.parametrize("door", ["materialize", "materialize_into", "materialize_to_file", "stream"])
def test_corrupted_chunk_data_is_data_loss_on_every_client_path(
    door: str, threaded: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bit flipped in a chunk's data (not its header) fails each way of receiving a stream, with chunks
    landed on a helper thread or inline, and the file path leaves no file behind: every path checks each
    chunk's CRC32C exactly once, wherever it does it."""
    monkeypatch.setattr(overlap, "HELPER_MIN_CPUS", 1 if threaded else 1 << 20)
    with running_server() as r:
        proxy = FlipProxy(r.port, MARKED[3000:3002].tobytes(), 2)
        try:
            with Client(f"127.0.0.1:{proxy.port}", timeout=30) as c, pytest.raises(ParaminitError) as info:
                if door == "materialize":
                    c.materialize(MARKED_PLAN, chunk_bytes=4096)
                elif door == "materialize_into":
                    out = np.full(4096, np.nan, dtype=np.float32)
                    c.materialize_into(MARKED_PLAN, {"w": out})
                elif door == "materialize_to_file":
                    c.materialize_to_file(MARKED_PLAN, tmp_path / "out.safetensors", chunk_bytes=4096)
                else:
                    list(c.stream(MARKED_PLAN, chunk_bytes=4096)[1])
            assert proxy.flipped.is_set()
            assert info.value.code == grpc.StatusCode.DATA_LOSS and "CRC32C mismatch" in info.value.message
            assert list(tmp_path.iterdir()) == []
        finally:
            proxy.close()
        with Client(target_of(r)) as c:  # unproxied, the same plan arrives intact
            np.testing.assert_array_equal(c.materialize(MARKED_PLAN, chunk_bytes=4096)["w"], MARKED)
