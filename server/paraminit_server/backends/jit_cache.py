"""A usable on-disk cache for the numba kernels: NUMBA_CACHE_DIR made writable, seeded, and pinned to a CPU model.

Runs before the kernels compile (at server start, and in the image build that compiles the seed).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path


def _writable(path: Path) -> str:
    """'' when numba could cache into `path` (its own test: create it, then a temporary file), else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


@dataclass
class JitCache:
    """What prepare_jit_cache did: the directory numba will use, a warning to log ('' if none), seed files copied."""

    path: str = ""
    warning: str = ""
    seeded: int = 0


def prepare_jit_cache(environ: MutableMapping[str, str] | None = None) -> JitCache:
    """Make NUMBA_CACHE_DIR usable before the kernels are compiled.

    An unwritable cache directory (a root-owned tmpfs, a read-only root) makes numba refuse to compile cached
    functions at all; it is replaced by a private temporary directory, which only costs the compilation time.
    PARAMINIT_JIT_CACHE_SEED names a read-only tree compiled into the image (its numba/ directory is copied into
    the cache without overwriting), so a container serves without compiling.

    Numba keys cached code on the CPU model and feature string. PARAMINIT_NUMBA_CPU_NAME (empty: this host's
    model) pins both, to that model's baseline features: a cache built on one machine then loads on every node
    that has at least those features, at the price of the instructions newer CPUs add. It only translates into
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when those are not set, so an empty image default changes nothing.
    """
    env = os.environ if environ is None else environ
    _pin_cpu_model(env)
    cache = env.get("NUMBA_CACHE_DIR")
    if not cache:
        return JitCache()
    result = JitCache(cache)
    why = _writable(Path(cache))
    if why:
        fallback = tempfile.mkdtemp(prefix="paraminit-numba-")
        result.warning = f"NUMBA_CACHE_DIR {cache} is not writable ({why}); caching into {fallback} instead"
        cache = result.path = fallback
        env["NUMBA_CACHE_DIR"] = cache
        _set_numba_config(CACHE_DIR=cache)
    seed = Path(env.get("PARAMINIT_JIT_CACHE_SEED", "")) / "numba"
    if env.get("PARAMINIT_JIT_CACHE_SEED") and seed.is_dir() and seed.resolve() != Path(cache).resolve():
        result.seeded = _copy_missing(seed, Path(cache))
    return result


def _set_numba_config(**values: str) -> None:
    """Numba reads its environment at import; when it is already imported, its config attributes are what count."""
    numba_config = sys.modules.get("numba.core.config")
    if numba_config is not None:
        for key, value in values.items():
            setattr(numba_config, key, value)


def _pin_cpu_model(env: MutableMapping[str, str]) -> None:
    name = env.get("PARAMINIT_NUMBA_CPU_NAME", "")
    if name and "NUMBA_CPU_NAME" not in env:
        env["NUMBA_CPU_NAME"] = name
        env.setdefault("NUMBA_CPU_FEATURES", "")
        _set_numba_config(CPU_NAME=name, CPU_FEATURES=env["NUMBA_CPU_FEATURES"])


def _copy_missing(src: Path, dst: Path) -> int:
    copied = 0
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied += 1
    return copied
