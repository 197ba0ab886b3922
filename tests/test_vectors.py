"""Every reference case of vectors.json, bit for bit, on the CPU backend and the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reference

from paraminit import dtypes
from paraminit_client import cli, plans
from paraminit_server.plans import sampler
from paraminit_server.plans.plan import resolve_unchecked
from support import CASES, VECTORS, case_param, poisoned, vector_cases


def expected_bits(case: dict[str, Any]) -> list[int]:
    return [int(b, 16) for b in case["bits"]]


def as_bits(arr: np.ndarray[Any, Any]) -> list[int]:
    return [int(x) for x in arr.reshape(-1).view(f"u{arr.dtype.itemsize}")]


def test_known_answers() -> None:
    assert sampler.mix(0) == 0xE220A8397B1DCDAF
    assert sampler.unit(0, 0) == 0.30117025575600564


@pytest.mark.parametrize("seed", list(VECTORS["unit"]))
def test_unit_streams(seed: str) -> None:
    want = VECTORS["unit"][seed]
    assert [sampler.unit(int(seed), i) for i in range(len(want))] == want
    got = reference.units(sampler.key(int(seed)), np.arange(len(want), dtype=np.uint64))
    assert got.tolist() == want


@pytest.mark.parametrize("case", vector_cases())
def test_reference_matches_vectors(case: dict[str, Any]) -> None:
    p = resolve_unchecked(0, case_param(case))
    values = reference.values_f64(p)
    assert [repr(float(v)) for v in values] == [repr(float(x)) for x in case["float64"]]
    assert as_bits(reference.materialize(p)) == expected_bits(case)


@pytest.mark.parametrize("case", vector_cases())
def test_cpu_backend_matches_vectors(case: dict[str, Any], cpu_backend: Any) -> None:
    p = resolve_unchecked(0, case_param(case))
    out = poisoned(p.numel, p.dtype.storage)
    cpu_backend.fill(p, out)
    assert as_bits(out) == expected_bits(case)


def test_cli_materialize_matches_vectors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every case through `paraminit materialize` (the embedded server, a plan file, a safetensors file)."""
    plan = {
        "params": [
            {
                "name": c["name"],
                "shape": c["shape"],
                "dtype": c["dtype"],
                "init": c["init"],
                **({"region": [{"start": a, "stop": b} for a, b in c["region"]]} if "region" in c else {}),
            }
            for c in CASES
        ]
    }
    src, out = tmp_path / "vectors_plan.json", tmp_path / "vectors.safetensors"
    src.write_text(json.dumps(plan))
    assert cli.main(["materialize", str(src), "-o", str(out), "-q"]) == 0, capsys.readouterr().err
    header = plans.safetensors_header(out)
    data = out.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    for case in CASES:
        a, b = header[case["name"]]["data_offsets"]
        assert header[case["name"]]["dtype"] == dtypes.by_name(case["dtype"]).safetensors, case["name"]
        got = np.frombuffer(data[start + a : start + b], dtype=f"<u{dtypes.by_name(case['dtype']).itemsize}")
        assert [int(x) for x in got] == expected_bits(case), case["name"]


SHARED_SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec"


@pytest.mark.skipif(not (SHARED_SPEC / "vectors.json").exists(), reason="no shared spec checkout beside the repository")
def test_vectors_are_the_shared_specs() -> None:
    """tests/vectors.json is a copy of the spec's reference cases (kept in sync when the spec changes)."""
    assert json.loads((SHARED_SPEC / "vectors.json").read_text()) == VECTORS
