"""Flat payloads beyond one gRPC message: uploaded payloads and safetensors files the server reads.

Both become binary64 arrays, converted exactly from float32, float16, bfloat16
or float64, so a checkpoint tensor passes through the usual single rounding
into the parameter's dtype and loads bit for bit when the dtypes agree.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit_server import errors


def to_binary64(raw: npt.NDArray[np.uint8], dt: dtypes.DTypeInfo) -> npt.NDArray[np.float64]:
    """Exact conversion of little-endian values to binary64 (every supported dtype embeds in binary64)."""
    if dt.fmt == dtypes.FMT_BFLOAT16:
        bits = raw.view("<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    if dt.fmt == dtypes.FMT_FLOAT16:
        return raw.view("<f2").astype(np.float64)
    return raw.view("<f4" if dt.itemsize == 4 else "<f8").astype(np.float64)


@dataclass
class Payload:
    owner: str
    values: npt.NDArray[np.float64]
    expires_at: float
    nonfinite: int  # count of NaN/inf values
    first_nonfinite: int


@dataclass(frozen=True)
class TensorInfo:
    dtype: dtypes.DTypeInfo
    shape: tuple[int, ...]
    start: int  # absolute file offset of the data
    nbytes: int


class Sources:
    """Where flat_ref and safetensors initializers get their values."""

    def __init__(self, max_bytes: int, ttl: float, safetensors_dirs: Iterable[str] = ()) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.dirs = [Path(d).resolve() for d in safetensors_dirs if d]
        self._payloads: dict[str, Payload] = {}
        self._lock = threading.Lock()

    # -- uploaded payloads ---------------------------------------------------------------

    def store(self, owner: str, dtype_enum: int, count: int, data: npt.NDArray[np.uint8]) -> tuple[str, Payload]:
        dt = dtypes.by_enum(dtype_enum)
        if dt is None:
            raise errors.InvalidRequest(f"unknown payload dtype enum value {dtype_enum}")
        if len(data) != count * dt.itemsize:
            raise errors.InvalidRequest(f"payload declared {count} {dt.name} values ({count * dt.itemsize} bytes) but "
                                        f"{len(data)} bytes arrived")
        self._expire()
        with self._lock:
            used = sum(p.values.nbytes for p in self._payloads.values())
            if used + count * 8 > self.max_bytes:
                raise errors.ResourceExhausted(f"payload needs {count * 8} bytes as binary64; {self.max_bytes - used} "
                                               f"of {self.max_bytes} payload bytes are free")
        values = to_binary64(data, dt)
        finite = np.isfinite(values)
        bad = np.flatnonzero(~finite) if not finite.all() else np.zeros(0, np.int64)
        payload = Payload(owner, values, time.time() + self.ttl, int(bad.size), int(bad[0]) if bad.size else -1)
        pid = secrets.token_hex(16)
        with self._lock:
            self._payloads[pid] = payload
        return pid, payload

    def payload(self, payload_id: str, owner: str) -> Payload | None:
        self._expire()
        with self._lock:
            p = self._payloads.get(payload_id)
        return p if p is not None and p.owner == owner else None

    def _expire(self) -> None:
        now = time.time()
        with self._lock:
            for pid in [k for k, p in self._payloads.items() if p.expires_at <= now]:
                del self._payloads[pid]

    # -- safetensors files ---------------------------------------------------------------

    def allowed(self, path: str) -> Path:
        """The resolved path, if it lies under an allowed directory; raises otherwise."""
        if not self.dirs:
            raise errors.InvalidRequest("this server reads no files: start it with --safetensors-dirs")
        real = Path(path).resolve()
        if not any(real.is_relative_to(d) for d in self.dirs):
            raise errors.InvalidRequest(f"{path} is not under an allowed directory")
        return real

    def tensor_info(self, path: str, tensor: str) -> TensorInfo:
        real = self.allowed(path)
        try:
            with open(real, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or n > 100 << 20:
                    raise errors.InvalidRequest(f"{path} is not a safetensors file (header length {n})")
                header = json.loads(f.read(n))
        except OSError as exc:
            raise errors.InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
        except (ValueError, UnicodeDecodeError):
            raise errors.InvalidRequest(f"{path} is not a safetensors file (bad header)") from None
        entry = header.get(tensor)
        if not isinstance(entry, dict) or tensor == "__metadata__":
            raise errors.InvalidRequest(f"tensor {tensor!r} is not in {path}")
        dt = dtypes.by_safetensors(entry.get("dtype"))
        if dt is None:
            raise errors.InvalidRequest(f"tensor {tensor!r} in {path} has dtype {entry.get('dtype')}, not one of "
                                        f"{', '.join(d.safetensors for d in dtypes.SUPPORTED)}")
        b, e = entry["data_offsets"]
        shape = tuple(int(d) for d in entry["shape"])
        if e - b != int(np.prod(shape, dtype=object)) * dt.itemsize or e > os.path.getsize(real) - 8 - n:
            raise errors.InvalidRequest(f"tensor {tensor!r} in {path} has inconsistent offsets")
        return TensorInfo(dt, shape, 8 + n + b, e - b)

    def tensor_values(self, path: str, tensor: str) -> npt.NDArray[np.float64]:
        info = self.tensor_info(path, tensor)
        raw = np.memmap(self.allowed(path), dtype=np.uint8, mode="r", offset=info.start, shape=(info.nbytes,))
        return to_binary64(np.asarray(raw), info.dtype)


class BoundSources:
    """Sources as one caller sees them: payloads are visible to the identity that uploaded them only."""

    def __init__(self, sources: Sources, owner: str) -> None:
        self.sources = sources
        self.owner = owner

    def payload(self, payload_id: str) -> Payload | None:
        return self.sources.payload(payload_id, self.owner)

    def tensor_info(self, path: str, tensor: str) -> TensorInfo:
        return self.sources.tensor_info(path, tensor)

    def tensor_values(self, path: str, tensor: str) -> npt.NDArray[np.float64]:
        return self.sources.tensor_values(path, tensor)
