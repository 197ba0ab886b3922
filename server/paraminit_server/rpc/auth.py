"""Authentication: bearer tokens checked by an interceptor, and the identity that owns leases.

Tokens come from a file (one `identity:token` or bare `token` per line) or the
environment, and are compared in constant time. With tokens configured, every
RPC but health needs `authorization: Bearer <token>`. Under mutual TLS the
client certificate is the identity when no token is given. Without either, a
local caller is its process user (from the kernel's socket table), so users of
one host never see or touch each other's leases and payloads. No identity sees
another's leases, the server's own user included.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

from paraminit import peers
from paraminit_server.plane.caller import REMOTE, UNIX_SHARED
from paraminit_server.rpc.peer_user import AMBIGUOUS, peer_uid

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
UNKNOWN_LOCAL = "uid:unknown"  # a local peer whose user the socket table does not show


class TokenAuth:
    def __init__(self, tokens: dict[str, str]) -> None:
        # keyed by SHA-256 so lookups never branch on secret bytes; compare_digest below is the real check
        self._by_digest = {hashlib.sha256(t.encode()).digest(): (t, ident) for t, ident in tokens.items()}

    @classmethod
    def load(cls, path: str = "", env_value: str = "") -> TokenAuth | None:
        lines: list[str] = []
        if path:
            lines += Path(path).read_text().splitlines()
        if env_value:
            lines += env_value.split(",")
        tokens: dict[str, str] = {}
        named: set[str] = set()
        unnamed: set[str] = set()
        for n, line in enumerate(x.strip() for x in lines):
            if not line or line.startswith("#"):
                continue
            ident, sep, token = line.partition(":")
            if not sep:
                ident, token = f"token-{n}", line
                unnamed.add(ident)
            elif not ident.strip():
                raise ValueError(f"auth token on line {n + 1} has an empty identity")
            else:
                named.add(ident)
            if len(token) < 16:
                raise ValueError(f"auth token for {ident!r} is shorter than 16 characters")
            if tokens.get(token, ident) != ident:  # one token, two identities: it would act as either
                raise ValueError(f"one auth token is given for two identities, {tokens[token]!r} and {ident!r}")
            tokens[token] = ident
        if named & unnamed:  # a bare token's name given to a named one: two secrets for one identity by accident
            raise ValueError(
                f"identity {sorted(named & unnamed)[0]!r} is both named and the name of a bare token; "
                "name every token or none with that name"
            )
        return cls(tokens) if tokens else None

    def identify(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        for key, value in metadata or ():
            # RFC 7235: the scheme is case-insensitive ("bearer T" is "Bearer T"); one space or more before the token
            scheme, _, rest = value.partition(" ") if key == "authorization" and isinstance(value, str) else ("", "", "")
            if scheme.lower() == "bearer" and rest.strip():
                token = rest.strip()
                hit = self._by_digest.get(hashlib.sha256(token.encode()).digest())
                if hit is not None and hmac.compare_digest(hit[0].encode(), token.encode()):
                    return hit[1]
        return None


def certificate_identity(auth: dict[str, list[bytes]]) -> str | None:
    """The client certificate's identity: its subject, else its subject alternative names, else the
    certificate's SHA-256 fingerprint; two different certificates never share an empty identity."""

    def text(key: str) -> list[str]:
        return [v.decode(errors="replace") for v in auth.get(key) or () if v]

    subject = text("x509_subject") or text("x509_common_name")
    if subject:
        return f"cert:{subject[0]}"
    sans = text("x509_subject_alternative_name")
    if sans:
        return "cert-san:" + ",".join(sorted(sans))
    pem = b"".join(auth.get("x509_pem_cert") or ())
    if pem:
        return "cert-sha256:" + hashlib.sha256(pem).hexdigest()
    return None


@dataclass(frozen=True)
class Endpoint:
    """Where this server listens, which a caller's connection must end at: its TCP ports, its Unix socket."""

    ports: tuple[int, ...] = ()
    unix_path: str = ""
    hosts: tuple[str, ...] = ()  # the addresses it listens at, where they are a closed set (peer_user.listening_hosts)


def server_user() -> str:
    """The identity of the server's own user when it calls without a token: its uid, like any other user."""
    return f"uid:{os.geteuid()}"


def peer_identity(peer: str, endpoint: Endpoint = Endpoint()) -> tuple[str, int | None]:
    """(identity, uid) of an unauthenticated caller, from what the kernel proves; uid None when unknown.

    A loopback TCP peer is the user whose socket has the peer's address and port and ends at a port of this
    server (`uid:N`; the server's own user too); an ambiguous answer (sockets of two users) is `remote`, as
    is any other host. gRPC does not say which Unix-socket connection a call came on, so SO_PEERCRED cannot be
    asked: a Unix-socket caller is the server's user only while the socket's mode lets no one else connect
    (0600, owned by that user, as the server creates it); once an operator widens it, its callers are
    UNIX_SHARED, an identity of its own that owns only what such callers made (tokens tell them apart)."""
    if peer.startswith("unix:"):
        try:
            st = os.stat(endpoint.unix_path) if endpoint.unix_path else None
        except OSError:
            st = None
        if st is not None and stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return server_user(), os.geteuid()
        return UNIX_SHARED, None
    if not peers.is_local_peer(peer):
        return REMOTE, None
    uid = peer_uid(peer, endpoint.ports, endpoint.hosts)
    if uid is None:
        return UNKNOWN_LOCAL, None
    if uid == AMBIGUOUS:
        return REMOTE, None
    return f"uid:{uid}", uid


def local_identity(peer: str, endpoint: Endpoint = Endpoint()) -> str:
    """Who an unauthenticated caller is (see peer_identity): `uid:N` for a local user, `remote` otherwise."""
    return peer_identity(peer, endpoint)[0]


def identity(context: grpc.ServicerContext, tokens: TokenAuth | None, endpoint: Endpoint = Endpoint()) -> tuple[str, int | None]:
    """Who is calling: token identity, else client certificate, else the peer's local user; and the caller's
    uid where the kernel shows it (whatever the identity), for what only that user can open."""
    ident = tokens.identify(context.invocation_metadata()) if tokens is not None else None
    peer_ident, uid = peer_identity(context.peer(), endpoint)
    if ident is not None:
        return f"token:{ident}", uid
    # (typeshed's grpc stubs say Mapping[str, bytes]; gRPC gives each property as a list of values)
    auth = cast("dict[str, list[bytes]]", context.auth_context() or {})
    return certificate_identity(auth) or peer_ident, uid


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call but health without a valid bearer token, on its metadata alone.

    The decision is made on the loop when the call's headers arrive: a denied call gets a request-streaming
    handler that never reads the request, so large bodies are not buffered for nothing."""

    def __init__(self, tokens: TokenAuth) -> None:
        self.tokens = tokens

        async def deny(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = details.method
        if method.startswith(HEALTH_PREFIX) or self.tokens.identify(details.invocation_metadata) is not None:
            return await continuation(details)
        return self._deny


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """TLS with cert/key; with a CA, clients must present a certificate it signed (mutual TLS)."""
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    root = Path(ca).read_bytes() if ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=bool(ca))
