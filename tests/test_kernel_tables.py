"""The CUDA header's table block is what `make kernel-tables` writes now (as test_proto_fresh.py for `make proto`).

The GPU kernels evaluate the correctly rounded log and cos with the CPU kernels' tables, copied into
paraminit_kernels.cuh as bit patterns; a block edited by hand, or left behind after cr_tables changed, would make
the GPU's normal values differ from the CPU's.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from paraminit_server.backends import kernel_tables
from paraminit_server.backends.cpu_kernels import cr_tables


def _header() -> str:
    return kernel_tables.HEADER.read_text()


def _bits(x: float) -> int:
    return int(struct.unpack("<Q", struct.pack("<d", x))[0])


def test_committed_block_is_fresh() -> None:
    assert kernel_tables.splice(_header()) == _header(), "the .cuh table block is stale: run `make kernel-tables`"


def test_block_holds_the_cpu_tables_bit_for_bit() -> None:
    """Read the header's numbers back (not the generator's text) and compare with cr_tables."""
    text = _header()
    t = cr_tables.tables()
    for name, key in (("PI_LOG_R", "log_r"), ("PI_COS_SL", "cos_sl")):
        body = text[text.index(f"#define {name}_DATA") : text.index(f"PI_TABLE({name},")]
        words = [int(w, 16) for w in re.findall(r"0x([0-9A-F]{16})ULL", body)]
        assert words == [_bits(v) for v in t[key].tolist()]
        assert len(set(words)) > 100  # a real table, not a constant fill
    ln2l = re.search(r"#define PI_C_LN2L 0x([0-9A-F]{16})ULL", text)
    assert ln2l is not None and int(ln2l.group(1), 16) == _bits(t["ln2l"])
    fix = re.search(r"#define PI_COS_FIX_N (\d+)", text)
    assert fix is not None and int(fix.group(1)) == len(cr_tables.COS_FIX) > 0
    assert all(f"{{{k}ULL, {d}LL}}" in text for k, d in cr_tables.COS_FIX.items())


def _stale_copies(tmp_path: Path) -> dict[str, Path]:
    """Copies of the header with their block made stale in the ways a hand edit or a forgotten regeneration would."""
    text = _header()
    word = f"0x{_bits(cr_tables.tables()['cos_ch'][5]):016X}ULL"
    assert text.count(word) >= 1
    flipped = f"0x{_bits(cr_tables.tables()['cos_ch'][5]) ^ 1:016X}ULL"
    variants = {
        "one table bit": text.replace(word, flipped, 1),
        "a FIX entry dropped": text.replace("#define PI_COS_FIX_N 1", "#define PI_COS_FIX_N 0", 1),
        "a line removed": text.replace("#define PI_C_P3", "// #define PI_C_P3", 1),
    }
    out = {}
    for i, (why, stale) in enumerate(variants.items()):
        assert stale != text, why
        out[why] = tmp_path / f"stale{i}.cuh"
        out[why].write_text(stale)
    return out


def test_a_stale_block_is_detected_and_rewritten(tmp_path: Path) -> None:
    for why, path in _stale_copies(tmp_path).items():
        stale = path.read_text()
        assert kernel_tables.splice(stale) != stale, why
        assert kernel_tables.main(["--check", str(path)]) == 1, why
        assert path.read_text() == stale, "--check must not write"
        assert kernel_tables.main([str(path)]) == 0
        assert path.read_text() == _header(), why  # rewritten: only the block changed, and back to the committed text


def test_text_around_the_block_is_kept(tmp_path: Path) -> None:
    text = _header()
    start, end = text.index(kernel_tables.BEGIN_PREFIX), text.index(kernel_tables.END)
    edited = "// a note above\n" + text[:start] + kernel_tables.BEGIN_PREFIX + "\n/* stale */\n" + text[end:] + "// a note below\n"
    got = kernel_tables.splice(edited)
    assert got.startswith("// a note above\n") and got.endswith("// a note below\n")
    assert "/* stale */" not in got and kernel_tables.block() in got


def test_a_header_without_markers_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(kernel_tables.MarkersMissing):
        kernel_tables.splice("#pragma once\n")
    path = tmp_path / "bare.cuh"
    path.write_text("#pragma once\n// BEGIN GENERATED\n")
    assert kernel_tables.main(["--check", str(path)]) == 2
    assert kernel_tables.main([str(path)]) == 2
    assert path.read_text() == "#pragma once\n// BEGIN GENERATED\n"
    assert "no '// BEGIN GENERATED'" in capsys.readouterr().err


def test_make_target_runs_the_generator(tmp_path: Path) -> None:
    """`python -m paraminit_server.backends.kernel_tables --check` (what `make kernel-tables` runs, read-only)."""
    res = subprocess.run(
        [sys.executable, "-m", "paraminit_server.backends.kernel_tables", "--check"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "up to date" in res.stdout
    stale = next(iter(_stale_copies(tmp_path).values()))
    res = subprocess.run(
        [sys.executable, "-m", "paraminit_server.backends.kernel_tables", "--check", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "make kernel-tables" in res.stderr
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "kernel-tables: $(STAMP)\n\t$(PY) -m paraminit_server.backends.kernel_tables\n" in makefile
