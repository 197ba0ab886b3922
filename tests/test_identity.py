"""Who a caller is, from what the kernel proves: Unix-socket modes, loopback sockets matched at both ends."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from paraminit_client import Client, param, plan_of
from paraminit_server.config import ServerConfig
from paraminit_server.rpc import auth, peer_user
from paraminit_server.rpc.auth import Endpoint, local_identity
from paraminit_server.rpc.peer_user import AMBIGUOUS, _proc_uid, peer_uid
from paraminit_server.rpc.server import Running, start

NOBODY = 65534


@contextlib.contextmanager
def unix_server(sock: Path) -> Iterator[Running]:
    running = start(ServerConfig(host=f"unix:{sock}", port=0, backend="cpu"), warm_up_async=False)
    try:
        yield running
    finally:
        running.stop(grace=0)


PLAN = plan_of([param("w", [64], {"ones": {}})])


def _as_nobody(code: str) -> dict[str, object]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    env = {k: v for k, v in os.environ.items() if k != "PARAMINIT_TOKEN"}
    child = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )
    assert child.returncode == 0, child.stderr[-2000:]
    out: dict[str, object] = json.loads(child.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture()
def open_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's own are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="paraminit-sock-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_another_user_on_a_widened_unix_socket_sees_nothing_of_the_servers(open_dir: Path) -> None:
    """An operator opens the socket to everyone (0666): another uid neither lists nor releases the server user's
    leases, and the server's user sees none of the socket's other callers' leases either."""
    sock = open_dir / "p.sock"
    with unix_server(sock) as r:
        assert oct(sock.stat().st_mode & 0o777) == "0o600"
        with Client(f"unix:{sock}") as mine:
            lease = mine.export(PLAN)
            assert [s.owner for s in mine.leases()] == [f"uid:{os.geteuid()}"]
            sock.chmod(0o666)
            out = _as_nobody(f"""
                import json
                from paraminit.v1 import init_service_pb2 as pb
                from paraminit_client import Client, ParaminitError, param, plan_of
                out = {{}}
                with Client("unix:{sock}") as c:
                    out["leases"] = [s.lease.lease_id for s in c.leases()]
                    try:
                        out["release"] = c.release("{lease.lease_id}")
                    except ParaminitError as err:
                        out["release"] = err.code.name
                    out["stream"] = c.materialize(plan_of([param("v", [4], {{"ones": {{}}}})]))["v"].tolist()
                print(json.dumps(out))
            """)
            assert out["leases"] == [] and out["release"] in ("NOT_FOUND", False), out
            assert out["stream"] == [1.0] * 4  # STREAM works for them
            assert lease.lease_id in {le.lease_id for le in r.plane.exports.leases.list(f"uid:{os.geteuid()}")}
            # while the socket is wide, this user's calls are no longer taken for the server's user either
            assert [s.owner for s in mine.leases()] == []
            sock.chmod(0o600)
            assert np.all(lease.arrays["w"] == 1.0)
            assert lease.release() is True


def test_unix_socket_is_never_wider_than_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound under umask 0177: even without the chmod after bind, and under umask 0, it is 0600."""
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    old = os.umask(0)
    try:
        sock = tmp_path / "q.sock"
        with unix_server(sock):
            assert oct(sock.stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)


def test_unix_identity_follows_the_socket_mode(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        sock.chmod(0o600)
        end = Endpoint((), str(sock))
        assert local_identity("unix:", end) == f"uid:{os.geteuid()}"
        sock.chmod(0o660)
        assert local_identity("unix:", end) == auth.UNIX_SHARED
    assert local_identity("unix:", Endpoint((), str(tmp_path / "gone.sock"))) == auth.UNIX_SHARED
    assert local_identity("unix:") == auth.UNIX_SHARED  # nothing known: never the server's user


def test_loopback_lookup_matches_both_ends_and_refuses_ambiguity() -> None:
    """Another user binds the same local address and port as this user's live connection (SO_REUSEADDR, as gRPC
    clients set it) and connects elsewhere, or to this server's port on another loopback address: the lookup
    never answers with their uid, and an ambiguous answer is an unauthenticated remote caller."""
    with socket.socket() as srv, socket.socket() as other:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", 0))
        srv.listen()
        other.bind(("127.0.0.1", 0))
        other.listen()
        server_port, other_port = srv.getsockname()[1], other.getsockname()[1]
        with socket.socket() as cl:
            cl.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            cl.connect(("127.0.0.1", server_port))
            port = cl.getsockname()[1]
            peer = f"ipv4:127.0.0.1:{port}"
            code = f"""
                import json, socket, sys, time
                done = []
                for dst in (("127.0.0.1", {other_port}), ("127.0.0.2", {server_port})):
                    s = socket.socket()
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", {port}))
                    s.connect(dst)
                    done.append(s)
                print(json.dumps({{"ready": True}}), flush=True)
                sys.stdin.readline()
            """
            if os.geteuid() != 0:
                pytest.skip("needs root to hold a socket as another user")
            child = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", textwrap.dedent(code)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None and "ready" in child.stdout.readline()
                accepted = [srv.accept()[0], srv.accept()[0], other.accept()[0]]
                # to this server's port, from the victim's address and port: two users (one via 127.0.0.2)
                assert peer_uid(peer, (server_port,)) == AMBIGUOUS
                assert local_identity(peer, Endpoint((server_port,))) == auth.REMOTE
                # at another port only the attacker's connection matches: never taken for this server's caller
                assert peer_uid(f"ipv4:127.0.0.1:{port}", (12,)) is None
                packed = socket.inet_aton("127.0.0.1")
                assert peer_user._proc_uid(packed, port, ("/proc/net/tcp",), (server_port,)) == AMBIGUOUS
                assert peer_user._proc_uid(packed, port, ("/proc/net/tcp",), (other_port,)) == NOBODY
                assert peer_uid(peer, (other_port,)) == NOBODY
                # exact look-ups at the addresses a server listens at: the connections ending there, and only they
                assert peer_uid(peer, (server_port,), ("127.0.0.1",)) == os.geteuid()
                assert peer_uid(peer, (server_port,), ("127.0.0.1", "127.0.0.2")) == AMBIGUOUS
                assert peer_uid(peer, (other_port,), ("127.0.0.1",)) == NOBODY
                assert peer_uid(peer, (12,), ("127.0.0.1",)) is None
                for a in accepted:
                    a.close()
            finally:
                child.communicate("done\n", timeout=30)


def test_shm_for_a_user_who_could_not_open_it_is_refused_before_any_work() -> None:
    """uid 65534 asks a root-owned server for an SHM export: FAILED_PRECONDITION saying what works, and no
    segment was made or filled for it; STREAM works for them."""
    from support import running_server, target_of

    with running_server() as r:
        made: list[int] = []
        original = r.plane.backend.export_buffer
        r.plane.backend.export_buffer = lambda n: (made.append(n), original(n))[1]  # type: ignore[method-assign]
        out = _as_nobody(f"""
            import json
            from paraminit_client import Client, ParaminitError, param, plan_of
            with Client("{target_of(r)}") as c:
                try:
                    c.export(plan_of([param("w", [1 << 20], {{"ones": {{}}}})]))
                    out = {{"export": "OK"}}
                except ParaminitError as err:
                    out = {{"export": err.code.name, "message": err.message}}
                out["stream"] = c.materialize(plan_of([param("v", [4], {{"ones": {{}}}})]))["v"].tolist()
            print(json.dumps(out))
        """)
        assert out["export"] == "FAILED_PRECONDITION", out
        message = str(out["message"])
        assert f"uid {NOBODY}" in message and "use STREAM delivery" in message
        assert made == [] and r.plane.admission.host.reserved == 0
        assert out["stream"] == [1.0] * 4


def test_a_server_at_known_addresses_looks_its_callers_up_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server listening at a closed set of addresses (one address, localhost) asks the kernel for the one socket
    with each connection's four addresses, never the whole connection table: the same uid as the table gives,
    for IPv4 and v4-mapped IPv6 clients; nothing for another address or port, or for a listening socket at the
    peer's address and port (what the kernel answers a look-up that misses with)."""
    assert peer_user.listening_hosts("127.0.0.1") == ("127.0.0.1",) and peer_user.listening_hosts("[::1]") == ("::1",)
    assert peer_user.listening_hosts("localhost") == ("127.0.0.1", "::1")
    assert all(peer_user.listening_hosts(h) == () for h in ("0.0.0.0", "::", "[::]", "paraminit.example"))

    def no_table(*args: object) -> None:
        raise AssertionError("the whole connection table was asked")

    with socket.socket() as srv, socket.socket() as listening:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        sp = srv.getsockname()[1]
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1")):
            with socket.socket(family) as cl:
                cl.connect((host, sp))
                peer = f"ipv4:127.0.0.1:{cl.getsockname()[1]}"
                assert peer_uid(peer, (sp,)) == os.geteuid()  # the table's answer
                with monkeypatch.context() as m:
                    m.setattr(peer_user, "_netlink_uid", no_table)
                    m.setattr(peer_user, "_proc_uid", no_table)
                    assert peer_uid(peer, (sp,), ("127.0.0.1",)) == os.geteuid()
                    assert local_identity(peer, Endpoint((sp,), "", ("127.0.0.1", "::1"))) == f"uid:{os.geteuid()}"
                    assert peer_uid(peer, (sp,), ("127.0.0.2",)) is None
                    assert peer_uid(peer, (listening.getsockname()[1],), ("127.0.0.1",)) is None
                    assert peer_uid(f"ipv4:127.0.0.1:{listening.getsockname()[1]}", (sp,), ("127.0.0.1",)) is None


def test_peer_uid_reads_the_socket_table(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as cl:
            port = cl.getsockname()[1]
            assert peer_uid(f"ipv4:127.0.0.1:{port}") == os.geteuid()
            assert local_identity(f"ipv4:127.0.0.1:{port}") == f"uid:{os.geteuid()}"
            # the /proc fallback (no netlink) gives the same answer
            packed = socket.inet_aton("127.0.0.1")
            assert _proc_uid(packed, port, ("/proc/net/tcp", "/proc/net/tcp6")) == os.geteuid()
            with monkeypatch.context() as m:
                m.setattr(peer_user, "_netlink_uid", lambda *a: (_ for _ in ()).throw(PermissionError("no netlink")))
                assert peer_uid(f"ipv4:127.0.0.1:{port}") == os.geteuid()
    for family, host in ((socket.AF_INET6, "::1"), (socket.AF_INET6, "::ffff:127.0.0.1")):
        with socket.socket(family) as srv:
            srv.bind(("::" if "." in host else host, 0))
            srv.listen()
            with socket.socket(family) as cl:
                cl.connect((host, srv.getsockname()[1]))
                assert peer_uid(f"ipv6:[{host}]:{cl.getsockname()[1]}") == os.geteuid()
    assert local_identity("ipv4:10.1.2.3:5000") == "remote"
    assert peer_uid("ipv4:127.0.0.1:1") is None
