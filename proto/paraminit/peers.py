"""Which peers share this host: zero-copy deliveries (SHM, CUDA IPC) are only for them."""

from __future__ import annotations


def is_local_peer(peer: str) -> bool:
    """True for loopback TCP and Unix-socket peers, as gRPC's context.peer() spells them."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


def is_local_target(target: str) -> bool:
    """True for a client target on this host: a Unix socket, localhost, or a loopback address."""
    if target.startswith("unix:"):
        return True
    host = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host in ("localhost", "::1") or host.startswith("127.")
