"""The one strict reader of safetensors headers: the server, `paraminit inspect` and `plan from-safetensors` use it.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then the data. The header is an object whose members are tensors, each
`{"dtype": CODE, "shape": [dims], "data_offsets": [begin, end]}` (offsets into
the data), plus an optional `"__metadata__"` map of strings to strings.

Everything is checked before anything is used, so a hostile file gets one clean
error wherever it is read: the length is bounded (MAX_HEADER_BYTES, and the
file), the JSON is strict (no NaN, no key twice, no byte that is not UTF-8),
every dtype is a safetensors dtype, every dimension a non-negative integer (not
2.0, not true), the element count and byte size fit in 63 bits, the offsets are
two integers that hold exactly shape x dtype bytes within the file, and no two
tensors' bytes overlap. Errors (HeaderError) never quote the file's bytes: a
server may read files its callers cannot.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paraminit import dtypes

MAX_HEADER_BYTES = 100 << 20  # as the safetensors library's own limit
MAX_COUNT = (1 << 63) - 1  # element counts, byte sizes and offsets fit a signed 64-bit integer
METADATA = "__metadata__"

# Bits per element of every dtype the safetensors format names.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class HeaderError(ValueError):
    """A header that breaks the format. `reason` never quotes the file's bytes; `tensor` (the entry's name,
    which is file content) and `position` (its place in the header, from 0) say which entry, when one does."""

    def __init__(self, reason: str, tensor: str | None = None, position: int | None = None, path: str | None = None) -> None:
        self.reason = reason
        self.tensor = tensor
        self.position = position
        self.path = path
        text = self.describe(names=True)
        super().__init__(text if path is None else f"{path}: not a safetensors file ({text})")

    def in_file(self, path: str | os.PathLike[str]) -> HeaderError:
        """The same error, saying which file (its text: `PATH: not a safetensors file (WHY)`)."""
        return HeaderError(self.reason, self.tensor, self.position, os.fspath(path))

    def describe(self, names: bool) -> str:
        """The error in words; `names=False` names an entry by its position only (for callers who may not
        see the file's contents)."""
        if self.position is None:
            return self.reason
        if names and self.tensor is not None:
            shown = repr(self.tensor) if len(self.tensor) <= 120 else repr(self.tensor[:120]) + "..."
            return f"tensor {shown}: {self.reason}"
        return f"tensor #{self.position + 1} of the header: {self.reason}"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header, checked against the format and the file."""

    name: str
    code: str  # the safetensors dtype code ("F32", "BF16", "I64", ...)
    shape: tuple[int, ...]
    begin: int  # data_offsets, relative to the start of the data
    end: int
    data_start: int  # absolute file offset of the data (8 + header length)

    @property
    def start(self) -> int:
        """Absolute file offset of the first byte."""
        return self.data_start + self.begin

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def dtype(self) -> dtypes.DTypeInfo | None:
        """The plan dtype of the tensor, or None for dtypes no plan holds (integers, booleans, 8-bit floats)."""
        return dtypes.by_safetensors(self.code)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header: its metadata and its tensors, in the order the header lists them."""

    header_len: int
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def in_file_order(self) -> list[TensorEntry]:
        """The tensors ordered by where their bytes lie."""
        return sorted(self.tensors.values(), key=lambda e: (e.begin, e.end))


def header_length(prefix: bytes, file_size: int) -> int:
    """The header length from a file's first 8 bytes, checked against the limit and the file's size.

    Raises:
        HeaderError: the file is shorter than 8 bytes, or the length is below 2, above MAX_HEADER_BYTES or
            beyond the file.
    """
    if len(prefix) < 8 or file_size < 8:
        raise HeaderError("shorter than the 8-byte header length")
    n = int.from_bytes(prefix[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > file_size:  # never the value itself: 8 bytes of the file
        raise HeaderError("its header length field does not fit the file")
    return n


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Duplicate
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse(raw: bytes, file_size: int) -> SafetensorsHeader:
    """Check the header bytes (what follows the 8-byte length) of a file of `file_size` bytes.

    Args:
        raw: the N header bytes.
        file_size: the whole file's size, which every tensor's bytes must lie within.

    Returns:
        The checked header.

    Raises:
        HeaderError: the first violation of the format found.
    """
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HeaderError("the header is not UTF-8 text") from None
    try:
        header = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise HeaderError("header nested too deeply") from None
    except _Duplicate:
        raise HeaderError("the header gives one key twice in an object") from None
    except ValueError as exc:  # json's messages say where, never what
        raise HeaderError(f"bad header: {exc}") from None
    if not isinstance(header, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(header), "null")
        raise HeaderError(f"the header is a JSON {kind}, not an object")
    metadata = header.get(METADATA)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{METADATA} must be an object mapping strings to strings")
    size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for position, (name, entry) in enumerate(header.items()):
        if name != METADATA:
            tensors[name] = _entry(name, position, entry, data_start, size)
    _check_overlaps(tensors, header)
    return SafetensorsHeader(len(raw), file_size, dict(metadata), tensors)


def _entry(name: str, position: int, entry: Any, data_start: int, size: int) -> TensorEntry:
    def bad(reason: str) -> HeaderError:
        return HeaderError(reason, name, position)

    if not isinstance(entry, dict):
        raise bad("the entry is not a JSON object")
    code = entry.get("dtype")
    bits = DTYPE_BITS.get(code) if isinstance(code, str) else None
    if bits is None or not isinstance(code, str):
        raise bad(f"has dtype that is not a safetensors dtype ({', '.join(DTYPE_BITS)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if any(d > MAX_COUNT for d in shape):
        raise bad("shape has a dimension beyond 2^63 - 1")
    count = 1
    for d in shape:
        count *= d
        if count > MAX_COUNT:  # also stops the product growing without bound
            raise bad("shape holds more than 2^63 - 1 elements")
    total_bits = count * bits
    if total_bits % 8:
        raise bad(f"{count} elements of {code} are not a whole number of bytes")
    nbytes = total_bits // 8
    if nbytes > MAX_COUNT:
        raise bad("its size overflows: more than 2^63 - 1 bytes")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad("data_offsets must be a list of two integers")
    begin, end = offsets
    if begin < 0 or end < begin or end - begin != nbytes:
        raise bad(f"inconsistent data_offsets: they hold {max(end - begin, 0) if begin >= 0 else 'no'} bytes, shape x dtype is {nbytes}")
    if end > size:
        raise bad(f"ends at byte {data_start + end}, past the end of the file ({data_start + size} bytes)")
    return TensorEntry(name, code, tuple(shape), begin, end, data_start)


def _check_overlaps(tensors: dict[str, TensorEntry], header: dict[str, Any]) -> None:
    """No two tensors share a byte (empty tensors hold none)."""
    spans = sorted((e.begin, e.end, e.name) for e in tensors.values() if e.end > e.begin)
    for (b0, e0, _), (b1, e1, name) in itertools.pairwise(spans):
        if b1 < e0:
            raise HeaderError(f"data_offsets [{b1}, {e1}] overlap [{b0}, {e0}] of another tensor", name, list(header).index(name))


def read(read_at: Callable[[int, int], bytes], file_size: int) -> SafetensorsHeader:
    """Read and check a header through `read_at(offset, n)` (which returns exactly n bytes or raises).

    Args:
        read_at: reads the file; the server's bounded pread or a plain file's.
        file_size: the file's size.

    Returns:
        The checked header.

    Raises:
        HeaderError: the file breaks the format.
    """
    if file_size < 8:
        raise HeaderError("shorter than the 8-byte header length")
    n = header_length(read_at(0, 8), file_size)
    return parse(read_at(8, n), file_size)


def read_file(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and check the header of the safetensors file at `path`.

    Args:
        path: the file.

    Returns:
        The checked header.

    Raises:
        OSError: the file cannot be opened or read.
        HeaderError: the file breaks the format (also when it shrinks while it is read); its text names the file.
    """
    try:
        return _read_file(path)
    except HeaderError as exc:
        raise exc.in_file(path) from None


def _read_file(path: str | os.PathLike[str]) -> SafetensorsHeader:
    # opened without waiting for a writer (a FIFO), and only a regular file is read: a file format has a size
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise HeaderError("not a regular file (a safetensors file is read by offset)")
        size = st.st_size

        def read_at(offset: int, n: int) -> bytes:
            parts, got = [], 0
            while got < n:
                part = os.pread(f.fileno(), n - got, offset + got)
                if not part:
                    raise HeaderError("the file ends inside its header (it changed while it was read)")
                parts.append(part)
                got += len(part)
            return b"".join(parts)

        return read(read_at, size)
