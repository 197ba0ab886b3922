"""Who is asking and how long they may wait: what the data plane needs to know about a call, whatever the transport."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ANONYMOUS = "anonymous"
# identities the transport gives callers it cannot tell apart (exports refuse them segments)
REMOTE = "remote"  # unauthenticated callers from other hosts, and local ones the kernel cannot tell apart
UNIX_SHARED = "unix:shared"  # callers on a Unix socket opened wider than the server's user


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Caller:
    """identity owns leases and payloads; local peers may receive zero-copy buffers; `wait` is how long the
    call may wait for memory (0: refuse at once); `queue_wait` how long it may wait in line for a concurrency
    slot (0: refuse at once when all are taken); `active()` turns false when the caller has gone; `uid` is the
    caller's user as the kernel shows it (None: in process, or not known), which decides who can open a segment."""

    identity: str = ANONYMOUS
    local: bool = True
    wait: float = 0.0
    active: Callable[[], bool] = field(default=_always)
    queue_wait: float = 0.0
    uid: int | None = None

    def gone(self) -> bool:
        return not self.active()


IN_PROCESS = Caller()
