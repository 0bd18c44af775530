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


# Files are read and written through bare descriptors (os.open/read/write): Python's buffered
# open() adds an fstat, an ioctl and two lseeks to every file, and on a shared filesystem each
# is a round trip (on one core, each also hands the GIL to the event loop and back).


def write_synced(path: str | os.PathLike[str], data: bytes, *, sync: bool = True) -> None:
    """Write `data` to `path` and, if `sync`, force it to disk (the directory entry needs `fsync_dir`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)  # umask applies, as open()'s
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A file's bytes; a symbolic link is refused (OSError ELOOP), never followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        parts = []
        while chunk := os.read(fd, _CHUNK):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str], *, sync: bool = False) -> str:
    """Hex sha256 of a file's bytes; a symbolic link is refused (OSError ELOOP), never followed.

    sync: also force the file's data to disk, through the same descriptor (one open, not two).
    """
    h = hashlib.sha256()
    # O_NOFOLLOW: a file swapped for a symlink after it was checked still cannot be read through
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return h.hexdigest()
