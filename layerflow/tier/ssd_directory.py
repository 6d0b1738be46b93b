"""An SSD directory one store owns: a real directory of this uid that group and others cannot write, locked.

The store writes, reads and deletes files in it, so a directory anyone else can write (or a link planted where it
should be) would let them aim those operations elsewhere; and two stores in one directory would delete each other's
copies. So a directory is opened with O_NOFOLLOW and checked on its descriptor, then locked with an exclusive flock on
a lock file inside it (released by the kernel when the owner dies, so a crash leaves no stale lock).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = ".layerflow-ssd.lock"
COPY_SUFFIX = ".kv"


class SsdDirectoryError(OSError):
    """An SSD directory is unsafe to write in (a link, not ours, writable by others) or owned by another store."""


class SsdDirectory:
    """One SSD directory: opened without following a link, checked to be ours and private to us, then locked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        self.lock_fd = -1
        self.fd = self._open()
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            kind = "a symbolic link: name the directory itself" if self.path.is_symlink() else "not a directory"
            raise SsdDirectoryError(f"{self.path}: {kind} ({e.strerror})") from None
        st = os.fstat(fd)
        problem = None
        if st.st_uid != os.getuid():
            problem = f"owned by uid {st.st_uid}, not by this process's uid {os.getuid()}"
        elif stat.S_IMODE(st.st_mode) & 0o022:
            problem = (f"mode {stat.S_IMODE(st.st_mode):o} is writable by group or others (chmod go-w it: the "
                       f"store creates and deletes files in it)")
        if problem is not None:
            os.close(fd)
            raise SsdDirectoryError(f"{self.path}: {problem}")
        return fd

    def lock(self) -> None:
        """Take the directory for this store; refuse it while another store (this process or another) holds it."""
        fd = self.open(LOCK_FILE, os.O_RDWR | os.O_CREAT)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise SsdDirectoryError(f"{self.path}: {LOCK_FILE} is not a regular file of uid {os.getuid()}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SsdDirectoryError(f"{self.path} is in use by another engine or transfer server (it holds "
                                    f"{LOCK_FILE}): give each its own ssd_cache_dir") from None
        self.lock_fd = fd

    def drop_stale(self) -> int:
        """Delete the copies a previous owner left: our regular `.kv` files (never a link, never another's file)."""
        dropped = 0
        with os.scandir(self.fd) as entries:
            for entry in entries:
                if (entry.name.endswith(COPY_SUFFIX) and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_uid == os.getuid()):
                    self.unlink(entry.name)
                    dropped += 1
        return dropped

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for fd in (self.lock_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.lock_fd = self.fd = -1


def take_directories(paths: list[Path]) -> list[SsdDirectory]:
    """Open, check and lock every directory, then delete what a previous owner left (all or none taken)."""
    taken: list[SsdDirectory] = []
    try:
        for path in paths:
            taken.append(SsdDirectory(path))
            if any(d.identity == taken[-1].identity for d in taken[:-1]):
                raise ValueError(f"SSD directory {path} is named twice in {[str(p) for p in paths]}")
        for d in taken:
            d.lock()
    except BaseException:
        for d in taken:
            d.close()
        raise
    for d in taken:
        dropped = d.drop_stale()
        if dropped:
            log.info("SSD tier: deleted %d copies a previous owner left in %s", dropped, d.path)
    return taken

