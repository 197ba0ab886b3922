"""Authentication: bearer tokens checked by an interceptor, and the identity that owns leases.

Tokens come from a file (one `identity:token` or bare `token` per line) or the
environment, and are compared in constant time. With tokens configured, every
RPC but health needs `authorization: Bearer <token>`. Under mutual TLS the
client certificate's subject is the identity when no token is given.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
ANONYMOUS = "anonymous"


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
        for n, line in enumerate(x.strip() for x in lines):
            if not line or line.startswith("#"):
                continue
            ident, sep, token = line.partition(":")
            if not sep:
                ident, token = f"token-{n}", line
            if len(token) < 16:
                raise ValueError(f"auth token for {ident!r} is shorter than 16 characters")
            tokens[token] = ident
        return cls(tokens) if tokens else None

    def identify(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                token = value[len("Bearer "):].strip()
                hit = self._by_digest.get(hashlib.sha256(token.encode()).digest())
                if hit is not None and hmac.compare_digest(hit[0].encode(), token.encode()):
                    return hit[1]
        return None


def identity(context: grpc.ServicerContext, tokens: TokenAuth | None) -> str:
    """Who is calling: token identity, else client-certificate subject, else anonymous."""
    if tokens is not None:
        ident = tokens.identify(context.invocation_metadata())
        if ident is not None:
            return f"token:{ident}"
    auth = context.auth_context() or {}
    for key in ("x509_subject", "x509_common_name"):
        values = auth.get(key)
        if values:
            return f"cert:{values[0].decode(errors='replace')}"
    return ANONYMOUS


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Rejects every call but health (and reflection) without a valid bearer token."""

    def __init__(self, tokens: TokenAuth) -> None:
        self.tokens = tokens

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.startswith(HEALTH_PREFIX) or self.tokens.identify(details.invocation_metadata) is not None:
            return continuation(details)
        if method.startswith(REFLECTION_PREFIX):
            return self._deny_bidi
        handler = continuation(details)
        if handler is None:
            return None
        return self._deny_stream if handler.response_streaming else self._deny_unary


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """TLS with cert/key; with a CA, clients must present a certificate it signed (mutual TLS)."""
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    root = Path(ca).read_bytes() if ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=bool(ca))
