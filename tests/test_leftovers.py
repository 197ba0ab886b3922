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
