"""Global element indices of huge tensors: full tensors of 2^63 elements or more are refused, and regions near
2^63 get their own exact indices (no wrap)."""

from __future__ import annotations

import grpc
import pytest
import reference

from paraminit.v1 import plan_pb2
from paraminit_client import Client, ParaminitError, param, plan_of
from support import resolved, running_server, target_of


def _region_param(shape: list[int], region: list[tuple[int, int]], seed: int = 9) -> plan_pb2.Param:
    p = param("w", shape, {"uniform": {"lo": -1, "hi": 1, "seed": seed}})
    for lo, hi in region:
        p.region.add(start=lo, stop=hi)
    return p


# -- flat indices near 2^63 -------------------------------------------------------------


@pytest.mark.parametrize("shape", [[2**64 - 1, 2**64 - 1], [2**40, 2**40], [2**21, 2**42]])
def test_full_tensors_of_2_63_elements_or_more_are_refused(shape: list[int]) -> None:
    with running_server() as r, Client(target_of(r)) as c:
        plan = plan_of([_region_param(shape, [(0, 1), (0, 1)])])
        report = c.validate(plan)
        assert not report.valid
        assert any("2^63 elements or more" in line for line in report.lines())
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "shape,rows",
    [
        ([2**40, 2**22], [0, 2**24, 2**39, 2**40 - 1]),  # 2^62 elements: the rows the old kernel wrapped onto row 0
        ([2**40, 2**23 - 1], [2**40 - 1]),  # 2^63 - 2^40 elements: the last row ends just under 2^63
    ],
)
def test_rows_near_2_63_get_their_own_global_index(shape: list[int], rows: list[int]) -> None:
    with running_server() as r, Client(target_of(r)) as c:
        got = {}
        for row in rows:
            p = _region_param(shape, [(row, row + 1), (shape[1] - 5, shape[1])])
            plan = plan_of([p])
            assert c.validate(plan).ok
            out = c.materialize(plan)["w"]
            want = reference.materialize(resolved(plan)[0])
            assert out.tobytes() == want.tobytes(), row
            g = reference.global_indices(resolved(plan)[0])
            assert int(g[0]) == row * shape[1] + shape[1] - 5  # exact, no wrap
            got[row] = out.tobytes()
        assert len(set(got.values())) == len(rows)  # no two rows repeat each other
