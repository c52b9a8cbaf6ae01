"""Output files that appear whole or not at all, and output paths checked before the work.

A run that fails at its very end must not leave half a file where the user expects a result, and
must not find out at its very end that it cannot write there. `check_output_file` and
`check_output_folder` raise a one-line `CanzonaError` for a path that cannot be written (a missing
or read-only folder, a folder or symbolic link where a file goes); `write_atomically` writes into
a temporary file in the same folder, flushes it to disk and renames it over the target, so that
the target is the old file or the new one, never a part of either.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from canzona.errors import CanzonaError
from canzona.runtime.lifecycle import stop_if_orphaned


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (files created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writable_folder(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise CanzonaError(f"{what}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):  # also false on a read-only file system
        raise CanzonaError(f"{what}: folder {folder} is not writable")


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """`path` as a file that can be written: its folder exists and is writable, and the path is
    not a folder, a symbolic link (it would be replaced, not followed) or another non-regular file.
    `what` names the path in the error (a flag, say)."""
    p = Path(path)
    name = f"{what} {path}"
    if p.is_symlink():
        raise CanzonaError(f"{name}: a symbolic link; give the file it points to (a link would be "
                           "replaced by the file, not followed)")
    if p.is_dir():
        raise CanzonaError(f"{name}: a folder; give a file name")
    if p.exists() and not p.is_file():
        raise CanzonaError(f"{name}: not a regular file")
    _writable_folder(p.parent, name)
    return p


def check_output_folder(path: str | os.PathLike, what: str = "output folder") -> Path:
    """`path` as a folder that files can be written into: an existing writable folder, or a new
    one whose parent folder exists and is writable."""
    p = Path(path)
    name = f"{what} {path}"
    if p.exists():
        if not p.is_dir():
            raise CanzonaError(f"{name}: not a folder")
        _writable_folder(p, name)
    elif p.is_symlink():
        raise CanzonaError(f"{name}: a symbolic link to nothing")
    else:
        _writable_folder(p.parent, name)
    return p


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temporary file beside `path`, flush it to disk and rename it to
    `path`. On any failure the temporary file is removed and `path` is left as it was. A process
    whose launcher died (`canzona.runtime.lifecycle`) stops instead of starting the write."""
    stop_if_orphaned()
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{secrets.token_hex(6)}")
    ours = True  # whether `tmp` is this write's to remove on failure
    try:
        # created inside the try: a signal that unwinds the process just after the file exists
        # still removes it below
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # not ours (a 48-bit name collision): leave it
            ours = False
            raise CanzonaError(f"cannot write {p}: its temporary name {tmp.name} is taken") from None
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)  # replaces a symbolic link itself, never writes through it
    except BaseException:
        if ours:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)
