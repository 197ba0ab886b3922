"""The user id behind a loopback TCP peer, asked of the kernel once per call.

The kernel's sock_diag netlink interface answers in two ways. Where the server listens at a closed set of
addresses (a loopback address, localhost), the client's end of the call's connection is one socket whose four
addresses are known but for which of those addresses it ended at: one exact look-up each, about 11 us. Where
the server listens on every address (0.0.0.0, ::), the connection may have ended at any address of the host,
so every established socket with the peer's local port is asked for (an in-kernel filter, but the kernel walks
its whole connection table: 2 ms per address family on a host with 262,144 buckets, more on larger hosts).
Reading /proc/net/tcp walks the same table as text (about 9 ms per call on a large host); it remains the
fallback where netlink sockets are not allowed.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import sys
from collections.abc import Collection

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_GE, INET_DIAG_BC_S_LE = 2, 3
TCP_ESTABLISHED = 1

_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI")  # family, protocol, extensions, states
_SOCKID = struct.Struct(">HH16s16sI8x")  # sport, dport, src, dst (network order), interface, cookie
_EXACT_ID = struct.Struct(">HH16s16sIII")  # the same, with the cookie "none" (both words all ones)
NO_COOKIE = 0xFFFFFFFF
_MSG_UID_AT = 4 + _SOCKID.size + 12  # family..retrans, id, expires/rqueue/wqueue, then uid
_PROC_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
AMBIGUOUS = -1  # more than one user's socket matches: nobody can be told apart


def split_peer(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC peer string `ipv4:h:p` or `ipv6:[h]:p`; v4-mapped v6 hosts come back as v4."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return None
    host, _, port = peer[5:].rpartition(":")
    host = host.strip("[]")
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return (host, int(port)) if port.isdigit() else None


def listening_hosts(host: str) -> tuple[str, ...]:
    """The addresses a server bound to `host` (as --host says it) accepts TCP connections at, where they are a
    closed set: one address, or localhost's two. Empty where they are not (0.0.0.0 and :: take every address of
    the host; another name may resolve to anything): then a peer's socket is looked for at any address.

    Args:
        host: the listening host as configured.

    Returns:
        The addresses, as text.
    """
    if host == "localhost":
        return ("127.0.0.1", "::1")
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return ()
    return () if addr.is_unspecified else (str(addr),)


def peer_uid(peer: str, server_ports: Collection[int] = (), server_hosts: Collection[str] = ()) -> int | None:
    """The user id of the process at the other end of a loopback TCP connection: the client's socket is the one
    whose local address and port are the peer's and whose remote port is one the server listens on (any, when
    `server_ports` is empty), at an address it listens at (`server_hosts`, listening_hosts; any, when empty).
    None when no socket matches; AMBIGUOUS when sockets of different users do (client sockets set SO_REUSEADDR,
    so another user can bind the same local address and port for a connection elsewhere, or to another of this
    host's addresses when the server listens on all of them)."""
    where = split_peer(peer)
    if where is None:
        return None
    packed = _packed(where[0])
    if packed is None:
        return None
    ends = [a for a in map(_packed, server_hosts) if a is not None and len(a) == len(packed)]
    try:
        if ends and server_ports:
            return _exact_uid(packed, where[1], ends, server_ports)
        return _netlink_uid(packed, where[1], server_ports)
    except OSError:
        return _proc_uid(packed, where[1], _PROC_TABLES, server_ports)


def _packed(host: str) -> bytes | None:
    """An address's bytes in network order (4 for IPv4, 16 for IPv6); None for what is not an address."""
    try:
        return socket.inet_pton(socket.AF_INET6, host) if ":" in host else socket.inet_aton(host)
    except OSError:
        return None


def _exact_uid(packed: bytes, port: int, ends: Collection[bytes], server_ports: Collection[int]) -> int | None:
    """Ask sock_diag for the one socket with each set of four addresses (peer address and port, a server address
    and port): TCP lets only one established socket have them, so these are every connection the call can have
    come on. An IPv4 look-up also finds a client's v4-mapped IPv6 socket (one connection table holds both)."""
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    uids: set[int] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        for seq, (dst, dport) in enumerate(((d, p) for d in ends for p in server_ports), 1):
            sockid = _EXACT_ID.pack(port, dport, packed.ljust(16, b"\0"), dst.ljust(16, b"\0"), 0, NO_COOKIE, NO_COOKIE)
            nl.send(_request(family, sockid, NLM_F_REQUEST, seq))
            uid = _read_one(nl, port, dport)
            if uid is not None:
                uids.add(uid)
    return _one(uids)


def _read_one(nl: socket.socket, port: int, dport: int) -> int | None:
    """The uid in an exact look-up's answer; None when no established socket has those addresses (the kernel
    answers a look-up that misses with a listening socket, or ENOENT)."""
    data = nl.recv(1 << 16)
    if len(data) < _NLMSG.size:
        raise OSError("malformed sock_diag reply")
    _length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data)
    body = _NLMSG.size
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, body)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, "sock_diag refused the request")
    if len(data) < body + _MSG_UID_AT + 4:
        raise OSError("malformed sock_diag reply")
    state, sport, got_dport, _src, uid = _socket_at(data, body)
    return uid if state == TCP_ESTABLISHED and sport == port and got_dport == dport else None


def _request(family: int, sockid: bytes, flags: int, seq: int, attrs: bytes = b"") -> bytes:
    """One netlink message asking sock_diag about established TCP sockets of `family` (`sockid` packed as _SOCKID or
    _EXACT_ID says)."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << TCP_ESTABLISHED) + sockid + attrs
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body


def _socket_at(data: bytes, body: int) -> tuple[int, int, int, bytes, int]:
    """(state, local port, remote port, local address, uid) of the inet_diag_msg starting at `body`."""
    sport, dport, src, _dst, _ifindex = _SOCKID.unpack_from(data, body + 4)
    return data[body + 1], sport, dport, src, int.from_bytes(data[body + _MSG_UID_AT : body + _MSG_UID_AT + 4], sys.byteorder)


def _one(uids: set[int]) -> int | None:
    return None if not uids else uids.pop() if len(uids) == 1 else AMBIGUOUS


def _netlink_uid(packed: bytes, port: int, server_ports: Collection[int] = ()) -> int | None:
    """Ask sock_diag for established TCP sockets with local port `port`, in each family the peer can have
    (an IPv4 client may hold a v4-mapped IPv6 socket), and match the local address."""
    wanted = {packed.ljust(16, b"\0")}
    families = [(socket.AF_INET6, packed)]
    if len(packed) == 4:
        families = [(socket.AF_INET, packed), (socket.AF_INET6, b"\0" * 10 + b"\xff\xff" + packed)]
        wanted.add(families[1][1])
    uids: set[int] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        for seq, (family, _) in enumerate(families, 1):
            nl.send(_dump_request(family, port, seq))
            uids |= _read_dump(nl, port, wanted, set(server_ports))
    return _one(uids)


def _dump_request(family: int, port: int, seq: int) -> bytes:
    # In-kernel filter: sport >= port and sport <= port. A failed test jumps 4 bytes past the end: reject.
    bytecode = (
        struct.pack("=BBH", INET_DIAG_BC_S_GE, 8, 16 + 4)
        + struct.pack("=BBH", 0, 0, port)
        + struct.pack("=BBH", INET_DIAG_BC_S_LE, 8, 8 + 4)
        + struct.pack("=BBH", 0, 0, port)
    )
    attr = struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
    return _request(family, _SOCKID.pack(0, 0, b"", b"", 0), NLM_F_REQUEST | NLM_F_DUMP, seq, attr)


def _read_dump(nl: socket.socket, port: int, wanted: set[bytes], dports: set[int]) -> set[int]:
    """The uids of every socket in the dump whose local end is (wanted address, port), and whose remote port is
    in `dports` (any when empty)."""
    found: set[int] = set()
    while True:
        data = nl.recv(1 << 16)
        pos = 0
        while pos + _NLMSG.size <= len(data):
            length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, pos)
            if length < _NLMSG.size:
                raise OSError("malformed sock_diag reply")
            if kind == NLMSG_DONE:
                return found
            if kind == NLMSG_ERROR:
                raise OSError("sock_diag refused the request")
            _state, sport, dport, src, uid = _socket_at(data, pos + _NLMSG.size)
            if sport == port and src in wanted and (not dports or dport in dports):
                found.add(uid)
            pos += (length + 3) & ~3


def _proc_uid(packed: bytes, port: int, tables: tuple[str, ...], server_ports: Collection[int] = ()) -> int | None:
    """The same answer from /proc/net/tcp{,6}, whose addresses are 32-bit words in host byte order, hex."""
    addr = "".join(f"{int.from_bytes(packed[i : i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
    wanted = {f"{addr}:{port:04X}"}
    if len(addr) == 8:  # an IPv4 peer may appear as a v4-mapped address in tcp6
        wanted.add(f"0000000000000000FFFF0000{addr}:{port:04X}")
    dports = {f"{p:04X}" for p in server_ports}
    uids: set[int] = set()
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if (
                        len(fields) > 7
                        and fields[1] in wanted
                        and fields[3] == "01"
                        and (not dports or fields[2].rpartition(":")[2] in dports)
                    ):
                        uids.add(int(fields[7]))
        except OSError:
            continue
    return _one(uids)
