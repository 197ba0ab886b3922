"""Outgoing gRPC messages written in place, in bytes objects that are reused once gRPC lets go of them.

grpcio sends only `bytes`, and copies each message into its own buffer when the
send starts. Building a fresh 1 MiB bytes per chunk costs a copy (the join of
header, data and checksum) and, whenever the heap has shrunk, a page fault per
4 KiB (about 12,000 per 256 MiB stream measured). Here a message is a bytes
object made uninitialized and written through a numpy view; a bytes object goes
back to work only when the pool holds the last reference to it, so nobody, not
gRPC and not a consumer that kept it, can ever see it change. A bytes object
still referenced elsewhere is simply left alone and a new one made.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)  # a NULL source leaves the contents unset
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


@dataclass(eq=False)
class Message:
    """A bytes object (`data`) and a writable view of its contents (`view`)."""

    data: bytes
    view: npt.NDArray[np.uint8]


def new_message(size: int) -> Message:
    """An uninitialized bytes object of `size` bytes and a writable view of it (the caller fills every byte)."""
    data = _new_bytes(None, size)
    view = np.frombuffer(memoryview((ctypes.c_char * size).from_address(_bytes_data(data))).cast("B"), dtype=np.uint8)
    return Message(data, view)


class MessagePool:
    """Messages by size, reused when free; at most `max_bytes` of them kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._lock = threading.Lock()
        self._by_size: dict[int, collections.deque[Message]] = {}
        self._probe = collections.deque([new_message(2)])  # never handed out

    def take(self, size: int) -> Message:
        """A message of `size` bytes that nobody else references (contents unspecified). Keep the Message
        until its bytes are referenced elsewhere (sent, queued): until then only the Message marks it busy;
        a message counts as free when neither it nor its bytes has a reference beyond the pool's."""
        with self._lock:
            ring = self._by_size.setdefault(size, collections.deque())
            # What "nobody else" reads as: a probe message held exactly as a free pooled one is (one ring slot,
            # one local name), counted by the same expressions, so no interpreter's counting convention matters.
            p = self._probe[0]
            free_data, free_message = sys.getrefcount(p.data), sys.getrefcount(p)
            for _ in range(len(ring)):  # oldest first: the ones sent longest ago are the likeliest free
                m = ring[0]
                ring.rotate(-1)
                if sys.getrefcount(m.data) == free_data and sys.getrefcount(m) == free_message:
                    return m
            m = new_message(size)
            if self.held + size <= self.max_bytes:
                ring.append(m)
                self.held += size
            return m

    def clear(self) -> None:
        """Drop every pooled message (those still in flight go when their holders let go)."""
        with self._lock:
            self._by_size.clear()
            self.held = 0
