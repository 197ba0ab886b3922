"""A stream's tensor table as columns (init_service.proto, PackedTensors): packed by servers, read by clients.

A plan of 100,000s of small parameters states its table once per stream. As one TensorInfo message per tensor
that costs microseconds per tensor on each side (building, checksumming and reading messages); as seven byte
strings it is a few array operations whatever the count. Both ends use this module, so the column encoding, the
split into messages and the checksum's covered bytes are written once.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    blob = "".join(names).encode()
    lengths = np.fromiter(map(len, names), dtype=_U32, count=len(names))
    if int(lengths.sum(dtype=np.int64)) != len(blob):  # not all ASCII: byte lengths name by name
        encoded = [n.encode() for n in names]
        lengths = np.fromiter(map(len, encoded), dtype=_U32, count=len(encoded))
    ranks = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    if ranks.size and int(ranks.max()) > 255:
        raise ValueError("a rank over 255 cannot be packed")
    dims = np.fromiter(itertools.chain.from_iterable(shapes), dtype=_U64, count=int(ranks.sum()))
    return Packed(
        len(names),
        lengths.tobytes(),
        blob,
        np.asarray(dtypes, dtype=_U8).tobytes(),
        ranks.astype(_U8).tobytes(),
        dims.tobytes(),
        np.asarray(offsets, dtype=_U64).tobytes(),
        np.asarray(nbytes, dtype=_U64).tobytes(),
    )


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
        out.append(
            Packed(
                b - a,
                packed.name_lengths[4 * a : 4 * b],
                packed.names[name_at[a] : name_at[b]],
                packed.dtypes[a:b],
                packed.ranks[a:b],
                packed.dims[8 * dim_at[a] : 8 * dim_at[b]],
                packed.offsets[8 * a : 8 * b],
                packed.nbytes[8 * a : 8 * b],
            )
        )
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


class Run(NamedTuple):
    """Tensors [first, stop) of a table that share a dtype enum, a shape and a byte size and lie back to back
    from byte `offset`: viewed as one array and split along its first axis (arrays_from_buffer)."""

    first: int
    stop: int
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int  # of each tensor


class Table:
    """A packed table read back: names, `runs()` for readers that view tensors (arrays_from_buffer), or
    `columns()` as lists."""

    def __init__(self, packed: Packed) -> None:
        """Raises:
        ValueError: the columns do not agree with each other or with `count`.
        """
        n = packed.count
        lengths = np.frombuffer(packed.name_lengths, dtype=_U32)
        ranks = np.frombuffer(packed.ranks, dtype=_U8)
        sizes = (lengths.size, len(packed.dtypes), ranks.size, len(packed.offsets) // 8, len(packed.nbytes) // 8)
        if (
            any(s != n for s in sizes)
            or len(packed.offsets) % 8
            or len(packed.nbytes) % 8
            or int(lengths.sum(dtype=np.int64)) != len(packed.names)
            or int(ranks.sum(dtype=np.int64)) * 8 != len(packed.dims)
        ):
            raise ValueError("the packed tensor table's columns do not agree in length")
        self.names = _names(packed.names, lengths)
        self._dtypes = np.frombuffer(packed.dtypes, dtype=_U8)
        self._shape_ids, self._shapes = shape_ids(np.frombuffer(packed.dims, dtype=_U64), ranks)
        self._offsets = np.frombuffer(packed.offsets, dtype=_U64)
        self._nbytes = np.frombuffer(packed.nbytes, dtype=_U64)

    def __len__(self) -> int:
        return len(self.names)

    def columns(self) -> tuple[list[str], list[int], list[tuple[int, ...]], list[int], list[int]]:
        """Names, dtype enums, shapes, offsets and byte counts, in plan order."""
        shapes = self._shapes
        return (
            self.names,
            self._dtypes.tolist(),
            [shapes[i] for i in self._shape_ids.tolist()],
            self._offsets.tolist(),
            self._nbytes.tolist(),
        )

    def runs(self) -> list[Run]:
        """The table as maximal runs (Run), in order: a plan of many small parameters has few."""
        return runs(self._dtypes, self._shapes, self._offsets, self._nbytes, self._shape_ids)


def runs(
    dtypes: Any, shapes: Sequence[tuple[int, ...]], offsets: Any, nbytes: Any, shape_ids: npt.NDArray[np.int64] | None = None
) -> list[Run]:
    """The maximal runs (Run) of a table given as columns (sequences or arrays), in order. With `shape_ids`, row
    i's shape is shapes[shape_ids[i]] and shapes are compared by id; else `shapes` has one per row."""
    n = len(shape_ids) if shape_ids is not None else len(shapes)
    if not n:
        return []
    off, size = np.asarray(offsets, dtype=_U64), np.asarray(nbytes, dtype=_U64)
    dt = np.asarray(dtypes, dtype=np.int64)
    cut = np.ones(n, dtype=bool)
    cut[1:] = (off[1:] != off[:-1] + size[:-1]) | (size[1:] != size[:-1]) | (dt[1:] != dt[:-1])
    if shape_ids is not None:
        cut[1:] |= shape_ids[1:] != shape_ids[:-1]
    else:
        cut[1:] |= np.fromiter(map(operator.ne, shapes[1:], shapes[:-1]), dtype=bool, count=n - 1)
    firsts = np.flatnonzero(cut)
    picked = shape_ids[firsts].tolist() if shape_ids is not None else firsts.tolist()
    return [
        Run(i, j, d, shapes[k], o, b)
        for i, j, d, k, o, b in zip(
            firsts.tolist(),
            [*firsts[1:].tolist(), n],
            dt[firsts].tolist(),
            picked,
            off[firsts].tolist(),
            size[firsts].tolist(),
            strict=True,
        )
    ]


def _names(blob: bytes, lengths: npt.NDArray[Any]) -> list[str]:
    """Every name: one decode and plain slices when the names are ASCII, else one decode per name."""
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    starts = [0, *ends[:-1]] if ends else []
    text = blob.decode()
    if len(text) == len(blob):  # ASCII: character offsets are byte offsets
        return [text[a:b] for a, b in zip(starts, ends, strict=True)]
    return [blob[a:b].decode() for a, b in zip(starts, ends, strict=True)]


def shape_ids(dims: npt.NDArray[Any], ranks: npt.NDArray[Any]) -> tuple[npt.NDArray[np.int64], list[tuple[int, ...]]]:
    """Every row's shape (dims concatenated, `ranks` per row) as an index into a list of the distinct shapes, built
    from one numpy unique per rank (a plan repeats a few shapes many times); id 0 is the scalar shape ()."""
    n = ranks.size
    ids = np.zeros(n, dtype=np.int64)
    shapes: list[tuple[int, ...]] = [()]
    at = np.concatenate([[0], np.cumsum(ranks, dtype=np.int64)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    for r in np.unique(ranks).tolist():
        if r == 0:
            continue
        rows = np.flatnonzero(ranks == r)
        mat = np.ascontiguousarray(dims[at[rows][:, None] + np.arange(r)])
        # rows as opaque 8r-byte items: numpy's unique on a 1-D array, much faster than over axis 0
        uniq, inverse = np.unique(mat.view(np.dtype((np.void, 8 * r))).reshape(-1), return_inverse=True)
        ids[rows] = inverse.reshape(-1) + len(shapes)
        shapes += [tuple(row) for row in uniq.view(_U64).reshape(-1, r).tolist()]
    return ids, shapes


def shapes_of(dims: npt.NDArray[Any], ranks: npt.NDArray[Any]) -> list[tuple[int, ...]]:
    """Every shape of a table whose dims are concatenated, as tuples: one tuple object per distinct shape."""
    ids, shapes = shape_ids(dims, ranks)
    return [shapes[i] for i in ids.tolist()]
