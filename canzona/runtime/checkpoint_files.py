"""Checkpoint folders that are complete or invisible, and checked before anything in them is trusted.

`torch.distributed.checkpoint` (DCP) writes a checkpoint as one folder: a file per rank and a
`.metadata` file (a pickle). Written in place, a save killed midway leaves some ranks' new files
beside other ranks' old ones, which load silently, and unpickling `.metadata` runs whatever code a
crafted one names. This module keeps DCP's format and adds:

- `save_checkpoint(state_dict, folder, manifest_info=...)` (collective): every rank writes into a
  staging folder `folder.tmp-<token>` (each file flushed to disk by DCP); the ranks hash what was
  written, each a share; rank 0 writes `manifest.json` (every file, its size and sha256, and
  `manifest_info`), flushes it, and makes the folder visible under its name with one rename. An
  existing checkpoint of that name is swapped out in the same atomic step (Linux `renameat2`), or,
  where the file system cannot, renamed aside to `folder.old-<token>` first and removed only after
  the new one is in place. At every instant a complete checkpoint is there to resume from; leftover
  staging folders of killed saves are never taken for checkpoints, and are removed by the next save
  of the same name.
- `verify_checkpoint(folder, expect)`: the manifest is read (JSON) and checked before anything is
  unpickled: every file listed is there with its size and sha256, no other file is, and the
  manifest's `info` has the `expect`ed values. A bit flip, a truncated file, a file from another
  save or run, a missing manifest: one-line `CheckpointError`. With a process group the ranks share
  the hashing.
- `SafeFileSystemReader(folder, manifest)`: a DCP reader that unpickles `.metadata` with an
  unpickler that knows only DCP's metadata classes, `torch.Size` and dtypes, checks that every
  entry it describes lies inside the checkpoint's files, and loads the non-tensor entries as plain
  data only (tensors DCP already loads with `weights_only`): a checkpoint runs no code, even one
  whose manifest is consistent.
- `verified_reader(folder)` (collective): the reader to give `dcp.load`: a `save_checkpoint` folder
  verified against its manifest, a plain `dcp.save` folder's `.metadata` read and checked against
  its files on every rank (none, a shard cut short or missing, ranks given folders of different
  saves: one `CheckpointError` on every rank before `dcp.load` reads anything; a save killed over
  an older one only where a new shard is shorter than the old `.metadata` needs).
- `latest_checkpoint(directory)`: the `step_K` folder with the largest K among the complete ones.

What remains trusted: the contents. A consistent checkpoint made by someone else can hold any
weights and hyper-parameters; the manifest proves that the files are the ones its writer listed,
not who the writer was.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import math
import os
import pickle
import re
import secrets
import shutil
import stat
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from canzona.errors import CanzonaError, CheckpointError
from canzona.runtime.atomic_files import fsync_dir
from canzona.runtime.lifecycle import stop_if_orphaned

if TYPE_CHECKING:
    from canzona.runtime.comm import Comm

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's index of the checkpoint (a pickle)
FORMAT = "canzona.checkpoint"
VERSION = 1
STAGING = ".tmp-"  # `{name}.tmp-{token}`: a save being written, or one that was killed
ASIDE = ".old-"  # `{name}.old-{token}`: the checkpoint being replaced, until the new one is in
MAX_MANIFEST_BYTES = 64 << 20  # about 400k files; a larger one is not a manifest this module wrote
HASH_CHUNK = 1 << 20
STEP_PREFIX = "step_"

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What `manifest.json` says: every file of the checkpoint, the world size that wrote it, and
    the writer's `manifest_info` (for example the step, the layout, the model's fingerprint)."""

    files: Mapping[str, FileEntry]
    info: Mapping[str, Any] = field(default_factory=dict)
    world: int = 1

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "world": self.world, "info": dict(self.info),
                           "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in sorted(self.files.items())}},
                          indent=1)


# --- the ranks of a collective step -------------------------------------------------------------


def first_line(e: BaseException) -> str:
    """An error's first line; for a DCP failure, that of the lowest failing rank's cause."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = min(e.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {first_line(cause)}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Ranks:
    """The ranks of `process_group` (the default group when None), or this process alone when
    torch.distributed is not initialised. `together` runs a step on each and raises the same
    error on every rank if any failed, so that no rank is left waiting in the next collective.

    `timeout_s`: the ranks meet within it (an optimizer's `timeout_s`), not within the process
    group's own timeout (30 minutes by default), and `call` names the collective call a rank that
    never came should have made (a save on rank 0 only): one `CanzonaError` line instead of a wait
    and gloo's error."""

    def __init__(self, process_group: Any = None, *, timeout_s: float | None = None, call: str = "") -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.timeout_s = timeout_s
        self.call = call

    @property
    def _collective(self) -> str:
        return f"{self.call or 'this call'} is collective: call it on every rank"

    def together(self, step: Callable[[], T], *, rank0_only: bool = False) -> list[T]:
        try:
            mine: tuple[bool, Any] = (True, step() if self.rank == 0 or not rank0_only else None)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            mine = (False, first_line(e))
        every = [mine]
        if self.distributed and self.timeout_s is not None:
            from canzona.runtime.comm import Comm  # bounded by timeout_s

            try:
                every = Comm(self.group, self.timeout_s, "world").all_gather_object(mine, "checkpoint step")
            except CanzonaError as e:
                raise CanzonaError(f"{e}; {self._collective}") from None
        elif self.distributed:
            every = [None] * self.world
            try:
                dist.all_gather_object(every, mine, group=self.group)
            except RuntimeError as e:  # gloo's or NCCL's, at the process group's timeout or a peer's death
                raise CheckpointError(f"the ranks did not meet ({first_line(e)}): a peer died, or {self._collective}") \
                    from None
        raise_failures({r: text for r, (ok, text) in enumerate(every) if not ok}, self.world)
        return [value for _, value in every]


def raise_failures(failed: Mapping[int, str], world: int) -> None:
    """One CheckpointError, alike on every rank, where any rank's step failed (`failed`: its
    first error line by rank): the error itself where every one of the `world` ranks failed alike,
    else the first failed rank's, named."""
    if failed:
        rank = min(failed)
        alike = len(failed) == world and all(text == failed[rank] for text in failed.values())
        raise CheckpointError(failed[rank] if alike else f"rank {rank}: {failed[rank]}")


def together_over(comms: Sequence[Comm | None], step: Callable[[], T], merge: Callable[[list[T]], T], *,
                  call: str, timeout_s: float | None = None) -> T:
    """`step` on this rank, merged with its result on every rank that `comms` reach, in turn: an
    optimizer's own groups (its DP group, then its TP group, reach every rank of its DP x TP mesh,
    as `DistributedOptimizer._inf_norm`'s max does), not the default process group, whose other
    ranks (another replica on its own DP group, another pipeline stage) are not in this call and
    may hold other values at the same names. Each round gathers each member's merged value and
    `merge`s them in member order: identical on every rank where `merge` depends on its argument
    alone. One `CheckpointError` on every rank if `step` raised on any (as `Ranks.together`, with
    global ranks); bounded by each group's timeout, or by `timeout_s` where given (hashing a large
    checkpoint may take longer than a step's collectives wait); not logged on the groups' own logs
    (no step's collective)."""
    from canzona.runtime.comm import Comm

    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    try:
        state: tuple[int, dict[int, str], Any] = (1, {}, step())
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        state = (1, {me: first_line(e)}, None)
    for comm in comms:
        if comm is None or comm.size == 1:
            continue
        try:
            wait_s = comm.timeout.total_seconds() if timeout_s is None else timeout_s
            every = Comm(comm.group, wait_s, comm.name).all_gather_object(state, "checkpoint step")
        except CanzonaError as e:
            raise CanzonaError(f"{e}; {call} is collective: call it on every rank") from None
        failed = {r: text for _, f, _ in every for r, text in f.items()}
        state = (sum(n for n, _, _ in every), failed, None if failed else merge([v for _, _, v in every]))
    count, failed, value = state
    raise_failures(failed, count)
    return value


class OwnRanks:
    """The ranks of one optimizer: those its own groups reach in turn (`comms`, its DP group then
    its TP group, or its FSDP mesh's group; `together_over`), never the default process group's
    others (another replica, another pipeline stage), which may save, load or train on their own
    at that moment. `Ranks`'s interface: this rank's index among them (DP rank + DP size x TP
    rank: the groups form a grid), their number, and `together`, each step's result by index.
    Where the optimizer's ranks are the whole job, the same steps as `Ranks` over it."""

    def __init__(self, comms: Sequence[Comm | None], *, timeout_s: float | None = None, call: str = "") -> None:
        self.comms = [c for c in comms if c is not None and c.size > 1]
        self.rank, self.world = 0, 1
        for comm in self.comms:
            self.rank += comm.rank * self.world
            self.world *= comm.size
        self.timeout_s = timeout_s
        self.call = call

    def together(self, step: Callable[[], T], *, rank0_only: bool = False) -> list[T]:
        def mine() -> dict[int, Any]:
            return {self.rank: step() if self.rank == 0 or not rank0_only else None}

        every = together_over(self.comms, mine, lambda parts: {i: v for part in parts for i, v in part.items()},
                              call=self.call or "this call", timeout_s=self.timeout_s)
        return [every[i] for i in range(self.world)]


# --- saving -------------------------------------------------------------------------------------


def save_checkpoint(state_dict: dict[str, Any], folder: str | os.PathLike, *,
                    manifest_info: Mapping[str, Any] | None = None, process_group: Any = None) -> Manifest:
    """Save `state_dict` with DCP so that `folder` appears complete or not at all (see the module's
    docstring). Collective over `process_group` (the default group; this process alone when
    torch.distributed is not initialised). `manifest_info` must be JSON; `verify_checkpoint`'s
    `expect` compares against it. An existing `folder` is replaced only if it is a checkpoint (it
    has a manifest) or empty. Any failure is a `CheckpointError` on every rank, and the folder
    that was there stays."""
    stop_if_orphaned()  # a rank whose launcher died starts no new checkpoint (lifecycle's docstring)
    folder = Path(folder)
    info = dict(manifest_info or {})
    try:
        json.dumps(info)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"manifest_info must be JSON: {e}") from None
    ranks = Ranks(process_group, call="save_checkpoint()")
    token = ranks.together(lambda: _prepare_destination(folder), rank0_only=True)[0]
    staging = folder.with_name(f"{folder.name}{STAGING}{token}")
    try:
        writer = dcp.FileSystemWriter(staging, sync_files=True, overwrite=False)
        try:
            with warnings.catch_warnings():
                # without torch.distributed, DCP warns that it saves in this process alone: as meant
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                metadata = dcp.save(state_dict, storage_writer=writer, process_group=process_group,
                                    no_dist=not ranks.distributed)
        except dcp.CheckpointException as e:
            raise CheckpointError(f"{folder}: the save failed on {first_line(e)}") from None
        # every rank knows every file from the metadata: each hashes a share of them
        names = sorted({s.relative_path for s in metadata.storage_data.values()} | {METADATA})
        shares = ranks.together(lambda: {n: _describe_file(staging / n) for n in names[ranks.rank::ranks.world]})
        files = {n: e for share in shares for n, e in share.items()}
        manifest = Manifest(files=files, info=info, world=ranks.world)
        ranks.together(lambda: _publish(staging, folder, manifest), rank0_only=True)
    except BaseException:
        if ranks.rank == 0:  # every rank is past writing: nothing is added to it any more
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _prepare_destination(folder: Path) -> str:
    """Rank 0, before anything is written: refuse to replace what is not a checkpoint, create the
    parent folder and the staging folder; return the staging token."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise CheckpointError(f"{folder} exists and is not a checkpoint folder: not replaced")
    if folder.is_dir() and not (folder / MANIFEST).is_file() and any(folder.iterdir()):
        raise CheckpointError(f"{folder} exists and is not a checkpoint written by save_checkpoint "
                              f"(no {MANIFEST}): not replaced; remove it or save elsewhere")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(6)
        folder.with_name(f"{folder.name}{STAGING}{token}").mkdir()
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot create the checkpoint folder: {e}") from None
    return token


def _describe_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, sha256=digest.hexdigest())


def _publish(staging: Path, folder: Path, manifest: Manifest) -> None:
    """Rank 0, after every rank's files are on disk: the manifest, then one rename."""
    fd = os.open(staging / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)  # the names of every rank's files and of the manifest
    if os.path.lexists(folder):
        if _exchange(staging, folder):
            old = staging  # the replaced checkpoint now lies under the staging name
        else:  # no atomic swap here: the old one is renamed aside, complete, until the new one is in
            old = folder.with_name(f"{folder.name}{ASIDE}{staging.name.rsplit(STAGING, 1)[1]}")
            os.rename(folder, old)
            try:
                os.rename(staging, folder)
            except OSError:
                os.rename(old, folder)  # put the old one back under its name
                raise
        fsync_dir(folder.parent)
        shutil.rmtree(old)
    else:
        os.rename(staging, folder)
        fsync_dir(folder.parent)
    _remove_leftovers(folder)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`); False where the system or
    the file system cannot (NFS, for one)."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_leftovers(folder: Path) -> None:
    """Staging and set-aside folders of earlier saves of `folder` that were killed. Two runs saving
    the same folder at once would be a mistake anyway; this makes the other one fail loudly."""
    for other in folder.parent.iterdir():
        if other.name.startswith((f"{folder.name}{STAGING}", f"{folder.name}{ASIDE}")) and not other.is_symlink():
            shutil.rmtree(other, ignore_errors=True)


# --- checking -----------------------------------------------------------------------------------


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of a checkpoint folder, checked for form (nothing is hashed)."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        st = path.lstat()
    except FileNotFoundError:
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such checkpoint folder") from None
        raise CheckpointError(f"{folder}: no {MANIFEST}: not a complete checkpoint (a save that did not finish, "
                              "or one not written by save_checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot read {MANIFEST}: {e}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: not a manifest (not a regular file, or too large)")
    try:
        raw = json.loads(path.read_bytes())
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        files = {}
        for name, entry in raw["files"].items():
            if not _plain_name(name) or name == MANIFEST:
                raise ValueError(f"lists {name!r}, which is not a file name in the folder")
            size, digest = entry["size"], entry["sha256"]
            if type(size) is not int or size < 0 or not re.fullmatch(r"[0-9a-f]{64}", str(digest)):
                raise ValueError(f"a malformed entry for {name!r}")
            files[name] = FileEntry(size=size, sha256=digest)
        if METADATA not in files or type(raw["world"]) is not int or not isinstance(raw["info"], dict):
            raise ValueError(f"no {METADATA}, world size or info")
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a valid manifest ({first_line(e)})") from None
    return Manifest(files=files, info=raw["info"], world=raw["world"])


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def _check_files(folder: Path, manifest: Manifest) -> None:
    """Every listed file is a regular file of its listed size, and no other file is there."""
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    unlisted = sorted(present - set(manifest.files))
    if unlisted:
        raise CheckpointError(f"{folder}: {unlisted[0]} is not in the manifest (a file from another save?)")
    for name, entry in sorted(manifest.files.items()):
        try:
            st = (folder / name).lstat()
        except FileNotFoundError:
            raise CheckpointError(f"{folder}: {name} is missing (an incomplete copy?)") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{folder}: {name} is not a regular file")
        if st.st_size != entry.size:
            raise CheckpointError(f"{folder}: {name} has {st.st_size} bytes, the manifest says {entry.size} "
                                  "(truncated, or from another save)")


def _check_expected(folder: Path, manifest: Manifest, expect: Mapping[str, Any] | None) -> None:
    for key, want in (expect or {}).items():
        got = manifest.info.get(key)
        if got != want:
            raise CheckpointError(f"{folder}: a checkpoint of {key} {got!r}, not {want!r}")


def _verify_share(folder: Path, expect: Mapping[str, Any] | None, rank: int, world: int) -> Manifest:
    manifest = read_manifest(folder)
    _check_expected(folder, manifest, expect)
    _check_files(folder, manifest)
    for name in sorted(manifest.files)[rank::world]:
        if _describe_file(folder / name) != manifest.files[name]:
            raise CheckpointError(f"{folder}: {name} differs from the manifest (sha256): a damaged file, or "
                                  "one from another save")
    return manifest


def verify_checkpoint(folder: str | os.PathLike, expect: Mapping[str, Any] | None = None, *,
                      process_group: Any = None) -> Manifest:
    """Check a checkpoint folder against its manifest before anything in it is unpickled: every
    listed file is there with its size and sha256, no other file is, and `manifest.info[key] ==
    value` for each item of `expect`. Raises a one-line `CheckpointError`; returns the manifest.

    Without `process_group` this process hashes every file. With one (`dist.group.WORLD`, say) the
    call is collective: each rank hashes a share and every rank raises the same error."""
    folder = Path(folder)
    if process_group is None:
        return _verify_share(folder, expect, 0, 1)
    return _verify_together(Ranks(process_group, call="verify_checkpoint()"), folder, expect)


def _verify_together(ranks: Ranks | OwnRanks, folder: Path, expect: Mapping[str, Any] | None) -> Manifest:
    every = ranks.together(lambda: _verify_share(folder, expect, ranks.rank, ranks.world))
    # each rank hashed a share of its own folder: folders of two saves (a path that differs by
    # rank) would each pass, and the ranks would load different checkpoints
    others = [r for r, manifest in enumerate(every) if manifest != every[ranks.rank]]
    if others:
        raise CheckpointError(f"{folder}: rank(s) {others} were given another checkpoint (their manifest differs): "
                              "every rank must load the same save")
    return every[ranks.rank]


def verified_reader(folder: str | os.PathLike, expect: Mapping[str, Any] | None = None, *,
                    process_group: Any = None, comms: Sequence[Comm | None] | None = None,
                    timeout_s: float | None = None, call: str = "",
                    _extension_registry: Any = None) -> SafeFileSystemReader:
    """Collective (over `process_group`, the default group when None): a reader of `folder`, checked
    against its manifest first when it has one (`verify_checkpoint`, the ranks sharing the hashing:
    a damaged file or one from another save of the same size is one `CheckpointError` on every
    rank, nothing read). A folder without a manifest (a plain `dcp.save`, an older canzona's) has
    its `.metadata` read and checked against the files (symlinks followed, as `dcp.load` follows
    them: a `snapshot_download` or `cp -rs` copy) on every rank here (`_check_plain`: none,
    an entry outside the files present, a shard cut short or missing: one `CheckpointError` on
    every rank, nothing read), and the ranks' `.metadata` compared (sha256; ranks given folders of
    different saves: one `CheckpointError` on every rank); the reader keeps the bytes checked and
    unpickles those alone, and still runs no code. A save killed or still writing is caught in a
    fresh folder only (no `.metadata`: DCP writes it last); over an older save, whose `.metadata`
    DCP leaves in place until the new one is written, only where a new shard is shorter than the
    old `.metadata` needs. Not caught there: whole new shards beside old ones (sizes alike), or a
    flipped bit (`save_checkpoint` folders are checked by sha256). Give it to `dcp.load(state_dict,
    storage_reader=...)` for a plain folder of `opt.state_dict()` or `get_optimizer_state_dict`'s.
    `timeout_s` and `call` (`Ranks`) bound the ranks' first meeting, which they all reach at once;
    the hashing, as long as the checkpoint is large, waits within the process group's timeout.
    `comms` (an optimizer's own groups, `OwnRanks`): collective over the ranks they reach alone,
    in place of `process_group`, so that one replica or pipeline stage loads while the others do
    anything else; the hashing waits within torch's default process group timeout.
    `_extension_registry` (as `dcp.FileSystemReader` takes it): the stream transforms a compressed
    save's entries name (`FileSystemWriter(_extensions=[...])`), each of which must resolve there."""
    if comms is not None:
        ranks: Ranks | OwnRanks = OwnRanks(comms, timeout_s=dist.default_pg_timeout.total_seconds(), call=call)
        first: Ranks | OwnRanks = OwnRanks(comms, timeout_s=timeout_s, call=call)
    else:
        ranks, first = Ranks(process_group, call=call), Ranks(process_group, timeout_s=timeout_s, call=call)
    # rank 0 decides for all: ranks that saw the folder differently would not meet in the hashing
    manifested = first.together(lambda: (Path(folder) / MANIFEST).exists(), rank0_only=True)[0]
    if not manifested:
        reader = SafeFileSystemReader(folder, _extension_registry=_extension_registry)
        # every rank its own read: one error on all; and one save on all (a path that differs by
        # rank, node-local copies of two saves, would each pass, each rank loading its own)
        every = first.together(lambda: _check_plain(reader))
        others = [r for r, digest in enumerate(every) if digest != every[0]]
        changing = "or the folder changed while being read (a save in progress)"
        if others and len(others) > 1 and len(set(every[1:])) == 1:  # rank 0 alone differs from all the others
            raise CheckpointError(f"{folder}: rank 0 was given another checkpoint than rank(s) {others} (its "
                                  f"{METADATA} differs from theirs), {changing}: every rank must load the same save")
        if others:
            raise CheckpointError(f"{folder}: rank(s) {others} were given another checkpoint than rank 0's (their "
                                  f"{METADATA} differs), {changing}: every rank must load the same save")
        return reader
    return SafeFileSystemReader(folder, _verify_together(ranks, Path(folder), expect),
                                _extension_registry=_extension_registry)


def _check_plain(reader: SafeFileSystemReader) -> str:
    """A folder without a manifest (a plain `dcp.save`), before `dcp.load` reads anything of it:
    its `.metadata` there (DCP writes it last: none, a save into a fresh folder killed or still
    writing; over an older save the old `.metadata` stays until the new one is written), read safely,
    and every entry inside the files present (a shard cut short or missing: one line here, where
    `dcp.load` raises its CheckpointException of tracebacks). Returns the sha256 of the `.metadata`
    bytes checked (which the reader keeps and unpickles): the save's identity, compared by the
    ranks (DCP's `save_id` is in those bytes)."""
    folder = Path(reader.path)
    if folder.is_dir() and not (folder / METADATA).exists():  # no folder at all: `read_metadata` says so
        local = sorted(p.name for p in folder.glob(f"__*{METADATA}"))
        if local:
            raise CheckpointError(f"{reader.path}: no {METADATA}, only rank-local metadata ({', '.join(local[:3])}"
                                  f"{', ...' if len(local) > 3 else ''}: use_collectives=False, or leftovers while a "
                                  "new save is still being written), not loaded: save it with collectives "
                                  "(dcp.save's default), or load it once the save has finished")
        raise CheckpointError(f"{reader.path}: no {METADATA}, not loaded: not a finished DCP checkpoint "
                              "(a save into this folder killed or still writing), or no checkpoint")
    return hashlib.sha256(reader.checked_metadata_bytes()).hexdigest()


def is_complete(folder: str | os.PathLike) -> bool:
    """A readable manifest and every file it lists with its size (nothing hashed)."""
    try:
        _check_files(Path(folder), read_manifest(folder))
    except (CheckpointError, OSError):
        return False
    return True


def latest_checkpoint(directory: str | os.PathLike, prefix: str = STEP_PREFIX) -> Path | None:
    """The complete checkpoint `{prefix}K` in `directory` with the largest K (None if there is
    none). Staging folders of saves in progress or killed are never taken. A `{prefix}K.old-*`
    folder counts only when `{prefix}K` is missing: a replacement killed between its two renames
    where no atomic swap was available."""
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)({re.escape(ASIDE)}[0-9a-f]+)?")
    named = [(int(m[1]), m[2] is None, child.name, child) for child in Path(directory).iterdir()
             if (m := pattern.fullmatch(child.name))]
    for *_, child in sorted(named, reverse=True):  # newest first: the older ones are not even read
        if child.is_dir() and is_complete(child):
            return child
    return None


# --- reading without running anything -----------------------------------------------------------

# What DCP's `.metadata` pickles (torch 2.13), and nothing else: dataclasses of plain values,
# torch.Size, dtypes, the tensor layout and memory-format codes, and the path it was saved to.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")


def _load_metadata(data: bytes, path: Path) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure of a crafted or damaged pickle
        raise CheckpointError(f"{path}: not DCP metadata, not loaded ({first_line(e)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata, not loaded (a {type(metadata).__name__})")
    return metadata


def _check_metadata(metadata: Metadata, path: Path, sizes: Mapping[str, int], registry: Any = None) -> None:
    """Every entry lies inside the checkpoint's files, and no tensor is larger than the bytes
    stored for it (a crafted size would otherwise allocate it), unless it is stored through a
    stream transform (`FileSystemWriter(_extensions=[ZStandard()])`: its compressed length) whose
    every descriptor resolves in `registry` (the reader's ExtensionRegistry; torch's default one
    when None): an unknown one ('bogus/1') is refused here, not exempt."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    registry = ExtensionRegistry() if registry is None else registry

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed DCP metadata, not loaded ({why})")

    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("no entries or storage")
    stored: dict[str, int] = {}
    transformed: set[str] = set()  # stored through a stream transform (FileSystemWriter's _extensions): compressed
    for index, where in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(where, _StorageInfo) or not isinstance(index.fqn, str):
            raise bad("a storage record of the wrong type")
        name, offset, length = where.relative_path, where.offset, where.length
        if not _plain_name(name) or name not in sizes:
            raise bad(f"entry {index.fqn!r} is stored in {name!r}, not a file of this checkpoint")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > sizes[name]:
            raise bad(f"entry {index.fqn!r} lies outside {name}")
        descriptors = getattr(where, "transform_descriptors", None)
        if descriptors is not None and (not isinstance(descriptors, (list, tuple))
                                        or not all(isinstance(d, str) for d in descriptors)):
            raise bad(f"entry {index.fqn!r} has malformed transform descriptors")
        if descriptors:
            try:
                registry.from_descriptor_list(descriptors)
            except Exception:  # noqa: BLE001 - an unknown name, or a version its class refuses
                unknown = next((d for d in descriptors if d.partition("/")[0] not in registry.extensions),
                               descriptors[0])
                raise bad(f"entry {index.fqn!r} is stored through an unknown stream transform {unknown!r}: "
                          "pass its ExtensionRegistry as _extension_registry") from None
            transformed.add(index.fqn)
        stored[index.fqn] = stored.get(index.fqn, 0) + length
    for key, entry in entries.items():
        if not isinstance(key, str) or key not in stored:
            raise bad(f"entry {key!r} has no stored data")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"entry {key!r} is a {type(entry).__name__}")
        size, dtype = entry.size, getattr(entry.properties, "dtype", None)
        if not isinstance(size, torch.Size) or not isinstance(dtype, torch.dtype) or any(d < 0 for d in size):
            raise bad(f"entry {key!r} has no valid size and dtype")
        if key not in transformed and math.prod(size) * dtype.itemsize > stored[key]:
            raise bad(f"entry {key!r} claims {list(size)} {dtype} but stores {stored[key]} bytes")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or len(chunk.offsets) != len(size) or any(
                    o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size)):
                raise bad(f"entry {key!r} has a chunk outside its tensor")


def _regular_file_sizes(folder: Path) -> dict[str, int]:
    """The regular files in `folder` by name, with their sizes, symlinks followed (a link to
    nothing or to a folder is no file)."""
    sizes = {}
    for p in folder.iterdir():
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[p.name] = st.st_size
    return sizes


def _numpy_scalar_globals() -> list[Any]:
    """NumPy's scalar reconstructor and its dtype classes (a NumPy scalar hyper-parameter in a
    plain `dcp.save(opt.state_dict())`: np.float32 betas, an np.float64 lr), and nothing else of
    NumPy's (no arrays); none where NumPy is not installed."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    kinds = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "longdouble")
    return [core.multiarray.scalar, numpy.dtype, *dict.fromkeys(type(numpy.dtype(k)) for k in kinds)]


class _PlainDataPlanner:
    """A load planner's proxy for `SafeFileSystemReader.read_data`: a non-tensor entry is loaded
    with `weights_only` (plain data and tensors only, and NumPy scalars) and handed to the planner re-serialised from
    that, so the planner's own unrestricted `torch.load` never sees the checkpoint's bytes."""

    def __init__(self, planner: Any, folder: Path) -> None:
        self._planner = planner
        self._folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            with torch.serialization.safe_globals(_numpy_scalar_globals()):
                plain = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the pickle holds, it is refused
            raise CheckpointError(f"{self._folder}: entry {read_item.dest_index.fqn!r} is not plain data, "
                                  f"not loaded ({first_line(e)})") from None
        clean = io.BytesIO()
        torch.save(plain, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _stat_of(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of `path`; None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class SafeFileSystemReader(dcp.FileSystemReader):
    """`dcp.FileSystemReader` that runs no code from the checkpoint: `.metadata` is unpickled with
    an unpickler that knows only DCP's metadata classes and checked against the files; non-tensor
    entries must be plain data (str, numbers, lists, dicts, tensors: what `torch.load(...,
    weights_only=True)` reads; NumPy scalars too). With `manifest` (from `verify_checkpoint`), the `.metadata` bytes it
    unpickles are checked against the manifest's sha256 first. Rank-local metadata (DCP saves
    without collectives) is not read."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest | None = None, *,
                 _extension_registry: Any = None) -> None:
        super().__init__(path, _extension_registry=_extension_registry)
        self._extension_registry = _extension_registry
        self.manifest = manifest
        self._checked: bytes | None = None  # the `.metadata` bytes read and checked, unpickled by read_metadata
        self._checked_stat: tuple[int, int, int] | None = None  # (inode, size, mtime) of the file they came from

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # another folder, or this one saved over since (a `.metadata` of another inode, size or
        # mtime): read and check it again, never the old bytes paired with the new files
        if checkpoint_id and (Path(checkpoint_id) != Path(self.path)
                              or _stat_of(Path(checkpoint_id) / METADATA) != self._checked_stat):
            self._checked = None
        super().reset(checkpoint_id)

    def checked_metadata_bytes(self) -> bytes:
        """`.metadata`'s bytes, read once and checked (against the manifest's sha256 where there is
        one; every entry inside the checkpoint's files): what every `read_metadata` unpickles, so
        that a `.metadata` replaced after the check is never read."""
        if self._checked is None:
            folder = Path(self.path)
            path = folder / METADATA
            try:
                before = _stat_of(path)
                data = path.read_bytes()
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
            if self.manifest is not None:
                entry = self.manifest.files[METADATA]
                if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
                    raise CheckpointError(f"{path}: differs from the manifest (sha256), not loaded")
                sizes = {name: e.size for name, e in self.manifest.files.items()}
            else:  # symlinks followed, as dcp.load reads them (snapshot_download's layout, `cp -rs`)
                sizes = _regular_file_sizes(folder)
            _check_metadata(_load_metadata(data, path), path, sizes, self._extension_registry)
            self._checked, self._checked_stat = data, before
        return self._checked

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to rank-local files
        metadata = _load_metadata(self.checked_metadata_bytes(), Path(self.path) / METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _PlainDataPlanner(planner, Path(self.path)))


__all__ = ["MANIFEST", "CheckpointError", "FileEntry", "Manifest", "OwnRanks", "Ranks", "SafeFileSystemReader",
           "is_complete", "latest_checkpoint", "read_manifest", "save_checkpoint", "verified_reader",
           "verify_checkpoint"]
