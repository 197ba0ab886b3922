"""Authentication and isolation: TLS, mutual TLS and certificate identities, bearer tokens, leases and payloads
that belong to their identity, unauthenticated calls that hold no worker and no memory, and local users."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.rpc.auth import certificate_identity
from paraminit_server.rpc.server import Running
from support import running_server, serve_subprocess, server_fixture

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

PLAN = plan_of([param("w", [64, 64], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"


def _cert(
    name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, path: Path, ca: bool = False
) -> tuple[x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    cert = b.sign(issuer_key, hashes.SHA256())
    (path / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return subject, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("ca", None, d, ca=True)
    for name in ("server", "alice", "bob"):
        _cert(name, ca, d)
    return d


@pytest.fixture()
def tls_server(pki: Path) -> Iterator[Running]:
    with running_server(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key")) as r:
        yield r


def test_tls(tls_server: Running, pki: Path) -> None:
    target = f"localhost:{tls_server.port}"
    with Client(target, tls_ca=str(pki / "ca.crt")) as c:
        assert c.materialize(PLAN)["w"].shape == (64, 64)
    # the client retries UNAVAILABLE (gRPC's retry policy): a deadline long enough for every attempt
    with Client(target, timeout=60) as plain, pytest.raises(ParaminitError) as info:
        plain.validate(PLAN)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_and_certificate_identities(pki: Path) -> None:
    with running_server(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"), tls_ca=str(pki / "ca.crt")) as r:
        target = f"localhost:{r.port}"
        with Client(target, tls_ca=str(pki / "ca.crt"), timeout=3) as anon, pytest.raises(ParaminitError):
            anon.validate(PLAN)
        with (
            Client(target, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "alice.crt"), tls_key=str(pki / "alice.key")) as a,
            Client(target, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "bob.crt"), tls_key=str(pki / "bob.key")) as b,
        ):
            lease = a.export(PLAN)
            assert [s.owner for s in a.leases()] == ["cert:CN=alice"]
            assert b.leases() == []
            with pytest.raises(ParaminitError) as info:
                b.release(lease.lease_id)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            assert lease.release()


token_server = server_fixture("function", auth_tokens=f"alice:{ALICE},bob:{BOB}")


def test_tokens_required_except_health(token_server: Running) -> None:
    target = f"127.0.0.1:{token_server.port}"
    with Client(target, token="") as anon:
        assert anon.health() == "SERVING"
        for call in (lambda: anon.validate(PLAN), lambda: anon.materialize(PLAN), anon.info, anon.leases):
            with pytest.raises(ParaminitError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(target, token="wrong-token-0123456789") as wrong, pytest.raises(ParaminitError) as info:
        wrong.validate(PLAN)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(target, token=ALICE) as alice:
        assert alice.validate(PLAN).ok


def test_the_bearer_scheme_is_case_insensitive(token_server: Running) -> None:
    """RFC 7235: "bearer", "BEARER" and "Bearer" name one scheme; another scheme, or no token, is refused."""
    from paraminit.v1 import init_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{token_server.port}") as channel:
        stub = pb_grpc.InitServiceStub(channel)
        for value, ok in (
            (f"Bearer {ALICE}", True),
            (f"bearer {ALICE}", True),
            (f"BEARER  {ALICE}", True),
            (f"Basic {ALICE}", False),
            ("Bearer ", False),
            (ALICE, False),
        ):
            try:
                stub.GetInfo(pb.GetInfoRequest(), metadata=[("authorization", value)], timeout=10)
                got = True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, value
                got = False
            assert got == ok, value


def test_leases_belong_to_their_identity(token_server: Running) -> None:
    target = f"127.0.0.1:{token_server.port}"
    with Client(target, token=ALICE) as alice, Client(target, token=BOB) as bob:
        lease = alice.export(PLAN)
        assert [s.owner for s in alice.leases()] == ["token:alice"]
        assert bob.leases() == []
        for rpc, req in (
            (bob.stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id)),
            (bob.stub.Renew, pb.RenewRequest(lease_id=lease.lease_id)),
            (bob.stub.Apply, pb.ApplyRequest(lease_id=lease.lease_id, plan=PLAN)),
        ):
            with pytest.raises(ParaminitError) as info:
                bob.transport.call(rpc, req)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
        lease.renew(60)
        assert lease.release() is True


def test_short_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="shorter than 16"), running_server(auth_tokens="alice:short"):
        pass


# -- hardening: pre-auth stalls, local users, certificates without a subject ---------------------


def _stalled(target: str, n: int) -> tuple[grpc.Channel, list[Any], threading.Event]:
    """n Validate calls on ONE new connection that send headers but never their request message."""
    ch = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    call = ch.stream_unary("/paraminit.v1.InitService/Validate", request_serializer=bytes, response_deserializer=bytes)
    release = threading.Event()

    def never() -> Iterator[bytes]:
        release.wait(120)
        yield from ()

    return ch, [call.future(never()) for _ in range(n)], release


def test_stalled_unauthenticated_calls_hold_no_worker(token_server: Running) -> None:
    """64 calls without a token that never send their body: refused on their headers, health and a valid
    client keep working (grpc would otherwise wait for each body on a worker thread)."""
    target = f"127.0.0.1:{token_server.port}"
    ch, calls, release = _stalled(target, 64)
    try:
        for f in calls:
            assert f.exception(timeout=30) is not None and f.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(target, token=ALICE, timeout=10) as alice:
            assert alice.health() == "SERVING"
            assert alice.validate(PLAN).ok
    finally:
        release.set()
        ch.close()


def test_local_users_are_isolated_without_tokens(tmp_path: Path) -> None:
    """Another local user (nobody) sees none of this user's leases or payloads and cannot release, renew
    or apply over them, and is refused SHM exports it could not open; it is `uid:65534`, this user `uid:<its uid>`."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    with running_server() as r, Client(f"127.0.0.1:{r.port}") as mine:
        lease = mine.export(PLAN)
        pid = mine.upload_payload(np.ones(4, np.float32))
        script = tmp_path / "other.py"
        script.write_text(
            textwrap.dedent(f"""
            import json, grpc
            from paraminit.v1 import init_service_pb2 as pb
            from paraminit_client import Client, ParaminitError, param, plan_of
            out = {{}}
            with Client("127.0.0.1:{r.port}") as c:
                out["leases"] = [s.lease.lease_id for s in c.leases()]
                for name, rpc, req in (("release", c.stub.Release, pb.ReleaseRequest(lease_id="{lease.lease_id}")),
                                       ("renew", c.stub.Renew, pb.RenewRequest(lease_id="{lease.lease_id}")),
                                       ("apply", c.stub.Apply, pb.ApplyRequest(lease_id="{lease.lease_id}",
                                        plan=plan_of([param("w", [64, 64], {{"zeros": {{}}}})])))):
                    try:
                        c.transport.call(rpc, req)
                        out[name] = "OK"
                    except ParaminitError as err:
                        out[name] = err.code.name
                report = c.validate(plan_of([param("p", [4], {{"flatRef": {{"payloadId": "{pid}"}}}})]))
                out["payload"] = report.lines()
                theirs = c.upload_payload(__import__("numpy").zeros(4, "float32"))
                out["theirs"] = theirs
                try:
                    c.export(plan_of([param("w", [1 << 20], {{"ones": {{}}}})]))
                    out["export"] = "OK"
                except ParaminitError as err:
                    out["export"] = [err.code.name, err.message]
            print(json.dumps(out))
        """)
        )
        env = {k: v for k, v in os.environ.items() if k != "PARAMINIT_TOKEN"}
        child = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", script.read_text()],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd="/",
        )
        assert child.returncode == 0, child.stderr[-2000:]
        out = json.loads(child.stdout.strip().splitlines()[-1])
        assert out["leases"] == []
        assert out["release"] == out["renew"] == out["apply"] == "NOT_FOUND"
        assert any("no payload" in line for line in out["payload"])
        assert [s.owner for s in mine.leases()] == [f"uid:{os.geteuid()}"]
        assert out["export"][0] == "FAILED_PRECONDITION" and "use STREAM" in out["export"][1], out["export"]
        assert np.all(lease.arrays["w"] != 0)  # Apply did not zero it
        report = mine.validate(plan_of([param("p", [4], {"flatRef": {"payloadId": out["theirs"]}})]))
        assert any("no payload" in line for line in report.lines())
        assert r.plane.sources.payload(out["theirs"], "uid:65534") is not None
        assert lease.release() is True


def test_certificates_without_subject_do_not_share_an_identity(tmp_path: Path, pki: Path) -> None:
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca_name = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes()).subject
    for who in ("eve", "mallory"):  # empty subject, different SANs
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"{who}.example")]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )  # type: ignore[arg-type]
        (tmp_path / f"{who}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{who}.key").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    with running_server(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"), tls_ca=str(pki / "ca.crt")) as r:
        target = f"localhost:{r.port}"
        kw = {"tls_ca": str(pki / "ca.crt"), "timeout": 10}
        with (
            Client(target, tls_cert=str(tmp_path / "eve.crt"), tls_key=str(tmp_path / "eve.key"), **kw) as eve,
            Client(target, tls_cert=str(tmp_path / "mallory.crt"), tls_key=str(tmp_path / "mallory.key"), **kw) as mal,
        ):
            lease = eve.export(PLAN)
            (owner,) = [s.owner for s in eve.leases()]
            assert owner != "cert:" and "eve.example" in owner
            assert mal.leases() == []
            with pytest.raises(ParaminitError) as info:
                mal.release(lease.lease_id)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            assert lease.release()
    assert certificate_identity({"x509_pem_cert": [b"A"]}) != certificate_identity({"x509_pem_cert": [b"B"]})


def test_unauthenticated_bodies_are_not_buffered() -> None:
    """Six 64 MiB requests without a token: refused on their headers, the server's memory does not grow by them."""
    from paraminit_server.backends.cpu import CpuBackend

    # Every kernel into the disk cache first: the server loads them all before SERVING, so none compiles (and
    # grows its peak memory) in the background while this measures.
    CpuBackend().warm_up()
    proc, target = serve_subprocess({"PARAMINIT_AUTH_TOKENS": f"alice:{ALICE}"})

    def rss() -> int:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

    try:
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
            call = ch.unary_unary("/paraminit.v1.InitService/Validate", request_serializer=bytes, response_deserializer=bytes)
            # the same refusal once with a small body first: what the first call's path costs (imports, buffers)
            # is not what the bound is about
            with pytest.raises(grpc.RpcError) as first:
                call(b"\0" * 1024, timeout=60)
            assert first.value.code() == grpc.StatusCode.UNAUTHENTICATED
            before = rss()
            body = b"\0" * (64 << 20)
            for _ in range(6):  # one at a time: a body the server buffered would add 64 MiB at once
                with pytest.raises(grpc.RpcError) as refused:
                    call(body, timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rss() - before < 64 << 20, (before, rss())
        with Client(target, token=ALICE) as alice:
            assert alice.validate(PLAN).ok
    finally:
        proc.terminate()
        proc.wait(30)
