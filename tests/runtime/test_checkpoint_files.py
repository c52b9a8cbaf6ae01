"""Checkpoint folders are complete or invisible, and checked before anything in them is trusted
(`canzona.runtime.checkpoint_files`, issue 17 findings 7 and 8).

- Replacing a checkpoint of 2 gloo ranks (an atomic swap, and the rename-aside fallback of file
  systems without one): at every file-system step of the save, the checkpoint a resume would pick
  is complete, verified and wholly one save's, the old one or the new one.
- A job killed while its ranks write a re-save leaves the old checkpoint as it was (never the new
  rank-0 file beside the old rank-1 file) and a staging folder that nothing takes for a
  checkpoint; the next save of the name removes it.
- A bit flip, a truncated, missing or added file, a shard or `.metadata` from another save, a
  missing or malformed manifest: one-line `CheckpointError` before anything is unpickled.
- A crafted `.metadata` or non-tensor entry, even with a consistent manifest, runs no code (plain
  DCP runs it: the tests show both), and metadata pointing outside the checkpoint's files or
  claiming huge tensors is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from canzona.errors import CanzonaError, CheckpointError
from canzona.harness.launch import run_ranks
from canzona.runtime import checkpoint_files
from canzona.runtime.checkpoint_files import (
    MANIFEST,
    SafeFileSystemReader,
    is_complete,
    latest_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

DEADLINE_S = 120.0
PART, SHARED = 256, 64  # elements of each rank's own tensor and of the tensor every rank holds


def state(rank: int, version: int) -> dict:
    """What rank `rank` saves in save number `version`: every value says which save it is from."""
    return {f"part{rank}": torch.full((PART,), float(100 * version + rank)),
            "shared": torch.full((SHARED,), float(version)), "note": f"v{version}"}


def version_of(folder: Path | None) -> int:
    """The save a checkpoint holds, verified and read safely; an AssertionError if it mixes saves."""
    assert folder is not None, "no complete checkpoint to resume from"
    manifest = verify_checkpoint(folder)
    reader = SafeFileSystemReader(folder, manifest)
    keys = reader.read_metadata().state_dict_metadata
    holder = {k: "" if k == "note" else torch.empty(SHARED if k == "shared" else PART) for k in keys}
    with warnings.catch_warnings():  # loaded in this process alone: as meant
        warnings.simplefilter("ignore")
        dcp.load(holder, storage_reader=reader, no_dist=True)
    versions = {int(holder["note"][1:]), int(holder["shared"][0])}
    versions |= {int(v[0]) // 100 for k, v in holder.items() if k.startswith("part")}
    assert len(versions) == 1, f"{folder} mixes saves {sorted(versions)}"
    return versions.pop()


def save_alone(folder: Path, version: int, **info) -> None:
    """A single-process save (no process group): the state of ranks 0 and 1 together."""
    save_checkpoint({**state(0, version), **state(1, version)}, folder, manifest_info=info)


# --- in spawned gloo ranks ---------------------------------------------------------------------


def _replace_while_watching(rank: int, root: Path) -> dict[str, list[int]]:
    """Replace a checkpoint twice (swap, then rename-aside); rank 0, which publishes, looks at what a
    resume would pick before and after every rename and removal."""
    save_checkpoint(state(rank, 1), root / "step_1", manifest_info={"step": 1})
    seen: list[int] = []
    originals = [(module, name, getattr(module, name)) for module, name in (
        (os, "rename"), (os, "replace"), (shutil, "rmtree"), (checkpoint_files, "_exchange"))]
    if rank == 0:
        (root / "step_1.tmp-0123abcd").mkdir()  # leftovers of killed saves of this name
        (root / "step_1.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"half a shard")
        (root / "step_1.old-4567").mkdir()

        def watching(fn):
            def watched(*args, **kwargs):
                seen.append(version_of(latest_checkpoint(root)))
                try:
                    return fn(*args, **kwargs)
                finally:
                    seen.append(version_of(latest_checkpoint(root)))
            return watched

        for module, name, fn in originals:
            setattr(module, name, watching(fn))
    try:
        save_checkpoint(state(rank, 2), root / "step_1", manifest_info={"step": 1})
        swapped, seen[:] = list(seen), []
        if rank == 0:
            checkpoint_files._exchange = lambda a, b: False  # a file system without an atomic swap
        save_checkpoint(state(rank, 3), root / "step_1", manifest_info={"step": 1})
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    save_checkpoint(state(rank, 9), root / "other", manifest_info={"step": 1})
    return {"swapped": swapped, "aside": list(seen)}


def _killed_while_writing(rank: int, world: int, root: Path) -> None:
    """Save step_1, then re-save it: once rank 0's new file is written, rank 1 kills both ranks
    (as a scheduler kills a job) before writing its own."""
    save_checkpoint(state(rank, 1), root / "step_1", manifest_info={"step": 1})
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    written = root / "rank0-wrote"
    original = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if rank == 1:
            end = time.monotonic() + 60
            while not written.exists() and time.monotonic() < end:
                time.sleep(0.01)
            os.kill(pids[0], signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(self, plan, planner)
        written.touch()
        return result

    dcp.FileSystemWriter.write_data = write_data
    save_checkpoint(state(rank, 2), root / "step_1", manifest_info={"step": 1})


def _plain_folders_of_two_saves(rank: int, root: Path) -> dict[str, str]:
    """Each rank given its own plain `dcp.save` folder (node-local copies of two saves: rank 0 the
    save of step 1, rank 1 that of step 2), then both the same one: what each `dcp.load` through
    `verified_reader` did."""
    for step in (1, 2):
        if rank == 0:
            dcp.save({"w": torch.full((4,), float(step)), "step": step}, checkpoint_id=root / f"plain_{step}",
                     no_dist=True)
    dist.barrier()
    done = {}
    for case, folder in (("two saves", root / f"plain_{rank + 1}"), ("one save", root / "plain_2")):
        holder = {"w": torch.zeros(4), "step": 0}
        try:
            dcp.load(holder, storage_reader=checkpoint_files.verified_reader(folder))
            done[case] = f"loaded step {holder['step']}"
        except BaseException as e:  # noqa: BLE001 - what it was is the point
            done[case] = f"{type(e).__name__}: {e}"
    return done


def _replace_then_get_killed(rank: int, world: int, root: str) -> None:
    """The scenarios in one spawn (a spawn costs seconds): the first ones' observations go to
    files, since the last one ends with the ranks killed."""
    seen = _replace_while_watching(rank, Path(root) / "replaced")
    if rank == 0:
        (Path(root) / "seen.json").write_text(json.dumps(seen))
    (Path(root) / "plain").mkdir(exist_ok=True)
    plain = _plain_folders_of_two_saves(rank, Path(root) / "plain")
    (Path(root) / f"plain{rank}.json").write_text(json.dumps(plain))
    (Path(root) / "killed").mkdir(exist_ok=True)
    dist.barrier()
    _killed_while_writing(rank, world, Path(root) / "killed")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("spawned")
    try:
        run_ranks(_replace_then_get_killed, 2, str(root), deadline_s=DEADLINE_S, collective_timeout_s=60)
        ending = "the ranks finished, but they were to be killed"
    except CanzonaError as e:
        ending = str(e)
    seen = json.loads((root / "seen.json").read_text()) if (root / "seen.json").exists() else {}
    plain = [json.loads(f.read_text()) for f in sorted(root.glob("plain?.json"))]
    return {"replaced": root / "replaced", "killed": root / "killed", "ending": ending, "plain": plain, **seen}


@pytest.mark.distributed
def test_replacing_a_checkpoint_never_shows_a_partial_or_mixed_one(spawned):
    # every look at a rename or removal found a complete checkpoint of one save: the old one until
    # the new one was in, the new one after (version_of raises on anything else)
    assert "swapped" in spawned, spawned["ending"]
    assert spawned["swapped"] == sorted(spawned["swapped"]) and set(spawned["swapped"]) == {1, 2}
    assert spawned["aside"] == sorted(spawned["aside"]) and set(spawned["aside"]) == {2, 3}
    root = spawned["replaced"]
    assert version_of(root / "step_1") == 3 and version_of(root / "other") == 9
    assert sorted(p.name for p in root.iterdir()) == ["other", "step_1"]  # leftovers removed
    files = json.loads((root / "step_1" / MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its file


@pytest.mark.distributed
def test_a_save_killed_midway_leaves_the_old_checkpoint_whole(spawned):
    # rank 1 SIGKILLs rank 0, then itself: the parent sees one or both die (it may stop rank 0 itself
    # if it looks between the two kills)
    assert "(signal SIGKILL) died without a result" in spawned["ending"], spawned["ending"]
    root = spawned["killed"]
    staging = [p for p in root.iterdir() if p.name.startswith("step_1.tmp-")]
    # the kill came after rank 0 wrote its new file and before rank 1 wrote its own
    assert len(staging) == 1 and sorted(p.name for p in staging[0].iterdir()) == ["__0_0.distcp"]
    assert latest_checkpoint(root) == root / "step_1"
    assert version_of(root / "step_1") == 1
    save_alone(root / "step_1", 5, step=1)  # the next save of the name
    assert version_of(root / "step_1") == 5
    assert sorted(p.name for p in root.iterdir()) == ["rank0-wrote", "step_1"]


@pytest.mark.distributed
def test_ranks_given_plain_folders_of_two_saves_are_refused_on_every_rank(spawned):
    """`verified_reader` of a plain `dcp.save` folder (no manifest), each rank given another save's
    (node-local copies of two saves). Before: each rank checked its own `.metadata` alone, and each
    loaded its own save silently (rank 0 step 1, rank 1 step 2). Now the ranks compare their
    `.metadata` (sha256): one `CheckpointError` on both; the same save on both loads."""
    assert len(spawned["plain"]) == 2, spawned["ending"]
    for rank, done in enumerate(spawned["plain"]):
        assert done["one save"] == "loaded step 2", done
        text = done["two saves"]
        assert text.startswith("CheckpointError: ") and "\n" not in text, text
        assert f"plain_{rank + 1}: rank(s) [1] were given another checkpoint than rank 0's" in text, text


# --- integrity: checked before anything is unpickled -------------------------------------------


def rewrite_manifest(folder: Path) -> None:
    """Make the manifest consistent with whatever the folder now holds (as a forger would)."""
    raw = json.loads((folder / MANIFEST).read_text())
    raw["files"] = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                    for p in folder.iterdir() if p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(raw))


def flip_a_bit_in(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def flip_a_bit(folder: Path, other: Path) -> None:
    flip_a_bit_in(folder / "__1_0.distcp")


TAMPERING = {
    "a bit flip": (flip_a_bit, "__1_0.distcp differs from the manifest"),
    "a shard from another save": (lambda f, o: shutil.copy(o / "__1_0.distcp", f), "__1_0.distcp differs from the manifest"),
    "metadata from another save": (lambda f, o: shutil.copy(o / ".metadata", f), r"\.metadata (differs from the manifest|has \d+ bytes)"),
    "a truncated file": (lambda f, o: os.truncate(f / "__0_0.distcp", 100), "__0_0.distcp has 100 bytes, the manifest says"),
    "a missing file": (lambda f, o: (f / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "an added file": (lambda f, o: shutil.copy(o / "__1_0.distcp", f / "__2_0.distcp"), "__2_0.distcp is not in the manifest"),
    "no manifest": (lambda f, o: (f / MANIFEST).unlink(), "no manifest.json: not a complete checkpoint"),
    "a malformed manifest": (lambda f, o: (f / MANIFEST).write_text("{"), "not a valid manifest"),
    "a manifest listing a path": (lambda f, o: (f / MANIFEST).write_text(
        (f / MANIFEST).read_text().replace('"__0_0.distcp"', '"../__0_0.distcp"')), "not a file name in the folder"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_checkpoint_is_refused_with_one_line(case, spawned, tmp_path):
    folder = tmp_path / "step_1"
    shutil.copytree(spawned["replaced"] / "step_1", folder)
    assert version_of(folder) == 3  # the copy itself is fine
    tamper, needle = TAMPERING[case]
    tamper(folder, spawned["replaced"] / "other")
    with pytest.raises(CheckpointError) as refused:
        verify_checkpoint(folder)
    assert re.search(needle, str(refused.value)) and "\n" not in str(refused.value)


def test_verify_checks_the_expected_manifest_info(tmp_path):
    save_alone(tmp_path / "step_4", 1, step=4, fingerprint="abc")
    assert verify_checkpoint(tmp_path / "step_4", {"step": 4, "fingerprint": "abc"}).info["step"] == 4
    with pytest.raises(CheckpointError, match="a checkpoint of fingerprint 'abc', not 'xyz'"):
        verify_checkpoint(tmp_path / "step_4", {"fingerprint": "xyz"})


# --- reading runs no code ------------------------------------------------------------------------


class Payload:
    """A pickle that creates a folder when it is loaded: the stand-in for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def crafted_metadata(folder: Path, marker: Path, case: str) -> bytes:
    if case == "code":
        return pickle.dumps(Payload(marker))
    if case in ("empty", "random"):
        return b"" if case == "empty" else os.urandom(2000)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own save: trusted here
    if case == "a path outside the checkpoint":
        next(iter(metadata.storage_data.values())).relative_path = "../outside.distcp"
    else:  # a huge tensor: the reader would allocate it before reading a byte
        metadata.state_dict_metadata["shared"].size = torch.Size([1 << 40])
    return pickle.dumps(metadata)


@pytest.mark.parametrize("case", ["code", "empty", "random", "a path outside the checkpoint", "a huge tensor"])
def test_crafted_metadata_with_a_consistent_manifest_is_refused(case, tmp_path):
    folder, marker = tmp_path / "step_1", tmp_path / "code-ran"
    save_alone(folder, 1, step=1)
    (folder / ".metadata").write_bytes(crafted_metadata(folder, marker, case))
    rewrite_manifest(folder)
    manifest = verify_checkpoint(folder)  # consistent: the manifest alone cannot tell
    with pytest.raises(CheckpointError, match="(not DCP metadata|malformed DCP metadata), not loaded"):
        SafeFileSystemReader(folder, manifest).read_metadata()
    assert not marker.exists()
    if case == "code":  # what plain DCP does with the same folder
        with pytest.raises(Exception):  # noqa: B017 - whatever it fails with, after running the code
            dcp.FileSystemReader(folder).read_metadata()
        assert marker.is_dir()


def test_a_crafted_entry_with_a_consistent_manifest_runs_no_code(tmp_path):
    folder, marker = tmp_path / "step_1", tmp_path / "code-ran"
    save_checkpoint({"w": torch.ones(4), "note": Payload(marker)}, folder)  # a manifest that matches
    assert not marker.exists()
    holder = {"w": torch.empty(4), "note": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(dcp.CheckpointException, match="'note' is not plain data, not loaded"):
            dcp.load(holder, storage_reader=SafeFileSystemReader(folder, verify_checkpoint(folder)), no_dist=True)
        assert not marker.exists()
        dcp.load(holder, checkpoint_id=str(folder), no_dist=True)  # plain DCP runs it
    assert marker.is_dir()


# --- which folders count as checkpoints ---------------------------------------------------------


def test_latest_checkpoint_takes_only_complete_ones(tmp_path):
    for step in (1, 3, 5):
        save_alone(tmp_path / f"step_{step}", step, step=step)
    (tmp_path / "step_5" / "__0_0.distcp").unlink()  # incomplete
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_7.tmp-00ff")  # a killed save's staging folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state(0, 9), checkpoint_id=str(tmp_path / "step_9"), no_dist=True)  # no manifest
    (tmp_path / "step_11").write_text("not a folder")
    assert not is_complete(tmp_path / "step_5") and not is_complete(tmp_path / "step_9")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    # a replacement killed between its two renames (no atomic swap): the complete old one counts
    shutil.copytree(tmp_path / "step_3", tmp_path / "step_4.old-0a")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4.old-0a"
    save_alone(tmp_path / "step_4", 4, step=4)  # the next save of step_4 replaces it
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    assert not (tmp_path / "step_4.old-0a").exists()
    assert latest_checkpoint(tmp_path / "step_3") is None  # no step_K inside a checkpoint


def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for target in ("mine", "file"):
        with pytest.raises(CheckpointError, match="not replaced"):
            save_alone(tmp_path / target, 1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]


def test_the_file_system_here_swaps_atomically(tmp_path):
    """The atomic swap is used where available (Linux local file systems); elsewhere the
    rename-aside fallback, which the spawned test also runs."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from-a").touch()
    assert checkpoint_files._exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "from-a").exists() and not (tmp_path / "a" / "from-a").exists()


# --- an optimizer loading a checkpoint folder by its path --------------------------------------


@pytest.mark.parametrize("case", ["a shard from another save", "a bit flip"])
def test_an_optimizer_loading_a_folder_by_path_verifies_its_manifest(case, one_rank, tmp_path):
    """`opt.load_sharded_state_dict(folder)` on a `save_checkpoint` folder. Before: the manifest was
    not read, and the shard of the step before (the same size: the same entries) or a flipped bit
    in a shard loaded silently, a state of no one step."""
    from canzona.harness.training import TrainSpec, build_model
    from canzona.runtime import DistributedOptimizer

    spec = TrainSpec(steps=2, global_batch=2)
    model = build_model(spec)
    opt = DistributedOptimizer(list(model.named_parameters()), model.spec())
    tokens = torch.randint(0, 256, (2, 2, 9), generator=torch.Generator().manual_seed(0))
    for step in (1, 2):
        opt.zero_grad()
        model.loss(tokens[step - 1]).backward()
        opt.step()
        save_checkpoint(opt.sharded_state_dict(), tmp_path / f"step_{step}", manifest_info={"step": step})
    saved = opt.state_dict()
    fresh = DistributedOptimizer(list(build_model(spec).named_parameters()), model.spec())
    fresh.load_sharded_state_dict(str(tmp_path / "step_2"))  # whole: loads
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"], saved["state"][0]["momentum_buffer"])

    folder = tmp_path / "step_2"
    if case == "a bit flip":
        flip_a_bit_in(folder / "__0_0.distcp")
    else:
        shutil.copy(tmp_path / "step_1" / "__0_0.distcp", folder)
    assert (folder / "__0_0.distcp").stat().st_size == (tmp_path / "step_1" / "__0_0.distcp").stat().st_size
    other = DistributedOptimizer(list(build_model(spec).named_parameters()), model.spec())
    before = other.state_dict()
    with pytest.raises(CheckpointError, match="__0_0.distcp differs from the manifest") as refused:
        other.load_sharded_state_dict(str(folder))
    assert "\n" not in str(refused.value)
    assert torch.equal(other.state_dict()["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_an_entry_that_cannot_be_read_is_one_checkpoint_error(one_rank, tmp_path):
    """A plain `dcp.save` of `sharded_state_dict()` (no manifest) whose metadata entry was
    overwritten in place (its size kept). Before: DCP's CheckpointException, a BaseException (past
    every `except Exception`) whose message is the ranks' tracebacks."""
    from canzona.harness.training import TrainSpec, build_model
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.checkpoint import meta_key

    spec = TrainSpec(steps=1, global_batch=2)
    model = build_model(spec)
    opt = DistributedOptimizer(list(model.named_parameters()), model.spec())
    opt.zero_grad()
    model.loss(torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))).backward()
    opt.step()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=str(tmp_path))
    where = next(info for index, info in pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data.items()
                 if index.fqn == meta_key(opt))
    with open(tmp_path / where.relative_path, "r+b") as f:
        f.seek(where.offset)
        f.write(b"\0" * where.length)
    before = opt.state_dict()
    try:
        opt.load_sharded_state_dict(str(tmp_path))
    except BaseException as e:  # noqa: BLE001 - what it was is the point
        refused = e
    assert isinstance(refused, CheckpointError), repr(refused)[:300]
    assert f"entry '{meta_key(opt)}' is not plain data" in str(refused) and "\n" not in str(refused)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_a_peer_that_never_comes_is_one_checkpoint_error(one_rank, tmp_path, monkeypatch):
    """The ranks' meeting failing as gloo fails it when a peer died or never called `save_checkpoint`
    (after the process group's timeout). Before: gloo's RuntimeError, though every failure of a
    save is promised as a `CheckpointError`."""

    def absent_peer(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 20000ms for send "
                           "operation to complete\nmore lines")

    monkeypatch.setattr(dist, "all_gather_object", absent_peer)
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(state(0, 1), tmp_path / "step_1")
    text = str(refused.value)
    assert "Timed out waiting 20000ms" in text and "save_checkpoint() is collective: call it on every rank" in text and "\n" not in text
    assert not (tmp_path / "step_1").exists() and latest_checkpoint(tmp_path) is None  # no checkpoint appeared


# --- a plain `dcp.save` folder of the optimizer's state, damaged ---------------------------------

PLAIN_DAMAGE = ["no .metadata", "a truncated shard", "a shard cut by 10 bytes", "a shard missing",
                "a save killed before its .metadata", "a save killed over an older one"]


def _stepped_optimizer(steps: int):
    from canzona.harness.training import TrainSpec, build_model
    from canzona.runtime import DistributedOptimizer

    spec = TrainSpec(steps=steps, global_batch=2)
    model = build_model(spec)
    opt = DistributedOptimizer(list(model.named_parameters()), model.spec())
    tokens = torch.randint(0, 256, (max(steps, 1), 2, 9), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        opt.zero_grad()
        model.loss(tokens[step]).backward()
        opt.step()
    return opt


@pytest.fixture(scope="module")
def plain_saves(tmp_path_factory):
    """`dcp.save({"optim": opt.state_dict()})` after 2 steps and after 1 (no manifest; two files per
    rank, `thread_count=2`), and the momentum saved in the first: made once, in a one-rank group
    of its own."""
    root = tmp_path_factory.mktemp("plain")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saves = {}
        for steps in (2, 1):
            opt = _stepped_optimizer(steps)
            saves[steps] = opt.state_dict()
            dcp.save({"optim": saves[steps]}, storage_writer=dcp.FileSystemWriter(root / f"step_{steps}", thread_count=2))
    finally:
        dist.destroy_process_group()
    return root / "step_2", root / "step_1", saves[2]["state"][0]["momentum_buffer"]


def test_a_whole_plain_dcp_folder_loads_through_the_verified_reader(one_rank, plain_saves):
    from canzona.runtime.checkpoint_files import verified_reader

    good, _, momentum = plain_saves
    assert len(list(good.glob("*.distcp"))) == 2
    template = {"optim": _stepped_optimizer(0).state_dict()}
    dcp.load(template, storage_reader=verified_reader(good))
    opt = _stepped_optimizer(0)
    opt.load_state_dict(template["optim"])
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


@pytest.mark.parametrize("case", PLAIN_DAMAGE)
def test_a_damaged_plain_dcp_folder_is_one_line_before_anything_loads(case, one_rank, plain_saves, tmp_path):
    """A plain `dcp.save` folder of `opt.state_dict()`, damaged: `verified_reader(folder)`, the reader
    the docs give `dcp.load` for such a folder, reads and checks its metadata against the files on
    every rank first: one `CheckpointError` line, before dcp.load reads anything, the optimizer
    untouched. Before: the reader was returned unchecked, and dcp.load raised DCP's
    CheckpointException (a BaseException, past every `except Exception`, its message the ranks'
    tracebacks)."""
    from canzona.runtime.checkpoint_files import verified_reader

    good, older, _ = plain_saves
    folder = tmp_path / "damaged"
    shutil.copytree(older if case == "a save killed over an older one" else good, folder)
    first = folder / sorted(good.glob("*.distcp"))[0].name
    if case == "a save killed over an older one":  # the older save's .metadata, a new file cut short
        shutil.copy(good / first.name, first)
    if case in ("no .metadata", "a save killed before its .metadata"):
        (folder / ".metadata").unlink()
    if case in ("a truncated shard", "a save killed before its .metadata", "a save killed over an older one"):
        first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    elif case == "a shard cut by 10 bytes":
        first.write_bytes(first.read_bytes()[:-10])
    elif case == "a shard missing":
        first.unlink()

    opt = _stepped_optimizer(1)
    before = opt.state_dict()
    with pytest.raises(CheckpointError) as refused:
        template = {"optim": opt.state_dict()}
        dcp.load(template, storage_reader=verified_reader(folder))
        opt.load_state_dict(template["optim"])
    text = str(refused.value)
    assert "\n" not in text and str(folder) in text, text
    expect = "no .metadata, not loaded" if ".metadata" in case else "lies outside" if "missing" not in case \
        else "not a file of this checkpoint"
    assert expect in text, text
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_the_verified_reader_unpickles_the_metadata_it_checked(one_rank, plain_saves, tmp_path, monkeypatch):
    """`verified_reader` reads `.metadata` once, checks those bytes, and its `read_metadata`
    unpickles exactly them (a `.metadata` replaced or removed after the check changes nothing),
    and `load_sharded_state_dict(folder)` reads it once per rank. Before: every `read_metadata`
    read the file again (three times per rank in `load_sharded_state_dict`), and `dcp.load` used
    whatever was there by then."""
    from canzona.runtime.checkpoint_files import verified_reader

    good, _, _ = plain_saves
    folder = tmp_path / "plain"
    shutil.copytree(good, folder)
    reader = verified_reader(folder)
    checked = (folder / ".metadata").read_bytes()
    (folder / ".metadata").unlink()
    assert pickle.dumps(reader.read_metadata().state_dict_metadata) == \
        pickle.dumps(pickle.loads(checked).state_dict_metadata)

    opt = _stepped_optimizer(1)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=str(tmp_path / "sharded"))
    reads = []
    read_bytes = Path.read_bytes

    def counted(path):
        reads.append(path.name)
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", counted)
    fresh = _stepped_optimizer(0)
    fresh.load_sharded_state_dict(str(tmp_path / "sharded"))
    assert reads.count(".metadata") == 1, reads
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])


def test_a_plain_dcp_folder_of_symlinks_loads_through_the_verified_reader(one_rank, plain_saves, tmp_path):
    """A plain `dcp.save` folder whose files are symlinks (`huggingface_hub.snapshot_download`'s
    layout, `cp -rs`), as plain `dcp.load` reads it: its shards are followed and loaded. Before:
    refused, 'stored in '__0_0.distcp', not a file of this checkpoint'. A link to nothing is a
    missing shard still."""
    from canzona.runtime.checkpoint_files import verified_reader

    good, _, momentum = plain_saves
    links = tmp_path / "links"
    links.mkdir()
    for f in good.iterdir():
        (links / f.name).symlink_to(f)
    template = {"optim": {"state": {0: {"momentum_buffer": torch.zeros_like(momentum)}}}}
    dcp.load(template, storage_reader=verified_reader(links))
    assert torch.equal(template["optim"]["state"][0]["momentum_buffer"], momentum)
    first = sorted(links.glob("*.distcp"))[0]
    first.unlink()
    first.symlink_to(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"stored in '{first.name}', not a file of this checkpoint"):
        verified_reader(links)


def _zlib_extension():
    """A DCP stream transform compressing with zlib (as `_extension.ZStandard` does with zstd,
    which needs a module not installed here)."""
    import io
    import zlib

    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Zlib(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test.zlib"

        @staticmethod
        def from_descriptor(version: str) -> Zlib:
            return Zlib()

        def get_descriptor(self) -> str:
            return "test.zlib/1"

        def transform_to(self, output):
            class Writer(io.RawIOBase):
                def __init__(self) -> None:
                    self.z = zlib.compressobj()

                def writable(self) -> bool:
                    return True

                def write(self, b) -> int:
                    output.write(self.z.compress(bytes(b)))
                    return len(memoryview(b))

                def close(self) -> None:
                    if not self.closed:
                        output.write(self.z.flush())
                    super().close()

            return Writer()

        def transform_from(self, input):
            return io.BytesIO(zlib.decompress(input.read()))

    return Zlib


def test_a_compressed_plain_dcp_folder_loads_through_the_safe_reader(tmp_path):
    """`dcp.FileSystemWriter(_extensions=[...])` (`ZStandard()`, say) records each entry's
    compressed length: a tensor stores fewer bytes than it holds. Its entries carry their
    `transform_descriptors`, and are not held to the byte bound; `SafeFileSystemReader` takes
    `_extension_registry` as `dcp.FileSystemReader` does. Before: refused ('claims [4096]
    torch.float32 but stores 651 bytes'), and the registry a TypeError."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    from canzona.runtime.checkpoint_files import verified_reader

    zlib_ext = _zlib_extension()
    registry = ExtensionRegistry()
    registry.register(zlib_ext)
    saved = {"w": torch.zeros(4096), "note": "v1"}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[zlib_ext()]), no_dist=True)
    stored = pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data
    assert sum(s.length for s in stored.values()) < 4096 and all(s.transform_descriptors for s in stored.values())
    verified_reader(tmp_path, _extension_registry=registry)  # checked: no refusal
    loaded = {"w": torch.ones(4096), "note": ""}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path, _extension_registry=registry), no_dist=True)
    assert torch.equal(loaded["w"], saved["w"]) and loaded["note"] == "v1"


def test_an_unknown_transform_descriptor_is_refused_before_anything_is_allocated(tmp_path):
    """A transformed entry is exempt from the byte bound only where every descriptor resolves in
    the reader's ExtensionRegistry (`verified_reader(_extension_registry=...)`): an unknown one
    ('bogus/1', or the zlib one without its registry) is one CheckpointError line at the check.
    Before: any non-empty descriptor list skipped the bound, and a crafted entry claiming 2**40
    floats was accepted (then allocated by a load's placeholder)."""
    import dataclasses

    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from canzona.runtime.checkpoint_files import verified_reader

    crafted = tmp_path / "crafted"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=crafted, no_dist=True)
    md = pickle.loads((crafted / ".metadata").read_bytes())
    big = torch.Size([2**40])
    md.state_dict_metadata["w"].size = big
    md.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=big)]
    md.storage_data = {k: dataclasses.replace(s, transform_descriptors=["bogus/1"]) for k, s in md.storage_data.items()}
    (crafted / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="unknown stream transform 'bogus/1'") as refused:
        verified_reader(crafted)
    assert "\n" not in str(refused.value)
    zipped = tmp_path / "zipped"
    zlib_ext = _zlib_extension()
    dcp.save({"w": torch.zeros(64)}, storage_writer=dcp.FileSystemWriter(zipped, _extensions=[zlib_ext()]), no_dist=True)
    with pytest.raises(CheckpointError, match="unknown stream transform 'test.zlib/1'"):
        verified_reader(zipped)
    registry = ExtensionRegistry()
    registry.register(zlib_ext)
    loaded = {"w": torch.ones(64)}
    dcp.load(loaded, storage_reader=verified_reader(zipped, _extension_registry=registry), no_dist=True)
    assert torch.equal(loaded["w"], torch.zeros(64))


def test_a_transformed_piece_claiming_more_than_its_parameter_is_refused_before_allocating(one_rank, tmp_path):
    """A compressed sharded save (its pieces not held to their stored bytes) edited so one AdamW
    piece claims 2**40 elements: load_sharded_state_dict refuses it, one CheckpointError naming
    the entry, before allocating its placeholder. Before: torch.empty of 2**40 floats (4 TiB)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.checkpoint import DCP_PREFIX, piece_key
    from canzona.runtime.checkpoint_files import verified_reader
    from reference.tiny_model import TinyQwen3

    model = TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", overlap_param_gather=False)
    zlib_ext = _zlib_extension()
    # the metadata and one AdamW piece (as a stepped save holds it): the refusal comes first
    key = piece_key(DCP_PREFIX, "adamw", "model.norm.weight", "exp_avg", 0)
    saved = {**opt.sharded_state_dict(), key: torch.zeros(4)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[zlib_ext()]))
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    big = torch.Size([2**40])
    md.state_dict_metadata[key].size = big
    md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=big)]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    registry = ExtensionRegistry()
    registry.register(zlib_ext)
    with pytest.raises(CheckpointError, match=f"entry '{re.escape(key)}' claims \\[{2**40}\\]") as refused:
        opt.load_sharded_state_dict(verified_reader(tmp_path, _extension_registry=registry))
    assert "\n" not in str(refused.value)


def test_numpy_hyper_parameters_in_a_plain_dcp_folder_load_through_the_safe_reader(tmp_path):
    """A plain `dcp.save(opt.state_dict())` of groups holding NumPy scalars (np.float32 betas, an
    np.float64 lr): the safe reader allows NumPy's scalar reconstructor and dtypes (only those)
    and gives them back as saved, as plain `dcp.load` does; anything else stays refused. Before:
    refused, 'not plain data (Weights only load failed ...)'."""
    import numpy as np

    from canzona.runtime.checkpoint_files import verified_reader

    groups = [{"betas": (np.float32(0.9), np.float32(0.999)), "lr": np.float64(0.01), "steps": np.int64(3)}]
    dcp.save({"optim": {"param_groups": groups}}, checkpoint_id=tmp_path, no_dist=True)
    loaded = {"optim": {"param_groups": [{"betas": (0.0, 0.0), "lr": 0.0, "steps": 0}]}}
    dcp.load(loaded, storage_reader=verified_reader(tmp_path), no_dist=True)
    got = loaded["optim"]["param_groups"][0]
    assert [type(b) for b in got["betas"]] == [np.float32, np.float32] and got["betas"] == groups[0]["betas"]
    assert type(got["lr"]) is np.float64 and got["lr"] == 0.01 and type(got["steps"]) is np.int64
    other = tmp_path / "other"
    dcp.save({"x": {"f": __import__("fractions").Fraction(1, 3)}}, checkpoint_id=other, no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="entry 'x.f' is not plain data"):
        dcp.load({"x": {"f": 0}}, storage_reader=verified_reader(other), no_dist=True)


def test_a_reset_onto_a_folder_rewritten_in_place_reads_its_new_metadata(tmp_path):
    """`reset(checkpoint_id)` of a safe reader whose folder was saved over since it read it (a
    `dcp.load(checkpoint_id=..., storage_reader=reader)` after a new save there): the new
    `.metadata` is read and checked, never the old one paired with the new files; unchanged,
    the bytes checked stay. Before: the cached bytes of the same path were kept."""
    from canzona.runtime.checkpoint_files import verified_reader

    dcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True)
    reader = verified_reader(tmp_path)
    checked = reader.checked_metadata_bytes()
    reader.reset(tmp_path)
    assert reader.checked_metadata_bytes() is checked
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=tmp_path, no_dist=True)
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, checkpoint_id=tmp_path, storage_reader=reader, no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(8.0))


def test_plain_folders_refused_name_rank_0_where_it_alone_differs(tmp_path, monkeypatch):
    """Ranks comparing a plain folder's `.metadata`: where rank 0 alone differs from every other
    rank (3 ranks, say), the refusal names rank 0, not all the others; either refusal adds that
    the folder may have changed while being read (a save in progress). Before: 'rank(s) [1, 2]
    were given another checkpoint than rank 0's', and no word of a save in progress."""
    from canzona.runtime.checkpoint_files import verified_reader

    dcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True)

    class Three:
        def __init__(self, *args, **kwargs) -> None:
            self.rank, self.world = 0, 3

        def together(self, step, *, rank0_only=False):
            mine = step()
            return [mine] * 3 if rank0_only else [mine, *(mine if d == "same" else d for d in digests)]

    monkeypatch.setattr(checkpoint_files, "Ranks", Three)
    digests = ["other", "other"]
    with pytest.raises(CheckpointError) as refused:
        verified_reader(tmp_path)
    text = str(refused.value)
    assert "rank 0 was given another checkpoint than rank(s) [1, 2]" in text and "a save in progress" in text, text
    digests = ["same", "other"]
    with pytest.raises(CheckpointError) as refused:
        verified_reader(tmp_path)
    text = str(refused.value)
    assert "rank(s) [2] were given another checkpoint than rank 0's" in text and "a save in progress" in text, text


def test_a_rank_local_dcp_save_is_named_by_the_verified_reader(tmp_path):
    """`dcp.save(..., use_collectives=False)` writes each rank's `__<rank>.metadata`, no `.metadata`:
    the refusal names the rank-local metadata and a save with collectives. Before: 'a save killed
    or still writing'."""
    from canzona.runtime.checkpoint_files import verified_reader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True, use_collectives=False)
    assert (tmp_path / "__0.metadata").exists() and not (tmp_path / ".metadata").exists()
    with pytest.raises(CheckpointError) as refused:
        verified_reader(tmp_path)
    text = str(refused.value)
    assert "rank-local metadata (__0.metadata" in text and "use_collectives=False" in text, text
    assert "leftovers while a new save is still being written" in text, text
    assert "killed" not in text and "\n" not in text, text
