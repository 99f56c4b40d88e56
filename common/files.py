"""Atomic file writes, file hashing and free disk space, the one copy every package uses (sizes print through
common/units.py byte_size)."""

import errno
import hashlib
import json
import os
import shutil


def write_atomic(path: str, data, fsync: bool = True) -> None:
    """Write text or bytes so that `path` holds the old or the whole new content, never a part.

    The temporary file sits in the same directory (so os.replace is atomic) under a per-process
    name, so several processes (ranks) may write the same path at once. With fsync (the default) the
    data is on disk before the rename, so it survives a power loss as well as a crash; frequent,
    disposable writes (heartbeats, status) pass fsync=False.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    binary = isinstance(data, bytes)
    try:
        with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_new(path: str, text: str) -> None:
    """Write `text` at `path` only if nothing is there: the whole content appears at once (a hard link of a complete
    temporary file), and when another process created `path` first, FileExistsError and that file untouched."""
    tmp = f"{path}.{os.getpid()}.new.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, data, fsync: bool = True, indent: int = None) -> None:
    """write_atomic of `data` as JSON."""
    write_atomic(path, json.dumps(data, indent=indent), fsync=fsync)


def file_sha256(path: str) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def disk_full(err: OSError) -> bool:
    """The error says the disk, or the user's quota on it, is full."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str) -> int:
    """Free bytes on the disk holding `path` (its nearest existing parent when it does not exist; 0 if unreadable)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
