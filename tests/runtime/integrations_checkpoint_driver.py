"""The optimizer-folder scenarios of `tests/runtime/test_integrations_hf.py`, run by
`tests/runtime/integrations_driver.py` in that file's one torchrun launch (2 gloo ranks; each
scenario's folders under `OUT/checkpoints`), or by this script's own `main` alone.

The integrations' optimizer folders (`CanzonaAccelerator.save_state` / `load_state`,
`CanzonaTrainer`'s checkpoints) on a bf16 model (fp32 master weights): a save killed midway into a
reused folder, a model/optimizer mix, a damaged file, a folder of an older canzona (plain
`dcp.save`, no manifest). Each scenario's findings (or the error it ended in) go to
`OUT/rank<r>.pt`; every expected failure happens alike on every rank.

    torchrun --nproc-per-node 2 tests/runtime/integrations_checkpoint_driver.py OUT
"""

from __future__ import annotations

import json
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import accelerate_loop as loop_example  # noqa: E402
import hf_trainer as trainer_example  # noqa: E402

from canzona.integrations.accelerate import canzona_optimizer  # noqa: E402
from canzona.runtime import DistributedOptimizer, checkpoint_files  # noqa: E402
from canzona.runtime.modules import named_parameters  # noqa: E402

SETUP = trainer_example.Setup()
OPT = "canzona_optimizer"


def error_text(attempt: Callable[[], Any]) -> str:
    try:
        attempt()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


@contextmanager
def killed_publish() -> Iterator[None]:
    """Every save_checkpoint dies after all ranks wrote their files, before the rename (rank 0)."""
    kept = checkpoint_files._publish

    def die(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed before the rename")

    checkpoint_files._publish = die
    try:
        yield
    finally:
        checkpoint_files._publish = kept


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.state_dict()  # waits for the step's parameter all-gathers
    return {n: p.detach().float().clone() for n, p in named_parameters(model)}


def opt_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's sharded state, cloned (what a load must reproduce exactly), with the witness of
    the model's weights and the masters of them it saves."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in opt.sharded_state_dict().items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def on_rank0(action: Callable[[], Any]) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def flip_a_byte(folder: Path) -> None:
    shard = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))


def legacy_copy(opt: DistributedOptimizer, folder: Path) -> None:
    """`folder` replaced by what the older integrations wrote: a plain dcp.save, in place."""
    on_rank0(lambda: shutil.rmtree(folder))
    dcp.save(opt.sharded_state_dict(), checkpoint_id=str(folder))


# --- accelerate -----------------------------------------------------------------------------------


def accelerate_setup(**accelerator_kwargs: Any) -> tuple[Any, Any, Any, list]:
    from canzona.integrations.accelerate import CanzonaAccelerator

    accelerator = CanzonaAccelerator(cpu=True, **accelerator_kwargs)
    data = trainer_example.MarkovTokens(SETUP)
    model = trainer_example.build_model(SETUP).to(torch.bfloat16)  # fp32 master weights
    opt = DistributedOptimizer(named_parameters(model), loop_example.model_spec(model, data), "muon",
                               {"lr": SETUP.matrix_lr}, {"lr": SETUP.adamw_lr})
    model, prepared = accelerator.prepare(model, opt)
    rank = dist.get_rank()
    batches = [{"input_ids": data.tokens[8 * s + 4 * rank:8 * s + 4 * rank + 4]} for s in range(8)]
    return accelerator, model, prepared, batches


def accelerate_step(accelerator: Any, model: Any, opt: Any, batch: dict) -> None:
    accelerator.backward(model(**batch, labels=batch["input_ids"]).loss)
    opt.step()
    opt.zero_grad()


def accelerate(out: Path) -> dict[str, Any]:
    accelerator, model, prepared, batches = accelerate_setup()
    opt = canzona_optimizer(prepared)
    first = out / "acc_reused"
    accelerate_step(accelerator, model, prepared, batches[0])
    accelerator.save_state(str(first))
    state1, weights1 = opt_state(opt), params(model)
    saved_manifest = checkpoint_files.read_manifest(first / f"{OPT}_0")
    accelerate_step(accelerator, model, prepared, batches[1])
    with killed_publish():
        killed = error_text(lambda: accelerator.save_state(str(first)))
    dist.barrier()  # rank 0 removes the failed save's staging folder
    result: dict[str, Any] = {"killed": killed, "after kill": sorted(p.name for p in first.iterdir())}
    # the previous optimizer folder: complete, verified, and exactly the first step's state
    manifest = checkpoint_files.verify_checkpoint(first / f"{OPT}_0", process_group=dist.group.WORLD)
    result["same manifest"] = manifest == saved_manifest
    probe_model = trainer_example.build_model(SETUP).to(torch.bfloat16)
    with torch.no_grad():  # the weights saved beside it (a save takes the masters of the model's weights)
        for n, p in named_parameters(probe_model):
            p.copy_(weights1[n])
    probe = DistributedOptimizer(named_parameters(probe_model),
                                 opt.spec, "muon", {"lr": SETUP.matrix_lr}, {"lr": SETUP.adamw_lr})
    probe.load_sharded_state_dict(checkpoint_files.SafeFileSystemReader(first / f"{OPT}_0", manifest))
    result["previous intact"] = same(opt_state(probe), state1)
    # accelerate rewrote its model files in place: new weights beside the previous optimizer state
    before, weights = opt_state(opt), params(model)
    result["mix"] = error_text(lambda: accelerator.load_state(str(first)))
    result["mix changed nothing"] = same(opt_state(opt), before)

    # a normal save and resume (a fresh model and optimizer) is not refused, and is exact
    whole = out / "acc_whole"
    accelerator.save_state(str(whole))
    state2 = opt_state(opt)
    accelerator.save_state(str(whole))  # saved again over its own (manifest) folder: replaced
    accelerate_step(accelerator, model, prepared, batches[2])
    result["resume"] = error_text(lambda: accelerator.load_state(str(whole)))
    result["resumed exactly"] = same(opt_state(opt), state2) and same(params(model), weights)
    fresh_acc, fresh_model, fresh_prepared, _ = accelerate_setup()
    result["fresh resume"] = error_text(lambda: fresh_acc.load_state(str(whole)))
    result["fresh resumed exactly"] = same(opt_state(canzona_optimizer(fresh_prepared)), state2) and \
        same(params(fresh_model), weights)

    # a damaged optimizer file: one error line, nothing loaded
    damaged = out / "acc_damaged"
    on_rank0(lambda: shutil.copytree(whole, damaged))
    on_rank0(lambda: flip_a_byte(damaged / f"{OPT}_0"))
    result["damaged"] = error_text(lambda: accelerator.load_state(str(damaged)))

    # a folder of the older integrations (no manifest) loads; saving over it is refused
    legacy = out / "acc_legacy"
    on_rank0(lambda: shutil.copytree(whole, legacy))
    fresh_acc.load_state(str(whole))
    legacy_copy(canzona_optimizer(fresh_prepared), legacy / f"{OPT}_0")
    accelerate_step(accelerator, model, prepared, batches[3])
    result["legacy"] = error_text(lambda: accelerator.load_state(str(legacy)))
    result["legacy loaded exactly"] = same(opt_state(opt), state2) and same(params(model), weights)
    stamps = {p.name: p.stat().st_mtime_ns for p in legacy.iterdir() if p.is_file()}
    result["save over legacy"] = error_text(lambda: accelerator.save_state(str(legacy)))
    result["legacy untouched"] = stamps == {p.name: p.stat().st_mtime_ns for p in legacy.iterdir() if p.is_file()} \
        and not (legacy / f"{OPT}_0" / checkpoint_files.MANIFEST).exists()
    return result


def accelerate_automatic(out: Path) -> dict[str, Any]:
    """Automatic checkpoint naming (total_limit=2): a save_state killed before its optimizer folder
    is published leaves checkpoint_2 with accelerate's files only; load_state() takes checkpoint_1."""
    from accelerate.utils import ProjectConfiguration

    def setup() -> tuple[Any, Any, Any, list]:
        project = ProjectConfiguration(project_dir=str(out / "acc_auto"), automatic_checkpoint_naming=True,
                                       total_limit=2)
        return accelerate_setup(project_config=project)

    accelerator, model, prepared, batches = setup()
    for batch in batches[:2]:  # checkpoint_0 and checkpoint_1
        accelerate_step(accelerator, model, prepared, batch)
        accelerator.save_state()
    state, weights = opt_state(canzona_optimizer(prepared)), params(model)
    accelerate_step(accelerator, model, prepared, batches[2])
    with killed_publish():
        result = {"killed": error_text(accelerator.save_state)}
    dist.barrier()
    result["folders"] = sorted(p.name for p in (out / "acc_auto" / "checkpoints").iterdir())
    fresh_acc, fresh_model, fresh_prepared, _ = setup()
    result["latest"] = error_text(fresh_acc.load_state)
    result["latest loaded exactly"] = same(opt_state(canzona_optimizer(fresh_prepared)), state) and \
        same(params(fresh_model), weights)
    # checkpoint_1's optimizer folder as an older canzona wrote it (no manifest): still taken
    legacy_copy(canzona_optimizer(fresh_prepared), out / "acc_auto" / "checkpoints" / "checkpoint_1" / f"{OPT}_0")
    legacy_acc, legacy_model, legacy_prepared, _ = setup()
    result["legacy latest"] = error_text(legacy_acc.load_state)
    result["legacy latest loaded exactly"] = same(opt_state(canzona_optimizer(legacy_prepared)), state) and \
        same(params(legacy_model), weights)
    # a folder without the optimizer's, named: one error before anything is loaded
    named_acc, named_model, _, _ = setup()
    before = params(named_model)
    result["named"] = error_text(lambda: named_acc.load_state(str(out / "acc_auto" / "checkpoints" / "checkpoint_2")))
    result["named changed nothing"] = same(params(named_model), before)
    return result


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def accelerate_dtensors(out: Path) -> dict[str, Any]:
    """A TP model (ColwiseParallel then RowwiseParallel over both ranks: Shard(0), Shard(1) and a
    Replicate bias) through save_state / load_state: what each rank's get_state_dict keeps, the
    gathers the load makes, and every local shard after a perturbation and the load."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from canzona.integrations.accelerate import CanzonaAccelerator
    from canzona.runtime.shards import local_tensor
    from canzona.spec import ModelSpec

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _TwoLinears()
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon", {"lr": 0.02},
                               {"lr": 0.01}, group=mesh)
    accelerator = CanzonaAccelerator(cpu=True)
    model, prepared = accelerator.prepare(model, opt)
    model(torch.randn(4, 16)).sum().backward()
    prepared.step()
    result: dict[str, Any] = {"placements": {n: str(p.placements) for n, p in model.named_parameters()}}
    saved = {n: local_tensor(p).detach().clone() for n, p in named_parameters(model)}
    whole = {n: p.full_tensor() for n, p in model.named_parameters()}
    state = accelerator.get_state_dict(model)  # what this rank keeps of the gathered model
    result["kept"] = {k: (tuple(v.shape), v.device.type, torch.equal(v, whole[k])) for k, v in state.items()}
    del state
    accelerator.save_state(str(out / "acc_dtensors"))
    with torch.no_grad():  # every local shard moved off its value
        for p in model.parameters():
            local_tensor(p).add_(1.0)
    gathers = []
    kept = DTensor.full_tensor

    def counted(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        gathers.append(1)
        return kept(self, *args, **kwargs)

    DTensor.full_tensor = counted
    try:
        result["load"] = error_text(lambda: accelerator.load_state(str(out / "acc_dtensors")))
    finally:
        DTensor.full_tensor = kept
    result["load gathers"] = len(gathers)
    result["differ"] = [n for n, p in named_parameters(model) if not torch.equal(local_tensor(p), saved[n])]
    return result


def two_optimizers(out: Path) -> dict[str, Any]:
    """Two models, each with its canzona optimizer (fp32: the weights checked against the save's
    witness), prepared (a, b, opt_a, opt_b) for save_state and, fresh, with the optimizers in the
    other order (a, b, opt_b, opt_a) for load_state (the models in the same order: accelerate
    matches its model files by order): whether every optimizer's state and both models' weights
    come back bit for bit. And what `get_state_dict` of a plain (ZeRO-1, no DTensor) model gives on
    every rank, outside save_state and inside it."""
    from canzona.integrations import accelerate as integration
    from canzona.spec import ModelSpec

    made: list[list] = []  # each setup's schedulers, in model order

    def setup(order: tuple[int, ...], schedulers: bool = False) -> tuple[Any, list, list]:
        torch.manual_seed(0)
        models = [_TwoLinears(), torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(24, 4))]
        opts = [DistributedOptimizer(named_parameters(m), ModelSpec.from_module(m), "muon", {"lr": mr}, {"lr": ar})
                for m, (mr, ar) in zip(models, ((0.02, 0.01), (0.03, 0.004)))]
        accelerator = integration.CanzonaAccelerator(cpu=True)
        made.append([torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in opts] if schedulers else [])
        prepared = accelerator.prepare(*models, *[opts[i] for i in order], *[made[-1][i] for i in order
                                                                              if schedulers])
        return accelerator, list(prepared[:2]), opts

    accelerator, models, opts = setup((0, 1), schedulers=True)
    made[0][0].base_lrs = [0.5 * r for r in made[0][0].base_lrs]  # what each scheduler saves is its own
    for model, opt, width in zip(models, opts, (16, 8)):
        model(torch.randn(4, width, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
        opt.step()
    states, weights = [opt_state(o) for o in opts], [params(m) for m in models]
    whole = accelerator.get_state_dict(models[0])  # every rank, as a user calls it
    result: dict[str, Any] = {"state dict": {k: torch.equal(v, models[0].state_dict()[k]) for k, v in whole.items()}}
    ptrs = {p.data_ptr() for p in models[0].parameters()}
    result["state dict copied"] = [v.data_ptr() not in ptrs for v in whole.values()]
    kept = integration.own_storage
    keeps: list[bool] = []
    integration.own_storage = lambda state, keep=True: keeps.append(keep) or kept(state, keep)
    try:
        accelerator.save_state(str(out / "two_optimizers"))
    finally:
        integration.own_storage = kept
    result["save_state keeps"] = keeps  # what each get_state_dict of the save kept on this rank
    fresh, fresh_models, fresh_opts = setup((1, 0))
    result["swapped"] = error_text(lambda: fresh.load_state(str(out / "two_optimizers")))
    result["swapped exactly"] = [same(opt_state(o), st) and same(params(m), w)
                                 for o, m, st, w in zip(fresh_opts, fresh_models, states, weights)]
    # accelerate loads schedulers by prepare order: the save records each optimizer's schedulers
    scheduled, scheduled_models, scheduled_opts = setup((1, 0), schedulers=True)
    result["swapped with schedulers"] = error_text(lambda: scheduled.load_state(str(out / "two_optimizers")))
    result["swapped with schedulers exactly"] = [same(opt_state(o), st) and same(params(m), w) for o, m, st, w
                                                 in zip(scheduled_opts, scheduled_models, states, weights)]
    result["schedulers' own rates"] = [s.base_lrs == want.base_lrs for s, want in zip(made[-1], made[0])]

    def unlinked() -> None:  # the manifests as an older canzona wrote them: no model or scheduler links
        for i in range(2):
            path = out / "two_optimizers" / f"{OPT}_{i}" / "manifest.json"
            raw = json.loads(path.read_text())
            raw["info"] = {k: v for k, v in raw["info"].items() if k not in ("prepared_model", "schedulers")}
            path.write_text(json.dumps(raw))

    on_rank0(unlinked)  # without the record, swapped optimizers with schedulers are refused
    older, older_models, _ = setup((1, 0), schedulers=True)
    before = params(older_models[0])
    result["older swapped with schedulers"] = error_text(lambda: older.load_state(str(out / "two_optimizers")))
    result["older swapped with schedulers untouched"] = same(params(older_models[0]), before)
    return result


def one_architecture(out: Path) -> dict[str, Any]:
    """Two models of one architecture (one fingerprint; different weights and rates), each with its
    canzona optimizer and a LambdaLR, prepared (a, b, opt_a, opt_b, sched_a, sched_b): two steps,
    save_state, two more (the straight run). Fresh, with the optimizers (and schedulers) prepared in
    the other order, load_state: whether each optimizer gets its own model's state (without
    schedulers) and whether the two steps after it (with schedulers) give the straight run's state,
    weights and rates bit for bit."""
    from canzona.integrations import accelerate as integration
    from canzona.spec import ModelSpec

    def setup(order: tuple[int, ...], schedulers: bool = True, sched_order: tuple[int, ...] | None = None,
              on_prepared: bool = False, extra: tuple[tuple[int, str], ...] = ()) -> tuple[Any, list, list, list, list]:
        """The schedulers built on the optimizers (`on_prepared`: on those prepare returned, the usual
        pattern) and prepared after them in `sched_order`, with `extra` ones inserted at their
        positions: "plain", a LambdaLR over a plain torch SGD; "again", a second one over model 0's."""
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            models.append(_TwoLinears())
        opts = [DistributedOptimizer(named_parameters(m), ModelSpec.from_module(m), "muon", {"lr": mr}, {"lr": ar})
                for m, (mr, ar) in zip(models, ((0.02, 0.01), (0.03, 0.004)))]
        accelerator = integration.CanzonaAccelerator(cpu=True)
        prepared = accelerator.prepare(*models, *[opts[i] for i in order])
        mine, theirs = [None, None], [None, None]
        for at, i in enumerate(order):
            mine[i] = prepared[2 + at]
        if schedulers:
            scheds = [torch.optim.lr_scheduler.LambdaLR(mine[i] if on_prepared else opts[i],
                                                        lambda step: 1.0 / (1 + step)) for i in range(2)]
            listed: list = [scheds[i] for i in (sched_order or order)]
            for at, kind in extra:
                over = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5) if kind == "plain" else opts[0]
                listed.insert(at, torch.optim.lr_scheduler.LambdaLR(over, lambda step: 0.5 ** step))
            done = accelerator.prepare(*listed)
            for i in range(2):
                theirs[i] = done[listed.index(scheds[i])]
            result["extra schedulers"] = [done[at] for at, _ in extra]
        return accelerator, list(prepared[:2]), opts, mine, theirs

    def steps(accelerator: Any, models: list, opts: list, scheds: list, first: int, last: int) -> None:
        for n in range(first, last):
            for k, (model, opt, sched) in enumerate(zip(models, opts, scheds)):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * n + 10 * k + dist.get_rank()))
                accelerator.backward(model(x).square().mean())
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()

    def rates(opts: list) -> list:
        return [[g["lr"] for g in o.param_groups] for o in opts]

    def own(scheds: list) -> list:  # what a scheduler saves and a load must give it back
        return [(s.scheduler.base_lrs, s.scheduler.last_epoch, s.scheduler._last_lr) for s in scheds]

    folder = out / "one_architecture"
    result: dict[str, Any] = {}
    # the schedulers built on the optimizers prepare returned (accelerate links them to every
    # optimizer), with a plain torch one last
    accelerator, models, opts, prepared, scheds = setup((0, 1), on_prepared=True, extra=((2, "plain"),))
    steps(accelerator, models, prepared, scheds, 0, 2)
    saved = [opt_state(o) for o in opts]
    accelerator.save_state(str(folder))
    saved_scheds = own([*scheds, *result.pop("extra schedulers")])
    steps(accelerator, models, prepared, scheds, 2, 4)
    straight = [(opt_state(o), params(m)) for o, m in zip(opts, models)]
    result["rates differ"] = rates(opts)[0] != rates(opts)[1]
    fresh, _, fresh_opts, _, _ = setup((1, 0), schedulers=False)
    result["swapped"] = error_text(lambda: fresh.load_state(str(folder)))
    result["swapped exactly"] = [same(opt_state(o), st) for o, st in zip(fresh_opts, saved)]

    def resumed(name: str, order: tuple[int, ...], **kwargs: Any) -> None:
        """load_state into a fresh setup, then each scheduler's own state and two steps: the straight run's."""
        again, again_models, again_opts, again_prepared, again_scheds = setup(order, **kwargs)
        result[name] = error_text(lambda: again.load_state(str(folder)))
        extra = result.pop("extra schedulers")
        result[f"{name} schedulers"] = own([*again_scheds, *extra]) == saved_scheds[:2 + len(extra)]
        stepped = error_text(lambda: steps(again, again_models, again_prepared, again_scheds, 2, 4))
        result[f"{name} exactly"] = stepped if stepped != "no error" else \
            [same(opt_state(o), st) and same(params(m), w) and r == want
             for o, m, (st, w), r, want in zip(again_opts, again_models, straight, rates(again_opts), rates(opts))]

    resumed("resumed", (1, 0))  # optimizers and schedulers prepared in the other order
    # the schedulers alone swapped, built on the prepared optimizers (before: both linked to the first
    # optimizer at the save and the load, so each took the other's file silently)
    resumed("resumed on prepared", (0, 1), sched_order=(1, 0), on_prepared=True)
    # a plain torch scheduler first, the canzona ones after it (before: each took its position's file)
    resumed("resumed plain first", (0, 1), extra=((0, "plain"),))
    # a second scheduler over one optimizer, which the save did not have: no file of its own
    again, again_models, _, _, _ = setup((0, 1), extra=((1, "again"),))
    result.pop("extra schedulers")
    before = params(again_models[0])
    result["another scheduler"] = error_text(lambda: again.load_state(str(folder)))
    result["another scheduler untouched"] = same(params(again_models[0]), before)
    # fewer canzona optimizers than at the save: model 0 and its optimizer alone, its scheduler and
    # plain ones (before: a plain one took the dropped optimizer's scheduler file silently), as many
    # as make the save's count of schedulers or one fewer
    for name, plains in (("fewer optimizers", 1), ("fewer optimizers as many schedulers", 2)):
        torch.manual_seed(0)
        lone_model = _TwoLinears()
        lone_opt = DistributedOptimizer(named_parameters(lone_model), ModelSpec.from_module(lone_model), "muon",
                                        {"lr": 0.02}, {"lr": 0.01})
        lone = integration.CanzonaAccelerator(cpu=True)
        lone_model, _ = lone.prepare(lone_model, lone_opt)
        plain = [torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5),
                                                   lambda step: 0.5 ** step) for _ in range(plains)]
        lone_scheds = lone.prepare(torch.optim.lr_scheduler.LambdaLR(lone_opt, lambda step: 1.0 / (1 + step)), *plain)
        before = params(lone_model)
        result[name] = error_text(lambda lone=lone: lone.load_state(str(folder)))
        result[f"{name} untouched"] = same(params(lone_model), before) and \
            [s.scheduler.last_epoch for s in lone_scheds] == [0] * (1 + plains)
    # a plain scheduler more than the save wrote files for (before: it was given scheduler_3.bin,
    # which accelerate failed to find after loading the models)
    again, again_models, _, _, _ = setup((0, 1), extra=((2, "plain"), (3, "plain")))
    result.pop("extra schedulers")
    before = params(again_models[0])
    result["more schedulers"] = error_text(lambda: again.load_state(str(folder)))
    result["more schedulers untouched"] = same(params(again_models[0]), before)
    return result


# --- transformers' Trainer ------------------------------------------------------------------------


def trainer(out: Path, name: str, steps: int, save_steps: int = 0, resume: str | None = None) -> Any:
    args = trainer_example.training_arguments(SETUP, str(out / name), steps, 1, save_steps)
    data = trainer_example.MarkovTokens(SETUP)
    model = trainer_example.build_model(SETUP).to(torch.bfloat16)
    t = trainer_example.build_trainer(SETUP, model, args, data)
    t.train(resume_from_checkpoint=resume)
    return t


def trainer_scenarios(out: Path) -> dict[str, Any]:
    t = trainer(out, "run", 2, save_steps=1)
    opt = t.distributed_optimizer()
    final = params(t.model)
    ckpt1, ckpt2 = out / "run" / "checkpoint-1", out / "run" / "checkpoint-2"
    saved_manifest = checkpoint_files.verify_checkpoint(ckpt1 / OPT, process_group=dist.group.WORLD)
    result: dict[str, Any] = {}
    # the step saved again (the optimizer now at step 2), killed before the rename
    with killed_publish():
        result["killed"] = error_text(lambda: t._save_optimizer_and_scheduler(str(ckpt1)))
    dist.barrier()  # rank 0 removes the failed save's staging folder
    result["after kill"] = sorted(p.name for p in ckpt1.iterdir())
    manifest = checkpoint_files.verify_checkpoint(ckpt1 / OPT, process_group=dist.group.WORLD)
    result["same manifest"] = manifest == saved_manifest
    # ... so that resuming from it runs as a straight run
    resumed = trainer(out, "resumed", 2, resume=str(ckpt1))
    result["resumed exactly"] = same(params(resumed.model), final)

    # resume_from_checkpoint=True after saves killed midway: checkpoint-3 killed before its
    # optimizer folder, checkpoint-2 after it (no trainer_state.json, written last): checkpoint-1
    latest = out / "latest"
    on_rank0(lambda: shutil.copytree(ckpt1, latest / "checkpoint-1"))
    on_rank0(lambda: shutil.copytree(ckpt2, latest / "checkpoint-2"))
    on_rank0(lambda: (latest / "checkpoint-2" / "trainer_state.json").unlink())
    on_rank0(lambda: (latest / "checkpoint-3").mkdir())
    on_rank0(lambda: shutil.copy(ckpt2 / "model.safetensors", latest / "checkpoint-3" / "model.safetensors"))
    from_latest = error_text(lambda: result.__setitem__("latest", trainer(out, "latest", 2, resume=True)))
    result["latest resume"] = from_latest
    result["latest resumed exactly"] = from_latest == "no error" and same(params(result.pop("latest").model), final)
    # ... named: one error before anything is loaded (transformers: a FileNotFoundError traceback)
    result["named partial"] = error_text(lambda: trainer(out, "from_partial", 2, resume=str(latest / "checkpoint-2")))
    # ... and where no checkpoint is whole: one error naming the folders
    none_whole = out / "none_whole"
    on_rank0(lambda: shutil.copytree(latest / "checkpoint-3", none_whole / "checkpoint-3"))
    result["none whole"] = error_text(lambda: trainer(out, "none_whole", 2, resume=True))

    # step 2's model files beside step 1's optimizer state (a save killed between them)
    mixed = out / "mixed"
    on_rank0(lambda: shutil.copytree(ckpt1, mixed))
    on_rank0(lambda: shutil.copy(ckpt2 / "model.safetensors", mixed / "model.safetensors"))
    result["mix"] = error_text(lambda: trainer(out, "from_mixed", 3, resume=str(mixed)))

    damaged = out / "damaged"
    on_rank0(lambda: shutil.copytree(ckpt2, damaged))
    on_rank0(lambda: flip_a_byte(damaged / OPT))
    result["damaged"] = error_text(lambda: trainer(out, "from_damaged", 3, resume=str(damaged)))

    legacy = out / "legacy"
    on_rank0(lambda: shutil.copytree(ckpt2, legacy))
    legacy_copy(opt, legacy / OPT)
    straight = params(trainer(out, "from_ckpt2", 3, resume=str(ckpt2)).model)
    from_legacy = trainer(out, "from_legacy", 3, resume=str(legacy))
    result["legacy resumed exactly"] = same(params(from_legacy.model), straight)
    legacy_latest = out / "legacy_latest"  # an older canzona's folder (no manifest) is whole
    on_rank0(lambda: shutil.copytree(legacy, legacy_latest / "checkpoint-2"))
    result["legacy latest resumed exactly"] = same(params(trainer(out, "legacy_latest", 3, resume=True).model),
                                                   straight)
    result["save over legacy"] = error_text(lambda: from_legacy._save_optimizer_and_scheduler(str(legacy)))
    result["legacy untouched"] = not (legacy / OPT / checkpoint_files.MANIFEST).exists()
    # the Trainer's own save of this step into a checkpoint folder holding an older in-place
    # optimizer folder: refused before the model files are written
    step_dir = out / "from_legacy" / f"checkpoint-{from_legacy.state.global_step}"
    on_rank0(lambda: shutil.copytree(legacy, step_dir))
    stamps = {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir() if p.is_file()}
    result["trainer save over legacy"] = error_text(lambda: from_legacy._save_checkpoint(from_legacy.model, None))
    result["model files untouched"] = stamps == {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()
                                                 if p.is_file()}
    return result


def outcome(attempt: Callable[[], Any]) -> Any:
    """What `attempt` returned, or its error as `error_text` gives it."""
    try:
        return attempt()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"


def trainer_rank_files(out: Path) -> dict[str, Any]:
    """`CanzonaTrainer.train`'s checks of the files each rank reads, the folders differing by rank
    (one disk per node, a save killed while one rank wrote its RNG file): `Trainer.train` itself
    stubbed to return the checkpoint it would resume from (no training: a second or so)."""
    from types import SimpleNamespace

    import transformers

    from canzona.integrations.hf import CanzonaTrainer
    from canzona.integrations.optimizer_state import save_optimizer
    from canzona.spec import ModelSpec

    rank, world = dist.get_rank(), dist.get_world_size()
    root = out / "rank_files"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon")
    for step in (1, 2):
        folder = root / f"checkpoint-{step}"

        def first(folder: Path = folder) -> None:
            folder.mkdir(parents=True)
            (folder / "trainer_state.json").write_text("{}")
            torch.save({"base_lrs": [0.1], "lr_lambdas": [{}]}, folder / "scheduler.pt")

        on_rank0(first)
        save_optimizer(opt, str(folder / OPT))
        torch.save({"cpu": torch.random.get_rng_state()}, folder / f"rng_state_{rank}.pth")
        dist.barrier()
    # rank 1's own disk: a copy of checkpoint-1 lacking one of the files each rank reads
    ckpt1 = root / "checkpoint-1"
    lacking = {"optimizer": OPT, "scheduler": "scheduler.pt"}
    node = {what: root / f"node-{what}" / "checkpoint-1" for what in lacking}
    if rank == 1:
        for what, folder in node.items():
            shutil.copytree(ckpt1, folder)
            gone = folder / lacking[what]
            shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    dist.barrier()
    stub = object.__new__(CanzonaTrainer)
    stub.args = SimpleNamespace(world_size=world, process_index=rank, output_dir=str(root))
    kept = transformers.Trainer.train
    transformers.Trainer.train = lambda self, resume, *args, **kwargs: f"resumes from {resume}"
    result: dict[str, Any] = {}
    try:
        # the folder on rank 0's disk only
        result["folder on rank 0 only"] = outcome(
            lambda: CanzonaTrainer.train(stub, str(ckpt1 if rank == 0 else root / "elsewhere" / "checkpoint-1")))
        # rank 1's copy without canzona_optimizer/: the optimizer's own load
        result["optimizer on rank 0 only"] = outcome(
            lambda: CanzonaTrainer._load_optimizer_and_scheduler(stub, str(ckpt1 if rank == 0 else node["optimizer"])))
        # rank 1's copy without scheduler.pt
        result["scheduler on rank 0 only"] = outcome(
            lambda: CanzonaTrainer.train(stub, str(ckpt1 if rank == 0 else node["scheduler"])))
        # resume_from_checkpoint=True: rank 1 killed while writing its RNG file of the last save
        if rank == 1:
            (root / "checkpoint-2" / "rng_state_1.pth").write_bytes(b"\x80\x02half")
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["latest, rank 1's rng damaged"] = outcome(lambda: CanzonaTrainer.train(stub, True))
        result["latest warnings"] = [str(w.message) for w in caught if "skipping" in str(w.message)]
    finally:
        transformers.Trainer.train = kept
    return result


SCENARIOS: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
    ("accelerate", accelerate), ("accelerate automatic", accelerate_automatic),
    ("accelerate dtensors", accelerate_dtensors), ("accelerate two optimizers", two_optimizers),
    ("accelerate one architecture", one_architecture), ("trainer", trainer_scenarios),
    ("trainer rank files", trainer_rank_files)]


def main() -> None:
    from accelerate import PartialState

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    PartialState(cpu=True)
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS:
        try:
            results[name] = scenario(out)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()


if __name__ == "__main__":
    main()
