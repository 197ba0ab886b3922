"""Every reference case of vectors.json, bit for bit, on the CPU backend and the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import reference

from conftest import VECTORS, case_param, poisoned
from paraminit_server import spec
from paraminit_server.plan import resolve_param

CASES = VECTORS["cases"]


def expected_bits(case: dict[str, Any]) -> list[int]:
    return [int(b, 16) for b in case["bits"]]


def as_bits(arr: np.ndarray[Any, Any]) -> list[int]:
    return [int(x) for x in arr.reshape(-1).view(f"u{arr.dtype.itemsize}")]


def test_known_answers() -> None:
    assert spec.mix(0) == 0xE220A8397B1DCDAF
    assert spec.unit(0, 0) == 0.30117025575600564


@pytest.mark.parametrize("seed", list(VECTORS["unit"]))
def test_unit_streams(seed: str) -> None:
    want = VECTORS["unit"][seed]
    assert [spec.unit(int(seed), i) for i in range(len(want))] == want
    got = reference.units(spec.key(int(seed)), np.arange(len(want), dtype=np.uint64))
    assert got.tolist() == want


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_matches_vectors(case: dict[str, Any]) -> None:
    p = resolve_param(0, case_param(case))
    values = reference.values_f64(p)
    assert [repr(float(v)) for v in values] == [repr(float(x)) for x in case["float64"]]
    assert as_bits(reference.materialize(p)) == expected_bits(case)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cpu_backend_matches_vectors(case: dict[str, Any], cpu_backend: Any) -> None:
    p = resolve_param(0, case_param(case))
    out = poisoned(p.numel, p.dtype.storage)
    cpu_backend.fill(p, out)
    assert as_bits(out) == expected_bits(case)
