"""Checkpoint files read defensively: bounded pread into buffers, never a memory map.

A file under an allowed directory may be replaced, truncated, a FIFO or a
symlink loop by the time a request reads it, and any directory on its way may
be swapped for a link. Files are opened once, beneath the allowed directory's
fd, with no link followed in any component (openat2 RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS, or a walk of O_NOFOLLOW opens where the kernel lacks it),
non-blocking (a FIFO never blocks a worker); they must be regular files by
fstat, are read through that fd only, with pread of bounded size: a file that shrinks under the read is an
error of the request (INVALID_ARGUMENT), never SIGBUS for the whole server.
Headers are parsed strictly (paraminit.safetensors_header, as the client's
tools parse them); anything malformed is INVALID_ARGUMENT with a message that
says what is wrong and quotes none of the file's bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit import dtypes, safetensors_header
from paraminit_server import errors

READ_BLOCK = 8 << 20  # the most one pread asks for
GATHER_WINDOW = 1 << 20  # short runs of a region are gathered from windows of this many bytes
MAX_PATH_ECHO = 200


class FileChanged(errors.InvalidRequest):
    """The file changed (shrank, was replaced) while the request read it."""


@dataclass(frozen=True)
class FileKey:
    """What identifies one version of a file: a rewrite changes size or mtime, a replacement the inode."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileKey:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file version, as its header places it (not the contract's TensorInfo)."""

    dtype: dtypes.DTypeInfo
    shape: tuple[int, ...]
    start: int  # absolute file offset of the data
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header of one file version."""

    key: FileKey
    data_start: int
    parsed: safetensors_header.SafetensorsHeader


def echo(text: str, limit: int = MAX_PATH_ECHO) -> str:
    """A user string as it may appear in an error: repr'd, and cut to `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x04, 0x08  # linux/openat2.h
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(os.uname().machine)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_openat2_missing = SYS_OPENAT2 is None  # set once the kernel says it has no openat2
_openat2_seen_working = False  # after one success, ENOSYS/EPERM are not taken for "no openat2"
_libc: Any = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, rel: str) -> int | None:
    """openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS); None where the kernel or libc has no openat2."""
    global _openat2_missing, _libc
    if _openat2_missing or SYS_OPENAT2 is None:
        return None
    how = _OpenHow(_OPEN_FLAGS, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    try:
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        fd = int(
            _libc.syscall(
                ctypes.c_long(SYS_OPENAT2),
                ctypes.c_int(dir_fd),
                ctypes.c_char_p(os.fsencode(rel)),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
    except (OSError, AttributeError):
        _openat2_missing = True
        return None
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _openat2_seen_working:  # no openat2, or a seccomp filter
        _openat2_missing = True
        return None
    raise OSError(err, os.strerror(err))


def _walk(dir_fd: int, parts: list[str]) -> int:
    """The component walk openat2 does in the kernel: each directory opened from its parent's fd, none a link."""
    fd = os.dup(dir_fd)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], _OPEN_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def open_beneath(root: str, rel: str, shown: str) -> tuple[int, os.stat_result]:
    """Open `rel` (components without '.', '..' or empty names) beneath the directory `root`, following no
    symbolic link in any component, without blocking; only regular files.

    The file is opened once, and everything after reads through the returned fd: a directory swapped for a link
    while the request runs cannot lead the read outside `root`.

    Raises:
        errors.InvalidRequest: the file cannot be opened that way, is not a regular file, or has more than one hard
            link (one made inside an allowed directory could reach a file outside it).
    """
    global _openat2_seen_working
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise errors.InvalidRequest(f"{shown} is not a plain path beneath an allowed directory")
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.InvalidRequest(f"cannot open the allowed directory of {shown}: {exc.strerror}") from None
    try:
        fd = _openat2(root_fd, rel)
        if fd is None:
            fd = _walk(root_fd, parts)
        else:
            _openat2_seen_working = True
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):  # a link (or a swapped one) on the way
            raise errors.InvalidRequest(
                f"cannot open {shown}: it is, or lies under, a symbolic link or not a "
                f"directory (links are not followed under allowed directories)"
            ) from None
        raise errors.InvalidRequest(f"cannot open {shown}: {exc.strerror}") from None
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.InvalidRequest(f"{shown} is not a regular file")
        if st.st_nlink > 1:  # a hard link under an allowed directory may name a file outside it
            raise errors.InvalidRequest(f"{shown} has {st.st_nlink} hard links (a file read under an allowed directory must have one)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def pread_exact(fd: int, offset: int, n: int, shown: str) -> bytes:
    """Exactly n bytes at offset, in reads of at most READ_BLOCK; a short file is FileChanged."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            part = os.pread(fd, min(READ_BLOCK, n - got), offset + got)
        except OSError as exc:
            raise errors.InvalidRequest(f"cannot read {shown}: {exc.strerror}") from None
        if not part:
            raise FileChanged(
                f"{shown} changed while it was read: {n} bytes expected at offset {offset}, the file ends after {offset + got}"
            )
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_header(fd: int, st: os.stat_result, shown: str) -> Header:
    """Parse and check the whole header once (paraminit.safetensors_header): a file that breaks the format is
    refused whichever of its tensors a plan names, with an error that quotes none of its bytes.

    Raises:
        errors.InvalidRequest: the file is not a safetensors file (FileChanged: it shrank while it was read).
    """
    try:
        parsed = safetensors_header.read(lambda offset, n: pread_exact(fd, offset, n, shown), st.st_size)
    except safetensors_header.HeaderError as exc:
        raise errors.InvalidRequest(f"{shown} is not a safetensors file ({exc.describe(names=False)})") from None
    return Header(FileKey.of(st), parsed.data_start, parsed)


def tensor_entry(header: Header, tensor: str, shown: str) -> StoredTensor:
    """The tensor's dtype, shape and data range; the dtype must be one a plan holds."""
    entry = header.parsed.tensors.get(tensor)
    name = echo(tensor, 120)
    if entry is None:
        raise errors.InvalidRequest(f"tensor {name} is not in {shown}")
    dt = entry.dtype
    if dt is None:  # a code of the format (checked), so it is no file content beyond that
        raise errors.InvalidRequest(
            f"tensor {name} in {shown} has dtype {entry.code}, not one of {', '.join(d.safetensors for d in dtypes.SUPPORTED)}"
        )
    return StoredTensor(dt, entry.shape, entry.start, entry.nbytes)


def read_runs(
    fd: int,
    data_start: int,
    itemsize: int,
    starts: npt.NDArray[np.int64],
    run_len: int,
    shown: str,
    sink: Callable[[npt.NDArray[np.uint8]], None],
) -> None:
    """Feed the bytes of every run to `sink`, in order, reading at most READ_BLOCK at a time."""
    run_bytes = run_len * itemsize
    if run_bytes == 0:
        return
    i, total = 0, len(starts)
    window_elems = max(GATHER_WINDOW // itemsize, run_len)
    while i < total:
        lo = int(starts[i])
        if run_bytes >= GATHER_WINDOW:  # a long run: straight through, block by block
            base = data_start + lo * itemsize
            for off in range(0, run_bytes, READ_BLOCK):
                sink(np.frombuffer(pread_exact(fd, base + off, min(READ_BLOCK, run_bytes - off), shown), np.uint8))
            i += 1
            continue
        # short runs: read the window that holds as many as fit, then gather them
        j = int(np.searchsorted(starts, lo + window_elems - run_len, side="right"))
        j = max(j, i + 1)
        hi = int(starts[j - 1]) + run_len
        block = np.frombuffer(pread_exact(fd, data_start + lo * itemsize, (hi - lo) * itemsize, shown), np.uint8)
        rel = (starts[i:j] - lo) * itemsize
        idx = (rel[:, None] + np.arange(run_bytes, dtype=np.int64)[None, :]).reshape(-1)
        sink(block[idx])
        i = j
