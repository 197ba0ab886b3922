"""Tried as an attacker: token identities that could cross, payloads across identities, a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.rpc.auth import TokenAuth
from support import running_server, target_of

A, B, C = "a" * 20, "b" * 20, "c" * 20


@pytest.mark.parametrize(
    "config,why",
    [
        (f"alice:{A},{B},token-1:{C}", "both named and the name of a bare token"),  # B's auto-name is token-1
        (f"alice:{A},bob:{A}", "two identities"),
        (f":{A}", "empty identity"),
    ],
)
def test_token_files_that_would_let_one_secret_act_as_another_identity_are_refused(config: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TokenAuth.load(env_value=config)


def test_tokens_of_one_identity_and_bare_tokens_stay_apart() -> None:
    auth = TokenAuth.load(env_value=f"alice:{A},alice:{B},{C}")
    assert auth is not None
    who = {t: auth.identify([("authorization", f"Bearer {t}")]) for t in (A, B, C)}
    assert who[A] == who[B] == "alice" and who[C] not in (None, "alice")


def test_payload_ids_of_another_identity_look_like_no_payload() -> None:
    """bob cannot use alice's payload, and cannot tell it from an id that does not exist (no oracle)."""
    with (
        running_server(auth_tokens=f"alice:{A},bob:{B}") as r,
        Client(target_of(r), token=A) as alice,
        Client(target_of(r), token=B) as bob,
    ):
        pid = alice.upload_payload(np.arange(4, dtype=np.float32))
        missing = "f" * len(pid)
        answers = []
        for ref in (pid, missing):
            with pytest.raises(ParaminitError) as info:
                bob.materialize(plan_of([param("p", [4], {"flatRef": {"payloadId": ref}})]))
            answers.append((info.value.code, info.value.message.replace(ref, "ID")))
        assert answers[0] == answers[1] and "no payload" in answers[0][1]
        assert alice.materialize(plan_of([param("p", [4], {"flatRef": {"payloadId": pid}})]))["p"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_full_disk_names_the_file_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    out = tmp_path / "w.safetensors"
    with running_server() as r, Client(target_of(r)) as c, pytest.raises(OSError) as info:
        c.materialize_to_file(plan_of([param("w", [1024], {"ones": {}})]), out)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out)
    assert "needs 4" in str(info.value)  # 4096 bytes of data and the header
    assert list(tmp_path.iterdir()) == []
