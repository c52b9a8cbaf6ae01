"""Output paths are checked before the work (`check_output_file`, `check_output_folder`) and
written whole or not at all (`write_atomically`): issue 17 finding 11, the library part."""

from __future__ import annotations

import os

import pytest

from canzona.errors import CanzonaError
from canzona.runtime.atomic_files import check_output_file, check_output_folder, write_atomically


def test_a_writable_file_path_passes(tmp_path):
    assert check_output_file(tmp_path / "new.pt", "--out") == tmp_path / "new.pt"
    (tmp_path / "old.pt").write_bytes(b"old")
    assert check_output_file(tmp_path / "old.pt", "--out") == tmp_path / "old.pt"


@pytest.mark.parametrize("case, needle", [
    ("a folder", "a folder; give a file name"),
    ("a symbolic link", "a symbolic link"),
    ("a dangling symbolic link", "a symbolic link"),
    ("a fifo", "not a regular file"),
    ("in a missing folder", "does not exist"),
    ("in a file", "does not exist"),
])
def test_an_unwritable_file_path_is_one_line(case, needle, tmp_path):
    target = tmp_path / "out.pt"
    if case == "a folder":
        target.mkdir()
    elif case == "a symbolic link":
        (tmp_path / "real.pt").write_bytes(b"keep")
        target.symlink_to(tmp_path / "real.pt")
    elif case == "a dangling symbolic link":
        target.symlink_to(tmp_path / "nowhere.pt")
    elif case == "a fifo":
        os.mkfifo(target)
    elif case == "in a missing folder":
        target = tmp_path / "missing" / "out.pt"
    else:
        (tmp_path / "file").write_text("")
        target = tmp_path / "file" / "out.pt"
    with pytest.raises(CanzonaError) as refused:
        check_output_file(target, "--out")
    message = str(refused.value)
    assert message.startswith(f"--out {target}: ") and needle in message and "\n" not in message


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_folder_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(CanzonaError, match="is not writable"):
        check_output_file(tmp_path / "ro" / "out.pt", "--out")
    with pytest.raises(CanzonaError, match="is not writable"):
        check_output_folder(tmp_path / "ro", "--save")


def test_output_folders(tmp_path):
    assert check_output_folder(tmp_path, "--save") == tmp_path
    assert check_output_folder(tmp_path / "new", "--save") == tmp_path / "new"  # created later
    (tmp_path / "file").write_text("")
    with pytest.raises(CanzonaError, match="--save .*file: not a folder"):
        check_output_folder(tmp_path / "file", "--save")
    with pytest.raises(CanzonaError, match="does not exist"):
        check_output_folder(tmp_path / "missing" / "ckpt", "--save")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.pt"
    target.write_bytes(b"old result")

    def fails_midway(f):
        f.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, fails_midway)
    assert target.read_bytes() == b"old result"
    assert [p.name for p in tmp_path.iterdir()] == ["out.pt"]
    write_atomically(target, lambda f: f.write(b"new result"))
    assert target.read_bytes() == b"new result"
    assert [p.name for p in tmp_path.iterdir()] == ["out.pt"]


def test_a_symbolic_link_is_replaced_not_followed(tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"not yours")
    (tmp_path / "out.pt").symlink_to(tmp_path / "elsewhere")
    write_atomically(tmp_path / "out.pt", lambda f: f.write(b"result"))
    assert (tmp_path / "elsewhere").read_bytes() == b"not yours"
    assert not (tmp_path / "out.pt").is_symlink() and (tmp_path / "out.pt").read_bytes() == b"result"


@pytest.mark.parametrize("writer", ["runtime", "fileio"])
def test_an_interrupt_just_after_the_temporary_exists_removes_it(tmp_path, monkeypatch, writer):
    """SIGTERM / Ctrl-C unwind the process with an exception wherever it is: arriving the moment
    the temporary file has been created (before the code after `os.open` runs), it still leaves
    nothing beside the target, and the target as it was."""
    import canzona.fileio as fileio
    import canzona.runtime.atomic_files as atomic_files

    module = atomic_files if writer == "runtime" else fileio
    real_open = os.open

    def open_then_interrupted(*args, **kwargs):
        real_open(*args, **kwargs)  # the file now exists
        raise KeyboardInterrupt

    monkeypatch.setattr(module.os, "open", open_then_interrupted)
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        if writer == "runtime":
            atomic_files.write_atomically(target, lambda f: f.write(b"new"))
        else:
            fileio.write_atomic(target, lambda p: p.write_text("new"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"] and target.read_text() == "old"


def test_a_writer_that_raises_our_own_error_leaves_no_temporary(tmp_path):
    """An error of canzona's own (a CheckpointError from inside the writer, say) is a failure like
    any other: the partial temporary file goes, the target stays."""
    from canzona.errors import CheckpointError

    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def partial(f):
        f.write(b"partial")
        raise CheckpointError("the writer failed")

    with pytest.raises(CheckpointError):
        write_atomically(target, partial)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"] and target.read_bytes() == b"old"
