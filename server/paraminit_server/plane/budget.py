"""Memory budgets: bytes of one memory (host or device) that requests reserve before they allocate, against a limit.

Requests reserve the memory they will hold before allocating it: a stream its
few slabs (on the backend) and their encoded copies (on the host), an export its
whole buffer for as long as the lease lives, an upload its payload. A request
that cannot reserve fails fast with RESOURCE_EXHAUSTED (or waits a bounded time
when the client's deadline leaves room) and allocates nothing. On the CPU
backend host and backend memory are one budget.
"""

from __future__ import annotations

from paraminit_server import errors
from paraminit_server.ledger import Claim, Ledger


class MemoryBudget:
    """Bytes of one memory (host or device) that requests hold while they run, against a limit."""

    def __init__(self, limit: int, name: str = "host") -> None:
        self.limit = limit
        self.name = name
        self.ledger = Ledger(name)

    @property
    def reserved(self) -> int:
        """Bytes held now."""
        return self.ledger.total

    def reserve(self, nbytes: int, wait: float = 0.0, what: str = "request") -> Claim:
        """Hold `nbytes` until the claim is released, waiting up to `wait` seconds for others to give some back.

        Raises:
            ResourceExhausted: more than the whole budget (at once), or not available within `wait`."""
        if nbytes > self.limit:
            raise errors.ResourceExhausted(f"{what} needs {nbytes} bytes of {self.name} memory; the budget is {self.limit}")

        def refusal(ledger: Ledger, n: int, holder: str) -> errors.ResourceExhausted | None:
            if ledger.total + n <= self.limit:
                return None
            return errors.ResourceExhausted(
                f"{what} needs {n} bytes of {self.name} memory, {self.limit - ledger.total} of {self.limit} are available now; retry later",
                retry_after=errors.MEMORY_RETRY_AFTER,
                reason="memory",
            )

        return self.ledger.claim(nbytes, what, refusal, wait)
