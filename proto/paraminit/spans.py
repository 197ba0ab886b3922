"""Which tensors of a data section lie in a byte range: the search a server fills a stream's slabs by and a client
lands a stream's chunks by, written once.

Tensors do not overlap, but an empty tensor may lie at the offset of a non-empty one (a stream's layout puts wider
dtypes first, so an empty float64 tensor late in a plan starts where an earlier float32 one does). Ordered by
offset alone, with ties in table order, such an empty tensor could put an end below the one before it, and a
binary search over the ends then missed the non-empty tensor: here they are ordered by offset and then end, so
both ascend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class ByteSpans:
    """A tensor table's byte ranges [offset, offset + nbytes), ordered for range searches.

    Args:
        offsets: each tensor's first byte in the data section, in table order.
        nbytes: each tensor's byte count, in table order.
    """

    def __init__(self, offsets: Sequence[int] | npt.NDArray[np.int64], nbytes: Sequence[int] | npt.NDArray[np.int64]) -> None:
        begins = np.asarray(offsets, dtype=np.int64)
        ends = begins + np.asarray(nbytes, dtype=np.int64)
        self.order = np.lexsort((ends, begins))  # table indices by offset, then end; stable
        self.begins, self.ends = begins[self.order], ends[self.order]

    def overlapping(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Table indices (ascending) of the tensors with bytes in [start, stop): two binary searches, so that a
        stream of many small pieces does not look at every tensor for each one. Empty tensors hold no bytes.

        Args:
            start: the range's first byte.
            stop: one past its last byte.

        Returns:
            The indices, as an int64 array.
        """
        lo = int(np.searchsorted(self.ends, start, side="right"))
        hi = int(np.searchsorted(self.begins, stop, side="left"))
        rows = self.order[lo:hi]
        if rows.shape[0]:
            rows = rows[self.ends[lo:hi] > self.begins[lo:hi]]
        return np.sort(rows)
