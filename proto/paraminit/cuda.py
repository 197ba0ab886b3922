"""CUDA device identity, the same on the server and the client: CUDA IPC handles open only on the same GPU.

Ordinals differ between processes (CUDA_VISIBLE_DEVICES), so a handle travels
with the device's UUID and each side finds its own ordinal for it. The UUID is
read from the driver (cuDeviceGetUuid, 16 raw bytes): CuPy's `props['uuid']`
is a C string that stops at the first zero byte. Where the driver cannot be
asked, the PCI bus id names the device instead. CuPy is passed in, never imported.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

UUID_BYTES = 16
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
UuidOf = Callable[[int], bytes | None]


def format_uuid(raw: bytes | bytearray | str) -> str:
    """nvidia-smi's spelling, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, from 16 raw bytes or any spelling of it."""
    if isinstance(raw, str):
        h = raw.strip().lower().removeprefix("gpu-").replace("-", "")
    else:
        if len(raw) != UUID_BYTES:
            return ""
        h = bytes(raw).hex()
    if len(h) != 2 * UUID_BYTES or any(c not in "0123456789abcdef" for c in h):
        return ""
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@functools.lru_cache(maxsize=64)
def driver_uuid(ordinal: int) -> bytes | None:
    """cuDeviceGetUuid for the ordinal-th visible device, or None when the driver library is not there.

    Cached: a process's visible devices do not change, and GetInfo and metrics ask often."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        buf = ctypes.create_string_buffer(UUID_BYTES)
        get = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        if get(buf, dev) != 0:
            return None
        return buf.raw[:UUID_BYTES]
    except (OSError, AttributeError):
        return None


def device_uuid(cp: Any, ordinal: int, props: dict[str, Any] | None = None, uuid_of: UuidOf | None = None) -> str:
    """The identity of a visible device: its UUID, else "PCI:<bus id>".

    `uuid_of` (default: driver_uuid, looked up at call time) reads the 16 raw bytes of an ordinal's UUID."""
    raw: bytes | bytearray | None = (uuid_of or driver_uuid)(ordinal)
    if raw is None:
        props = props if props is not None else cp.cuda.runtime.getDeviceProperties(ordinal)
        maybe = props.get("uuid", b"")
        raw = maybe if isinstance(maybe, (bytes, bytearray)) and len(maybe) == UUID_BYTES else None
    if raw is not None:
        text = format_uuid(raw)
        if text:
            return text
    try:
        return "PCI:" + str(cp.cuda.runtime.deviceGetPCIBusId(ordinal)).upper()
    except Exception:
        return ""


def same_device(a: str, b: str) -> bool:
    """Two identities name the same device (UUIDs compared in any spelling)."""
    if a.startswith("PCI:") or b.startswith("PCI:"):
        return a.upper() == b.upper() and bool(a)
    fa, fb = format_uuid(a), format_uuid(b)
    return bool(fa) and fa == fb


def local_ordinal(cp: Any, identity: str, uuid_of: UuidOf | None = None) -> int:
    """This process's ordinal for the device a peer named; LookupError when it is not visible here."""
    count = int(cp.cuda.runtime.getDeviceCount())
    for ordinal in range(count):
        if same_device(device_uuid(cp, ordinal, uuid_of=uuid_of), identity):
            return ordinal
    raise LookupError(
        f"GPU {identity or '(unnamed)'} is not visible in this process ({count} visible device(s); check CUDA_VISIBLE_DEVICES)"
    )
