"""Checkpoint reads stay beneath their allowed directory while an attacker swaps directories for links."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from paraminit_server import errors
from paraminit_server.plans import files
from paraminit_server.plans.payloads import ValueSources
from paraminit_server.plans.snapshot import RequestSnapshot

RENAME_EXCHANGE = 2
AT_FDCWD = -100
SECRET = b"hunter2!" + b"s" * 56
SWAPPER = """
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(p) for p in sys.argv[1:3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("swapping", flush=True)
for _ in range(50_000_000):  # bounded; stops when the test says so
    if stop.is_set():
        break
    libc.renameat2(-100, a, -100, b, 2)
"""


def _exchange(a: Path, b: Path) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)) == 0


@pytest.mark.parametrize("way", ["openat2", "walk"])
def test_swapped_directories_never_lead_outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """2,000 reads of tree/sub/*.safetensors while a thread swaps sub for a link to a directory outside the tree:
    each answer is the inside file's values or an error, and no error quotes the outside files' bytes or sizes."""
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "sub").mkdir(parents=True)
    outside.mkdir()
    inside_w = np.arange(16, dtype=np.float32)
    save_file({"w": inside_w}, str(tree / "sub" / "w.safetensors"))
    save_file({"w": inside_w}, str(tree / "sub" / "secret.safetensors"))
    save_file({"w": -np.ones(16, np.float32)}, str(outside / "w.safetensors"))  # readable outside: different values
    (outside / "secret.safetensors").write_bytes(SECRET)  # not safetensors: its first 8 bytes must never show
    (tree / "link").symlink_to(outside, target_is_directory=True)
    if not _exchange(tree / "sub", tree / "link") or not _exchange(tree / "sub", tree / "link"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    leaked = str(int.from_bytes(SECRET[:8], "little"))
    monkeypatch.setattr(files, "_openat2_missing", way == "walk")
    sources = ValueSources(1 << 20, 60.0, [str(tree)])
    # the swapper is a process of its own, so that it swaps while this one holds the GIL between its checks
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(tree / "sub"), str(tree / "link")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert swapper.stdout is not None and swapper.stdout.readline().strip() == "swapping"
    read, refused = 0, 0
    try:
        for i in range(2000):
            bound = RequestSnapshot(sources, "someone")
            name = "w" if i % 2 else "secret"
            try:
                values, _ = bound.tensor_values(str(tree / "sub" / f"{name}.safetensors"), "w")
            except errors.InvalidRequest as exc:
                refused += 1
                said = str(exc).replace(str(tmp_path), "<tmp>")  # the path's own digits (pytest-64/...) are not file bytes
                assert leaked not in said and str(len(SECRET)) not in said, str(exc)
                continue
            read += 1
            assert values.tobytes() == inside_w.astype(np.float64).tobytes(), (i, name)
    finally:
        swapper.communicate("stop\n", timeout=60)
    assert read > 0 and refused > 0  # the race went both ways


def test_links_beneath_an_allowed_directory_are_refused(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "real").mkdir(parents=True)
    save_file({"w": np.ones(4, np.float32)}, str(tree / "real" / "w.safetensors"))
    (tree / "alias").symlink_to(tree / "real", target_is_directory=True)
    (tree / "file_link.safetensors").symlink_to(tree / "real" / "w.safetensors")
    bound = RequestSnapshot(ValueSources(1 << 20, 60.0, [str(tree)]), "someone")
    assert bound.tensor_info(str(tree / "real" / "w.safetensors"), "w").shape == (4,)
    assert bound.tensor_info(str(tree / "real" / ".." / "real" / "w.safetensors"), "w").shape == (4,)
    for path in (tree / "alias" / "w.safetensors", tree / "file_link.safetensors"):
        with pytest.raises(errors.InvalidRequest, match="symbolic link"):
            bound.tensor_info(str(path), "w")
    with pytest.raises(errors.InvalidRequest, match="not under an allowed directory"):
        bound.tensor_info(str(tree / ".." / "elsewhere.safetensors"), "w")
    # a hard link made inside the allowed directory to a file outside it (any file with a second link) is refused
    outside = tmp_path / "outside.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(outside))
    os.link(outside, tree / "hard.safetensors")
    with pytest.raises(errors.InvalidRequest, match="has 2 hard links"):
        bound.tensor_info(str(tree / "hard.safetensors"), "w")


def test_the_component_walk_refuses_links_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels without openat2 take the walk of O_NOFOLLOW opens: the same answers."""
    monkeypatch.setattr(files, "_openat2_missing", True)
    test_links_beneath_an_allowed_directory_are_refused(tmp_path)


def test_non_safetensors_errors_quote_no_file_bytes(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(SECRET)
    bound = RequestSnapshot(ValueSources(1 << 20, 60.0, [str(tmp_path)]), "someone")
    with pytest.raises(errors.InvalidRequest, match="not a safetensors file") as info:
        bound.tensor_info(str(tmp_path / "x.safetensors"), "w")
    said = str(info.value).replace(str(tmp_path), "<tmp>")  # the path's own digits (pytest-64/...) are not file bytes
    assert "<tmp>/x.safetensors" in said
    assert str(int.from_bytes(SECRET[:8], "little")) not in said
    assert str(len(SECRET)) not in said
