"""paraminit_client.filesink: direct writes of any length and the reused blocks without a server, and durable files
through a real server (early flushes, direct I/O at any size, the fallback when direct writes are refused)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paraminit import wire
from paraminit_client import Client, filesink, param, plan_of
from support import server_fixture, wait_until


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * (64 << 10) + 17])
def test_direct_sink_writes_prefix_and_chunks_exactly(tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
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
                piece = memoryview(data)[off : off + 5000]
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


server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def test_durable_file_flushes_as_it_goes(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without direct I/O the early-flush thread runs several times during a write, and the file is still
    exactly the stream."""
    from paraminit_client import filesink

    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(filesink.BufferedSink, "FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(filesink.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    monkeypatch.setattr(filesink, "DirectSink", _no_direct)
    put = filesink.BufferedSink.put

    def put_then_let_the_flusher_run(self: Any, c: Any) -> None:
        """Each MiB is taken by the flush thread before the next arrives: how often it runs does not depend on
        how the scheduler treats a loaded machine."""
        put(self, c)
        assert wait_until(lambda: self._pending < self.FLUSH_BYTES, 60, 0.001)

    monkeypatch.setattr(filesink.BufferedSink, "put", put_then_let_the_flusher_run)
    plan = plan_of([param("w", [3 << 20], {"normal": {"std": 0.02, "seed": 4}})])  # 12 MiB
    client.materialize_to_file(plan, tmp_path / "w.safetensors", chunk_bytes=1 << 20)
    from safetensors.numpy import load_file

    assert load_file(str(tmp_path / "w.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()
    assert len(syncs) >= 2


def _no_direct(*args: object) -> None:
    from paraminit_client import filesink

    raise filesink.DirectUnavailable("refused in this test")


@pytest.mark.parametrize("numel", [1, 1023, 4096 * 3 + 5, (3 << 20) // 4 + 7])
def test_durable_file_with_direct_io_is_the_stream_at_any_size(
    client: Client, tmp_path: Path, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 64 KiB so the ring turns over many times; sizes that end mid-block and mid-page. The file
    (written directly, then cut to size) equals the same plan written through the page cache, byte for byte."""
    from paraminit_client import filesink

    opened: list[str] = []
    real_init = filesink.DirectSink.__init__

    def spy(self: filesink.DirectSink, path: str, prefix: bytes, total: int) -> None:
        real_init(self, path, prefix, total)
        opened.append(path)

    monkeypatch.setattr(filesink.DirectSink, "BLOCK", 64 << 10)
    monkeypatch.setattr(filesink.DirectSink, "__init__", spy)
    plan = plan_of([param("w", [numel], {"uniform": {"lo": -1, "hi": 1, "seed": 6}}), param("b", [3], {"ones": {}}, "bfloat16")])
    client.materialize_to_file(plan, tmp_path / "direct.safetensors", chunk_bytes=16 << 10)
    assert len(opened) == 1, "direct I/O was not used on this file system"
    monkeypatch.setattr(filesink, "DirectSink", _no_direct)
    client.materialize_to_file(plan, tmp_path / "cached.safetensors", chunk_bytes=16 << 10)
    direct, cached = (tmp_path / "direct.safetensors").read_bytes(), (tmp_path / "cached.safetensors").read_bytes()
    assert direct == cached and len(direct) == len(cached)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cached.safetensors", "direct.safetensors"]
    from safetensors.numpy import load_file

    assert load_file(str(tmp_path / "direct.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()


def test_a_file_system_that_refuses_direct_writes_falls_back(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT accepted at open but refused at the first write (as some file systems do): the page cache
    path writes the same file."""
    from paraminit_client import filesink

    real, refused = os.pwrite, []

    def refuse_direct(fd: int, data: object, offset: int) -> int:
        if fcntl_flags(fd) & getattr(os, "O_DIRECT", 0):
            refused.append(fd)
            raise OSError(22, "Invalid argument")
        return real(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(filesink.os, "pwrite", refuse_direct)
    plan = plan_of([param("w", [5000], {"uniform": {"lo": -1, "hi": 1, "seed": 7}})])
    client.materialize_to_file(plan, tmp_path / "w.safetensors")
    from safetensors.numpy import load_file

    assert len(refused) == 1  # the probe, once
    assert load_file(str(tmp_path / "w.safetensors"))["w"].tobytes() == client.materialize(plan)["w"].tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _expected_file(tmp_path: Path) -> tuple[Any, bytes]:
    plan = plan_of([param("w", [3000], {"normal": {"std": 1.0, "seed": 4}})])
    ref = tmp_path / "ref.safetensors"
    Client().materialize_to_file(plan, ref)
    return plan, ref.read_bytes()


def test_a_link_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    plan, want = _expected_file(tmp_path)
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(real.name)
    Client().materialize_to_file(plan, link)
    assert link.is_symlink() and os.readlink(link) == real.name and real.read_bytes() == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.safetensors", "real.safetensors", "ref.safetensors"]


def test_a_fifo_is_written_in_place_never_replaced(tmp_path: Path) -> None:
    import stat
    import threading

    plan, want = _expected_file(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    Client().materialize_to_file(plan, fifo)
    reader.join(30)
    assert got == [want] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_is_written_in_place_never_replaced(tmp_path: Path) -> None:
    """As root (the container default) a rename would replace a device node with a regular file: /dev/null
    became a copy of the safetensors. A private null device stands in for /dev/null here."""
    import stat

    plan, _ = _expected_file(tmp_path)
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    Client().materialize_to_file(plan, null)
    st = os.lstat(null)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_killed_writer_leaves_no_partial_file(tmp_path: Path) -> None:
    """The file is written unnamed (O_TMPFILE) until complete: SIGKILL mid-write leaves nothing in the directory
    (a hidden `.NAME.part` of the file's full size stayed before)."""
    import subprocess
    import sys

    out = tmp_path / "big.safetensors"
    code = (
        "import sys\n"
        "from paraminit_client import Client, param, plan_of\n"
        "def seen(done, total):\n"
        "    if done:\n"
        "        print('writing', flush=True); sys.stdin.read()\n"  # blocks mid-file until killed
        "plan = plan_of([param('w', [1 << 24], {'normal': {'std': 1.0}})])\n"
        f"Client().materialize_to_file(plan, {str(out)!r}, progress=seen)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    finally:
        proc.kill()
        proc.wait()
    assert list(tmp_path.iterdir()) == []


def test_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    """-o over an existing private file leaves it private (its mode, not a new file's 0644 less the umask)."""
    plan = plan_of([param("w", [4, 4], {"normal": {"std": 1.0, "seed": 1}})])
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"old")
    os.chmod(out, 0o600)
    fresh = tmp_path / "fresh.safetensors"
    with Client() as c:
        c.materialize_to_file(plan, str(out))
        c.materialize_to_file(plan, str(fresh))
    assert os.stat(out).st_mode & 0o777 == 0o600 and out.read_bytes() == fresh.read_bytes()
    assert os.stat(fresh).st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
