"""The optimizer object itself is not pickled, copied or `torch.save`d: its state lives in flat
buffers that the model's hooks, the gradient guards and in-flight collectives share, bound to its
process group, and none of that travels in a pickle. A copy would be an optimizer no rank can step
(and `torch.save(opt)` wrote one silently). What saves it is `state_dict()`.

torch.save gives no object a say before it opens its target, so the refusal (during the pickling)
undoes what torch.save began there:

- a path: torch's zip writer opened (created, or truncated) it first: the file is removed. A file
  that was there before is lost all the same (truncated before any pickling);
- a file object the caller opened (io.BytesIO, a file, a pipe, a socket's): torch's zip writer
  holds everything in memory until its `with` block exits, then writes the archive through the
  object's `write` (looked up at each call) and flushes. Truncating back afterwards would not serve
  a pipe or a socket, and nothing runs after that exit before the error reaches the caller; so the
  refusal shadows the object's `write` with one that drops what this torch.save writes, and its
  `flush` (the exit's last call) with one that takes both shadows off: not a byte reaches the
  object, whatever it is. Left as it was: an object whose attributes cannot be set (`__slots__`),
  and torch's legacy format (`_use_new_zipfile_serialization=False`), which writes its header to
  the object before pickling.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch

from canzona.errors import CheckpointError

NOT_PICKLED = ("{cls} cannot be pickled, copied or torch.save()d as an object (its state lives in buffers bound to "
               "the model's hooks and the process group): save optimizer.state_dict() (torch.save, or dcp.save with "
               "get_optimizer_state_dict) and load it into a new {cls} with load_state_dict()")

_SHADOWED = ("write", "flush")
_ABSENT = object()


class NotPickled:
    """Mixed into the optimizers: pickling (`pickle`, `copy.copy`, `copy.deepcopy`, `torch.save`)
    raises `CheckpointError`, and torch.save leaves nothing written."""

    def __reduce_ex__(self, protocol: object) -> object:
        _undo_torch_save()
        raise CheckpointError(NOT_PICKLED.format(cls=type(self).__name__))


def _torch_save_frame() -> FrameType | None:
    """The frame of the torch.save call this pickling runs in, if any."""
    save = torch.serialization.save.__code__
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not save:
        frame = frame.f_back
    return frame


def _undo_torch_save() -> None:
    frame = _torch_save_frame()
    if frame is None:
        return
    target = frame.f_locals.get("f")
    if isinstance(target, (str, os.PathLike)):
        try:
            os.unlink(target)
        except OSError:  # not created, or not removable: torch's own error handling stands
            pass
    elif frame.f_locals.get("_use_new_zipfile_serialization", True):
        _silence(target, frame)


def _silence(target: Any, save: FrameType) -> None:
    """Drop what the torch.save call of frame `save` writes into `target` from here on; the exit's
    flush, or any write from outside that call, takes the shadows off first (so no later write of
    the caller's is lost, whatever torch's exit does)."""
    kept = {name: vars(target).get(name, _ABSENT) for name in _SHADOWED} if hasattr(target, "__dict__") else None
    if kept is None:
        return

    def restore() -> None:
        for name, value in kept.items():
            if value is _ABSENT:
                vars(target).pop(name, None)
            else:
                setattr(target, name, value)

    def inside_save() -> bool:
        frame = sys._getframe(2)
        while frame is not None and frame is not save:
            frame = frame.f_back
        return frame is not None

    def write(data: Any) -> int:
        if inside_save():
            return memoryview(data).nbytes
        restore()
        return target.write(data)

    def flush() -> None:
        restore()
        target.flush()

    try:
        target.write, target.flush = write, flush
    except (AttributeError, TypeError):  # read-only attributes: left as it was
        restore()
