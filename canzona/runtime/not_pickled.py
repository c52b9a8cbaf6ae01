"""The optimizer object itself is not pickled, copied or `torch.save`d: its state lives in flat
buffers that the model's hooks, the gradient guards and in-flight collectives share, bound to its
process group, and none of that travels in a pickle. A copy would be an optimizer no rank can step
(and `torch.save(opt)` wrote one silently). What saves it is `state_dict()`.
"""

from __future__ import annotations

import os
import sys

import torch

from canzona.errors import CheckpointError

NOT_PICKLED = ("{cls} cannot be pickled, copied or torch.save()d as an object (its state lives in buffers bound to "
               "the model's hooks and the process group): save optimizer.state_dict() (torch.save, or dcp.save with "
               "get_optimizer_state_dict) and load it into a new {cls} with load_state_dict()")


class NotPickled:
    """Mixed into the optimizers: pickling (`pickle`, `copy.copy`, `copy.deepcopy`, `torch.save`)
    raises `CheckpointError` before anything is written."""

    def __reduce_ex__(self, protocol: object) -> object:
        _drop_torch_save_file()
        raise CheckpointError(NOT_PICKLED.format(cls=type(self).__name__))


def _drop_torch_save_file() -> None:
    """`torch.save(opt, path)` has opened `path` (truncating it) before it pickles anything: remove
    it, so that no partial file is left behind (on POSIX the open writer then finishes an unlinked
    file). A file object passed to torch.save is the caller's to close."""
    save = torch.serialization.save.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not save:
        frame = frame.f_back
    if frame is None:
        return
    target = frame.f_locals.get("f")
    if isinstance(target, (str, os.PathLike)):
        try:
            os.unlink(target)
        except OSError:  # not created, or not removable: torch's own error handling stands
            pass
