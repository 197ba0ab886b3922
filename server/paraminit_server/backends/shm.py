"""POSIX shared-memory segments: what the CPU backend lends to local peers.

A segment is created exclusively with mode 0600 under a 128-bit random name,
its tmpfs space reserved up front (a full /dev/shm is ENOSPC here, not SIGBUS
mid-fill), and unlinked on close.

A server killed outright (SIGKILL, OOM) cannot unlink its segments, so every
name carries the process's instance tag (`paraminit-<tag>-<random>`), and the
process holds an exclusive flock on `<tag>.lock` in a directory of its user for
as long as it lives. A starting server removes the segments of every tag whose
lock it can take: those instances are dead. A live server's lock cannot be
taken, so its segments are never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import threading

import numpy as np

from paraminit import hostmem
from paraminit_server import errors
from paraminit_server.backends import SHM, ExportHandle

SHM_DIR = "/dev/shm"
POPULATE_THREADS = 4  # at most: population scales to two threads on a 2-core host (0.28 -> 0.18 s for 498 MB)
SHM_PREFIX = "paraminit-"
log = logging.getLogger("paraminit.server")
_instance: tuple[str, int, int] | None = None  # (tag, fd of the held lock, pid of the process that took it)
_instance_lock = threading.Lock()


def lock_dir() -> str:
    """Where this user's instance locks live (mode 0700, one per user)."""
    return os.path.join(SHM_DIR, f".paraminit-locks-{os.geteuid()}")


def instance_tag() -> str:
    """This process's tag, created with its lock (and earlier instances swept) on first use; a forked child
    takes its own (its parent's lock and segments stay its parent's)."""
    global _instance
    with _instance_lock:
        if _instance is None or _instance[2] != os.getpid():
            d = lock_dir()
            tag = secrets.token_hex(6)
            tmp = os.path.join(d, f"{tag}.lock.new")
            try:
                own_lock_dir(d)
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # held until the process ends, however it ends
                    os.write(fd, f"{os.getpid()}\n".encode())
                    os.rename(tmp, os.path.join(d, f"{tag}.lock"))  # sweepers only ever see locked locks
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            except UnsafeLockDir as exc:  # a permanent state another user made: retrying never helps
                raise errors.FailedPrecondition(
                    f"shared memory is unavailable: the lock directory {d} {exc.strerror}; remove it or have its owner do so"
                ) from None
            except OSError as exc:  # a full or inode-less /dev/shm: no segments here, nothing else is affected
                raise errors.ResourceExhausted(
                    f"shared memory is unavailable: cannot take an instance lock in {d}: {exc.strerror or exc}"
                ) from None
            _instance = (tag, fd, os.getpid())
            atexit.register(release_instance)
            sweep()
        return _instance[0]


class UnsafeLockDir(OSError):
    """The lock directory exists but is not this user's private directory."""


def own_lock_dir(path: str) -> None:
    """Create the user's lock directory 0700, or check that the existing one is a real directory (not a link)
    owned by this user and closed to everyone else: another user who made it first could swap a live server's
    lock files, and a starting server would then sweep that server's segments.

    Raises:
        UnsafeLockDir: it exists with another owner, another type or group/other access.
        OSError: it cannot be created.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeLockDir(errno.EEXIST, "exists and is not a directory (refusing to use it)", path)
    if st.st_uid != os.geteuid():
        raise UnsafeLockDir(errno.EPERM, f"is owned by uid {st.st_uid}, not this user (refusing to use it)", path)
    if st.st_mode & 0o077:
        raise UnsafeLockDir(errno.EPERM, f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700 (refusing to use it)", path)


def release_instance() -> None:
    """Remove this process's lock file (its segments are gone by now): a server that exits leaves nothing in
    /dev/shm. The file is unlinked while still locked, so no sweeper ever takes it for a dead instance's. A
    forked child's exit leaves its parent's lock alone."""
    global _instance
    with _instance_lock:
        if _instance is None or _instance[2] != os.getpid():
            return
        tag, fd, _pid = _instance
        _instance = None
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(lock_dir(), f"{tag}.lock"))
        os.close(fd)


def sweep() -> list[str]:
    """Remove the segments of this user's dead instances (their locks are free); returns what went."""
    d = lock_dir()
    own = _instance[0] if _instance is not None else None
    removed: list[str] = []
    try:
        own_lock_dir(d)  # never sweep on the word of a directory someone else controls
        locks = [f for f in os.listdir(d) if f.endswith(".lock")]
    except OSError:
        return removed
    for name in locks:
        tag = name[: -len(".lock")]
        if tag == own:
            continue
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # alive
            for seg in os.listdir(SHM_DIR):
                if seg.startswith(f"{SHM_PREFIX}{tag}-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(SHM_DIR, seg))
                        removed.append(seg)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d shared-memory segments of server instances that died", len(removed))
    return removed


def new_name() -> str:
    return f"{SHM_PREFIX}{instance_tag()}-{secrets.token_hex(16)}"


class ShmSegment:
    """A segment created with O_EXCL, mode 0600, mapped once; `array` is its bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.name = new_name()
        self.path = os.path.join(SHM_DIR, self.name)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise errors.ResourceExhausted(f"cannot create a {size}-byte shared-memory segment: {exc}") from None
        mapped: mmap.mmap | None = None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, max(size, 1))
            mapped = mmap.mmap(fd, max(size, 1))
            # tmpfs space is taken now, not at a fill's first touch: populated from several threads where the
            # kernel can (faster than fallocate and the fill's own faults), else reserved by fallocate
            if not hostmem.populate(np.frombuffer(mapped, dtype=np.uint8), min(POPULATE_THREADS, os.cpu_count() or 1)):
                os.posix_fallocate(fd, 0, max(size, 1))
        except BaseException as exc:
            if mapped is not None:
                mapped.close()
            os.unlink(self.path)
            if isinstance(exc, OSError):
                raise errors.ResourceExhausted(f"cannot create a {size}-byte shared-memory segment: {exc.strerror}") from None
            raise
        finally:
            os.close(fd)
        self._map = mapped
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=size)

    def handle(self) -> ExportHandle:
        return ExportHandle(SHM, self.size, shm_name=self.name)

    def recycle(self) -> bool:
        """A fresh unguessable name for the same pages; the old name stops resolving at once."""
        name = new_name()
        path = os.path.join(SHM_DIR, name)
        try:
            os.rename(self.path, path)
        except OSError:
            return False
        self.name, self.path = name, path
        return True

    def unmap(self) -> None:
        """Drop this process's mapping, keep the name (a holder whose lease expired may still map it)."""
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a view is still alive somewhere; the mapping goes when it does
            self._map.close()

    def mapped_elsewhere(self) -> bool:
        """Whether another process (of this user, who alone can open the segment) still maps it or holds it open."""
        return mapped_by_others(self.path)

    @staticmethod
    def held_elsewhere(buffers: list[ShmSegment]) -> set[int]:
        """The ids of those of `buffers` another process maps or holds open, in one pass over /proc."""
        by_path = {b.path: id(b) for b in buffers}
        return {by_path[p] for p in held_by_others(set(by_path))}

    def close(self) -> None:
        self.unmap()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def mapped_by_others(path: str) -> bool:
    """Whether any process but this one maps `path` or holds it open (see held_by_others)."""
    return bool(held_by_others({path}))


def held_by_others(paths: set[str]) -> set[str]:
    """Which of `paths` any process but this one maps or holds open, in one pass over /proc (its maps and fds: a
    descriptor kept without a mapping keeps the pages too; processes whose entries cannot be read, another user's,
    cannot have opened a 0600 segment of ours)."""
    me = str(os.getpid())
    found: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and p != me]
    except OSError:
        return found
    for pid in pids:
        if found == paths:
            break
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f.read().decode(errors="replace").splitlines():
                    fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (if any)
                    if len(fields) == 6 and fields[5] in paths:
                        found.add(fields[5])
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    found.add(target)
    return found
