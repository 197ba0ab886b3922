"""What the plan scanner and its compiled passes agree on: protobuf's wire types and the scan's flags.

Its own module, so the scanner (imported with every plan) and its numba kernels (imported on first use) both take
them from below instead of from each other."""

from __future__ import annotations

# Per-parameter flags
IRREGULAR = 1  # read this parameter from the message (region, patches, unknown or repeated fields, ...)
FIELDS = 5  # numeric fields of an initializer message kept (the largest, TruncatedNormal, has five)
# Wire types of protobuf
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
ABSENT = -1
