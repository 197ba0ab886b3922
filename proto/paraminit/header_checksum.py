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
    for t in tensors:
        parts += [_bytes(t.name.encode()), _u64(t.dtype), _u64(len(t.shape)), *(_u64(d) for d in t.shape),
                  _u64(t.offset), _u64(t.nbytes)]
    return b"".join(parts)


def header_crc32c(header: Any) -> int:
    """CRC-32C of a StreamHeader's covered bytes."""
    return int(crc32c.crc32c(covered(header.safetensors_prefix, header.plan_digest, header.data_bytes,
                                     header.tensors)))
