"""Validation reports every violation at once, with TorchLean's messages word for word."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from paraminit.v1 import init_service_pb2 as pb
from paraminit.v1 import plan_pb2
from paraminit.violations import MAX_ANSWER_VIOLATIONS
from paraminit_client import Client, ParaminitError, param, plan_of, zip_plan
from paraminit_server.plans.validation import Limits, Report, check
from support import running_server, server_fixture, target_of


def validate(plan: plan_pb2.Plan, limits: Limits | None = None) -> Report:
    """The check's sweep without resolution: what Validate answers."""
    return check(plan, limits, resolve=False).report


def messages(plan: plan_pb2.Plan, limits: Limits | None = None) -> list[str]:
    return [str(v) for v in validate(plan, limits).violations]


def test_valid_plan_has_no_violations_and_sizes() -> None:
    plan = plan_of(
        [
            param("w", [3, 4], {"uniform": {"lo": -1, "hi": 1}}, "bfloat16"),
            param("b", [], {"ones": {}}, "float64"),
            param("r", [4, 4], {"normal": {"std": 0}}, region=[(1, 3), (0, 2)]),
        ]
    )
    report = validate(plan)
    assert report.ok
    assert report.param_bytes == (24, 8, 16)


def test_every_violation_reported_at_once() -> None:
    plan = plan_of(
        [
            param("u", [2], {"uniform": {"lo": "NaN", "hi": 1}}),
            param("u2", [2], {"uniform": {"lo": 2, "hi": 1}}),
            param("n", [2], {"normal": {"mean": "Infinity", "std": 1}}),
            param("n2", [2], {"normal": {"std": -0.5}}),
            param("f", [2, 3], {"flat": {"values": [1, 2]}}),
            param("x", [5], {"xavierUniformForShape": {}}),
            param("k", [], {"kaimingUniformForShape": {}}),
            param("", [1], {"zeros": {}}),
            param("u", [1], {"zeros": {}}),
            plan_pb2.Param(name="noinit", shape=[1]),
            param("reg", [4, 4], {"zeros": {}}, region=[(3, 2), (0, 5)]),
            param("reg2", [4], {"zeros": {}}, region=[(1, 1)]),
            param("reg3", [4, 4], {"zeros": {}}, region=[(0, 1)]),
            param("nf", [2], {"flat": {"values": [1, "Infinity"]}}),
        ]
    )
    plan.params.add(name="dt", shape=[1], dtype=99).init.zeros.SetInParent()
    got = messages(plan)
    want = [
        "params[0].init.uniform ('u'): initialization: uniform bounds must be finite",
        "params[1].init.uniform ('u2'): initialization: uniform lower bound must not exceed the upper bound",
        "params[2].init.normal ('n'): initialization: normal mean and standard deviation must be finite",
        "params[3].init.normal ('n2'): initialization: normal standard deviation must be nonnegative",
        "params[4].init.flat.values ('f'): torch.runtimeInit: flat initializer length mismatch (expected 6, got 2)",
        "params[5].init.xavierUniformForShape ('x'): torch.runtimeInit: Xavier initialization expects at least 2 dimensions, got [5]",
        "params[6].init.kaimingUniformForShape ('k'): torch.runtimeInit: Kaiming initialization expects at least 2 dimensions, got []",
        "params[7].name (''): parameter name must not be empty",
        "params[8].name ('u'): duplicate parameter name 'u' (first at params[0])",
        "params[10].region[0] ('reg'): range start 3 exceeds stop 2",
        "params[10].region[1] ('reg'): range [0, 5) is out of bounds for dimension 1 of size 4",
        "params[11].region[0] ('reg2'): range [1, 1) is empty",
        "params[12].region ('reg3'): region has 1 ranges but the shape [4, 4] has rank 2",
        "params[13].init.flat.values ('nf'): flat values must be finite (1 not finite, first at index 1)",
        "params[14].dtype ('dt'): unknown dtype enum value 99",
    ]
    assert [g for g in got if "noinit" not in g] == want
    assert any(g.startswith("params[9].init ('noinit'): initializer is not set") for g in got)


def test_truncated_normal_rules_reported_with_the_rest() -> None:
    plan = plan_of(
        [
            param("t_inf", [2], {"truncatedNormal": {"std": 1, "lo": "-Infinity", "hi": 2}}),
            param("t_nan", [2], {"truncatedNormal": {"mean": "NaN", "std": 1, "lo": -2, "hi": 2}}),
            param("t_neg", [2], {"truncatedNormal": {"std": -1, "lo": -2, "hi": 2}}),
            param("t_lo", [2], {"truncatedNormal": {"std": 1, "lo": -0.49, "hi": 2}}),
            param("t_hi", [2], {"truncatedNormal": {"mean": 1, "std": 0.02, "lo": 0.9, "hi": 1.0099}}),
            param("n", [2], {"normal": {"std": -0.5}}),
            param("ok_edge", [2], {"truncatedNormal": {"std": 1, "lo": -0.5, "hi": 0.5}}),
            param("ok_point", [2], {"truncatedNormal": {"mean": 3, "std": 0, "lo": 3, "hi": 3}}),
        ]
    )
    got = messages(plan)
    assert got[:3] == [
        "params[0].init.truncatedNormal ('t_inf'): initialization: truncated normal mean, standard deviation and bounds must be finite",
        "params[1].init.truncatedNormal ('t_nan'): initialization: truncated normal mean, standard deviation and bounds must be finite",
        "params[2].init.truncatedNormal ('t_neg'): initialization: truncated normal standard deviation must be nonnegative",
    ]
    assert got[3].startswith(
        "params[3].init.truncatedNormal ('t_lo'): truncated normal bounds [-0.49, 2.0] are "
        "too tight: they must hold [mean - std / 2, mean + std / 2] = [-0.5, 0.5]"
    )
    assert got[4].startswith("params[4].init.truncatedNormal ('t_hi'): truncated normal bounds [0.9, 1.0099] are too tight")
    assert got[5] == "params[5].init.normal ('n'): initialization: normal standard deviation must be nonnegative"
    assert len(got) == 6


def test_equal_bounds_and_zero_std_are_valid() -> None:
    plan = plan_of(
        [
            param("a", [2], {"uniform": {"lo": 1, "hi": 1}}),
            param("b", [2], {"normal": {"std": 0}}),
            param("c", [2], {"kaimingUniform": {"fanIn": 0}}),
            param("d", [2], {"xavierUniform": {}}),
        ]
    )
    assert messages(plan) == []


def test_size_overflow_and_limits() -> None:
    huge = plan_of([param("h", [1 << 40, 1 << 40], {"zeros": {}})])
    assert any("has 2^63 elements or more" in m for m in messages(huge))
    wide = plan_of([param("w", [1 << 60, 4], {"zeros": {}})])  # 2^62 elements fit; their 2^64 bytes do not
    assert any("size overflows: 4611686018427387904 elements of float32 exceed 2^63 bytes" in m for m in messages(wide))
    plan = plan_of([param("a", [100], {"zeros": {}}), param("b", [100], {"zeros": {}}, "float64")])
    report = validate(plan, Limits(max_param_bytes=500, max_plan_bytes=1000))
    assert report.only_limits
    assert [str(v) for v in report.violations] == [
        "params[1].shape ('b'): parameter needs 800 bytes (800 B), over the per-parameter limit of 500 (500 B; "
        "--max-param-bytes, PARAMINIT_MAX_PARAM_BYTES)",
        "params: plan needs 1200 bytes (1.2 KiB), over the per-plan limit of 1000 (1000 B; --max-plan-bytes, PARAMINIT_MAX_PLAN_BYTES)",
    ]


def test_untrusted_shapes_are_sized_without_big_integers() -> None:
    """Rank first, then a product that stops at 2^63: no message formats a huge number (Python refuses to print
    integers past 4,300 digits), and an empty tensor's fans are 0 whatever its other dimensions."""
    import time

    from paraminit.shapes import fan_in_out

    deep = plan_of([param("deep", [1 << 62] * 231, {"zeros": {}})])
    assert messages(deep) == [
        "params[0].shape ('deep'): rank 231 exceeds the maximum of 32",
        "params[0].shape ('deep'): the full tensor [4611686018427387904, 4611686018427387904, "
        "4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, "
        "4611686018427387904, 4611686018427387904, ... (231 dimensions)] has 2^63 elements or "
        "more; flat indices must fit in 64 bits",
    ]
    flat = plan_of([param("f", [1 << 62] * 40, {"flat": {"values": [1.0, 2.0]}})])
    assert any("(expected 2^63 or more, got 2)" in m for m in messages(flat))
    started = time.process_time()
    wide = plan_of([param("w", [(1 << 62) + k for k in range(60_000)], {"normal": {"std": -1.0}})])
    found = messages(wide)
    assert time.process_time() - started < 5.0  # was about 30 s of big-integer products; a bound, not a timing
    assert any("normal standard deviation must be nonnegative" in m for m in found)  # the rest is still checked
    empty = [0] + [1 << 62] * 18  # 0 elements, but a shape no array library holds, and a fan of 2^1054
    assert fan_in_out(empty) == (0, 0) and fan_in_out([1 << 62, 0, 5]) == (0, 0)
    assert messages(plan_of([param("e", empty, {"xavierUniformForShape": {"seed": 1}})])) == [
        "params[0].shape ('e'): the dimensions of [0, 4611686018427387904, 4611686018427387904, 4611686018427387904, "
        "4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, "
        "4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, "
        "4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904, 4611686018427387904] "
        "other than 0 multiply to 2^60 or more; an empty tensor's shape must still fit in 2^63 bytes as if it were "
        "not empty"
    ]
    ok = plan_of([param("e", [1 << 20, 0, 1 << 20], {"xavierUniformForShape": {"seed": 1}})])
    assert messages(ok) == []
    with Client() as client:  # materialized: 0 bytes, a zero fan (docs/SAMPLER.md section 3)
        arrays = client.materialize(ok)
    assert arrays["e"].shape == (1 << 20, 0, 1 << 20)


def test_reserved_names_are_refused() -> None:
    """`__metadata__` is the safetensors header's own key: a tensor of that name would overwrite it."""
    small = plan_of([param("__metadata__", [2], {"zeros": {}})])
    assert messages(small) == [
        "params[0].name ('__metadata__'): parameter name '__metadata__' is reserved (a safetensors header keeps it for the file's metadata)"
    ]
    from paraminit_server.plans import columns

    many = plan_of([param(f"p{i}", [2], {"zeros": {}}) for i in range(1100)] + [param("__metadata__", [2], {"zeros": {}})])
    got = validate(many)
    assert columns.of(many).scan is not None  # the name rules judged as columns
    assert [v.field for v in got.violations] == ["params[1100].name"]


def test_initializer_list_length_messages() -> None:
    init = plan_pb2.Init(zeros=plan_pb2.Zeros())
    with pytest.raises(ValueError, match=r"^torch.runtimeInit: initializer array shorter than parameter list$"):
        zip_plan([("a", [1]), ("b", [1])], [init])
    with pytest.raises(ValueError, match=r"^torch.runtimeInit: initializer array longer than parameter list$"):
        zip_plan([("a", [1])], [init, init])
    assert len(zip_plan([("a", [1])], [init]).params) == 1


server = server_fixture(max_plan_bytes=1 << 30, slab_bytes=1 << 20)


def mixed_plan() -> plan_pb2.Plan:
    return plan_of(
        [
            param("w", [33, 17], {"kaimingUniformForShape": {"seed": 3}}),
            param("e", [50, 8], {"normal": {"mean": 0.5, "std": 2.0, "seed": 4}}, "bfloat16"),
            param("h", [7], {"uniform": {"lo": -3, "hi": 5, "seed": 5}}, "float16"),
            param("d", [4, 5, 6], {"xavierUniformForShape": {"seed": 6}}, "float64", region=[(1, 3), (0, 5), (2, 5)]),
            param("f", [3], {"flat": {"values": [1.5, -2.25, 3e38]}}, "bfloat16"),
            param("s", [], {"ones": {}}),
        ]
    )


def test_validate_rpc(client: Client) -> None:
    report = client.validate(mixed_plan())
    assert report.ok and report.total_bytes == sum(report.param_bytes) > 0
    bad = plan_of([param("a", [3], {"uniform": {"lo": 1, "hi": 0}}), param("a", [2], {"flat": {"values": [1]}})])
    report = client.validate(bad)
    assert not report.valid and len(report.violations) == 3


def test_invalid_plan_gives_every_violation(client: Client) -> None:
    bad = plan_of(
        [
            param("a", [3], {"uniform": {"lo": 1, "hi": 0}}),
            param("b", [2], {"flat": {"values": [1]}}),
            param("c", [4], {"kaimingUniformForShape": {}}),
        ]
    )
    with pytest.raises(ParaminitError) as info:
        client.materialize(bad)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in err.violations] == [
        "params[0].init.uniform",
        "params[1].init.flat.values",
        "params[2].init.kaimingUniformForShape",
    ]
    assert "initialization: uniform lower bound must not exceed the upper bound" in err.message
    assert "Traceback" not in err.message


# -- error details stay small enough to arrive ------------------------------------------


def test_many_long_violations_arrive_as_invalid_argument() -> None:
    names = [f"model.layers.{i}.self_attention.query_key_value.weight.{'x' * 180}" for i in range(20)]
    plan = plan_of(
        [param(n, [4], {"uniform": {"lo": 1, "hi": 0}}) for n in names]
        + [
            param("y" * 10_000, [4], {"normal": {"std": -1}}),
            param("z", [4], {"safetensors": {"path": "/" + "p" * 4000, "tensor": "t" * 4000}}),
            param("q", [4], {"flatRef": {"payloadId": "f" * 50_000}}),
        ]
    )
    with running_server() as r, Client(target_of(r), timeout=30) as c:
        with pytest.raises(ParaminitError) as info:
            c.materialize(plan)
        err = info.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
        assert err.violations and "uniform lower bound must not exceed the upper bound" in err.violations[0].description
        assert len(err.violations) == 24 and err.omitted == 0  # all of them fit the default trailer limit
        assert len(err.message.encode()) <= 400 and "invalid plan: 24 violation(s)" in err.message  # the 10k name breaks two rules
        report = c.validate(plan)  # Validate's body still carries every violation
        assert len(report.violations) == 24
        with pytest.raises(ParaminitError) as info:  # a 1 MB lease id is echoed cut short
            c.release("L" * (1 << 20))
        assert info.value.code == grpc.StatusCode.NOT_FOUND and len(info.value.message) <= 400


def test_a_box_reports_at_most_two_violations_whatever_its_rank() -> None:
    """A patch box with many bad ranges is at most two violations (the first two, and a count of the others):
    thousands of patches of a rank-32 shape made over 100,000 violations of one parameter before."""
    shape = [2] * 32
    p = plan_pb2.Param(name="w", shape=shape)
    p.init.zeros.SetInParent()
    for _ in range(4096):
        q = p.patches.add()
        q.init.ones.SetInParent()
        for _d in range(32):
            q.box.add(start=0, stop=5)
    report = validate(plan_pb2.Plan(params=[p]))
    found = report.violations
    assert len(found) + report.omitted == 2 * 4096 and len(found) == 1000  # the first 1000 kept, the rest counted
    assert [str(v) for v in found[:2]] == [
        "params[0].patches[0].box[0] ('w'): range [0, 5) is out of bounds for dimension 0 of size 2",
        "params[0].patches[0].box[1] ('w'): range [0, 5) is out of bounds for dimension 1 of size 2 (30 more ranges "
        "of this box are bad too)",
    ]


def test_validation_keeps_the_first_thousand_violations_and_counts_the_rest() -> None:
    """A plan of 98,304 violations (24 parameters of 4,096 empty patches, 1,005-character names) keeps 1,000
    Violations and a count: what it holds no longer grows with its mistakes (117 MiB of messages before), and
    the categories of those only counted still decide valid and fits_limits."""
    import tracemalloc

    params = []
    for k in range(24):
        p = param(f"{k:05d}" + "n" * 1000, [8, 8], {"zeros": {}})
        for _ in range(4096):
            q = p.patches.add(init=plan_pb2.Init(ones=plan_pb2.Ones()))
            q.box.add(start=3, stop=3)
            q.box.add(start=0, stop=8)
        params.append(p)
    params.append(param("big", [1 << 20], {"zeros": {}}))  # over the per-parameter limit, after 98,304 others
    tracemalloc.start()
    try:
        report = validate(plan_pb2.Plan(params=params), Limits(max_param_bytes=1 << 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(report.violations) == 1000 and report.omitted == 24 * 4096 + 1 - 1000
    assert not report.valid and not report.fits_limits  # the limit violation was only counted, and still counts
    assert peak < 32 << 20, peak


def test_an_answer_lists_at_most_a_thousand_violations_and_counts_the_rest(server: Any) -> None:
    """24 parameters with 1,000-byte names and 512 empty patches each: 12,288 violations, but an answer lists the
    first 1,000 and counts the rest, so its size stays bounded whatever the plan (in process and over a server)."""
    params = []
    for i in range(24):
        p = param(f"{i:04d}" + "n" * 996, [4, 4], {"zeros": {}})
        for _ in range(512):
            p.patches.add(init=plan_pb2.Init(zeros=plan_pb2.Zeros()))  # no box: one violation each
        params.append(p)
    plan = plan_of(params)
    with Client() as here, Client(target_of(server)) as remote:
        for report in (here.validate(plan), remote.validate(plan)):
            assert not report.valid and len(report.violations) == MAX_ANSWER_VIOLATIONS
            assert report.omitted == 24 * 512 - MAX_ANSWER_VIOLATIONS  # every one found, the rest counted
            assert report.violations[0].index == 0 and report.violations[-1].index == MAX_ANSWER_VIOLATIONS // 512
        with grpc.insecure_channel(target_of(server)) as ch:
            raw = ch.unary_unary("/paraminit.v1.InitService/Validate", request_serializer=bytes, response_deserializer=bytes)
            answer = raw(pb.ValidateRequest(plan=plan).SerializeToString(), timeout=60)
    assert len(answer) < 2 << 20  # 12,288 violations with their 1,000-byte names would be over 12 MB
