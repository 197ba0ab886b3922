"""How a plan's bytes reach the caller: one enum the client's modules share, parsed from user strings here only.

The public functions that take a delivery (`Client.export`, `torch.materialize_module`) accept a `Delivery` or its
string, for compatibility, and call `Delivery.parse` once; everything after compares members, never strings.
"""

from __future__ import annotations

import enum
from collections.abc import Collection

from paraminit_client.errors import InvalidArgument

__all__ = ["Delivery"]


class Delivery(enum.StrEnum):
    """A way to receive a plan's tensors (the values are the strings callers and the command line use)."""

    AUTO = "auto"  # torch adapter: the best the server offers (zero-copy on this host, else a stream)
    IN_PROCESS = "in_process"  # torch adapter: an in-process data plane writes into the new tensors
    STREAM = "stream"  # chunks over the call (any server)
    SHM = "shm"  # a shared-memory segment on this host, lent under a lease
    CUDA_IPC = "cuda_ipc"  # one CUDA allocation on this host, lent under a lease

    @property
    def leases(self) -> bool:
        """Whether the buffer is lent under a lease (which needs a client that outlives the call)."""
        return self in (Delivery.SHM, Delivery.CUDA_IPC)

    @classmethod
    def parse(cls, value: Delivery | str, allowed: Collection[Delivery], choices: str) -> Delivery:
        """The member a caller's value names, if it is one the caller takes.

        Args:
            value: a Delivery or its string.
            allowed: the members the caller takes.
            choices: how the error message lists them ("auto, stream, shm, cuda_ipc or in_process").

        Returns:
            The member.

        Raises:
            InvalidArgument: (a ValueError) a value that is not one of `allowed`.
        """
        found = cls._value2member_map_.get(value) if isinstance(value, str) else None
        if not isinstance(found, cls) or found not in allowed:
            raise InvalidArgument(f"delivery must be {choices}, got {value!r}")
        return found
