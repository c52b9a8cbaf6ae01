"""Reading and writing the files users hand to canzona, safely.

Inputs (plans, hardware profiles, cost tables) come from users: a FIFO, `/dev/zero`, a huge or
deeply nested document, a 5000-digit integer or a `NaN` must end in one clear error, never a hang,
unbounded memory or a traceback. Outputs (plans, traces, plots) are written to a temporary file
beside the target and renamed over it, so a full disk or a killed process never leaves a truncated
file where a good one was.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from canzona.errors import CanzonaError

# The largest plan canzona writes (Qwen3-32B at DP 16384, TP 8) is about 1 MB; a hundred times that
# is still read in well under a second, and anything larger is not one of our files.
MAX_INPUT_BYTES = 128 * 2**20


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different: a key given twice (a figure edited by adding a second
    line) would silently be read as its last value, where the user may have meant either."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:80]!r} given twice")
        out[key] = value
    return out


def parse_json(text: str, where: str, error: type[CanzonaError] = CanzonaError) -> Any:
    """Parse strict JSON: no NaN / Infinity, no key twice in an object, bounded nesting and integer
    length, one-line errors."""
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # a non-finite constant, or an integer longer than Python converts
        reason = "a number has too many digits" if "integer string conversion" in str(e) else str(e)
        raise error(f"{where}: not valid JSON ({reason})") from None


def read_text(path: str | Path, what: str, error: type[CanzonaError] = CanzonaError,
              max_bytes: int | None = None) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes` (default `MAX_INPUT_BYTES`); FIFOs,
    devices and directories are rejected before they are opened (opening a FIFO blocks until a
    writer appears)."""
    max_bytes = MAX_INPUT_BYTES if max_bytes is None else max_bytes
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"cannot read {what} {path}: not a regular file")
        if info.st_size > max_bytes:
            raise error(f"cannot read {what} {path}: {info.st_size} bytes is more than the "
                        f"{max_bytes} a {what} may have")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since stat
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise error(f"cannot read {what} {path}: more than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"cannot read {what} {path}: not UTF-8 text") from None


def read_json(path: str | Path, what: str, error: type[CanzonaError] = CanzonaError) -> Any:
    return parse_json(read_text(path, what, error), str(path), error)


def dumps_json(obj: Any, indent: int | None = None) -> str:
    """JSON that every parser accepts: a non-finite number is a bug upstream, not `Infinity`."""
    return json.dumps(obj, indent=indent, allow_nan=False)


def is_finite_number(value: Any) -> bool:
    """A real number as JSON means it: booleans are not numbers, NaN and infinities are not finite,
    and neither is an integer too large for a float (10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_whole_number(value: Any, low: int, high: int) -> bool:
    """An integer (not a boolean) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def one_line(text: str) -> str:
    """`text` with control characters (a newline in a path) escaped, so an error stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_output_path(path: str | Path, what: str, suffixes: tuple[str, ...] | None = None,
                      inputs: Iterable[str | Path | None] = ()) -> Path:
    """Fail before any work if `path` cannot be written: missing or unwritable folder, something
    other than a regular file in its place (a directory, a device, a symlink: renaming over them
    would replace them), (with `suffixes`) an extension the writer does not produce, or one of the
    command's `inputs` (a model, hardware or cost file; a catalog name is no file): writing would
    replace the file the command reads, and the next run would fail on it."""
    p = Path(path)
    for given in inputs:
        if given is not None and _same_file(p, Path(given)):
            raise CanzonaError(f"cannot write {what} {p}: it is the input file {given}, which writing would replace; "
                               "choose another path")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        got = f"unsupported extension '{p.suffix}'" if p.suffix else "no extension"
        raise CanzonaError(f"{what} {p}: {got}; use one of {', '.join(suffixes)}")
    if len(p.name.encode()) > NAME_MAX:
        raise CanzonaError(f"cannot write {what}: the file name is longer than {NAME_MAX} bytes")
    try:
        if p.is_symlink():
            raise CanzonaError(f"cannot write {what} {p}: it is a symbolic link (give the file it points to)")
        if p.exists() and not p.is_file():
            kind = "a directory" if p.is_dir() else "not a regular file"
            raise CanzonaError(f"cannot write {what} {p}: it is {kind}")
        folder = p.parent if str(p.parent) else Path(".")
        if not folder.exists():
            raise CanzonaError(f"cannot write {what} {p}: folder {folder} does not exist")
        if not folder.is_dir():
            raise CanzonaError(f"cannot write {what} {p}: {folder} is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise CanzonaError(f"cannot write {what} {p}: folder {folder} is not writable")
    except OSError as e:
        raise CanzonaError(f"cannot write {what} {p}: {e.strerror or e}") from None
    return p


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one existing file (through links, relative or absolute paths)."""
    try:
        return a.exists() and b.is_file() and os.path.samefile(a, b)
    except OSError:
        return False


NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows file systems


def write_atomic(path: str | Path, write: Callable[[Path], None], what: str = "file") -> None:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it over `path`.

    The temporary file keeps `path`'s extension (writers such as matplotlib pick the format from
    it); on any failure it is removed and `path` is left as it was."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    # a short name of its own (the target's name may already be as long as names can be), known
    # before the file exists: a signal that unwinds the process between the file's creation and
    # the code after it still finds it to remove (as it would not in tempfile.mkstemp's return)
    tmp = str(folder / f".canzona-{secrets.token_hex(8)}.tmp{p.suffix[:16]}")
    try:
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            tmp = ""  # not ours (a 64-bit name collision): leave it
            raise
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # created 0600; the target gets what open() would give
        os.replace(tmp, p)
    except OSError as e:
        raise CanzonaError(f"cannot write {what} {p}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str | Path, text: str, what: str = "file") -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text), what)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
