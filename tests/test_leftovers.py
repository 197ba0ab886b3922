"""Nothing left behind: lock files, leases of exited processes, partial output files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from conftest import running_server, serve_subprocess, target_of, wait_until
from paraminit_client import Client, param, plan_of
from paraminit_client.plans import plan_to_json
from paraminit_server.backends.cpu import CpuBackend


def test_lock_file_goes_with_the_server() -> None:
    proc, target = serve_subprocess()
    try:
        with Client(target) as c:
            lease = c.export(plan_of([param("w", [1024], {"ones": {}})]))
            tag = lease.info.shm.segment_name.split("-")[1]
            lease.release()
        lock = Path(f"/dev/shm/.paraminit-locks-{os.geteuid()}/{tag}.lock")
        assert lock.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not lock.exists()


EXITS_HOLDING = textwrap.dedent("""
    import sys
    from paraminit_client import Client, param, plan_of
    c = Client(sys.argv[1])
    lease = c.export(plan_of([param("w", [4096], {"ones": {}})]))
    print(lease.info.shm.segment_name, flush=True)
    # exits holding the lease and the client: nothing released by hand
""")


def test_remote_client_releases_its_leases_at_exit() -> None:
    proc, target = serve_subprocess()
    try:
        names = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", EXITS_HOLDING, target], capture_output=True, text=True,
                                 timeout=120, check=True)
            names.append(Path("/dev/shm") / out.stdout.strip())
        assert wait_until(lambda: not any(n.exists() for n in names), 10), names  # the TTL is 300 s
        with Client(target) as c:
            assert c.leases() == []
    finally:
        proc.terminate()
        proc.wait(60)


class GatedBackend(CpuBackend):
    """Blocks the fill of parameter 'slow' until the test opens the gate: the stream is mid-file, for sure."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def fill(self, p: Any, out: Any, l_begin: int = 0) -> None:
        if p.name == "slow":
            self.gate.wait(120)
        super().fill(p, out, l_begin)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_interrupted_materialize_leaves_no_partial_file(tmp_path: Path, sig: signal.Signals) -> None:
    backend = GatedBackend()
    plan = plan_of([param("a", [1 << 18], {"ones": {}}), param("slow", [1 << 18], {"ones": {}})])
    (tmp_path / "plan.json").write_text(plan_to_json(plan))
    out = tmp_path / "out" / "big.safetensors"
    out.parent.mkdir()
    with running_server(backend) as r:
        try:
            proc = subprocess.Popen([str(Path(sys.executable).parent / "paraminit"), "materialize",
                                     str(tmp_path / "plan.json"), "-o", str(out), "--target", target_of(r)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert wait_until(lambda: any(out.parent.iterdir()) or proc.poll() is not None, 120)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            backend.gate.set()
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig)
    assert f"interrupted by {sig.name}" in err and "was not written" in err, err
    assert list(out.parent.iterdir()) == []
