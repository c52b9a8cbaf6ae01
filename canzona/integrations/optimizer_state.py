"""The sharded optimizer folders `CanzonaAccelerator.save_state` and `CanzonaTrainer` write beside
the framework's own files: complete or invisible, and checked before they are read.

`save_optimizer` writes a canzona optimizer's sharded state with `save_checkpoint`: every rank into a
staging folder, a manifest (each file's sha256) and one atomic rename or swap. A save killed midway
(a reused `save_state(output_dir)` folder, a Trainer saving a step again) leaves the previous
folder as it was, never the old `.metadata` beside new shard files (a silent mix of two steps).

`load_optimizer` verifies such a folder against its manifest on every rank (the ranks share the
hashing) and reads it with `SafeFileSystemReader`: a damaged, truncated or foreign file is one
`CheckpointError` line on every rank, and nothing is loaded. A folder written by the older plain
`dcp.save` (no manifest) loads as before.

The framework writes the model's files before the optimizer folder, so a save killed between them
leaves this step's weights beside the previous step's optimizer state (and, for the Trainer, its
scheduler and step count). The load checks the weights just loaded (`check_weights=True`): with fp32 master weights (a bf16 / fp16 model) that they are the
checkpoint's masters cast to their dtype, which holds after every step; without (an fp32 model,
`master_weights=False`) that they equal the checkpoint's witness of them (a few elements of every
parameter, recorded at the save). A mismatch is one `CheckpointError` on every rank, nothing
loaded. An optimizer folder of an older canzona has no witness: without masters it is not checked.

Saving over such an older folder is refused (one `CheckpointError`, on every rank, before anything
of the optimizer is written): it is the only copy of that state, and replacing it in place is what
could leave a mix. Move it aside or delete it (it still loads), or save to a new folder.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from canzona.errors import CheckpointError
from canzona.runtime.checkpoint_files import (
    MANIFEST,
    Ranks,
    save_checkpoint,
    verified_reader,
)

CONTENT = "canzona optimizer state"  # manifest_info["content"] of every such folder


def _group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def fingerprint(opt: Any) -> str | None:
    """The fingerprint of the model `opt` steps (its spec's: names, shapes, roles, TP dims), or None."""
    spec = getattr(opt, "spec", None)
    return spec.fingerprint() if spec is not None and hasattr(spec, "fingerprint") else None


def optimizer_info(opt: Any) -> dict[str, Any]:
    """What an optimizer folder's manifest says it holds (the model's fingerprint: what
    `CanzonaAccelerator.load_state` matches each optimizer's folder by)."""
    info: dict[str, Any] = {"content": CONTENT, "optimizer": str(getattr(opt, "optimizer", ""))}
    found = fingerprint(opt)
    if found is not None:
        info["fingerprint"] = found
        info["model"] = getattr(opt.spec, "name", "")
    return info


def is_legacy(folder: str | os.PathLike) -> bool:
    """A non-empty folder without a manifest: written in place by an older canzona (plain dcp.save)."""
    p = Path(folder)
    return p.is_dir() and not (p / MANIFEST).exists() and any(p.iterdir())


def written_whole(folder: str | os.PathLike) -> bool:
    """An optimizer folder whose save finished: its manifest is in (or, written in place by an older
    canzona, its `.metadata`, which dcp.save writes last)."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in (MANIFEST, ".metadata"))


def outside_level(depth: int = 1) -> int:
    """The `stacklevel` of a warning raised by the function `depth` frames up from this one's caller
    (1: the caller itself) that points at the first frame outside canzona, accelerate and
    transformers: the user's call (`prepare`, `train`, `load_state`), not canzona's own line."""
    inside = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (sys.modules.get(n) for n in ("canzona", "accelerate", "transformers"))
                   if getattr(m, "__file__", None))
    frame, level = sys._getframe(depth), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class Named(str):
    """A reason `latest_whole` is given for skipping a folder that is no save killed midway (said of
    the others): one naming what wrote it (a `save_only_model` save, another framework's), or a
    damaged file in a save that finished."""


def latest_whole(parent: str, numbered: Iterable[tuple[int, str]], problem: Callable[[str], str | None], *,
                 asked: str, killed: str, none: str) -> str:
    """Of the folders of `parent` (`numbered`: each one's number and name), the highest-numbered one
    that `problem` finds nothing wrong with (the framework's own rule takes the highest, a save
    killed midway's folder too); one warning naming the folders skipped, if any. None such: one
    `CheckpointError`, `asked` (what the user called) naming each folder skipped and why, and that
    `killed` (a save killed midway) leaves those whose reason is no `Named` one; `none` where there
    is no folder at all."""
    skipped, unnamed = [], []
    for _, name in sorted(numbered, reverse=True):
        folder = os.path.join(parent, name)
        found = problem(folder)
        if found is None:
            if skipped:  # steps behind the latest save: said, once (the search runs on rank 0)
                warnings.warn(f"{asked}: resuming from {name}, skipping {', '.join(skipped)}"
                              f"{_left(killed, unnamed, skipped, ': ')}", stacklevel=outside_level())
            return folder
        skipped.append(f"{name} ({found})")
        if not isinstance(found, Named):
            unnamed.append(name)
    if not skipped:
        raise CheckpointError(none)
    raise CheckpointError(f"{asked}: no whole checkpoint in {parent}: {', '.join(skipped)}"
                          f"{_left(killed, unnamed, skipped, '; ')}")


def _left(killed: str, unnamed: list[str], skipped: list[str], sep: str) -> str:
    """`latest_whole`'s tail: that `killed` leaves the folders skipped for no `Named` reason."""
    if not unnamed:
        return ""
    like = "such a folder" if len(unnamed) == len(skipped) else f"a folder like {', '.join(unnamed)}"
    return f"{sep}{killed} leaves {like}"


def legacy_message(folder: str | os.PathLike) -> str:
    return (f"{folder} holds optimizer state written in place by an older canzona (no {MANIFEST}): it is not "
            "replaced, since a save killed midway would leave a mix of two steps; move it aside or delete it (it "
            "still loads), or save to a new folder")


def check_replaceable(folders: list[str | os.PathLike]) -> None:
    """Collective: one `CheckpointError` on every rank if rank 0 sees an older in-place optimizer
    folder among `folders` (call before anything of the checkpoint is written)."""

    def check() -> None:
        for folder in folders:
            if is_legacy(folder):
                raise CheckpointError(legacy_message(folder))

    Ranks(_group()).together(check, rank0_only=True)


def save_optimizer(opt: Any, folder: str | os.PathLike, info: dict[str, Any] | None = None) -> None:
    """Collective: `opt`'s sharded state into `folder`, complete or not at all (`save_checkpoint`);
    `info` (JSON) recorded in its manifest beside `optimizer_info`."""
    save_checkpoint(opt.sharded_state_dict(), folder, manifest_info={**optimizer_info(opt), **(info or {})},
                    process_group=_group())


def load_optimizer(opt: Any, folder: str | os.PathLike) -> None:
    """Collective: `opt`'s state from `folder`, verified against its manifest first (every rank
    raises the same `CheckpointError` for a damaged or foreign file, and nothing is loaded); a
    folder of an older canzona (no manifest) is read as it always was."""
    opt.load_sharded_state_dict(verified_reader(folder, {"content": CONTENT}, process_group=_group()), check_weights=True)
