"""Nothing left behind: lock files, leases of exited processes, partial output files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import serve_subprocess, wait_until
from paraminit_client import Client, param, plan_of


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
