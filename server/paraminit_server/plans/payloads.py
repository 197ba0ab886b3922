"""Flat payloads beyond one gRPC message: uploaded payloads and safetensors files the server reads.

Uploaded payloads are kept in their own dtype; backends convert the slice a
window reads to binary64 (exact: every supported dtype embeds in binary64).
Checkpoint values become binary64 when read. Either way a value passes through
the usual single rounding into the parameter's dtype and loads bit for bit when
the dtypes agree.

Uploads reserve their bytes against the payload limit before the first byte is
kept, so concurrent uploads cannot overshoot it. Checkpoints are read through
files.py (bounded pread, never a memory map); a region of a checkpoint tensor
reads and converts only that region, and its bytes are reserved against the
memory budget before they are read. A request reads both through its own
RequestSnapshot (plans/snapshot.py).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from paraminit import dtypes
from paraminit_server import errors
from paraminit_server.ledger import Claim, Ledger
from paraminit_server.plans import files
from paraminit_server.plans.files import FileChanged, StoredTensor

__all__ = ["FileChanged", "Payload", "PayloadTicket", "StoredTensor", "ValueSources", "to_binary64"]

CONTENT_HASHES = 4096  # remembered (file version, tensor, region) -> SHA-256, so Validate reads a file once


def to_binary64(raw: npt.NDArray[np.uint8], dt: dtypes.DTypeInfo) -> npt.NDArray[np.float64]:
    """Exact conversion of little-endian values to binary64 (every supported dtype embeds in binary64)."""
    if dt.max_finite is not None:  # an 8-bit float: a lookup of its 256 patterns
        return dtypes.binary64_table(dt)[raw]
    if dt.fmt == dtypes.FMT_BFLOAT16:
        bits = raw.view("<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    if dt.fmt == dtypes.FMT_FLOAT16:
        return raw.view("<f2").astype(np.float64)
    return raw.view("<f4" if dt.itemsize == 4 else "<f8").astype(np.float64)


def payload_sha256(dt: dtypes.DTypeInfo, data: Any = b"") -> str:
    """What plan digests cover for a payload: SHA-256 of the dtype name, a NUL and the bytes as uploaded."""
    return str(payload_hasher(dt, data).hexdigest())


def payload_hasher(dt: dtypes.DTypeInfo, data: Any = b"") -> Any:
    h = hashlib.sha256(dt.name.encode() + b"\0")
    h.update(np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data)
    return h


Scanned = tuple[int, int, float]  # (count of NaN/inf values, index of the first or -1, largest finite |value|)


def scan_values(values: npt.NDArray[Any], piece: int = 1 << 16, at: int = 0, before: Scanned = (0, -1, 0.0)) -> Scanned:
    """Scanned of `values`, in pieces of the uploaded dtype (numpy's or ml_dtypes' own ufuncs: no binary64 copy).
    A piece is read twice, while it is in cache (its max and min, which a NaN or an infinity turns non-finite);
    only a piece that holds one is looked at again. A payload scanned in parts gives what one scan gives: `at` is
    the payload index of values[0], `before` the scan of the elements before it."""
    count, first, largest = before
    for lo in range(0, values.size, piece):
        part = values[lo : lo + piece]
        top = max(float(part.max()), -float(part.min()))
        if math.isfinite(top):  # every value of the piece is finite
            largest = max(largest, top)
            continue
        finite = np.isfinite(part)
        bad = np.flatnonzero(~finite)
        if bad.size:
            count += int(bad.size)
            first = at + lo + int(bad[0]) if first < 0 else first
            part = part[finite]
        if part.size:
            largest = max(largest, float(np.max(np.abs(part))))
    return count, first, largest


class Follower:
    """An upload's sha256 and scan (scan_values) computed on a helper thread while its bytes land, a piece behind the
    receiving thread: hashing and scanning release the GIL, so they overlap receiving and copying instead of
    following them (each piece is hashed and scanned while it is still in cache)."""

    PIECE = 256 << 10  # bytes hashed and scanned at a time

    def __init__(self, buf: npt.NDArray[np.uint8], dt: dtypes.DTypeInfo) -> None:
        self._buf, self._dt = buf, dt
        self._hasher = payload_hasher(dt)
        self._cond = threading.Condition()
        self._landed = self._done = 0
        self._closing = self._stopped = False
        self._error: BaseException | None = None
        self._scan: Scanned = (0, -1, 0.0)
        self._thread = threading.Thread(target=self._run, name="paraminit-upload-digest", daemon=True)
        self._thread.start()

    def landed(self, upto: int) -> None:
        """Bytes [0, upto) of the buffer hold their final values."""
        with self._cond:
            self._landed = upto
            if upto - self._done >= self.PIECE:
                self._cond.notify()

    def finish(self) -> tuple[str, Scanned]:
        """Wait for the rest: the sha256 of everything landed, and the scan of its whole elements."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return str(self._hasher.hexdigest()), self._scan

    def stop(self) -> None:
        """Abandon the upload: the helper ends at its next piece."""
        with self._cond:
            self._stopped = self._closing = True
            self._cond.notify()

    def _run(self) -> None:
        item = self._dt.itemsize
        try:
            while True:
                with self._cond:
                    while not self._closing and self._landed - self._done < self.PIECE:
                        self._cond.wait()
                    if self._stopped:
                        return
                    # whole elements until the end: a message may stop inside an element, whose rest comes next
                    start, end = self._done, self._landed if self._closing else self._landed - self._landed % item
                    if start == end:
                        if self._closing:
                            return
                        continue
                for a in range(start, end, self.PIECE):
                    if self._stopped:  # abandoned: no more work on its bytes
                        return
                    b = min(end, a + self.PIECE)
                    self._hasher.update(self._buf[a:b])
                    # pieces start on an element (PIECE is a multiple of every itemsize); only the payload's very
                    # end may cut one, and a payload that is not a whole number of elements is refused anyway
                    self._scan = scan_values(
                        self._buf[a : b - (b - a) % item].view(self._dt.numpy.newbyteorder("<")), at=a // item, before=self._scan
                    )
                with self._cond:
                    self._done = end
        except BaseException as exc:  # handed to finish()
            self._error = exc


@dataclass
class Payload:
    owner: str
    values: npt.NDArray[Any]  # in the uploaded dtype (bfloat16 via ml_dtypes)
    expires_at: float
    nonfinite: int  # count of NaN/inf values
    first_nonfinite: int
    sha256: str = ""  # of the dtype and the bytes as uploaded: what plan digests cover
    claim: Claim | None = None  # its bytes in the store's ledger, released when it expires
    max_abs: float = 0.0  # the largest finite |value|: the 8-bit range rule's bound of a flat_ref


class Reservation(Protocol):
    def release(self) -> object: ...


PayloadTicket = Claim  # payload bytes taken from the limit: an upload in flight, then the stored payload


class ValueSources:
    """Where flat_ref and safetensors initializers get their values."""

    def __init__(
        self, max_bytes: int, ttl: float, safetensors_dirs: Iterable[str] = (), charge: Callable[[int], Claim] | None = None
    ) -> None:
        """Args:
        max_bytes: stored and in-flight payload bytes.
        ttl: seconds a payload lives.
        safetensors_dirs: directories whose files plans may name.
        charge: takes a payload's bytes from the server's memory budget too, for as long as it lives (a
            payload is host memory like any other); raises when they do not fit.
        """
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._charge = charge
        # each allowed directory as resolved at start, and as written (an operator's path may pass through links
        # above the directory; nothing beneath it may)
        self.dirs = [Path(d).resolve() for d in safetensors_dirs if d]
        roots = {
            (written, str(Path(d).resolve())) for d in safetensors_dirs if d for written in (os.path.abspath(d), str(Path(d).resolve()))
        }
        self._roots = sorted(roots, key=lambda r: -len(r[0]))  # (as written or resolved, resolved), deepest first
        self._payloads: dict[str, Payload] = {}
        self.ledger = Ledger("payloads")  # uploads in flight (pending claims) and stored payloads (committed)
        self._uploads = 0  # uploads in flight, for draining
        self._lock = self.ledger.lock  # a payload is stored in the same step as its claim commits
        self._idle = threading.Condition(self._lock)
        self._hashes: collections.OrderedDict[tuple[Any, ...], str] = collections.OrderedDict()

    # -- uploaded payloads ---------------------------------------------------------------

    def used_bytes(self) -> int:
        """Stored and in-flight payload bytes."""
        return self.ledger.total

    def share(self) -> int:
        """The payload bytes one identity may hold (stored and in flight): three quarters of the limit, so one
        identity's uploads always leave the others a quarter of it for their payload TTL."""
        return self.max_bytes - self.max_bytes // 4

    def reserve(self, nbytes: int, owner: str = "") -> Claim:
        """Take an upload's bytes from the limit and from its owner's share (see share) now, before anything is
        received; an empty owner (the server's own use, tests) is held to the limit alone.

        Raises:
            ResourceExhausted: stored payloads and uploads in flight leave too few bytes, in all or in the owner's share."""
        self._expire()

        def refusal(ledger: Ledger, n: int, holder: str) -> errors.ResourceExhausted | None:
            used = ledger.total
            if used + n > self.max_bytes:
                return errors.ResourceExhausted(
                    f"payload needs {n} bytes; {max(0, self.max_bytes - used)} of "
                    f"{self.max_bytes} payload bytes are free (uploads in flight count)"
                )
            mine, share = ledger.held_bytes(holder), self.share()
            if holder and mine + n > share:
                return errors.ResourceExhausted(
                    f"payload needs {n} bytes; this identity holds {mine} of its {share} payload bytes (three quarters "
                    f"of --max-payload-bytes {self.max_bytes}, so others keep the rest; uploads in flight count)"
                )
            return None

        ticket = self.ledger.claim(nbytes, owner, refusal)
        if self._charge is not None:
            try:
                ticket.also = self._charge(nbytes)
            except BaseException:
                ticket.release()
                raise
        return ticket

    @contextlib.contextmanager
    def uploading(self) -> Iterator[None]:
        """Count an upload in flight, so shutdown can let it finish within the drain time."""
        with self._lock:
            self._uploads += 1
        try:
            yield
        finally:
            with self._lock:
                self._uploads -= 1
                self._idle.notify_all()

    def wait_uploads(self, timeout: float) -> bool:
        """True once no upload is in flight; False if some still are after `timeout` seconds."""
        with self._lock:
            return self._idle.wait_for(lambda: self._uploads == 0, max(0.0, timeout))

    def store(
        self,
        owner: str,
        dtype_enum: int,
        count: int,
        data: npt.NDArray[np.uint8],
        ticket: Claim | None = None,
        sha256: str = "",
        scanned: Scanned | None = None,
    ) -> tuple[str, Payload]:
        """Keep an upload in its own dtype; with a ticket its bytes were reserved already, without one they are
        taken now. `sha256` of the dtype name, a NUL and the bytes, and `scanned` (scan_values of the values), if the
        caller computed them on the way in (Follower)."""
        dt = dtypes.by_enum(dtype_enum)
        if dt is None:
            raise errors.InvalidRequest(f"unknown payload dtype enum value {dtype_enum}")
        nbytes = count * dt.itemsize
        if len(data) != nbytes:
            raise errors.InvalidRequest(f"payload declared {count} {dt.name} values ({nbytes} bytes) but {len(data)} bytes arrived")
        ticket = ticket or self.reserve(nbytes, owner)
        with ticket:  # given back unless it becomes the payload
            if ticket.nbytes < nbytes:
                raise errors.InvalidRequest(f"payload of {count} values is larger than reserved")
            values = data.view(dt.numpy.newbyteorder("<"))
            nonfinite, first, largest = scanned if scanned is not None else scan_values(values)
            digest = sha256 or payload_sha256(dt, data)
            payload = Payload(owner, values, time.time() + self.ttl, nonfinite, first, digest, ticket, largest)
            pid = secrets.token_hex(16)

            def keep() -> None:
                self._payloads[pid] = payload

            if not ticket.commit(keep):
                raise errors.InvalidRequest("payload reservation was already used")
        return pid, payload

    def payload(self, payload_id: str, owner: str) -> Payload | None:
        self._expire()
        with self._lock:
            p = self._payloads.get(payload_id)
        return p if p is not None and p.owner == owner else None

    def _expire(self) -> None:
        now = time.time()
        with self._lock:
            for pid in [k for k, p in self._payloads.items() if p.expires_at <= now]:
                gone = self._payloads.pop(pid)
                if gone.claim is not None:
                    gone.claim.release()

    # -- safetensors files ---------------------------------------------------------------

    def allowed(self, path: str) -> tuple[str, str, str]:
        """(allowed directory, the path relative to it, the path as errors show it); raises unless the path, as
        written, names something beneath an allowed directory. Nothing is resolved here: links are refused when
        the file is opened (files.open_beneath), in every component, so what is checked is what is read."""
        shown = files.echo(path)
        if not self.dirs:
            raise errors.InvalidRequest(
                "this server reads no files: start it with --safetensors-dirs DIR[:DIR...] (in process, Client(safetensors_dirs=[...]))"
            )
        if "\0" in path:
            raise errors.InvalidRequest(f"path {shown} contains a NUL character")
        full = os.path.normpath(os.path.abspath(path))  # '..' folds lexically: a/link/.. is a, never link's parent
        for written, real in self._roots:
            if full.startswith(written.rstrip("/") + "/"):
                return real, full[len(written.rstrip("/")) + 1 :], shown
        allowed = ", ".join(files.echo(written) for written, _ in self._roots)
        raise errors.InvalidRequest(f"{shown} is not under an allowed directory ({allowed})")

    def remembered_hash(self, key: tuple[Any, ...]) -> str | None:
        with self._lock:
            h = self._hashes.get(key)
            if h is not None:
                self._hashes.move_to_end(key)
            return h

    def remember_hash(self, key: tuple[Any, ...], digest: str) -> None:
        with self._lock:
            self._hashes[key] = digest
            while len(self._hashes) > CONTENT_HASHES:
                self._hashes.popitem(last=False)
