"""A stream's tensor table as columns (init_service.proto, PackedTensors): packed by servers, read by clients.

A plan of 100,000s of small parameters states its table once per stream. As one TensorInfo message per tensor
that costs microseconds per tensor on each side (building, checksumming and reading messages); as seven byte
strings it is a few array operations whatever the count. Both ends use this module, so the column encoding, the
split into messages and the checksum's covered bytes are written once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

# The columns in PackedTensors field order (2..8), which is also the order the header checksum covers them in.
COLUMNS = ("name_lengths", "names", "dtypes", "ranks", "dims", "offsets", "nbytes")
_U32, _U64, _U8 = np.dtype("<u4"), np.dtype("<u8"), np.dtype("u1")


@dataclass(frozen=True)
class Packed:
    """The columns of `count` tensors, each a byte string (PackedTensors without the message)."""

    count: int
    name_lengths: bytes
    names: bytes
    dtypes: bytes
    ranks: bytes
    dims: bytes
    offsets: bytes
    nbytes: bytes

    def fields(self) -> dict[str, Any]:
        """The PackedTensors fields, for `PackedTensors(**packed.fields())`."""
        return {"count": self.count, **{c: getattr(self, c) for c in COLUMNS}}


def pack(names: Sequence[str], dtypes: Any, shapes: Sequence[Sequence[int]], offsets: Any, nbytes: Any) -> Packed:
    """Columns of a table given in plan order (dtypes, offsets and nbytes: sequences or integer arrays)."""
    encoded = [n.encode() for n in names]
    ranks = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    if ranks.size and int(ranks.max()) > 255:
        raise ValueError("a rank over 255 cannot be packed")
    dims = np.fromiter(itertools.chain.from_iterable(shapes), dtype=_U64, count=int(ranks.sum()))
    return Packed(len(encoded), np.fromiter(map(len, encoded), dtype=_U32, count=len(encoded)).tobytes(),
                  b"".join(encoded), np.asarray(dtypes, dtype=_U8).tobytes(), ranks.astype(_U8).tobytes(),
                  dims.tobytes(), np.asarray(offsets, dtype=_U64).tobytes(), np.asarray(nbytes, dtype=_U64).tobytes())


def split(packed: Packed, budget: int) -> list[Packed]:
    """The table cut into consecutive groups of whole tensors, each group's columns about `budget` bytes at most
    (one tensor larger than that goes alone); at least one group, empty for an empty table."""
    n = packed.count
    lengths = np.frombuffer(packed.name_lengths, dtype=_U32).astype(np.int64)
    ranks = np.frombuffer(packed.ranks, dtype=_U8).astype(np.int64)
    per = lengths + ranks * 8 + 4 + 1 + 1 + 16
    ends = np.cumsum(per)
    cuts = [0]
    while cuts[-1] < n:
        base = int(ends[cuts[-1] - 1]) if cuts[-1] else 0
        nxt = int(np.searchsorted(ends, base + budget, side="right"))
        cuts.append(max(nxt, cuts[-1] + 1))
    if len(cuts) <= 2:
        return [packed]
    name_at = np.concatenate([[0], np.cumsum(lengths)])
    dim_at = np.concatenate([[0], np.cumsum(ranks)])
    out = []
    for a, b in itertools.pairwise(cuts):
        out.append(Packed(b - a, packed.name_lengths[4 * a:4 * b], packed.names[name_at[a]:name_at[b]],
                          packed.dtypes[a:b], packed.ranks[a:b], packed.dims[8 * dim_at[a]:8 * dim_at[b]],
                          packed.offsets[8 * a:8 * b], packed.nbytes[8 * a:8 * b]))
    return out


def join(parts: Sequence[Any]) -> Packed:
    """One table from the PackedTensors (or Packed) of a header and its parts, in order."""
    return Packed(sum(int(p.count) for p in parts), *(b"".join(getattr(p, c) for p in parts) for c in COLUMNS))


def checksum(prefix: bytes, plan_digest: str, data_bytes: int, packed: Packed) -> int:
    """The StreamHeader checksum of a packed table (init_service.proto, header_crc32c): prefix, digest, data size,
    then each column as its 8-byte length and its bytes."""
    crc = 0
    for piece in (prefix, plan_digest.encode()):
        crc = crc32c.crc32c(len(piece).to_bytes(8, "little"), crc)
        crc = crc32c.crc32c(piece, crc)
    crc = crc32c.crc32c(int(data_bytes).to_bytes(8, "little"), crc)
    for c in COLUMNS:
        column = getattr(packed, c)
        crc = crc32c.crc32c(len(column).to_bytes(8, "little"), crc)
        crc = crc32c.crc32c(column, crc)
    return int(crc)


class Table:
    """A packed table read back: `columns()` for readers that want it whole (arrays_from_buffer), or rows."""

    def __init__(self, packed: Packed) -> None:
        """Raises:
            ValueError: the columns do not agree with each other or with `count`.
        """
        n = packed.count
        lengths = np.frombuffer(packed.name_lengths, dtype=_U32)
        ranks = np.frombuffer(packed.ranks, dtype=_U8)
        sizes = (lengths.size, len(packed.dtypes), ranks.size, len(packed.offsets) // 8, len(packed.nbytes) // 8)
        if any(s != n for s in sizes) or len(packed.offsets) % 8 or len(packed.nbytes) % 8 \
                or int(lengths.sum(dtype=np.int64)) != len(packed.names) \
                or int(ranks.sum(dtype=np.int64)) * 8 != len(packed.dims):
            raise ValueError("the packed tensor table's columns do not agree in length")
        self.names = _names(packed.names, lengths)
        self.dtypes: list[int] = np.frombuffer(packed.dtypes, dtype=_U8).tolist()
        self.shapes = shapes_of(np.frombuffer(packed.dims, dtype=_U64), ranks)
        self.offsets: list[int] = np.frombuffer(packed.offsets, dtype=_U64).tolist()
        self.nbytes: list[int] = np.frombuffer(packed.nbytes, dtype=_U64).tolist()

    def __len__(self) -> int:
        return len(self.names)

    def columns(self) -> tuple[list[str], list[int], list[tuple[int, ...]], list[int], list[int]]:
        """Names, dtype enums, shapes, offsets and byte counts, in plan order."""
        return self.names, self.dtypes, self.shapes, self.offsets, self.nbytes


def _names(blob: bytes, lengths: npt.NDArray[Any]) -> list[str]:
    """Every name: one decode and plain slices when the names are ASCII, else one decode per name."""
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    starts = [0, *ends[:-1]] if ends else []
    text = blob.decode()
    if len(text) == len(blob):  # ASCII: character offsets are byte offsets
        return [text[a:b] for a, b in zip(starts, ends, strict=True)]
    return [blob[a:b].decode() for a, b in zip(starts, ends, strict=True)]


def shapes_of(dims: npt.NDArray[Any], ranks: npt.NDArray[Any]) -> list[tuple[int, ...]]:
    """Every shape of a table whose dims are concatenated, as tuples: one tuple object per distinct shape (a plan
    repeats a few shapes many times), built from one numpy unique per rank."""
    n = ranks.size
    out: list[tuple[int, ...]] = [()] * n
    at = np.concatenate([[0], np.cumsum(ranks, dtype=np.int64)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    for r in np.unique(ranks).tolist():
        if r == 0:
            continue
        rows = np.flatnonzero(ranks == r)
        mat = np.ascontiguousarray(dims[at[rows][:, None] + np.arange(r)])
        # rows as opaque 8r-byte items: numpy's unique on a 1-D array, much faster than over axis 0
        uniq, inverse = np.unique(mat.view(np.dtype((np.void, 8 * r))).reshape(-1), return_inverse=True)
        shapes = [tuple(row) for row in uniq.view(_U64).reshape(-1, r).tolist()]
        picked = [shapes[j] for j in inverse.reshape(-1).tolist()]
        if rows.size == n:
            return picked
        for i, s in zip(rows.tolist(), picked, strict=True):
            out[i] = s
    return out
