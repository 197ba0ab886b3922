"""The CPU kernels' JIT cache: an unwritable cache falls back and is seeded, the CPU-model pin, a read-only install
only slows the start, a cold CLI says it compiles, a warm-up that fails exits with one line, and a process whose
kernel sources were edited after it imported them keeps its code out of the cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paraminit_client import Client, param, plan_of
from paraminit_server.backends.cpu import COMPILE_LINE
from support import scanner_seed, serve_subprocess

BIN = Path(sys.executable).parent


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# -- JIT cache ------------------------------------------------------------------------------------------------------


def test_kernels_of_edited_sources_stay_out_of_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key digests the sources as they are on disk; a process that imported them before an edit compiles
    the older code, which must not be saved (nor a newer entry loaded) under the edited sources' key."""
    from numba.core.caching import FunctionCache

    from paraminit_server.backends.cpu_kernels import jit as kjit
    from paraminit_server.backends.cpu_kernels.distributions import fill_normal

    saved: list[object] = []
    loaded: list[object] = []
    monkeypatch.setattr(FunctionCache, "save_overload", lambda self, sig, data: saved.append(sig))
    monkeypatch.setattr(FunctionCache, "load_overload", lambda self, sig, ctx: loaded.append(sig))
    cache = kjit.KernelCache(fill_normal.py_func)
    kjit.sources_digest.cache_clear()
    try:
        digest = kjit.sources_digest()
        assert digest is not None and re.fullmatch("[0-9a-f]{64}", digest)
        cache.save_overload("sig", None)
        cache.load_overload("sig", None)
        assert saved == ["sig"] and loaded == ["sig"]
        monkeypatch.setattr(kjit, "_IMPORTED", {**kjit._IMPORTED, "distributions.py": -1})  # edited since import
        kjit.sources_digest.cache_clear()
        assert kjit.sources_digest() is None
        assert cache.load_overload("sig", None) is None
        cache.save_overload("sig", None)
        assert saved == ["sig"] and loaded == ["sig"]
    finally:
        kjit.sources_digest.cache_clear()


def test_unwritable_cache_falls_back_and_seed_is_copied(tmp_path: Path) -> None:
    from paraminit_server.backends import jit_cache

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # unwritable even for root: a path below a regular file
    seed = _tree(
        tmp_path / "seed",
        {"numba/backends_abc/cpu_kernels.fill-1.py311.nbi": "index", "numba/backends_abc/cpu_kernels.fill-1.py311.1.nbc": "code"},
    )
    env = {"NUMBA_CACHE_DIR": str(blocker / "numba"), "PARAMINIT_JIT_CACHE_SEED": str(seed)}
    result = jit_cache.prepare_jit_cache(env)
    assert "not writable" in result.warning and env["NUMBA_CACHE_DIR"] == result.path != str(blocker / "numba")
    cache = Path(result.path)
    assert result.seeded == 2
    assert (cache / "backends_abc" / "cpu_kernels.fill-1.py311.1.nbc").read_text() == "code"
    # A writable cache keeps what it has (entries compiled here are newer than the seed's).
    (cache / "backends_abc" / "cpu_kernels.fill-1.py311.nbi").write_text("newer index")
    again = jit_cache.prepare_jit_cache({"NUMBA_CACHE_DIR": str(cache), "PARAMINIT_JIT_CACHE_SEED": str(seed)})
    assert again.warning == "" and again.seeded == 0
    assert (cache / "backends_abc" / "cpu_kernels.fill-1.py311.nbi").read_text() == "newer index"


def test_cpu_model_pin_translates_only_when_asked() -> None:
    from paraminit_server.backends import jit_cache

    env = {"PARAMINIT_NUMBA_CPU_NAME": ""}
    jit_cache.prepare_jit_cache(env)
    assert "NUMBA_CPU_NAME" not in env and "NUMBA_CPU_FEATURES" not in env
    env = {"PARAMINIT_NUMBA_CPU_NAME": "x86-64-v3"}
    jit_cache.prepare_jit_cache(env)
    assert env["NUMBA_CPU_NAME"] == "x86-64-v3" and env["NUMBA_CPU_FEATURES"] == ""
    env = {"PARAMINIT_NUMBA_CPU_NAME": "x86-64-v3", "NUMBA_CPU_NAME": "znver4"}  # numba's own setting wins
    jit_cache.prepare_jit_cache(env)
    assert env["NUMBA_CPU_NAME"] == "znver4" and "NUMBA_CPU_FEATURES" not in env


@pytest.fixture(scope="module")
def read_only_install(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a server installed read-only, as in the image: numba may cache only under
    NUMBA_CACHE_DIR or the home directory (not next to the sources), and both are unwritable."""
    base = tmp_path_factory.mktemp("ro")
    blocker = base / "file"
    blocker.write_text("")
    return {
        "NUMBA_CACHE_LOCATOR_CLASSES": "UserProvidedCacheLocator,UserWideCacheLocator",
        "NUMBA_CACHE_DIR": str(blocker / "numba"),
        "HOME": str(blocker),
        "XDG_CACHE_HOME": str(blocker),
        "TMPDIR": str(base),
        "PARAMINIT_LOG_FORMAT": "text",
    }


@pytest.mark.slow
def test_unwritable_numba_cache_only_slows_start(read_only_install: dict[str, str], tmp_path: Path) -> None:
    """The server caches into a fallback directory, seeded as in the image (here with the plan scanner alone), and
    compiles the fill kernels it lacks there."""
    env = {**read_only_install, "PARAMINIT_JIT_CACHE_SEED": str(scanner_seed(tmp_path / "seed"))}
    proc, target = serve_subprocess(env, stderr=subprocess.PIPE)
    try:
        with Client(target) as c:
            assert c.health() == "SERVING"
            out = c.materialize(plan_of([param("w", [64], {"uniform": {"lo": -1, "hi": 1, "seed": 5}})]))
            assert any(float(v) != 0.0 for v in out["w"].reshape(-1))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "is not writable" in err and "caching into" in err, err
    fallback = Path(err.split("caching into ", 1)[1].split()[0])
    assert list(fallback.glob("plans_*/scanner_kernels.*.nbi")), err  # the seed was copied into the fallback
    assert err.count(COMPILE_LINE) == 1, err  # a cold cache is not silent, and says so once


# Runs the command after dropping, as another thread leaving `warnings.catch_warnings` would (a progress bar's
# import did), the warning filter the kernels add on import: the in-process data plane imports them on its own
# thread while the caller's thread goes on importing.
_DROPPED_FILTER_CLI = """
import sys, threading, warnings
entered, imported = threading.Event(), threading.Event()

def other():
    with warnings.catch_warnings():
        entered.set()
        imported.wait()

t = threading.Thread(target=other)
t.start()
entered.wait()
import paraminit_server.backends.cpu
imported.set()
t.join()
from paraminit_client.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_cold_cli_says_it_compiles_and_reports_compiling_apart(tmp_path: Path) -> None:
    """A first materialize with an empty kernel cache prints the compile line once, and none of numba's warnings
    about its inliner even when the kernels' warning filter was dropped (see _DROPPED_FILTER_CLI), and reports the
    compile seconds apart from the time its throughput is computed over; the next process loads them and says
    nothing. The plan is large enough to be read by the compiled scanner, whose compiling is counted too."""
    plan = tmp_path / "plan.json"
    params = [{"name": f"w{i}", "shape": [128, 256], "init": {"normal": {"std": 0.02, "seed": i}}} for i in range(32)]
    plan.write_text(json.dumps({"params": params}))
    size = 4 << 20
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    summaries = []
    for command in ([sys.executable, "-c", _DROPPED_FILTER_CLI], [str(BIN / "paraminit")]):
        r = subprocess.run(
            [*command, "materialize", str(plan), "-o", str(tmp_path / "w.safetensors")],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr
        summaries.append((r.stdout, r.stderr))
    (cold, cold_err), (warm, warm_err) = summaries
    assert cold_err.count(COMPILE_LINE) == 1, cold_err
    assert "Warning" not in cold_err + warm_err, cold_err + warm_err
    assert "for each kind of value and dtype" in cold_err and "now: normal values" in cold_err, cold_err
    m = re.search(r"in ([\d.]+) s plus ([\d.]+) s compiling CPU kernels \(([\d.]+) (\w+)/s;", cold)
    assert m and float(m.group(2)) > 0, cold
    # the rate is over the time without compiling: far above the bytes over both times together
    rate = float(m.group(3)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m.group(4)]
    assert rate * (float(m.group(1)) + float(m.group(2))) > 2 * size, cold
    assert COMPILE_LINE not in warm_err and "compiling" not in warm, (warm, warm_err)
    assert re.search(r"in [\d.]+ s \([\d.]+ \w+/s;", warm), warm


def test_failed_warm_up_exits_non_zero_with_one_line(read_only_install: dict[str, str], tmp_path: Path) -> None:
    """A kernel that cannot compile fails the warm-up: the server must exit (and be restarted or reported)
    instead of staying up NOT_SERVING; stderr says why in one line, no traceback. The compiler is broken for
    the server process alone, by a sitecustomize on its path (as LLVM running out of memory would break it)."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import numba.core.dispatcher
        def compile(self, sig):
            raise MemoryError("LLVM ERROR: out of memory")
        numba.core.dispatcher.Dispatcher.compile = compile
    """)
    )
    env = {
        **os.environ,
        **read_only_install,
        "PARAMINIT_PORT": "0",
        "PARAMINIT_BACKEND": "cpu",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run([str(BIN / "paraminit-server")], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "warm-up failed" in line]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "out of memory" in errors[0], errors[0]


def test_prebuild_cpu_leaves_a_process_nothing_to_compile() -> None:
    """`prebuild --cpu` (the CPU image's build, and the suite's start under xdist) shares the kernels out between
    processes; afterwards a new process loads every kernel and the plan scanner from the cache and compiles none."""
    built = subprocess.run([sys.executable, "-m", "paraminit_server.prebuild", "--cpu", "--processes", "2"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert "CPU kernels ready in numba's cache (2 processes" in built.stdout
    probe = textwrap.dedent(
        """
        from paraminit_server.backends.cpu import CpuBackend
        from paraminit_server.plans import scanner, scanner_kernels
        backend = CpuBackend()
        backend.preload()  # compiles nothing: ready only when every kernel came from the cache
        scanner.warm_up()
        passes = (scanner_kernels.count, scanner_kernels.fill, scanner_kernels.join_names, scanner_kernels.canonical)
        compiled = sum(sum(f.stats.cache_misses.values()) for f in passes)
        loaded = sum(sum(f.stats.cache_hits.values()) for f in passes)
        print(backend._ready_all, compiled, loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "0", "4"], out.stdout + out.stderr
    assert COMPILE_LINE not in out.stderr
