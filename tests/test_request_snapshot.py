"""A request resolves the payloads and checkpoint headers its plan names once: validation, resolution, the digest
and the fill read that snapshot, so a payload that expires between them changes nothing or is reported cleanly."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from paraminit import dtypes
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server import errors
from paraminit_server.plans import payloads
from paraminit_server.plans import plan as planlib
from paraminit_server.plans.payloads import ValueSources
from paraminit_server.plans.snapshot import RequestSnapshot
from paraminit_server.rpc.server import Running
from support import digest_of, running_server, target_of


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snapshot_ckpt")


@pytest.fixture(scope="module")
def server(ckpt_dir: Path) -> Iterator[Running]:
    with running_server(safetensors_dirs=str(ckpt_dir)) as r:
        yield r


@pytest.fixture()
def client(server: Running) -> Iterator[Client]:
    with Client(target_of(server)) as c:
        yield c


def _expire_after_first_lookup(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every payload expires the moment the store first hands it out: any second lookup in the same request
    finds nothing. Returns the ids looked up, in order."""
    looked_up: list[str] = []
    original = ValueSources.payload

    def payload(self: ValueSources, payload_id: str, owner: str) -> payloads.Payload | None:
        looked_up.append(payload_id)
        found = original(self, payload_id, owner)
        if found is not None:
            found.expires_at = 0.0  # the next lookup's _expire() drops it
        return found

    monkeypatch.setattr(ValueSources, "payload", payload)
    return looked_up


def test_payload_expiring_mid_request_is_the_one_filled_and_digested(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.random.default_rng(3).standard_normal(6 * 7).astype(np.float32)
    pid = client.upload_payload(values)
    plan = plan_of([param("w", [6, 7], {"flatRef": {"payloadId": pid}}), param("b", [7], {"normal": {"std": 1}})])
    before = client.validate(plan)
    assert before.valid, before.lines()
    looked_up = _expire_after_first_lookup(monkeypatch)
    got = client.materialize(plan)["w"]
    assert got.tobytes() == values.tobytes()
    assert looked_up == [pid]  # once for validation, resolution, digest and fill together
    # the next request looks the payload up afresh: it is gone now, and validation says so
    with pytest.raises(ParaminitError) as info:
        client.materialize(plan)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any("no payload" in v.description for v in info.value.violations)


def test_digest_covers_the_payload_validation_saw(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.arange(12, dtype=np.float32) - 5.5
    pid = client.upload_payload(values)
    plan = plan_of([param("w", [12], {"flatRef": {"payloadId": pid}})])
    want = client.validate(plan).plan_digest
    _expire_after_first_lookup(monkeypatch)
    header, chunks = client.stream(plan)
    body = b"".join(bytes(c.data) for c in chunks)
    assert header.plan_digest == want
    assert body.endswith(values.tobytes())
    pid2 = client.upload_payload(values)
    plan2 = plan_of([param("w", [12], {"flatRef": {"payloadId": pid2}})])
    report = client.validate(plan2)  # the payload expires after validation's lookup, before the digest's
    assert report.valid
    assert report.plan_digest == digest_of(plan2, _Holding(values))  # the digest saw the payload's bytes
    assert report.plan_digest != digest_of(plan2, _Holding(None))


class _Holding:
    """ValueSources that hold one payload (or none) under every id, for digests computed here."""

    def __init__(self, values: np.ndarray[Any, Any] | None) -> None:
        self.values = values

    def payload(self, payload_id: str) -> Any:
        if self.values is None:
            return None
        sha256 = payloads.payload_sha256(dtypes.by_name("float32"), self.values.view(np.uint8))
        largest = float(np.abs(self.values).max())
        return SimpleNamespace(sha256=sha256, values=self.values, nonfinite=0, first_nonfinite=-1, max_abs=largest)


def test_payload_gone_before_the_request_is_invalid_argument(client: Client) -> None:
    with pytest.raises(ParaminitError) as info:
        client.materialize(plan_of([param("w", [3], {"flatRef": {"payloadId": "ab" * 16}})]))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in info.value.violations] == ["params[0].init.flatRef.payloadId"]


def test_checkpoint_rewritten_mid_request_is_refused_cleanly(
    server: Running, client: Client, ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header read while validating is the one the request uses: a file replaced before its values are read
    gives INVALID_ARGUMENT, not values from another file under the digest of the first."""
    path = ckpt_dir / "w.safetensors"
    first = np.linspace(-1, 1, 20, dtype=np.float32)
    save_file({"w": first}, str(path))
    plan = plan_of([param("w", [20], {"safetensors": {"path": str(path), "tensor": "w"}})])
    assert client.materialize(plan)["w"].tobytes() == first.tobytes()
    original = RequestSnapshot.tensor_info

    def tensor_info(self: RequestSnapshot, p: str, tensor: str) -> Any:
        info = original(self, p, tensor)
        save_file({"w": first[::-1].copy(), "x": first}, p)  # replaced after validation read the header
        return info

    monkeypatch.setattr(RequestSnapshot, "tensor_info", tensor_info)
    with pytest.raises(ParaminitError) as exc:
        client.materialize(plan)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "changed" in exc.value.message


def test_resolution_without_its_payload_is_not_found_not_an_assertion() -> None:
    """resolve() on a plan whose payload the request does not hold names the payload (NOT_FOUND)."""
    sources = RequestSnapshot(ValueSources(1 << 20, 60.0), "someone")
    p = param("w", [4], {"flatRef": {"payloadId": "cd" * 16}})
    with pytest.raises(errors.NotFound, match="no payload"):
        planlib.resolve_unchecked(0, p, sources)


def test_snapshot_keeps_one_answer_per_payload() -> None:
    store = ValueSources(1 << 20, 60.0)
    data = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.uint8)
    pid, payload = store.store("me", 1, 4, data.copy())
    snap = RequestSnapshot(store, "me")
    assert snap.payload(pid) is payload
    payload.expires_at = 0.0
    assert store.payload(pid, "me") is None  # gone from the store
    assert snap.payload(pid) is payload  # still the request's
    assert hashlib.sha256(b"float32\0" + data.tobytes()).hexdigest() == payload.sha256
    other = RequestSnapshot(store, "me")
    assert other.payload(pid) is None  # a new request sees the store as it is now
