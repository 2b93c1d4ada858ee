"""Atomic, durable file creation. A file appears under its final name only complete and on disk.

Sequence: write ``.NAME.tmp-PID-TID`` in the same folder, fsync it, rename over NAME, fsync the
folder. Any failure removes the temp file. ENOSPC (and EDQUOT, EFBIG, EROFS, EIO: ``errors.WRITE_STOPS``)
anywhere becomes ``DiskFull`` so the caller can stop cleanly, in its own words; every other OSError
propagates unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hsx.errors import WRITE_STOPS, DiskFull, Unwritable

TMP_MARK = ".tmp-"
FILE_MODE = 0o644


def is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")


def pending_name(path: Path) -> Path:
    """Where a file written whole and durable waits for its writer's go-ahead (a rename to ``path``,
    then the folder's fsync): a temp file to every reader, so a crash before the go-ahead leaves
    nothing counted (the vLLM backend's files, judged by the driver after vLLM wrote them)."""
    return path.with_name(f".{path.name}{TMP_MARK}pending")


def temp_of(name: str) -> tuple[str, int | None] | None:
    """What a temp file is of: (the NAME it was to become, its writer's pid), or None if ``name``
    is no temp file; the pid is None for a temp of another naming (an older hsx)."""
    if not is_temp(name):
        return None
    target, _, writer = name[1:].partition(TMP_MARK)
    pid = writer.split("-", 1)[0]
    return target, int(pid) if pid.isdigit() else None


def _full(e: OSError) -> bool:
    """A write error the run stops cleanly on (``errors.WRITE_STOPS``: a full volume, a file-size
    limit, a read-only volume, an I/O error), not a bug."""
    return e.errno in WRITE_STOPS


def writable_folder(path: Path) -> Path:
    """``path`` made a folder (its parents too) that can be written, or ``Unwritable`` saying why:
    it or a parent is a file, its volume is read-only, or writing there is not permitted."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        if not os.access(path, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
    except (FileExistsError, NotADirectoryError):
        file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise Unwritable(f"cannot write to {path}: {file} is a file, not a folder; choose another place") from None
    except OSError as e:
        raise Unwritable(f"cannot write to {path}: {e.strerror}; choose another place") from None
    return path


def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:  # an I/O error reaching the disk: the clean stop, as in a write
        if _full(e):
            raise DiskFull(path, e) from e
        raise


def write_parts(path: Path, parts: Iterable[memoryview | bytes], sync_dir: bool = True) -> int:
    """Write ``parts`` to ``path`` atomically and durably; return the size written.

    With ``sync_dir=False`` the caller fsyncs the folder later, once for a batch of renames; the
    file is durable only after that.
    """
    tmp = temp_name(path)
    size = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            for part in parts:
                write_all(fd, part)
                size += memoryview(part).nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        if sync_dir:
            fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if _full(e):
            raise DiskFull(path, e) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def write_durable(path: Path, data: bytes) -> int:
    return write_parts(path, [data])


@contextmanager
def flocked(guard: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive flock on ``guard`` (created empty where absent) for the block: racing processes
    take turns, and the kernel drops it when its holder dies, so no stale guard is ever left.
    ``waiting`` is called once when another process holds it."""
    fd = os.open(guard, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def create_exclusive(path: Path, data: bytes) -> bool:
    """Put ``path`` in place whole and durable unless a file is there already (then False): a temp
    file hard-linked to the name, which fails where one exists, so racing creators never overwrite
    each other and no reader ever sees half of it."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except (FileExistsError, FileNotFoundError):  # a file is there (its holder may tidy our temp)
        return False
    except OSError as e:
        if _full(e):
            raise DiskFull(path, e) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def durable_rename(src: Path, dst: Path) -> None:
    """fsync ``src`` (written by someone else, e.g. a Parquet writer), rename it, fsync the folder."""
    try:
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(src, FILE_MODE)
        os.rename(src, dst)
        fsync_dir(dst.parent)
    except OSError as e:
        if _full(e):
            raise DiskFull(dst, e) from e
        raise
