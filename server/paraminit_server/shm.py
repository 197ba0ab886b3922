"""POSIX shared-memory segments: what the CPU backend lends to local peers.

A segment is created exclusively with mode 0600 under a 128-bit random name,
its tmpfs space reserved up front (a full /dev/shm is ENOSPC here, not SIGBUS
mid-fill), and unlinked on close.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import numpy as np

from paraminit_server import errors
from paraminit_server.backends import SHM, ExportHandle

SHM_DIR = "/dev/shm"
SHM_PREFIX = "paraminit-"


class ShmSegment:
    """A segment created with O_EXCL, mode 0600, mapped once; `array` is its bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.name = SHM_PREFIX + secrets.token_hex(16)
        self.path = os.path.join(SHM_DIR, self.name)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise errors.ResourceExhausted(f"cannot create a {size}-byte shared-memory segment: {exc}") from None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, max(size, 1))
            os.posix_fallocate(fd, 0, max(size, 1))
            self._map = mmap.mmap(fd, max(size, 1))
        except OSError as exc:
            os.unlink(self.path)
            raise errors.ResourceExhausted(f"cannot create a {size}-byte shared-memory segment: {exc}") from None
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=size)

    def handle(self) -> ExportHandle:
        return ExportHandle(SHM, self.size, shm_name=self.name)

    def recycle(self) -> bool:
        """A fresh unguessable name for the same pages; the old name stops resolving at once."""
        name = SHM_PREFIX + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        try:
            os.rename(self.path, path)
        except OSError:
            return False
        self.name, self.path = name, path
        return True

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):  # a view is still alive somewhere; the mapping goes when it does
            self._map.close()
