"""google.protobuf Timestamp/Duration <-> float seconds, for the contract's lease and payload times."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


def timestamp(epoch_seconds: float) -> timestamp_pb2.Timestamp:
    """A Timestamp for seconds since the Unix epoch (nanosecond resolution)."""
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(round(epoch_seconds * 1e9))
    return ts


def epoch(ts: timestamp_pb2.Timestamp) -> float:
    """Seconds since the Unix epoch of a Timestamp."""
    return ts.seconds + ts.nanos / 1e9


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def seconds(d: duration_pb2.Duration) -> float:
    """Seconds of a Duration; an unset field reads as 0 (the server default)."""
    return d.seconds + d.nanos / 1e9
