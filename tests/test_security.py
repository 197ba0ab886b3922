"""TLS, mutual TLS and bearer tokens, and lease isolation between identities."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import running_server, server_fixture
from paraminit.v1 import init_service_pb2 as pb
from paraminit_client import Client, ParaminitError, param, plan_of
from paraminit_server.server import Running

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

PLAN = plan_of([param("w", [64, 64], {"uniform": {"lo": -1, "hi": 1, "seed": 1}})])
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"


def _cert(name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, path: Path,
          ca: bool = False) -> tuple[x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = b.sign(issuer_key, hashes.SHA256())
    (path / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
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
    with Client(target, timeout=3) as plain, pytest.raises(ParaminitError) as info:
        plain.validate(PLAN)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_and_certificate_identities(pki: Path) -> None:
    with running_server(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"), tls_ca=str(pki / "ca.crt")) as r:
        target = f"localhost:{r.port}"
        with Client(target, tls_ca=str(pki / "ca.crt"), timeout=3) as anon, pytest.raises(ParaminitError):
            anon.validate(PLAN)
        with Client(target, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "alice.crt"), tls_key=str(pki / "alice.key")) as a, \
             Client(target, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "bob.crt"), tls_key=str(pki / "bob.key")) as b:
            lease = a.export(PLAN)
            assert [s.owner for s in a.leases()] == ["cert:CN=alice"]
            assert b.leases() == []
            with pytest.raises(ParaminitError) as info:
                b._call(b.stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id))
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


def test_leases_belong_to_their_identity(token_server: Running) -> None:
    target = f"127.0.0.1:{token_server.port}"
    with Client(target, token=ALICE) as alice, Client(target, token=BOB) as bob:
        lease = alice.export(PLAN)
        assert [s.owner for s in alice.leases()] == ["token:alice"]
        assert bob.leases() == []
        for rpc, req in ((bob.stub.Release, pb.ReleaseRequest(lease_id=lease.lease_id)),
                         (bob.stub.Renew, pb.RenewRequest(lease_id=lease.lease_id)),
                         (bob.stub.Apply, pb.ApplyRequest(lease_id=lease.lease_id, plan=PLAN))):
            with pytest.raises(ParaminitError) as info:
                bob._call(rpc, req)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
        lease.renew(60)
        assert lease.release() is True


def test_short_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="shorter than 16"), running_server(auth_tokens="alice:short"):
        pass
