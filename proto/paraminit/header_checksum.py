"""The stream header's checksum: CRC-32C over everything a client relies on before writing a byte.

Chunks carry their own CRC-32C; the header (the safetensors prefix, tensor names,
dtypes, shapes, offsets, sizes, the data size and the plan digest) carries this
one, so a flipped byte anywhere in it fails loudly instead of producing a file
with a renamed tensor or a header that is not JSON. The covered bytes are a
plain concatenation any implementation can rebuild (init_service.proto spells it
out): byte strings as an 8-byte little-endian length then the bytes, integers as
8-byte little-endian values.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import crc32c


def _u64(n: int) -> bytes:
    return int(n).to_bytes(8, "little")


def _bytes(b: bytes) -> bytes:
    return _u64(len(b)) + b


def covered(prefix: bytes, plan_digest: str, data_bytes: int, tensors: Iterable[Any]) -> bytes:
    """The covered bytes: prefix, plan digest, data size, then per tensor name, dtype, rank, dims, offset, nbytes."""
    parts = [_bytes(prefix), _bytes(plan_digest.encode()), _u64(data_bytes)]
    layouts: dict[tuple[int, int], Any] = {}  # one struct per (name length, rank): a plan has few
    for t in tensors:
        name, shape = t.name.encode(), t.shape
        key = (len(name), len(shape))
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = struct.Struct(f"<Q{key[0]}sQQ{key[1]}QQQ").pack
        parts.append(layout(key[0], name, t.dtype, key[1], *shape, t.offset, t.nbytes))
    return b"".join(parts)


def checksum(prefix: bytes, plan_digest: str, data_bytes: int, tensors: Iterable[Any]) -> int:
    """CRC-32C of the covered bytes (tensors: anything with name, dtype, shape, offset and nbytes)."""
    return int(crc32c.crc32c(covered(prefix, plan_digest, data_bytes, tensors)))


def header_crc32c(header: Any) -> int:
    """CRC-32C of a StreamHeader's covered bytes."""
    return checksum(header.safetensors_prefix, header.plan_digest, header.data_bytes, header.tensors)
