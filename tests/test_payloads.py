"""Flat payloads of any size (uploads) and checkpoint tensors named in safetensors files."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import reference
from safetensors.numpy import save_file

from paraminit import dtypes
from paraminit_client import Client, ParaminitError, param, plan_from_safetensors, plan_of
from paraminit_server import errors
from paraminit_server.plane.caller import Caller
from paraminit_server.plane.materializer import PayloadPiece
from paraminit_server.rpc.server import Running
from support import running_server, target_of, wait_until


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def server(ckpt_dir: Path) -> Iterator[Running]:
    with running_server(safetensors_dirs=str(ckpt_dir), auth_tokens="alice:alice-token-0123456789,bob:bob-token-0123456789ab") as r:
        yield r


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    with Client(target_of(server), token="alice-token-0123456789") as c:
        yield c


def test_payload_larger_than_a_message(client: Client) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(10 << 20).astype(np.float32)  # 40 MiB: ten times gRPC's default message limit
    pid = client.upload_payload(values)
    got = client.materialize(plan_of([param("w", [2560, 4096], {"flatRef": {"payloadId": pid}})]))["w"]
    assert got.tobytes() == values.tobytes()


@pytest.mark.parametrize(
    "src,dst",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("float64", "float32"),
        ("float64", "bfloat16"),
        ("float32", "float16"),
    ],
)
def test_payload_dtypes_convert_exactly_then_round_once(client: Client, src: str, dst: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(4099) * 3).astype(np.float64)
    x[:3] = [1.0039062509313226, -1.00390625, 65519.99]  # tie and overflow cases
    payload = x.astype(ml_dtypes.bfloat16 if src == "bfloat16" else src)
    pid = client.upload_payload(payload)
    got = client.materialize(plan_of([param("w", [4099], {"flatRef": {"payloadId": pid}}, dst)]))["w"]
    exact = payload.astype(np.float64)
    from paraminit import dtypes

    want = reference.cast(exact, dtypes.by_name(dst))
    assert got.view(want.dtype).tobytes() == want.tobytes()
    if src == dst:
        assert got.tobytes() == payload.tobytes()


def test_payload_errors(server: Running, client: Client) -> None:
    pid = client.upload_payload(np.array([1.0, np.inf, 2.0], np.float32))
    with pytest.raises(ParaminitError) as info:
        client.materialize(
            plan_of([param("a", [4], {"flatRef": {"payloadId": pid}}), param("b", [2], {"flatRef": {"payloadId": "0" * 32}})])
        )
    msgs = [v.description for v in info.value.violations]
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any("flat initializer length mismatch (expected 4, got 3)" in m for m in msgs)
    assert any("flat values must be finite (1 not finite, first at index 1)" in m for m in msgs)
    assert any("no payload '000" in m for m in msgs)
    with Client(f"127.0.0.1:{server.port}", token="bob-token-0123456789ab") as bob, pytest.raises(ParaminitError) as info:
        bob.materialize(plan_of([param("a", [3], {"flatRef": {"payloadId": pid}})]))
    assert "no payload" in info.value.message  # another identity cannot use alice's payload


def test_checkpoint_mixed_with_fresh_layers(client: Client, ckpt_dir: Path) -> None:
    rng = np.random.default_rng(2)
    backbone = rng.standard_normal((64, 32)).astype(np.float32)
    emb = rng.standard_normal((100, 16)).astype(ml_dtypes.bfloat16)
    path = ckpt_dir / "model.safetensors"
    save_file({"backbone.weight": backbone, "emb": emb.view(np.uint16)}, str(path))
    # safetensors.numpy has no bfloat16: rewrite the header's dtype for that tensor (same bytes)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = raw[8 : 8 + n].replace(b'"U16"', b'"BF16"')
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n :])
    fallback = plan_of(
        [
            param("backbone.weight", [64, 32], {"zeros": {}}),
            param("emb", [100, 16], {"zeros": {}}, "bfloat16"),
            param("head.weight", [10, 32], {"kaimingUniformForShape": {"seed": 3}}),
        ]
    )
    plan = plan_from_safetensors(path, fallback)
    got = client.materialize(plan)
    assert got["backbone.weight"].tobytes() == backbone.tobytes()
    assert got["emb"].tobytes() == emb.tobytes()
    fresh = client.materialize(fallback)
    assert got["head.weight"].tobytes() == fresh["head.weight"].tobytes()


def test_checkpoint_mismatches_are_clear(client: Client, ckpt_dir: Path, tmp_path: Path) -> None:
    path = ckpt_dir / "small.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    with pytest.raises(ValueError, match=r"w: checkpoint shape \[4, 4\] != plan shape \[4, 5\]"):
        plan_from_safetensors(path, plan_of([param("w", [4, 5], {"zeros": {}})]))
    with pytest.raises(ValueError, match="w: checkpoint dtype F32 != plan dtype float16"):
        plan_from_safetensors(path, plan_of([param("w", [4, 4], {"zeros": {}}, "float16")]))
    wrong = plan_of(
        [
            param("w", [2, 8], {"safetensors": {"path": str(path), "tensor": "w", "dtype": "DTYPE_FLOAT64"}}),
            param("x", [1], {"safetensors": {"path": str(path), "tensor": "nope"}}),
        ]
    )
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": np.ones(1, np.float32)}, str(outside))
    wrong.params.add().CopyFrom(param("y", [1], {"safetensors": {"path": str(outside), "tensor": "w"}}))
    report = client.validate(wrong)
    lines = report.lines()
    assert any("is float32 in the file, not float64" in m for m in lines)
    assert any("has shape [4, 4] in the file; the parameter's shape is [2, 8]" in m for m in lines)
    assert any("tensor 'nope' is not in" in m for m in lines)
    assert any("is not under an allowed directory" in m for m in lines)


@pytest.mark.parametrize("src", ["float32", "bfloat16", "float16", "float64"])
def test_payloads_keep_their_dtype_and_windows_convert_exactly(server: Running, client: Client, src: str) -> None:
    """Stored as uploaded (no binary64 copy); any window, region or column of them gives the same bytes."""
    rng = np.random.default_rng(7)
    shape = (300, 70)
    values = rng.standard_normal(shape).astype(np.float32).astype(dtypes.by_name(src).numpy)
    pid = client.upload_payload(values)
    [payload] = [p for p in server.plane.sources._payloads.values() if p.values.tobytes() == values.tobytes()]
    assert payload.values.dtype == values.dtype  # kept as uploaded
    want64 = values.astype(np.float64)
    owner = payload.owner
    for dst in ("float32", "bfloat16", "float64"):
        dt = dtypes.by_name(dst)
        for region in ((), ((17, 250), (3, 4)), ((299, 300), (0, 70)), ((5, 290), (10, 60))):
            plan = plan_of([param("w", list(shape), {"flatRef": {"payloadId": pid}}, dst, region=region or None)])
            got = client.materialize(plan)["w"]
            box = tuple(slice(a, b) for a, b in region) if region else (slice(None), slice(None))
            want = reference.cast(np.ascontiguousarray(want64[box]).reshape(-1), dt)  # one rounding from binary64
            assert got.view(dt.storage).reshape(-1).tobytes() == want.tobytes(), (dst, region)
            # any window of the region, as streams and exports cut them
            [rp] = server.plane.check(plan, Caller(owner)).params
            for a, b in ((0, rp.numel), (1, rp.numel - 1), (rp.numel // 3, rp.numel // 3 + 7), (rp.numel - 1, rp.numel)):
                out = np.full(b - a, 0xFFFF if dt.itemsize == 2 else np.nan, dtype=dt.storage)
                server.plane.backend.fill(rp, out, a)
                assert out.tobytes() == want[a:b].tobytes(), (dst, region, a, b)


MiB = 1 << 20


# -- uploads in flight count against the payload limit ----------------------------------


def test_concurrent_uploads_cannot_overshoot_the_payload_limit() -> None:
    """Four uploads of 1.5 MiB (float64, kept as uploaded) against a 4 MiB limit, all receiving at once: two fit."""
    count = (3 * MiB // 2) // 8
    go = threading.Event()
    with running_server(max_payload_bytes=4 * MiB) as r:
        plane = r.plane
        values = np.arange(count, dtype=np.float64)
        raw = values.tobytes()
        f64 = dtypes.by_name("float64").enum

        def pieces() -> Any:
            yield PayloadPiece(f64, count, raw[:4096])
            assert go.wait(60)
            yield PayloadPiece(0, 0, raw[4096:])

        results: list[Any] = []

        def upload() -> None:
            try:
                results.append(plane.upload(pieces(), Caller("uploader")))
            except errors.ResourceExhausted as exc:
                results.append(exc)

        threads = [threading.Thread(target=upload) for _ in range(4)]
        for t in threads:
            t.start()
        # the two that do not fit are refused while the other two are still receiving
        assert wait_until(lambda: sum(isinstance(x, errors.ResourceExhausted) for x in results) == 2, 30)
        assert plane.sources.used_bytes() == 2 * count * 8
        go.set()
        for t in threads:
            t.join(60)
        stored = [x for x in results if not isinstance(x, BaseException)]
        assert len(stored) == 2
        assert plane.sources.used_bytes() == 2 * count * 8 <= 4 * MiB
        assert all(np.array_equal(p.values, values) for _, p in stored)

        def failing() -> Any:  # a failed upload gives its bytes back
            yield PayloadPiece(f64, count, raw[:4096])
            raise errors.InvalidRequest("client went away")

        with pytest.raises(errors.ResourceExhausted):
            plane.upload(failing(), Caller("uploader"))  # no room while two are stored
        assert plane.sources.used_bytes() == 2 * count * 8


def test_payloads_are_charged_to_the_memory_budget_while_they_live() -> None:
    """A stored payload is host memory: it holds its bytes in --memory-budget (not only in --max-payload-bytes)
    until it expires, so uploads cannot grow the server's memory past its budget."""
    count = (6 * MiB) // 8
    f64 = dtypes.by_name("float64").enum
    raw = np.arange(count, dtype=np.float64).tobytes()
    with running_server(max_payload_bytes=64 * MiB, memory_budget=10 * MiB, payload_ttl=1.0) as r:
        plane = r.plane
        before = plane.admission.host.reserved
        plane.upload(iter([PayloadPiece(f64, count, raw)]), Caller("a"))
        assert plane.admission.host.reserved - before == count * 8
        with pytest.raises(errors.ResourceExhausted, match="host memory"):
            plane.upload(iter([PayloadPiece(f64, count, raw)]), Caller("b"))
        assert plane.admission.host.reserved - before == count * 8  # the refused one holds nothing
        time.sleep(1.2)  # the first payload expires: its budget goes back with it
        plane.upload(iter([PayloadPiece(f64, count, raw)]), Caller("b"))
        assert plane.admission.host.reserved - before == count * 8


@pytest.mark.parametrize("dtype", [d.name for d in dtypes.SUPPORTED])
def test_the_follower_hashes_and_scans_what_lands(dtype: str) -> None:
    """An upload's digest and scan, computed behind the writer a piece at a time while pieces of odd sizes land,
    equal the whole payload's: sha256, the non-finite count, the first one's index and the largest |value|,
    with non-finite values on both sides of piece boundaries."""
    from paraminit_server.plans.payloads import Follower, payload_sha256, scan_values

    dt = dtypes.by_name(dtype)
    n = 3 * Follower.PIECE // dt.itemsize + 5
    values = (np.random.default_rng(3).standard_normal(n) * 4).astype(dt.numpy)
    bad = np.nan if dt.name == "float8_e4m3fn" else np.inf  # (e4m3fn has no infinity)
    for at in (Follower.PIECE // dt.itemsize + 1, 2 * Follower.PIECE // dt.itemsize - 1, n - 1):
        values[at] = bad
    raw = values.view(np.uint8)
    buf = np.full(raw.size, 0xFF, dtype=np.uint8)  # poisoned: each byte is read only after it landed
    follower = Follower(buf, dt)
    at = 0
    for size in [1, 7, Follower.PIECE - 3, 100_000, 3] * 40:
        size = min(size, raw.size - at)
        buf[at : at + size] = raw[at : at + size]
        at += size
        follower.landed(at)
        if at == raw.size:
            break
    sha, scanned = follower.finish()
    assert at == raw.size
    assert sha == payload_sha256(dt, raw)
    assert scanned == scan_values(values) and scanned[0] == 3 and scanned[1] == Follower.PIECE // dt.itemsize + 1
    assert scanned[2] == float(np.max(np.abs(values[np.isfinite(values)].astype(np.float64))))


def test_an_abandoned_follower_stops() -> None:
    from paraminit_server.plans.payloads import Follower

    buf = np.zeros(1 << 20, dtype=np.uint8)
    follower = Follower(buf, dtypes.by_name("float32"))
    follower.landed(1 << 19)
    follower.stop()
    wait_until(lambda: not any(t.name == "paraminit-upload-digest" and t.is_alive() for t in threading.enumerate()))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_follower_waits_for_an_element_cut_by_a_message(dtype: str) -> None:
    """A message may end inside an element (any client may send any sizes): the follower works on whole elements and
    takes the cut one with the next message, so the scan never reads an element from a misaligned start."""
    from paraminit_server.plans.payloads import Follower, payload_sha256, scan_values

    dt = dtypes.by_name(dtype)
    values = np.random.default_rng(4).standard_normal(2 * Follower.PIECE // dt.itemsize).astype(dt.numpy)
    values[-1] = np.nan
    raw = values.view(np.uint8)
    buf = np.full(raw.size, 0xFF, dtype=np.uint8)
    follower = Follower(buf, dt)
    cut = Follower.PIECE + 1  # inside an element
    buf[:cut] = raw[:cut]
    follower.landed(cut)
    assert wait_until(lambda: follower._done > 0)  # it worked on what had landed before the rest arrived
    assert follower._done % dt.itemsize == 0
    buf[cut:] = raw[cut:]
    follower.landed(raw.size)
    sha, scanned = follower.finish()
    assert sha == payload_sha256(dt, raw) and scanned == scan_values(values) and scanned[:2] == (1, values.size - 1)


def test_one_identity_leaves_the_others_a_quarter_of_the_payload_bytes() -> None:
    """One identity's payloads (stored and in flight) hold at most three quarters of --max-payload-bytes, so its big
    uploads never refuse every other identity's for the payload TTL."""
    from paraminit_server.errors import ResourceExhausted
    from paraminit_server.plans.payloads import ValueSources

    store = ValueSources(1 << 20, 60.0)
    assert store.share() == 768 << 10
    alice = store.reserve(700 << 10, "token:alice")
    with pytest.raises(ResourceExhausted, match="this identity holds 716800 of its 786432 payload bytes"):
        store.reserve(100 << 10, "token:alice")
    bob = store.reserve(300 << 10, "token:bob")  # the quarter alice cannot take
    with pytest.raises(ResourceExhausted, match="payload bytes are free"):
        store.reserve(100 << 10, "token:carol")  # the limit itself still holds
    alice.release()
    store.reserve(100 << 10, "token:alice").release()
    bob.release()
