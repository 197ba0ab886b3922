"""Look at a safetensors file: per-tensor statistics and, with a plan, whether they match its initializers.

The expected mean, standard deviation and bounds of every initializer follow from
its formula (paraminit/v1/plan.proto); a tensor passes when its sample mean and
standard deviation lie within FLAG_SIGMAS standard errors of them (plus the
dtype's rounding), and every value lies within the bounds.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paraminit import dtypes, inits, safetensors_header, shapes
from paraminit.sizes import format_size
from paraminit.v1 import plan_pb2
from paraminit_client.errors import MissingPackage, file_errors

FLAG_SIGMAS = 5.0  # a deviation of 5 standard errors flags a tensor (about 1 in 1.7 million by chance, per test)
Z_MAX = inits.Z_MAX  # the sampler raises u1 to 1e-6, so |z| <= 5.2565
CHUNK_ELEMENTS = 1 << 22


SafetensorsError = safetensors_header.HeaderError  # a file that is not a readable safetensors file
Entry = safetensors_header.TensorEntry  # one tensor of a safetensors file


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, str], list[Entry]]:
    """The `__metadata__` and the tensors (in file order) of a safetensors file, checked by the one strict reader
    (paraminit.safetensors_header) the server and `plan from-safetensors` use.

    Args:
        path: the file.

    Returns:
        (metadata, tensors ordered by where their bytes lie).

    Raises:
        FileAccessError: (an OSError) the file cannot be read.
        CheckpointFormatError: (a ValueError) the file breaks the format; the text names the file and the first
            violation.
    """
    with file_errors():
        header = safetensors_header.read_file(path)
    return dict(header.metadata), header.in_file_order()


def _values(path: str | os.PathLike[str], e: Entry) -> Iterator[np.ndarray[Any, Any]]:
    """The tensor's values as float64, CHUNK_ELEMENTS at a time (large tensors never sit in memory twice)."""
    dt = e.dtype
    assert dt is not None
    count = e.nbytes // dt.itemsize
    if count == 0:
        return
    # read with pread, not mapped: a file truncated while it is read is an error here, not SIGBUS in a mapping
    with open(path, "rb") as f:
        for i in range(0, count, CHUNK_ELEMENTS):
            n = min(CHUNK_ELEMENTS, count - i) * dt.itemsize
            buf = bytearray(n)
            if os.preadv(f.fileno(), [buf], e.start + i * dt.itemsize) != n:
                raise SafetensorsError("the file ends inside the tensor's data (it changed while it was read)", e.name).in_file(
                    os.fspath(path)
                )
            yield np.frombuffer(buf, dtype=dt.numpy).astype(np.float64)


@dataclass(frozen=True)
class Stats:
    """Sample statistics of one tensor (population standard deviation); NaN when it has no finite value."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    nonfinite: int


def tensor_stats(chunks: Iterator[np.ndarray[Any, Any]]) -> Stats:
    """Mean, standard deviation, min and max over finite values, combined chunk by chunk (Chan et al.)."""
    n, mean, m2, lo, hi, bad = 0, 0.0, 0.0, math.inf, -math.inf, 0
    for x in chunks:
        finite = np.isfinite(x)
        if not finite.all():
            bad += int(x.size - np.count_nonzero(finite))
            x = x[finite]
        k = int(x.size)
        if k == 0:
            continue
        km = float(x.mean())
        km2 = float(np.square(x - km).sum())
        delta = km - mean
        total = n + k
        mean += delta * k / total
        m2 += km2 + delta * delta * n * k / total
        n = total
        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
    if n == 0:
        return Stats(0, math.nan, math.nan, math.nan, math.nan, bad)
    return Stats(n, mean, math.sqrt(m2 / n), lo, hi, bad)


@dataclass(frozen=True)
class Expected:
    """What an initializer promises: mean, standard deviation, value bounds, and its kind in words."""

    label: str  # e.g. "normal(0, 0.02)"
    mean: float
    std: float
    lo: float
    hi: float
    kurtosis: float  # of the distribution: for the standard error of the sample standard deviation
    density: str  # "normal", "uniform" or "point"


def expected_of(p: plan_pb2.Param, init: plan_pb2.Init | None = None) -> Expected | None:
    """The distribution an initializer defines over the parameter's region (None for payloads and checkpoint
    tensors, whose values are data).

    Args:
        p: the parameter (its shape and region; its own `init` unless `init` is given).
        init: a patch's initializer to describe over the same parameter instead.

    Returns:
        The expected statistics, or None when there is nothing to compare with.
    """
    init = p.init if init is None else init
    if inits.kind_of(init) is None:
        return None
    shape = [int(d) for d in p.shape]
    m = inits.value_form(init, shape).moments(shape, shapes.region_of(p))
    if m is None:
        return None
    return Expected(inits.label(init, shape), m.mean, m.std, m.lo, m.hi, m.kurtosis, m.density)


@dataclass
class Row:
    """One tensor of the file: its statistics and, with a plan, the verdict."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stats: Stats | None  # None for dtypes a plan cannot hold (integers, booleans)
    expected: Expected | None = None
    in_plan: bool = False
    problems: list[str] = field(default_factory=list)
    file: str = ""  # the file that holds it (a shard of a sharded checkpoint)

    @property
    def status(self) -> str:
        """ "ok", "FLAG", or "-" when there is nothing to compare with."""
        if self.problems:
            return "FLAG"
        return "ok" if self.expected is not None else "-"


@dataclass
class Report:
    path: str
    metadata: dict[str, str]
    rows: list[Row]
    missing: list[str]  # plan parameters the file lacks
    with_plan: bool

    @property
    def ok(self) -> bool:
        return not self.missing and not any(r.problems for r in self.rows)


def judge(stats: Stats, exp: Expected, dtype: str) -> list[str]:
    """Why `stats` do not fit `exp` (empty: they do). Tolerances: FLAG_SIGMAS standard errors of the sample mean
    (std / sqrt(n)) and of the sample standard deviation (std * sqrt((kurtosis - 1) / (4 n))), plus one rounding
    into `dtype` of the largest magnitude involved; bounds allow that rounding only."""
    if stats.nonfinite:
        return [f"{stats.nonfinite} values are not finite"]
    if stats.count == 0:
        return []
    try:
        dt = dtypes.by_name(dtype)
    except ValueError:  # not a plan dtype: the coarsest 16-bit rounding
        dt = dtypes.BFLOAT16
    u = dt.unit_roundoff
    scale = max(abs(exp.lo), abs(exp.hi), abs(exp.mean))
    tiny = dt.subnormal_spacing  # a rounding near zero is off by at most half of it
    problems = []
    mean_tol = FLAG_SIGMAS * exp.std / math.sqrt(stats.count) + u * scale + tiny
    if abs(stats.mean - exp.mean) > mean_tol:
        problems.append(f"mean {stats.mean:.6g}, expected {exp.mean:.6g} +- {mean_tol:.2g}")
    std_tol = FLAG_SIGMAS * exp.std * math.sqrt(max(exp.kurtosis - 1.0, 0.0) / (4 * stats.count)) + 2 * u * scale + tiny
    if abs(stats.std - exp.std) > std_tol:
        problems.append(f"std {stats.std:.6g}, expected {exp.std:.6g} +- {std_tol:.2g}")
    lo_tol, hi_tol = u * abs(exp.lo) + tiny, u * abs(exp.hi) + tiny
    if stats.min < exp.lo - lo_tol or stats.max > exp.hi + hi_tol:
        problems.append(f"values in [{stats.min:.6g}, {stats.max:.6g}], expected within [{exp.lo:.6g}, {exp.hi:.6g}]")
    return problems


def inspect_file(path: str | os.PathLike[str], plan: plan_pb2.Plan | None = None) -> Report:
    """Statistics of every tensor of a safetensors file, judged against `plan` when given.

    Args:
        path: the file.
        plan: the plan it should hold (None: statistics only).

    Returns:
        The report: a row per tensor, and the plan's parameters the file lacks.

    Raises:
        FileAccessError: (an OSError) the file cannot be read.
        CheckpointFormatError: (a ValueError) the file breaks the format, also when it changes while it is read.
    """
    with file_errors():
        return _inspect_file(path, plan)


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint: the file itself, or in a directory the shards its
    model.safetensors.index.json names (in order), else its model.safetensors.

    Raises:
        FileNotFoundError: a directory with neither.
        CheckpointFormatError: (a ValueError) an index that is not JSON with a weight_map of file names.
    """
    if not os.path.isdir(path):
        return [os.fspath(path)]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, "rb") as f:
            try:
                weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise SafetensorsError("not a JSON object with a weight_map of tensor names to shard files", "").in_file(index) from None
        if any(not isinstance(n, str) or os.path.basename(n) != n for n in names):
            raise SafetensorsError("the weight_map names a file outside the directory", "").in_file(index)
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(errno.ENOENT, "no model.safetensors or model.safetensors.index.json in the directory", os.fspath(path))


def _entries(path: str | os.PathLike[str]) -> tuple[dict[str, str], list[tuple[str, Entry]]]:
    """The metadata and every (file, tensor) of a checkpoint, file by file: a single file's own metadata; for
    shards, the plan digest their index records (each shard's own is that of its part of the plan)."""
    files = checkpoint_files(path)
    meta: dict[str, str] = {}
    out = []
    for file in files:
        m, entries = read_header(file)
        meta = m if len(files) == 1 else meta
        out += [(file, e) for e in entries]
    if len(files) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "rb") as f:
            digest = json.load(f).get("metadata", {}).get("plan_digest")
        meta = {"plan_digest": digest} if isinstance(digest, str) else {}
    return meta, out


def _inspect_file(path: str | os.PathLike[str], plan: plan_pb2.Plan | None) -> Report:
    meta, entries = _entries(path)
    params = {p.name: p for p in plan.params} if plan is not None else {}
    rows = []
    for file, e in entries:
        dt = e.dtype
        row = Row(e.name, dt.name if dt else e.code, e.shape, e.nbytes, tensor_stats(_values(file, e)) if dt else None, file=file)
        p = params.get(e.name)
        if plan is not None and p is None:
            row.problems.append("not in the plan")
        elif p is not None:
            row.in_plan = True
            want = dtypes.by_enum(p.dtype)
            if want is None or dt is None or want.enum != dt.enum:
                row.problems.append(f"dtype {row.dtype}, the plan says {want.name if want else p.dtype}")
            if tuple(shapes.out_shape(p)) != e.shape:
                row.problems.append(f"shape {list(e.shape)}, the plan says {list(shapes.out_shape(p))}")
            row.expected = expected_of(p)
            if row.stats is not None and not row.problems:
                row.problems += _judge_param(file, e, p, row)
        rows.append(row)
    if plan is not None:  # in the plan's order (the file's order is the writer's); tensors not in it last
        order = {p.name: k for k, p in enumerate(plan.params)}
        rows.sort(key=lambda r: order.get(r.name, len(order)))
    present = {e.name for _, e in entries}
    missing = [p.name for p in plan.params if p.name not in present] if plan is not None else []
    return Report(str(path), meta, rows, missing, plan is not None)


def _judge_param(path: str | os.PathLike[str], e: Entry, p: plan_pb2.Param, row: Row) -> list[str]:
    """Why the tensor does not fit its parameter: the whole tensor against the initializer, or with patches each
    part (the base's elements, each patch's) against its own initializer, since patched rows follow their patch."""
    assert row.stats is not None
    patches = [q for q in p.patches if len(q.box) == len(p.shape)]
    if not patches:
        return judge(row.stats, row.expected, row.dtype) if row.expected is not None else []
    # a patch holding part of a tensor of its own (Patch.part) draws over that tensor's shape
    wanted = [row.expected, *(expected_of(plan_pb2.Param(shape=q.part.shape) if q.HasField("part") else p, q.init) for q in patches)]
    parts = _part_stats(_values(path, e), p, patches)  # one pass over the file whatever the number of patches
    problems = []
    for owner, (exp, stats) in enumerate(zip(wanted, parts, strict=True)):
        if exp is None:
            continue
        found = judge(stats, exp, row.dtype)
        problems += found if owner == 0 else [f"patch {owner - 1} ({exp.label}): {x}" for x in found]
    return problems


def _part_stats(chunks: Iterator[np.ndarray[Any, Any]], p: plan_pb2.Param, patches: Sequence[plan_pb2.Patch]) -> list[Stats]:
    """Statistics of each part of the tensor: [0] the base's elements, [j + 1] those patch j sets (the last patch
    covering an element wins, as when it was filled)."""
    region = shapes.region_of(p)
    ext = [b - a for a, b in region]
    parts = [Stats(0, math.nan, math.nan, math.nan, math.nan, 0) for _ in range(len(patches) + 1)]
    begin = 0
    for x in chunks:
        r = np.arange(begin, begin + x.size, dtype=np.int64)
        begin += x.size
        coords: list[np.ndarray[Any, Any]] = []
        for d in range(len(ext) - 1, -1, -1):  # global coordinates of each element, last dimension first
            r, c = np.divmod(r, ext[d])
            coords.insert(0, c + region[d][0])
        owners = np.zeros(x.size, dtype=np.int32)
        for j, q in enumerate(patches):
            inside = np.ones(x.size, dtype=bool)
            for c, rng in zip(coords, q.box, strict=True):
                inside &= (c >= rng.start) & (c < rng.stop)
            owners[inside] = j + 1
        for owner in np.unique(owners).tolist():
            parts[owner] = _merged(parts[owner], tensor_stats(iter([x[owners == owner]])))
    return parts


def _merged(a: Stats, b: Stats) -> Stats:
    """The statistics of two disjoint sets of values from theirs (Chan et al.)."""
    if b.count == 0 or a.count == 0:
        keep = b if a.count == 0 else a
        return Stats(keep.count, keep.mean, keep.std, keep.min, keep.max, a.nonfinite + b.nonfinite)
    n = a.count + b.count
    delta = b.mean - a.mean
    m2 = a.std * a.std * a.count + b.std * b.std * b.count + delta * delta * a.count * b.count / n
    return Stats(n, a.mean + delta * b.count / n, math.sqrt(m2 / n), min(a.min, b.min), max(a.max, b.max), a.nonfinite + b.nonfinite)


# -- output ---------------------------------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:.4g}"


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def format_table(report: Report, wide: bool = False, columns: int | None = None) -> str:
    """The human table: one line per tensor, a verdict per tensor with a plan, and a total line.

    Args:
        report: what inspect_file found.
        wide: every column (min, max, the plan's expected statistics); the default is a compact table: name, dtype,
            shape, bytes, mean, std, non-finite count (when any), and with a plan the expected initializer and
            the check.
        columns: the width to fit (a terminal's): names stay whole; other columns are left out first (bytes,
            expected, dtype, std, mean, shape, in that order, and a line says which), then, where a name is still
            too long, each row puts its name on a line of its own (wrapped at the width) and its cells indented
            below; no line is wider than `columns`. None (output that is not a terminal) fits nothing.

    Returns:
        The table, the FLAG lines and a summary line.
    """
    any_nonfinite = any(r.stats is not None and r.stats.nonfinite for r in report.rows)
    cols: list[tuple[str, bool]] = [("name", False), ("dtype", False), ("shape", False), ("bytes", True), ("mean", True), ("std", True)]
    if wide:
        cols += [("min", True), ("max", True)]
    if wide or any_nonfinite:
        cols.append(("non-finite", True))
    if report.with_plan:
        cols.append(("expected", False))
        if wide:
            cols += [("exp mean", True), ("exp std", True), ("exp min", True), ("exp max", True)]
        cols.append(("check", False))
    lines: list[list[str]] = [[c for c, _ in cols]]
    for r in report.rows:
        s, x = r.stats, r.expected
        cell = {
            "name": r.name,
            "dtype": r.dtype,
            "shape": _shape(r.shape),
            "bytes": format_size(r.nbytes),
            "mean": _num(s.mean) if s else "-",
            "std": _num(s.std) if s else "-",
            "min": _num(s.min) if s else "-",
            "max": _num(s.max) if s else "-",
            "non-finite": str(s.nonfinite) if s else "-",
            "expected": x.label if x else "-",
            "exp mean": _num(x.mean) if x else "-",
            "exp std": _num(x.std) if x else "-",
            "exp min": _num(x.lo) if x else "-",
            "exp max": _num(x.hi) if x else "-",
            "check": r.status,
        }
        lines.append([cell[c] for c, _ in cols])
    table, dropped = _lay_out(lines, cols, columns if not wide else None)
    out = list(table)
    for r in report.rows:
        for problem in r.problems:
            out.append(f"FLAG {r.name}: {problem}")
    for name in report.missing:
        out.append(f"FLAG {name}: in the plan, not in the file")
    total = sum(r.nbytes for r in report.rows)
    digest = report.metadata.get("plan_digest", "")
    summary = f"{report.path}: {len(report.rows)} tensors, {format_size(total)}"
    if digest:
        summary += f", plan digest {digest[:16]}"
    if report.with_plan:
        flagged = sum(1 for r in report.rows if r.problems) + len(report.missing)
        summary += "; every tensor matches the plan" if not flagged else f"; {flagged} flagged"
    out.append(summary)
    if dropped:
        out.append(f"(left out to fit {columns} columns: {', '.join(dropped)}; --wide or a wider terminal shows them)")
    if columns is not None and not wide:  # FLAG lines, the summary and the note wrap too: no line is wider
        notes = [piece for line in out[len(table) :] for piece in textwrap.wrap(line, columns, subsequent_indent="  ") or [""]]
        out = table + notes
    return "\n".join(out)


DROP_FIRST = ("bytes", "expected", "dtype", "std", "mean", "shape")  # what a narrow terminal loses first


def _lay_out(lines: list[list[str]], cols: list[tuple[str, bool]], columns: int | None) -> tuple[list[str], list[str]]:
    """The table's lines within `columns` (None: as wide as it is): whole names, columns left out in DROP_FIRST
    order while the rows are too wide, then names on lines of their own. Returns (lines, columns left out)."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(cols))]
    keep = list(range(len(cols)))

    def width(indices: list[int]) -> int:
        return sum(widths[i] for i in indices) + 2 * (len(indices) - 1)

    dropped: list[str] = []
    if columns is not None:
        for name in DROP_FIRST:
            if width(keep) <= columns:
                break
            k = next((i for i in keep if cols[i][0] == name), None)
            if k is not None:
                keep.remove(k)
                dropped.append(name)

    def row_text(row: list[str], indices: list[int]) -> str:
        return "  ".join(row[i].rjust(widths[i]) if cols[i][1] else row[i].ljust(widths[i]) for i in indices).rstrip()

    if columns is None or width(keep) <= columns:
        return [row_text(row, keep) for row in lines], dropped
    # a name too long for the width: the name on its own line(s), its cells below it, indented
    rest = keep[1:]
    out = []
    for row in lines:
        name = row[0]
        out += [name[i : i + columns] for i in range(0, max(len(name), 1), columns)]
        cells = row_text(row, rest)
        out.append(("  " + cells)[:columns])
    return out, dropped


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def to_json(report: Report) -> dict[str, Any]:
    """The report as JSON-safe data (non-finite numbers become null)."""
    tensors = []
    for r in report.rows:
        item: dict[str, Any] = {"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "nbytes": r.nbytes}
        if r.stats is not None:
            s = r.stats
            item.update(
                count=s.count, mean=_finite(s.mean), std=_finite(s.std), min=_finite(s.min), max=_finite(s.max), nonfinite=s.nonfinite
            )
        if report.with_plan:
            x = r.expected
            item["expected"] = None if x is None else {"init": x.label, "mean": x.mean, "std": x.std, "min": x.lo, "max": x.hi}
            item["check"] = r.status
            item["problems"] = list(r.problems)
        tensors.append(item)
    out: dict[str, Any] = {
        "file": report.path,
        "metadata": report.metadata,
        "tensors": tensors,
        "total_bytes": sum(r.nbytes for r in report.rows),
    }
    if report.with_plan:
        out.update(missing=report.missing, ok=report.ok)
    return out


# -- histograms -----------------------------------------------------------------------------------------------------


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".png"


def check_plot(out_dir: str | os.PathLike[str]) -> Path:
    """Make sure `plot` can run before any statistics are computed: matplotlib imports and `out_dir` is (or can
    be made) a writable directory.

    Args:
        out_dir: where the PNGs go.

    Returns:
        The directory, created if it was missing.

    Raises:
        RuntimeError: matplotlib is not installed.
        OSError: the directory cannot be made or written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        raise MissingPackage("matplotlib", "--plot") from None
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    if not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(13, "cannot write into this directory", str(target))
    return target


def plot(report: Report, out_dir: str | os.PathLike[str], bins: int = 100, log: bool = False) -> list[Path]:
    """One PNG per tensor: a density histogram of its values, with the plan's expected density drawn over it.
    Needs matplotlib (`pip install 'paraminit[plot]'`). The x range is the bulk of the distribution (normal: mean
    +- 4 std); `log` draws the whole range of the values with a logarithmic density axis, so the tails show."""
    target = check_plot(out_dir)
    import matplotlib.pyplot as plt

    by_name = {e.name: (file, e) for file, e in _entries(report.path)[1]}
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    try:
        for r in report.rows:
            file, e = by_name[r.name]
            if r.stats is None or r.stats.count == 0:
                continue
            ax.clear()
            _draw(ax, r, _values(file, e), bins, log)
            path = target / _file_name(r.name)
            fig.tight_layout()
            fig.savefig(path)
            written.append(path)
    finally:
        plt.close(fig)
    return written


def _draw(ax: Any, r: Row, chunks: Iterator[np.ndarray[Any, Any]], bins: int, log: bool = False) -> None:
    s, x = r.stats, r.expected
    assert s is not None
    lo, hi = s.min, s.max
    if x is not None and x.density in ("normal", "uniform"):
        lo, hi = min(lo, x.lo), max(hi, x.hi)
    if not log and s.std > 0:  # the bulk: beyond 4 std a normal holds 6e-5 of its values, invisible on a linear axis
        centre, spread = (x.mean, x.std) if x is not None and x.density == "normal" else (s.mean, s.std)
        if x is None or x.density == "normal":
            lo, hi = max(lo, centre - 4 * spread), min(hi, centre + 4 * spread)
    if hi <= lo:  # every value the same: one bar holding all of them
        pad = max(abs(lo) * 0.01, 1e-3)
        ax.bar([lo], [1.0], width=pad / 5, color="#8fb3d9", label=f"values ({s.count:,}): all {lo:g}")
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("fraction of values")
        if x is not None:
            ax.axvline(x.mean, color="#c0392b", lw=1.6, ls="--", label=f"expected {x.label}: all {x.mean:g}")
        _label(ax, r, s)
        return
    edges = np.linspace(lo, hi, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    for c in chunks:
        counts += np.histogram(c[np.isfinite(c)], bins=edges)[0]
    width = edges[1] - edges[0]
    density = counts / max(s.count, 1) / width
    ax.bar(edges[:-1], density, width=width, align="edge", color="#8fb3d9", edgecolor="none", label=f"values ({s.count:,})")
    if x is not None:
        grid = np.linspace(lo, hi, 600)
        if x.density == "normal":
            pdf = np.exp(-0.5 * ((grid - x.mean) / x.std) ** 2) / (x.std * math.sqrt(2 * math.pi))
            ax.plot(grid, pdf, color="#c0392b", lw=1.6, label=f"expected {x.label}")
        elif x.density == "uniform":
            pdf = np.where((grid >= x.lo) & (grid <= x.hi), 1.0 / (x.hi - x.lo), 0.0)
            ax.plot(grid, pdf, color="#c0392b", lw=1.6, label=f"expected {x.label}")
        elif x.density == "point":
            ax.axvline(x.mean, color="#c0392b", lw=1.6, ls="--", label=f"expected {x.label}: all {x.mean:g}")
    if log:
        ax.set_yscale("log")
        ax.set_ylabel("density (log scale)")
        positive = density[density > 0]
        if positive.size:
            ax.set_ylim(positive.min() / 2, positive.max() * 20)  # headroom for the legend
    else:
        ax.set_ylabel("density")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom for the legend
    _label(ax, r, s)


def _label(ax: Any, r: Row, s: Stats) -> None:
    from matplotlib.ticker import MaxNLocator

    verdict = f" [{r.status}]" if r.expected is not None or r.problems else ""
    ax.set_title(f"{r.name}  {r.dtype} {_shape(r.shape)}{verdict}", fontsize=10)
    ax.set_xlabel(f"value   (mean {s.mean:.4g}, std {s.std:.4g}, min {s.min:.4g}, max {s.max:.4g})", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(7))
    ax.legend(fontsize=8, loc="upper right")
