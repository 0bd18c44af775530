"""Durable files: data and directory entries forced to disk, and files hashed without following links.

A write that must survive a crash (an adapter version, a checkpoint, a trainer state) writes
its files, fsyncs each, fsyncs the directory holding them, and only then renames that directory
into place; the rename itself becomes durable with an fsync of the parent.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def fsync_file(path: Path) -> None:
    """Force a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and force it to disk (the directory entry needs `fsync_dir`)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: str | os.PathLike[str], *, sync: bool = False) -> str:
    """Hex sha256 of a file's bytes; a symbolic link is refused (OSError ELOOP), never followed.

    sync: also force the file's data to disk, through the same open file (one open, not two).
    """
    h = hashlib.sha256()
    # O_NOFOLLOW: a file swapped for a symlink after it was checked still cannot be read through
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()
