"""Where each parameter lies in a delivered buffer: the safetensors stream and export arenas.

The stream orders tensors by descending item size, so with a 64-byte aligned
data section every tensor starts on a multiple of its item size and any slab
boundary that is a multiple of 8 falls between elements. safetensors forbids
holes, so this is the alignment the format allows; exports pad to `align`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit.results import SpanTable
from paraminit.spans import ByteSpans
from paraminit_server.plans.columns import ParamTable
from paraminit_server.plans.plan import Offsets, ResolvedParam

STREAM_ALIGN = 64
EXPORT_ALIGN = 64
SLAB_QUANTUM = 8


@dataclass(frozen=True)
class Placement:
    param: ResolvedParam
    offset: int  # bytes from the start of the data section / arena


class Layout:
    """Where every parameter of a delivered buffer lies: parameter i (plan order) at byte offsets[i].

    The placements and the stream's safetensors prefix are built only when asked for: an in-process fill needs
    neither, only the tensor table (`spans`, from the table's columns)."""

    def __init__(self, params: ParamTable, offsets: Offsets, data_bytes: int, prefix: bytes | Callable[[], bytes] = b"") -> None:
        self.params = params
        self.offsets = offsets
        self.data_bytes = data_bytes
        self._prefix = prefix

    @functools.cached_property
    def placements(self) -> tuple[Placement, ...]:
        """In plan order."""
        return tuple([Placement(p, int(o)) for p, o in zip(self.params, self.offsets, strict=True)])

    @functools.cached_property
    def prefix(self) -> bytes:
        """safetensors 8-byte length + JSON header, for streams (b"" for exports)."""
        return self._prefix if isinstance(self._prefix, bytes) else self._prefix()

    @functools.cached_property
    def _spans(self) -> ByteSpans:
        return ByteSpans(self.offsets, self.params.nbytes)

    def gaps(self) -> list[tuple[int, int]]:
        """The byte ranges [start, stop) of the data section no tensor covers (an export's padding), ascending."""
        begins, ends = self._spans.begins, self._spans.ends
        starts = np.concatenate([[0], np.maximum.accumulate(ends)]) if ends.shape[0] else np.zeros(1, dtype=np.int64)
        stops = np.concatenate([begins, [self.data_bytes]])
        keep = stops > starts
        return list(zip(starts[keep].tolist(), stops[keep].tolist(), strict=True))

    def overlapping(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Plan indices (ascending) of the parameters with bytes in [start, stop) (paraminit.spans)."""
        return self._spans.overlapping(start, stop)

    def spans(self) -> SpanTable:
        """Where each tensor lies, in plan order, as plain tuples (no protobuf for in-process callers)."""
        params = self.params  # from the columns, without a ResolvedParam each
        return SpanTable(params.names, params.dtype.tolist(), params.shapes, np.asarray(self.offsets).tolist(), params.nbytes.tolist())


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def stream_layout(params: ParamTable, plan_digest: str) -> Layout:
    """Contiguous safetensors layout, by descending item size and then row order (a stable sort), the header padded
    so the data section starts 64-byte aligned; the header is built only when asked for."""
    nbytes = params.nbytes
    order = np.argsort(-params.itemsize, kind="stable")
    ends = np.cumsum(nbytes[order])
    offsets = np.empty_like(ends)
    offsets[order] = ends - nbytes[order]
    total = int(ends[-1]) if ends.shape[0] else 0

    def prefix() -> bytes:
        st = {d.enum: d.safetensors for d in dtypes.SUPPORTED}
        entries = list(zip(map(st.__getitem__, params.dtype.tolist()), params.shapes, nbytes.tolist(), strict=True))
        return _padded(_header(params.names, entries, offsets.tolist(), plan_digest))

    return Layout(params, offsets, total, prefix)


def _padded(text: bytes) -> bytes:
    """The 8-byte length and the header, padded with spaces so the data section starts STREAM_ALIGN-aligned."""
    text += b" " * (_round_up(8 + len(text), STREAM_ALIGN) - 8 - len(text))
    return len(text).to_bytes(8, "little") + text


def _header(names: Sequence[str], entries: Sequence[tuple[str, tuple[int, ...], int]], offsets: Sequence[int], plan_digest: str) -> bytes:
    """The safetensors JSON header, byte for byte what json.dumps(separators=(",", ":")) makes of the dict
    {"__metadata__": ..., name: {"dtype", "shape", "data_offsets"}, ...}, written out entry by entry
    (entries: safetensors dtype, shape and bytes of each parameter)."""
    # no parameter is named __metadata__ (validation refuses the name), so the entries never collide with it
    meta: dict[str, object] = {"__metadata__": {"plan_digest": plan_digest, "format": "pt"}}
    quote = json.encoder.encode_basestring_ascii  # what json.dumps uses (ensure_ascii)
    parts = [json.dumps(meta, separators=(",", ":"))[:-1]]
    for name, (dt, shape, nbytes), o in zip(names, entries, offsets, strict=True):
        parts.append(f'{quote(name)}:{{"dtype":{quote(dt)},"shape":[{",".join(map(str, shape))}],"data_offsets":[{o},{o + nbytes}]}}')
    return (",".join(parts) + "}").encode()


def export_layout(params: ParamTable, align: int = EXPORT_ALIGN) -> Layout:
    """Plan-order arena with every tensor aligned to `align` bytes (64 on CPU, 256 on GPU)."""
    padded = (params.nbytes + (align - 1)) // align * align
    ends = np.cumsum(padded)
    return Layout(params, ends - padded, int(ends[-1]) if ends.shape[0] else 0)
