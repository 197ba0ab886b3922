"""Checkpoint formats a plan is written as, one interface (`Format.write`) with three implementations:

- `SafetensorsFile`: one safetensors file (what `materialize -o FILE` always wrote);
- `ShardedSafetensors`: `model-XXXXX-of-YYYYY.safetensors` shards and `model.safetensors.index.json`, as
  transformers' `save_pretrained` names and fills them, so `from_pretrained(DIR)` loads them;
- `DistributedCheckpoint`: a `torch.distributed.checkpoint` (DCP) directory that `dcp.load` reads into any
  sharding; under `torch.distributed` each rank writes its own part and rank 0 the metadata.

Every format streams: no file holds more than a bounded window of the model in memory (a shard's stream, a
DCP item of at most `DCP_ITEM_BYTES`), and each reads through the `Source` it is given (a `Client`: in
process or from a server). Nothing a loader would take is left by a failure or a signal: each file is
written under a hidden name and renamed into place when complete, and what names the others (the index,
the DCP metadata) last, after stale ones are removed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import grpc

from paraminit import sizes
from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit_client import filesink
from paraminit_client.errors import FileAccessError, InvalidArgument, ParaminitError, require
from paraminit_client.plans import set_region
from paraminit_client.transports import Chunk, Slab, ValidationReport, land

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "FORMATS",
    "DistributedCheckpoint",
    "Format",
    "SafetensorsFile",
    "ShardedSafetensors",
    "format_for",
    "progress_bar",
    "write_stream",
]

Progress = bool | Callable[[int, int], None]
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DCP_METADATA = ".metadata"
DCP_ITEM_BYTES = 64 << 20  # the most one DCP item (a row block of a parameter) holds in memory while written
SHARD_WRITERS = 4  # shards written at once


class Source(Protocol):
    """What a format reads a plan through: a `Client`, in process or from a server."""

    def validate(self, plan: plan_pb2.Plan) -> ValidationReport: ...

    def stream(self, plan: plan_pb2.Plan, *, chunk_bytes: int = 0, check_crc: bool = True) -> tuple[pb.StreamHeader, Iterator[Chunk]]: ...

    def materialize(self, plan: plan_pb2.Plan) -> dict[str, np.ndarray[Any, Any]]: ...


class Format(Protocol):
    """A checkpoint format: writes a whole plan to `dest` and returns the plan's header (its tensors in plan
    order, total data bytes, digest)."""

    @property
    def name(self) -> str: ...

    def write(
        self, source: Source, plan: plan_pb2.Plan, dest: Path, *, progress: Progress = False, chunk_bytes: int = 0, durable: bool = True
    ) -> pb.StreamHeader: ...


class SafetensorsFile:
    """One safetensors file, written atomically (or in order into a device or FIFO)."""

    name = "safetensors"

    def write(
        self, source: Source, plan: plan_pb2.Plan, dest: Path, *, progress: Progress = False, chunk_bytes: int = 0, durable: bool = True
    ) -> pb.StreamHeader:
        try:
            existing = os.stat(dest)  # follows links: a link is written through, never replaced
        except FileNotFoundError:
            existing = None
        except OSError as exc:
            raise FileAccessError(exc) from None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise FileAccessError(IsADirectoryError(errno.EISDIR, "Is a directory", str(dest)))
        header, chunks = source.stream(plan, chunk_bytes=chunk_bytes, check_crc=False)
        counter = _Counter(progress, header.data_bytes, dest.name)
        update = counter.update if progress else None
        try:
            if existing is not None and not stat.S_ISREG(existing.st_mode):
                _write_in_place(dest, header.safetensors_prefix, chunks, update)  # a device, a FIFO: never renamed over
            else:
                _write_atomically(dest.resolve() if dest.is_symlink() else dest, header, chunks, update, durable)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            counter.close()
        return header


def _ensure_ok(report: ValidationReport, in_parts: bool = False) -> None:
    """Raise the plan's violations (every one) before anything is written. `in_parts`: the plan is read a
    part at a time (a shard, a DCP item), so a limit on the whole plan does not apply; each part's own call
    is held to the limits.
    """
    problems = [v for v in report.violations if not (in_parts and v.is_limit and v.index < 0)]
    if not problems:
        return
    code = grpc.StatusCode.INVALID_ARGUMENT if not report.valid else grpc.StatusCode.RESOURCE_EXHAUSTED
    first = f": {problems[0]}" if problems else ""
    raise ParaminitError(code, f"the plan cannot be written{first}", problems, report.omitted)


def _directory(dest: Path) -> Path:
    """dest as the directory a multi-file format writes into: made if missing (its parent must exist)."""
    try:
        existing = os.stat(dest)
    except FileNotFoundError:
        try:
            os.mkdir(dest)
        except OSError as exc:
            raise FileAccessError(exc) from None
        return dest
    except OSError as exc:
        raise FileAccessError(exc) from None
    if not stat.S_ISDIR(existing.st_mode):
        raise FileAccessError(NotADirectoryError(errno.ENOTDIR, "a sharded or DCP checkpoint is a directory", str(dest)))
    return dest


def _sub_plan(plan: plan_pb2.Plan, indices: Sequence[int]) -> plan_pb2.Plan:
    """The plan's parameters at `indices`, in that order (each parameter's values depend on itself alone)."""
    return _with_params(plan, [plan.params[k] for k in indices])


def shard_groups(param_bytes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Parameter indices per shard, in plan order: a shard is closed when the next tensor would take it past
    `max_shard_bytes`; a tensor larger than that has a shard of its own (huggingface_hub's rule)."""
    groups: list[list[int]] = [[]]
    size = 0
    for k, n in enumerate(param_bytes):
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups if groups[0] else []


class _Counter:
    """One progress report (a bar, or a callable given (bytes so far, total) once with 0 at once, then after each
    chunk), over one writer or several concurrent ones."""

    def __init__(self, progress: Progress, total: int, name: str) -> None:
        self._lock = threading.Lock()
        self._bar = progress_bar(total, name) if progress is True else None
        self._report = progress if callable(progress) else None
        self._done, self._total = 0, total
        if self._report is not None:
            self._report(0, total)

    def update(self, n: int) -> None:
        with self._lock:
            self._done += n
            if self._bar is not None:
                self._bar.update(n)
            if self._report is not None:
                self._report(self._done, self._total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass(frozen=True)
class ShardedSafetensors:
    """Shards of at most `max_shard_bytes` of tensor data (a larger tensor alone in its shard) and their index,
    named as transformers' `save_pretrained` names them; one shard is `model.safetensors` with no index, as
    there. Shards are written `SHARD_WRITERS` at a time, each under a hidden name; only when all are
    complete are stale index, single file and shards removed, the shards renamed into place and the index
    written, last."""

    max_shard_bytes: int
    name: str = "safetensors"

    def write(
        self, source: Source, plan: plan_pb2.Plan, dest: Path, *, progress: Progress = False, chunk_bytes: int = 0, durable: bool = True
    ) -> pb.StreamHeader:
        report = source.validate(plan)
        _ensure_ok(report, in_parts=True)
        groups = shard_groups(report.param_bytes, self.max_shard_bytes)
        if not report.fits_limits:  # the whole is over a limit: each shard, the call that reads it, must fit
            for group in groups:
                _ensure_ok(source.validate(_sub_plan(plan, group)))
        directory = _directory(dest)
        n = len(groups)
        names = [SINGLE_NAME] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        counter = _Counter(progress, report.total_bytes, directory.name)
        hidden: list[str | None] = [None] * n
        headers: list[pb.StreamHeader | None] = [None] * n
        failed = threading.Event()

        def one(k: int) -> None:
            if failed.is_set():
                return
            try:
                header, chunks = source.stream(_sub_plan(plan, groups[k]), chunk_bytes=chunk_bytes, check_crc=False)
                try:
                    hidden[k] = _write_hidden(directory / names[k], header, chunks, counter.update, durable)
                finally:
                    close = getattr(chunks, "close", None)
                    if close is not None:
                        close()
                headers[k] = header
            except BaseException:
                failed.set()
                raise

        try:
            with ThreadPoolExecutor(max_workers=max(1, min(SHARD_WRITERS, n))) as pool:
                for f in [pool.submit(one, k) for k in range(n)]:
                    f.result()
            _commit_shards(directory, names, hidden, groups, report.total_bytes, plan, durable, report.plan_digest)
        except BaseException:
            for path in hidden:
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    filesink.forget_partial(path)
            raise
        finally:
            counter.close()
        return _whole_header(report, [h for h in headers if h is not None])


def _commit_shards(
    directory: Path,
    names: list[str],
    hidden: list[str | None],
    groups: list[list[int]],
    total_bytes: int,
    plan: plan_pb2.Plan,
    durable: bool,
    digest: str = "",
) -> None:
    """Remove what a loader would take from an older write, rename the complete shards in, write the index last
    (its metadata: total_size, as transformers writes it, and the whole plan's digest)."""
    try:
        for old in os.listdir(directory):
            if old in (INDEX_NAME, SINGLE_NAME) or (SHARD_NAME.fullmatch(old) and old not in names):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / old)
        for name, path in zip(names, hidden, strict=True):
            assert path is not None
            os.replace(path, directory / name)
            filesink.forget_partial(path)
        if len(names) > 1:
            weight_map = {plan.params[i].name: names[k] for k, group in enumerate(groups) for i in group}
            index = {"metadata": {"total_size": total_bytes, "plan_digest": digest}, "weight_map": dict(sorted(weight_map.items()))}
            _write_small(directory / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode(), durable)
        elif durable:
            _fsync_dir(directory)
    except OSError as exc:
        if isinstance(exc, ParaminitError):
            raise
        raise FileAccessError(exc) from exc


def _write_small(dest: Path, data: bytes, durable: bool) -> None:
    """A small file (an index, DCP metadata) written whole under a hidden name, then renamed into place."""
    fd, tmp = filesink.make_partial(dest, _create)
    try:
        try:
            _write_all(fd, data)
            os.fchmod(fd, _mode_for(dest))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        if durable:
            _fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        filesink.forget_partial(tmp)


def _whole_header(report: ValidationReport, headers: Sequence[pb.StreamHeader]) -> pb.StreamHeader:
    """The header of a plan written as several files: every tensor (offsets within its own file), the total
    data bytes and the whole plan's digest."""
    out = pb.StreamHeader(plan_digest=report.plan_digest, data_bytes=report.total_bytes)
    for h in headers:
        out.tensors.extend(h.tensors)
    return out


@dataclass(frozen=True)
class DistributedCheckpoint:
    """A torch.distributed.checkpoint directory: each parameter stored as row blocks of at most `item_bytes`
    (DCP chunks of the global tensor, so `dcp.load` reads them into any sharding), in `__RANK_0.distcp` data
    files (torch.save records, what DCP's FileSystemReader reads) and a pickled `.metadata`, written last.

    Under an initialized `torch.distributed` process group every rank calls `write` with the same plan: each
    writes the blocks of its share of the bytes, rank 0 gathers where they went and writes the metadata; any
    world size gives a checkpoint that loads to the same tensors."""

    item_bytes: int = DCP_ITEM_BYTES
    name: str = "dcp"

    def write(
        self, source: Source, plan: plan_pb2.Plan, dest: Path, *, progress: Progress = False, chunk_bytes: int = 0, durable: bool = True
    ) -> pb.StreamHeader:
        torch = require("torch", "a DCP checkpoint")
        dist = torch.distributed
        group = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
        report = source.validate(plan)
        _ensure_ok(report, in_parts=True)
        directory = _directory(dest) if rank == 0 else dest
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / DCP_METADATA)  # a loader takes no checkpoint until this write's is complete
        if group:
            dist.barrier()
        items = dcp_items(plan, report.param_bytes, self.item_bytes)
        mine = _share(items, rank, world)
        counter = _Counter(progress, sum(i.nbytes for i in mine), directory.name)
        try:
            placed = _write_dcp_file(source, plan, directory / f"__{rank}_0.distcp", mine, counter.update, durable) if mine else []
        finally:
            counter.close()
        everything: list[Any] = [None] * world
        if group:
            dist.all_gather_object(everything, placed)
        else:
            everything = [placed]
        if rank == 0:
            metadata = _dcp_metadata(plan, [p for part in everything for p in part], torch)
            _write_small(directory / DCP_METADATA, pickle.dumps(metadata), durable)
        if group:
            dist.barrier()
        return pb.StreamHeader(plan_digest=report.plan_digest, data_bytes=report.total_bytes)


@dataclass(frozen=True)
class DcpItem:
    """A row block of one parameter: its index in the plan, its box (global coordinates), its bytes."""

    param: int
    box: tuple[tuple[int, int], ...]
    nbytes: int


def dcp_items(plan: plan_pb2.Plan, param_bytes: Sequence[int], item_bytes: int) -> list[DcpItem]:
    """Every parameter's box (its region, else the whole tensor) cut along its first dimension into blocks
    of at most `item_bytes` (a row larger than that is a block of its own)."""
    items = []
    for k, p in enumerate(plan.params):
        box = tuple((r.start, r.stop) for r in p.region) or tuple((0, int(d)) for d in p.shape)
        nbytes = int(param_bytes[k])
        if not box or nbytes == 0:
            items.append(DcpItem(k, box, nbytes))
            continue
        rows = box[0][1] - box[0][0]
        row_bytes = nbytes // rows
        step = max(1, item_bytes // max(row_bytes, 1))
        for start in range(box[0][0], box[0][1], step):
            stop = min(start + step, box[0][1])
            items.append(DcpItem(k, ((start, stop), *box[1:]), (stop - start) * row_bytes))
    return items


def _share(items: list[DcpItem], rank: int, world: int) -> list[DcpItem]:
    """Rank `rank`'s items: those whose first byte falls in its equal share of the checkpoint's bytes."""
    total = sum(i.nbytes for i in items)
    out, at = [], 0
    for i in items:
        if (at * world) // max(total, 1) == rank or (total == 0 and rank == 0):
            out.append(i)
        at += i.nbytes
    return out


def _write_dcp_file(
    source: Source, plan: plan_pb2.Plan, dest: Path, items: list[DcpItem], update: Callable[[int], None], durable: bool
) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int]]:
    """The items as torch.save records, one after another, in one data file written under a hidden name and
    renamed into place; returns (name, offsets, sizes, file, offset, length) of each. Records go through the
    file sink (direct I/O for a durable file where the file system allows it), and the next item is made
    while one is written: two items in memory at most."""
    import torch

    from paraminit_client.torch_rules import numpy_to_torch

    def values_of(item: DcpItem) -> Any:
        p = plan.params[item.param]
        one = plan_pb2.Param()
        one.CopyFrom(p)
        set_region(one, item.box)
        return numpy_to_torch(source.materialize(_with_params(plan, [one]))[p.name]).reshape([b - a for a, b in item.box])

    fd, tmp = filesink.make_partial(dest, _create)
    placed = []
    try:
        try:
            sink = filesink.open_sink(fd, tmp, b"", 0, durable)
            try:
                with ThreadPoolExecutor(max_workers=1) as ahead:
                    pending = ahead.submit(values_of, items[0]) if items else None
                    at = 0
                    for k, item in enumerate(items):
                        assert pending is not None
                        tensor = pending.result()
                        pending = ahead.submit(values_of, items[k + 1]) if k + 1 < len(items) else None
                        record = _SinkWriter(sink, at)
                        torch.save(tensor, cast("IO[bytes]", record))  # into the sink: no copy of the record between
                        del tensor
                        box_start, box_shape = tuple(a for a, _ in item.box), tuple(b - a for a, b in item.box)
                        placed.append((plan.params[item.param].name, box_start, box_shape, dest.name, at, record.at - at))
                        at = record.at
                        update(item.nbytes)
                sink.finish(at)
            finally:
                sink.close()
            if durable:
                os.fsync(fd)
            os.fchmod(fd, _mode_for(dest))
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, ParaminitError):
            raise FileAccessError(exc) from exc
        raise
    finally:
        filesink.forget_partial(tmp)
    return placed


class _SinkWriter(io.RawIOBase):
    """A write-only file object over a sink, from a given offset on (what torch.save writes a record to)."""

    def __init__(self, sink: filesink.Sink, at: int) -> None:
        super().__init__()
        self._sink, self._start, self.at = sink, at, at

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        self._sink.put(Slab(self.at, data))
        self.at += len(data)
        return len(data)

    def tell(self) -> int:
        return self.at - self._start


def _with_params(plan: plan_pb2.Plan, params: Sequence[plan_pb2.Param]) -> plan_pb2.Plan:
    """The plan (its plan-wide fields) with these parameters."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    del out.params[:]
    out.params.extend(params)
    return out


def _dcp_metadata(plan: plan_pb2.Plan, placed: list[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int]], torch: Any) -> Any:
    """DCP's Metadata for the placed items: each parameter a TensorStorageMetadata of its global shape with one
    chunk per item, and where each item's record is."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from paraminit_client.torch_rules import TORCH_DTYPES

    chunks: dict[str, list[Any]] = {}
    storage = {}
    for name, offsets, shape, file, offset, length in placed:
        chunks.setdefault(name, []).append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
        storage[MetadataIndex(fqn=name, offset=torch.Size(offsets))] = _StorageInfo(relative_path=file, offset=offset, length=length)
    state: dict[str, Any] = {}
    for p in plan.params:
        if p.name in chunks:
            properties = TensorProperties(dtype=TORCH_DTYPES[p.dtype])
            state[p.name] = TensorStorageMetadata(properties=properties, size=torch.Size(list(p.shape)), chunks=chunks[p.name])
    return Metadata(state_dict_metadata=state, planner_data={name: (name,) for name in state}, storage_data=storage)


FORMATS = ("safetensors", "dcp")


@contextlib.contextmanager
def process_group(writer: Format) -> Iterator[None]:
    """For a DCP write under torchrun (WORLD_SIZE > 1 in the environment, no process group yet): a gloo group
    for the write (it only gathers where each rank's items went), destroyed after it; else nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not isinstance(writer, DistributedCheckpoint) or world <= 1:
        yield
        return
    dist = require("torch.distributed", "a DCP checkpoint")

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def format_for(name: str | None = None, max_shard_size: int | str | None = None) -> Format:
    """The format of that name (`safetensors`, the default, or `dcp`); `max_shard_size` (bytes, or a size
    such as "5GB") makes safetensors sharded.

    Raises:
        InvalidArgument: an unknown format, a bad size, or a shard size given for DCP.
    """
    name = name or "safetensors"
    if name not in FORMATS:
        raise InvalidArgument(f"format {name!r} is not one of {', '.join(FORMATS)}")
    limit = parse_shard_size(max_shard_size)
    if name == "dcp":
        if limit:
            raise InvalidArgument("--max-shard-size is for the safetensors format; a DCP checkpoint has one data file per rank")
        return DistributedCheckpoint()
    return ShardedSafetensors(limit) if limit else SafetensorsFile()


def parse_shard_size(value: int | str | None) -> int:
    """Bytes of a shard size: an int, or a size string as transformers takes it ("5GB", "500MB", "2GiB").

    Raises:
        InvalidArgument: not a positive size.
    """
    if value is None or value == 0 or value == "":
        return 0
    if isinstance(value, int):
        n = value
    else:
        try:
            n = sizes.parse_size(value)
        except ValueError:
            n = -1
    if n <= 0:
        raise InvalidArgument(f"max shard size {value!r} is not a positive size (bytes, or such as 5GB, 500MB, 2GiB)")
    return n


def _write_in_place(dest: Path, prefix: bytes, chunks: Iterator[Chunk], update: Callable[[int], None] | None) -> None:
    """Write the stream in order into an existing file that is not a regular file (a device such as /dev/null,
    a FIFO, a terminal): opened for writing as it is, no temporary file, nothing renamed over it."""
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_NOCTTY)
    except OSError as exc:
        raise FileAccessError(exc) from None
    try:
        write_stream(fd, prefix, chunks, update)
    finally:
        os.close(fd)


def write_stream(fd: int, prefix: bytes, chunks: Iterator[Chunk], update: Callable[[int], None] | None = None) -> None:
    """The safetensors prefix then every chunk, in order, to an open descriptor (a pipe, standard output).

    Raises:
        FileAccessError: a write failed (a closed pipe, a full disk).
        ParaminitError: as for `Client.stream`.
    """
    try:
        _write_all(fd, prefix)
        land(chunks, lambda c: _write_all(fd, c.data), update)
    except OSError as exc:
        if isinstance(exc, ParaminitError):
            raise
        raise FileAccessError(exc) from exc


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:  # a short write is legal (a pipe): write the rest
        view = view[os.write(fd, view) :]


def _write_atomically(
    dest: Path, header: pb.StreamHeader, chunks: Iterator[Chunk], update: Callable[[int], None] | None, durable: bool
) -> None:
    """A regular file: written under no name (O_TMPFILE, so a killed process leaves nothing behind) or a hidden
    temporary one where the file system has no O_TMPFILE, then given its name only when complete."""
    named = _write_hidden(dest, header, chunks, update, durable)
    try:
        os.replace(named, dest)
        if durable:
            _fsync_dir(dest.parent)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(named)
        raise FileAccessError(exc) from exc
    finally:
        filesink.forget_partial(named)


def _write_hidden(dest: Path, header: pb.StreamHeader, chunks: Iterator[Chunk], update: Callable[[int], None] | None, durable: bool) -> str:
    """The complete file under a hidden name beside dest (tracked as partial until the caller renames it or
    removes it); nothing is left behind on failure."""
    fd, tmp = _open_unnamed(dest)
    base = len(header.safetensors_prefix)
    named: str | None = tmp
    try:
        try:
            if base + header.data_bytes:
                try:
                    os.posix_fallocate(fd, 0, base + header.data_bytes)
                except OSError as exc:  # a full disk: say which file, and how much it needed
                    raise OSError(exc.errno, f"{exc.strerror} (the file needs {base + header.data_bytes} bytes)", str(dest)) from None
            # an unnamed file is reopened (for O_DIRECT) through its descriptor's /proc link
            sink = filesink.open_sink(fd, tmp or f"/proc/self/fd/{fd}", header.safetensors_prefix, header.data_bytes, durable)
            try:
                land(chunks, sink.put, update)
                sink.finish()
            finally:
                sink.close()
            if durable:
                os.fsync(fd)
            os.fchmod(fd, _mode_for(dest))
            if named is None:
                named = _link_unnamed(fd, dest)
        finally:
            os.close(fd)
        return named
    except BaseException as exc:
        if named is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named)
            filesink.forget_partial(named)
        if isinstance(exc, OSError) and not isinstance(exc, ParaminitError):
            raise FileAccessError(exc) from exc
        raise


def _mode_for(dest: Path) -> int:
    """The new file's permissions: those of the file it replaces (a 0600 file stays private), else 0644 less the
    umask, as a new file gets."""
    try:
        st = os.stat(dest)
    except OSError:
        return 0o644 & ~_umask()
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o644 & ~_umask()


def _open_unnamed(dest: Path) -> tuple[int, str | None]:
    """(fd, None) for an O_TMPFILE file in dest's directory, else (fd, path) of a hidden temporary file there."""
    directory = str(dest.parent or ".")
    flag = getattr(os, "O_TMPFILE", 0)
    try:
        if flag and os.path.isdir("/proc/self/fd"):
            try:
                return os.open(directory, flag | os.O_WRONLY, 0o600), None
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        return filesink.make_partial(dest, _create)
    except OSError as exc:
        raise FileAccessError(exc) from None


def _create(path: str) -> int:
    """A new file at path, private until it is complete (FileExistsError when the name is taken)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _link_unnamed(fd: int, dest: Path) -> str:
    """Give a complete O_TMPFILE file a hidden name beside dest (renamed over dest next), tracked as partial."""
    # linkat(AT_SYMLINK_FOLLOW) through the descriptor's /proc link: os.link takes linkat only with a dir_fd
    dfd = os.open(dest.parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _, named = filesink.make_partial(
            dest, lambda path: os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dfd, follow_symlinks=True)
        )
        return named
    finally:
        os.close(dfd)


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    dfd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def progress_bar(total: int, name: str) -> Any:
    """A terminal progress bar of `total` bytes (tqdm, imported when a bar is first drawn: it costs every start)."""
    from tqdm import tqdm

    # "iB" with unit_divisor 1024 reads KiB, MiB, GiB: the units of every size paraminit prints
    return tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=name, leave=True)  # the finished bar stays on screen
