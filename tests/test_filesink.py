"""paraminit_client.filesink without a server: direct writes of any length, and the reused blocks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from paraminit import wire
from paraminit_client import filesink


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * (64 << 10) + 17])
def test_direct_sink_writes_prefix_and_chunks_exactly(tmp_path: Path, size: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filesink.DirectSink, "BLOCK", 64 << 10)
    prefix = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a":1}        '
    data = np.random.default_rng(size).integers(1, 255, size, dtype=np.uint8).tobytes()  # no zero bytes
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if len(prefix) + size:
            os.posix_fallocate(fd, 0, len(prefix) + size)
        sink = filesink.DirectSink(str(path), prefix, len(prefix) + size)
        try:
            for off in range(0, size, 5000):  # chunks that straddle blocks
                piece = memoryview(data)[off:off + 5000]
                sink.put(wire.Chunk(off, piece, 0))
            sink.finish()
        finally:
            sink.close()
    finally:
        os.close(fd)
    assert path.read_bytes() == prefix + data


def test_blocks_are_reused_and_a_new_size_replaces_the_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filesink, "_spare", [])
    small = filesink._blocks(64 << 10, 4)
    filesink._give_back(small)
    again = filesink._blocks(64 << 10, 4)
    assert all(any(m is s for s in small) for m in again)  # the same pages, already touched
    filesink._give_back(again)
    big = filesink._blocks(1 << 20, 4)
    filesink._give_back(big)
    assert [len(m) for m in filesink._spare] == [1 << 20] * 4  # the small ones were closed, not kept
    assert all(m.closed for m in small)
