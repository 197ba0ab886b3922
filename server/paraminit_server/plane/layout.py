"""Where each parameter lies in a delivered buffer: the safetensors stream and export arenas.

The stream orders tensors by descending item size, so with a 64-byte aligned
data section every tensor starts on a multiple of its item size and any slab
boundary that is a multiple of 8 falls between elements. safetensors forbids
holes, so this is the alignment the format allows; exports pad to `align`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from paraminit_server.plans.plan import ResolvedParam

STREAM_ALIGN = 64
EXPORT_ALIGN = 64
SLAB_QUANTUM = 8


@dataclass(frozen=True)
class Placement:
    param: ResolvedParam
    offset: int  # bytes from the start of the data section / arena


@dataclass(frozen=True)
class Layout:
    placements: tuple[Placement, ...]  # in plan order
    data_bytes: int
    prefix: bytes = b""  # safetensors 8-byte length + JSON header, for streams

    def in_offset_order(self) -> list[Placement]:
        return sorted(self.placements, key=lambda pl: pl.offset)

    def spans(self) -> list[TensorSpan]:
        """Where each tensor lies, in plan order, as plain tuples (no protobuf for in-process callers)."""
        return [TensorSpan(pl.param.name, pl.param.dtype.enum, pl.param.out_shape, pl.offset, pl.param.nbytes)
                for pl in self.placements]


class TensorSpan(NamedTuple):
    """One tensor of a delivered buffer: the fields of the contract's TensorInfo, as a plain tuple."""

    name: str
    dtype: int  # paraminit.v1.DType enum value
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def stream_layout(params: Sequence[ResolvedParam], plan_digest: str) -> Layout:
    """Contiguous safetensors layout: header padded so the data section starts 64-byte aligned."""
    indices = [p.index for p in params]
    if all(a < b for a, b in itertools.pairwise(indices)):  # plan order: a stable pass per item size, no sort
        order = [p for size in sorted({p.dtype.itemsize for p in params}, reverse=True)
                 for p in params if p.dtype.itemsize == size]
    else:
        order = sorted(params, key=lambda p: (-p.dtype.itemsize, p.index))
    offsets: dict[int, int] = {}
    pos = 0
    for p in order:
        offsets[p.index] = pos
        pos += p.nbytes
    text = _header(params, offsets, plan_digest)
    text += b" " * (_round_up(8 + len(text), STREAM_ALIGN) - 8 - len(text))
    prefix = len(text).to_bytes(8, "little") + text
    return Layout(tuple([Placement(p, offsets[p.index]) for p in params]), pos, prefix)


def _header(params: Sequence[ResolvedParam], offsets: dict[int, int], plan_digest: str) -> bytes:
    """The safetensors JSON header, byte for byte what json.dumps(separators=(",", ":")) makes of the dict
    {"__metadata__": ..., name: {"dtype", "shape", "data_offsets"}, ...}, written out entry by entry."""
    meta: dict[str, object] = {"__metadata__": {"plan_digest": plan_digest, "format": "pt"}}
    if any(p.name == "__metadata__" for p in params):  # a parameter of that name replaces the entry: as a dict does
        header: dict[str, object] = dict(meta)
        for p in params:
            o = offsets[p.index]
            header[p.name] = {"dtype": p.dtype.safetensors, "shape": list(p.out_shape),
                              "data_offsets": [o, o + p.nbytes]}
        return json.dumps(header, separators=(",", ":")).encode()
    quote = json.encoder.encode_basestring_ascii  # what json.dumps uses (ensure_ascii)
    parts = [json.dumps(meta, separators=(",", ":"))[:-1]]
    for p in params:
        o = offsets[p.index]
        parts.append(f'{quote(p.name)}:{{"dtype":{quote(p.dtype.safetensors)},"shape":[{",".join(map(str, p.out_shape))}],'
                     f'"data_offsets":[{o},{o + p.nbytes}]}}')
    return (",".join(parts) + "}").encode()


def export_layout(params: Sequence[ResolvedParam], align: int = EXPORT_ALIGN) -> Layout:
    """Plan-order arena with every tensor aligned to `align` bytes (64 on CPU, 256 on GPU)."""
    placements = []
    pos = 0
    for p in params:
        pos = _round_up(pos, align)
        placements.append(Placement(p, pos))
        pos += p.nbytes
    return Layout(tuple(placements), _round_up(pos, align))
