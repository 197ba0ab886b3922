"""A request's view of the payloads and checkpoint files it names (plans/payloads.py holds them for the server).

Every step of one request (validation, the digest, resolution, the fill) reads payloads and files through one
RequestSnapshot, so they all see the same values: a payload looked up once, a checkpoint header parsed once per
file version, checkpoint values reserved against the memory budget until the request ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from paraminit.regions import Region
from paraminit_server import errors
from paraminit_server.plans import files
from paraminit_server.plans.files import FileChanged, Header, StoredTensor
from paraminit_server.plans.payloads import Payload, Reservation, ValueSources, scan_values, to_binary64

__all__ = ["RequestSnapshot"]


def _region_of(info: StoredTensor, region: tuple[tuple[int, int], ...] | None, tensor: str, shown: str) -> Region:
    """The region of a checkpoint tensor a plan asks for (all of it without one); a plan's digest asks before
    validation has compared shapes, so a region that does not fit the file's tensor is an error of the request."""
    box = Region.of(info.shape, region)
    if not box.fits:
        raise errors.InvalidRequest(
            f"region {list(box.box)} does not fit tensor {files.echo(tensor, 120)} of shape {list(info.shape)} in {shown}"
        )
    return box


class RequestSnapshot:
    """ValueSources as one request sees them, a snapshot: payloads of its identity only, each looked up once per
    request and kept for it (a payload that expires or is removed after validation saw it is still the one
    resolution, the digest and the fill use); each checkpoint header parsed once per request (a file that
    changes after that is refused, never half read); checkpoint values reserved against the memory budget
    until release()."""

    def __init__(
        self,
        sources: ValueSources,
        owner: str,
        reserve: Callable[[int], Reservation] | None = None,
        gaussian: Callable[[int, int], npt.NDArray[np.float64]] | None = None,
        zero_keys: Callable[[int, int], npt.NDArray[np.float64]] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Args:
        sources: the server's payloads and allowed files.
        owner: the caller's identity (whose payloads it sees).
        reserve: takes bytes from the memory budget (checkpoint values, computed values) until release().
        gaussian: (n, seed) -> the first n normal(0, 1, seed) values, binary64: what an orthogonal
            parameter factorizes and a sparse one keeps (the data plane passes the CPU kernels' normal).
        zero_keys: (n, seed) -> the keys choosing a sparse parameter's zeros (docs/SAMPLER.md 2.6).
        stop: whether the request is over (deadline, cancellation, drain): long computations (an orthogonal
            matrix) ask it as they go.
        """
        self.sources = sources
        self.owner = owner
        self._reserve = reserve
        self.gaussian = gaussian
        self.zero_keys = zero_keys
        self.stop = stop
        self._headers: dict[str, Header] = {}
        self._held: list[Reservation] = []
        self._hashes: dict[tuple[str, str, tuple[tuple[int, int], ...]], str] = {}
        self._payloads: dict[str, Payload | None] = {}
        self._largest: dict[tuple[Any, ...], float] = {}

    def payload(self, payload_id: str) -> Payload | None:
        """The request's payload under this id: looked up on first use, the same answer for the rest of the
        request (None when the caller has no such payload)."""
        if payload_id not in self._payloads:
            self._payloads[payload_id] = self.sources.payload(payload_id, self.owner)
        return self._payloads[payload_id]

    def hold(self, held: Reservation) -> None:
        """Keep a reservation of the request's until release()."""
        self._held.append(held)

    def charge(self, nbytes: int) -> None:
        """Reserve memory the request computes values into (an orthogonal matrix) against the budget, until
        release(); raises ResourceExhausted when it does not fit."""
        if self._reserve is not None:
            self._held.append(self._reserve(nbytes))

    @contextlib.contextmanager
    def _open(self, path: str) -> Iterator[tuple[int, Header, str]]:
        """The open file and its header, parsed once per file version in this request."""
        root, rel, shown = self.sources.allowed(path)
        real = os.path.join(root, rel)
        fd, st = files.open_beneath(root, rel, shown)
        try:
            header = self._headers.get(real)
            if header is None or header.key != files.FileKey.of(st):
                if header is not None:
                    raise FileChanged(f"{shown} changed while the request read it")
                header = self._headers[real] = files.read_header(fd, st, shown)
            yield fd, header, shown
        finally:
            os.close(fd)

    def tensor_info(self, path: str, tensor: str) -> StoredTensor:
        with self._open(path) as (_fd, header, shown):
            return files.tensor_entry(header, tensor, shown)

    def tensor_values(
        self, path: str, tensor: str, region: tuple[tuple[int, int], ...] | None = None
    ) -> tuple[npt.NDArray[np.float64], bool]:
        """The tensor's values as binary64: only the region's (in the region's row-major order, compact=True)
        when it is a proper part of the tensor, else the whole tensor's. Returns (values, compact)."""
        with self._open(path) as (fd, header, shown):
            info = files.tensor_entry(header, tensor, shown)
            box = _region_of(info, region, tensor, shown)
            region, compact = box.box, not box.is_full
            starts, run_len = box.run_starts()
            numel = len(starts) * run_len
            if self._reserve is not None:  # the raw bytes and their binary64 copy
                self._held.append(self._reserve(numel * (info.dtype.itemsize + 8)))
            raw = np.empty(numel * info.dtype.itemsize, dtype=np.uint8)
            h = hashlib.sha256()
            pos = 0

            def sink(piece: npt.NDArray[np.uint8]) -> None:
                nonlocal pos
                raw[pos : pos + len(piece)] = piece
                h.update(piece.data)
                pos += len(piece)

            files.read_runs(fd, info.start, info.dtype.itemsize, starts, run_len, shown, sink)
            self._hashes[(path, tensor, region)] = h.hexdigest()
            values = to_binary64(raw, info.dtype)
            return values, compact

    def largest_magnitude(self, path: str, tensor: str) -> float:
        """The largest |value| of a whole checkpoint tensor (NaN if it holds one), read in bounded pieces: the
        8-bit range rule's bound of a parameter that reads a wider tensor. Read once per file version."""
        with self._open(path) as (fd, header, shown):
            info = files.tensor_entry(header, tensor, shown)
            key = ("largest", header.key, info.start, info.nbytes)
            known = self._largest.get(key)
            if known is not None:
                return known
            box = _region_of(info, None, tensor, shown)
            starts, run_len = box.run_starts()
            largest = 0.0
            as_read = info.dtype.numpy.newbyteorder("<")

            def sink(piece: npt.NDArray[np.uint8]) -> None:  # whole elements: read_runs cuts at READ_BLOCK
                nonlocal largest
                values = piece.view(as_read)
                nonfinite, _, big = scan_values(values)  # as uploads are scanned, in the file's dtype
                if nonfinite:  # the rare file holding inf or NaN: that is its largest |value| (refused)
                    big = float(np.max(np.abs(values.astype(np.float64))))
                largest = big if math.isnan(big) or math.isnan(largest) else max(largest, big)

            files.read_runs(fd, info.start, info.dtype.itemsize, starts, run_len, shown, sink)
            self._largest[key] = largest
            return largest

    def content_hash(self, path: str, tensor: str, region: tuple[tuple[int, int], ...] | None = None) -> str:
        """SHA-256 of the bytes a plan uses from a checkpoint tensor (its region's, in order): plan digests
        cover what the file holds, not just its name. Read once per file version and region."""
        with self._open(path) as (fd, header, shown):
            info = files.tensor_entry(header, tensor, shown)
            box = _region_of(info, region, tensor, shown)
            region = box.box
            done = self._hashes.get((path, tensor, region))
            if done is not None:
                return done
            key = (header.key, info.start, info.nbytes, region)
            remembered = self.sources.remembered_hash(key)
            if remembered is not None:
                return remembered
            starts, run_len = box.run_starts()
            h = hashlib.sha256()
            files.read_runs(fd, info.start, info.dtype.itemsize, starts, run_len, shown, lambda piece: h.update(piece.data))
            digest = self._hashes[(path, tensor, region)] = h.hexdigest()
            self.sources.remember_hash(key, digest)
            return digest

    def release(self) -> None:
        """Give back the memory reserved for checkpoint values and held for the request (idempotent)."""
        held, self._held = self._held, []
        self._payloads.clear()
        for r in held:
            r.release()
