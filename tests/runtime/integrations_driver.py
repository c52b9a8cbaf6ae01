"""One rank of the `tests/runtime/test_integrations_hf.py` runs, under torchrun (2 gloo ranks).

Runs the examples' `Trainer` (`examples/hf_trainer.py`) and accelerate (`examples/accelerate_loop.py`)
code in one process group, scenario after scenario, and writes `OUT/rank<r>.pt` after each: per
scenario its final parameters, logs and each optimizer step's local gradients (seen by tensor
hooks of its own, as autograd accumulated them over micro-batches), or the error it ended in.
A failure is recorded and the next scenario runs; failures that the tests expect happen alike on
every rank, before any collective could be left waiting.

With them, the optimizer folders' scenarios of `integrations_checkpoint_driver.py`.

    torchrun --nproc-per-node 2 tests/runtime/integrations_driver.py OUT   (this checkout on PYTHONPATH)
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import accelerate_loop as loop_example  # noqa: E402
import hf_trainer as trainer_example  # noqa: E402

from canzona.harness.training import GradientRecorder  # noqa: E402
from canzona.integrations.accelerate import CanzonaAccelerator, canzona_optimizer  # noqa: E402
from canzona.runtime.modules import named_parameters  # noqa: E402
from tests.runtime import integrations_checkpoint_driver as checkpoints  # noqa: E402

SETUP = trainer_example.Setup()
TRAINER_STEPS = 4  # accumulation 2, checkpoints at steps 2 and 4
GIVEN_STEPS = 3
LOOP_STEPS = 4  # accumulation 2, save_state at step 2
LOOP_SAVE_AT = 2
LOOSE_NORM = 1e6  # a clipping bound no gradient norm reaches


class StepGradients:
    """Each optimizer step's local gradients of `model`: `GradientRecorder`'s accumulation, cut
    by a pre-hook on the canzona optimizer's `step()` (whatever calls it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.recorder = GradientRecorder(named_parameters(model))
        self.steps: list[dict[str, torch.Tensor]] = []

    def attach(self, optimizer: Any) -> None:
        canzona_optimizer(optimizer).register_step_pre_hook(lambda *_: self.steps.append(self.recorder.take()))


def final_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.state_dict()  # waits for the last step's parameter all-gathers
    return {n: p.detach().cpu().clone() for n, p in named_parameters(model)}


# --- transformers' Trainer -----------------------------------------------------------------------


def run_trainer(out: Path, name: str, steps: int, accumulation: int = 1, save_steps: int = 0, own: bool | str = False,
                resume: str | None = None, optimizer_kwargs: dict | None = None, samples: int | None = None,
                **overrides: Any) -> dict[str, Any]:
    """`own`: True, `optimizers=(DistributedOptimizer, scheduler)`; "alone", `(DistributedOptimizer, None)`
    (the Trainer builds its schedule over the given optimizer). `samples`: a data set of that many
    (the model and rates as SETUP's)."""
    from transformers import TrainerCallback

    from canzona.integrations.hf import CanzonaTrainer

    args = trainer_example.training_arguments(SETUP, str(out / name), steps, accumulation, save_steps, **overrides)
    data = trainer_example.MarkovTokens(SETUP if samples is None else dataclasses.replace(SETUP, samples=samples))
    model = trainer_example.build_model(SETUP)
    if own == "alone":
        trainer = CanzonaTrainer(model=model, args=args, train_dataset=data,
                                 optimizers=(trainer_example.own_optimizer(SETUP, model, args, data)[0], None))
    else:
        trainer = trainer_example.build_trainer(SETUP, model, args, data, own=own, optimizer_kwargs=optimizer_kwargs)
    grads = StepGradients(model)
    # the first layer's MLP's forward calls: gradient checkpointing runs the layer's forward again in
    # backward (transformers checkpoints `forward`, so the layer's own hooks run once; its modules' again)
    forwards = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    class Attach(TrainerCallback):  # the optimizer exists once training begins
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            grads.attach(optimizer)

    trainer.add_callback(Attach())
    trainer.train(resume_from_checkpoint=resume)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    return {"params": final_parameters(model), "grads": grads.steps, "logs": trainer.state.log_history,
            "accelerator": type(trainer.accelerator).__name__, "overlapped_steps": optimizer.overlapped_steps,
            "forwards": forwards[0], "checkpointing": model.is_gradient_checkpointing}


def adamw_trainer(out: Path, stock: bool) -> dict[str, Any]:
    """CanzonaTrainer with AdamW on every parameter (`matrix_optimizer="adamw"`), or transformers'
    own Trainer with torch's AdamW (`stock`, DDP), on the same arguments: accumulation, a warm-up
    and cosine schedule, the norm measured unclipped."""
    from transformers import Trainer

    from canzona.integrations.hf import CanzonaTrainer

    name = "stock-adamw" if stock else "adamw"
    args = trainer_example.training_arguments(SETUP, str(out / name), 3, accumulation=2, max_grad_norm=0.0,
                                              optim="adamw_torch", lr_scheduler_type="cosine", warmup_steps=1)
    model = trainer_example.build_model(SETUP)
    data = trainer_example.MarkovTokens(SETUP)
    trainer = Trainer(model=model, args=args, train_dataset=data) if stock else \
        CanzonaTrainer(model=model, args=args, train_dataset=data, matrix_optimizer="adamw")
    trainer.train()
    return {"params": final_parameters(model), "logs": trainer.state.log_history}


def plain_trainer(out: Path) -> dict[str, Any]:
    """transformers.Trainer itself, given a canzona optimizer: must fail loudly."""
    from transformers import Trainer

    args = trainer_example.training_arguments(SETUP, str(out / "plain"), 1)
    data = trainer_example.MarkovTokens(SETUP)
    model = trainer_example.build_model(SETUP)
    Trainer(model=model, args=args, train_dataset=data,
            optimizers=trainer_example.own_optimizer(SETUP, model, args, data)).train()
    return {}


# --- accelerate ----------------------------------------------------------------------------------


def build_separately(accelerator: Any) -> tuple[Any, ...]:
    """`loop_example.build`, with the model prepared in a call of its own before the rest."""
    from canzona.runtime import DistributedOptimizer

    data = trainer_example.MarkovTokens(SETUP)
    model = trainer_example.build_model(SETUP).to(accelerator.device)
    pairs = list(named_parameters(model))
    groups = [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": SETUP.weight_decay},
              {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]
    opt = DistributedOptimizer(groups, loop_example.model_spec(model, data), "muon", {"lr": SETUP.matrix_lr},
                               {"lr": SETUP.adamw_lr})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, loop_example.schedule(SETUP, LOOP_STEPS, accelerator.num_processes))
    loader = torch.utils.data.DataLoader(data, batch_size=SETUP.batch, shuffle=True)
    model = accelerator.prepare(model)
    return (model, *accelerator.prepare(opt, loader, sched))


def sync_each_batch_accelerator() -> CanzonaAccelerator:
    """`loop_example.make_accelerator(2, cpu=True)`, accumulating by accelerate's plugin with
    `sync_each_batch=True` (accelerate then runs no micro-batch under `no_sync`)."""
    from accelerate import DataLoaderConfiguration
    from accelerate.utils import GradientAccumulationPlugin

    return CanzonaAccelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True),
                              cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def run_loop(out: Path, overlap_step: bool = False, max_norm: float = SETUP.max_grad_norm,
             save: bool = True, separately: bool = False, sync_each_batch: bool = False,
             samples: int | None = None) -> dict[str, Any]:
    """The loop to LOOP_STEPS, saving its state at LOOP_SAVE_AT on the way (`save`); the model
    prepared before the rest in a call of its own (`separately`); accumulating by accelerate's
    plugin with `sync_each_batch=True` (`sync_each_batch`); on a data set of `samples` (one pass
    at most)."""
    accelerator = sync_each_batch_accelerator() if sync_each_batch else loop_example.make_accelerator(2, cpu=True)
    setup = SETUP if samples is None else dataclasses.replace(SETUP, samples=samples)
    model, opt, loader, sched = build_separately(accelerator) if separately else \
        loop_example.build(setup, accelerator, LOOP_STEPS, {"overlap_step": overlap_step})
    grads = StepGradients(model)
    grads.attach(opt)
    progress = loop_example.Progress()
    accelerator.register_for_checkpointing(progress)
    norms: list[float] = []

    def on_step(step: int, loss: float, norm: float) -> None:
        norms.append(norm)
        if step == LOOP_SAVE_AT and save:
            accelerator.save_state(str(out / "loop_state"))

    loop_example.train(accelerator, model, opt, loader, sched, progress, LOOP_STEPS, max_norm, on_step)
    return {"params": final_parameters(model), "grads": grads.steps, "norms": norms,
            "prepared": type(model).__name__, "overlapped_steps": opt.optimizer.overlapped_steps,  # accelerate wraps it
            **({"refusals": refusals(accelerator, model)} if save else {})}


def refusals(accelerator: CanzonaAccelerator, model: torch.nn.Module) -> dict[str, str]:
    """What the accelerator refuses, each found by a local check (no collective) on every rank."""
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    params = list(model.parameters())
    other = trainer_example.build_model(SETUP)  # a second model and its optimizer, to prepare wrongly
    other_opt = DistributedOptimizer(named_parameters(other), ModelSpec.from_module(other))
    wrapped = torch.nn.parallel.DistributedDataParallel(other)

    def loose_parameter() -> None:
        other.extra = torch.nn.Parameter(torch.zeros(1))  # trainable, and no optimizer holds it
        accelerator.prepare(other, other_opt)

    attempts = {
        "clip a subset": lambda: accelerator.clip_grad_norm_(params[:3], 1.0),
        "clip_grad_value_ a subset": lambda: accelerator.clip_grad_value_(params[:3], 0.1),
        "a DDP model": lambda: accelerator.prepare(wrapped, other_opt),
        "a loose parameter": loose_parameter,
    }
    out = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            out[what] = "accepted"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[what] = f"{type(e).__name__}: {e}"
    return out


def clip_every_micro_batch() -> dict[str, Any]:
    """accelerate's loop clipping on every micro-batch (no `if accelerator.sync_gradients:`): the
    first one, under no_sync, is refused; the loop goes on and clips at the sync step as usual."""
    accelerator = loop_example.make_accelerator(2, cpu=True)
    model, opt, loader, sched = loop_example.build(SETUP, accelerator, 1)
    out: dict[str, Any] = {"clips": []}
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            try:
                out["clips"].append(float(accelerator.clip_grad_norm_(model.parameters(), SETUP.max_grad_norm)))
            except Exception as e:  # noqa: BLE001 - the test reads the type and message
                out["clips"].append(f"{type(e).__name__}: {e}")
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            return out
    return out


def resumed_loop(out: Path) -> dict[str, Any]:
    """A fresh model and optimizer, load_state from LOOP_SAVE_AT, on to LOOP_STEPS."""
    accelerator = loop_example.make_accelerator(2, cpu=True)
    model, opt, loader, sched = loop_example.build(SETUP, accelerator, LOOP_STEPS)
    progress = loop_example.Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state(str(out / "loop_state"))
    start = progress.step
    loop_example.train(accelerator, model, opt, loader, sched, progress, LOOP_STEPS, SETUP.max_grad_norm)
    return {"params": final_parameters(model), "start": start}


def plain_accelerator(out: Path) -> dict[str, Any]:
    """accelerate.Accelerator itself, given a canzona optimizer: must fail loudly."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=1, cpu=True)
    model, opt, loader, sched = loop_example.build(SETUP, accelerator, 1)
    loop_example.train(accelerator, model, opt, loader, sched, loop_example.Progress(), 1, SETUP.max_grad_norm)
    return {}


def hf_tensor_parallel(out: Path, config: str, overrides: bool = True) -> dict[str, Any]:
    """transformers' own TP plan over both ranks (TP 2, DP 1; `overrides`: with the ones canzona
    trains under, `tests/runtime/hf_tp_setup.py`), one step with the plan `canzona plan --model
    <config> --dp 1 --tp 2` wrote: the full parameters before and after, this rank's local
    gradients (as the optimizer reads them), the spec and configs, the loss and the unsharded
    model's loss on the same tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec
    from tests.cli_helpers import invoke
    from tests.runtime import hf_tp_setup as hf

    folder, plan = out / f"hf-tp-{config}", out / f"hf-tp-{config}.json"
    if dist.get_rank() == 0 and not plan.exists():
        hf.save_model(folder, hf.EXAMPLES / config)
        invoke("plan", "--model", hf.EXAMPLES / config / "config.json", "--dp", 1, "--tp", hf.TP, "--out", plan)
    dist.barrier()
    hf.register_head_norm()
    saved = folder / f"{config}-model"
    model = hf.load_sharded(saved, (hf.NORMS | (hf.WHOLE_EXPERTS if "moe" in config else {})) if overrides else None)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def full() -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named_parameters(model)}

    spec, before = ModelSpec.from_module(model), full()
    recorder = GradientRecorder(named_parameters(model))
    opt = DistributedOptimizer(named_parameters(model), spec, group=init_device_mesh("cpu", (1, hf.TP),
                                                                                    mesh_dim_names=("dp", "tp")),
                               plan=str(plan))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = recorder.take()
    opt.step()
    opt.wait_params()
    with torch.no_grad():
        plain_loss = AutoModelForCausalLM.from_pretrained(saved)(input_ids=tokens, labels=tokens).loss
    return {"before": before, "after": full(), "grads": grads, "spec": spec, "matrix": opt.matrix_cfg,
            "adamw": opt.adamw_cfg, "loss": float(loss), "plain_loss": float(plain_loss)}


def hf_tensor_parallel_trainer(out: Path, model_init: bool = False) -> dict[str, Any]:
    """CanzonaTrainer given a model sharded by transformers' TP plan, as a user would write it (the
    optimizer's (dp, tp) mesh and the CLI's plan in optimizer_kwargs; after "hf tp tiny_qwen3",
    which saved the model and wrote the plan), as `model=` or built by `model_init=` (which the
    Trainer calls in its constructor and again in `train()`): refused on every rank, before any
    training step (`steps`: the optimizer steps taken, none expected)."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.integrations.hf import CanzonaTrainer
    from tests.runtime import hf_tp_setup as hf

    hf.register_head_norm()

    def build() -> torch.nn.Module:
        return hf.load_sharded(out / "hf-tp-tiny_qwen3" / "tiny_qwen3-model", hf.NORMS)

    mesh = init_device_mesh("cpu", (1, hf.TP), mesh_dim_names=("dp", "tp"))
    args = trainer_example.training_arguments(SETUP, str(out / "hf-tp-trainer"), 2)
    given = {"model_init": build} if model_init else {"model": build()}
    trainer = CanzonaTrainer(**given, args=args, train_dataset=trainer_example.MarkovTokens(SETUP),
                             optimizer_kwargs={"group": mesh, "plan": str(out / "hf-tp-tiny_qwen3.json")})
    trainer.train()
    return {"steps": trainer.state.global_step}


def checkpoint_scenario(run: Callable[[Path], dict[str, Any]], out: Path) -> dict[str, Any]:
    """One of integrations_checkpoint_driver's scenarios, in a folder of its own (its names are
    other scenarios' too), the ranks meeting after it as that driver's `main` has them meet."""
    folder = out / "checkpoints"
    folder.mkdir(exist_ok=True)
    try:
        return run(folder)
    finally:
        dist.barrier()


def main() -> None:
    from accelerate import PartialState

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    PartialState(cpu=True)  # the gloo process group, as the Trainer's arguments would set it up
    rank = dist.get_rank()  # (accelerator.end_training() would destroy the group: not called here)
    scenarios: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("trainer", lambda: run_trainer(out, "trainer", TRAINER_STEPS, accumulation=2, save_steps=2)),
        ("trainer resumed", lambda: run_trainer(out, "resumed", TRAINER_STEPS, accumulation=2,
                                                resume=str(out / "trainer" / "checkpoint-2"))),
        ("trainer given optimizer", lambda: run_trainer(out, "given", GIVEN_STEPS, own=True)),
        # optimizers=(opt, None): the Trainer's own schedule over the given optimizer, with accumulation
        # an epoch of 3 batches per rank (10 samples each, the last batch of 2) accumulated by 2: every
        # epoch ends in a group of one micro-batch
        ("trainer partial accumulation", lambda: run_trainer(out, "partial", 4, accumulation=2, samples=20)),
        ("trainer given optimizer alone", lambda: run_trainer(out, "given-alone", GIVEN_STEPS, accumulation=2,
                                                              own="alone")),
        ("trainer unclipped", lambda: run_trainer(out, "unclipped", 2, max_grad_norm=0.0)),
        # against transformers' own Trainer and torch's AdamW
        ("trainer adamw", lambda: adamw_trainer(out, stock=False)),
        ("stock trainer adamw", lambda: adamw_trainer(out, stock=True)),
        # accelerate's sync_each_batch: the Trainer runs every micro-batch outside accelerator.no_sync
        ("trainer sync_each_batch", lambda: run_trainer(
            out, "sync-each-batch", TRAINER_STEPS, accumulation=2,
            accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})),
        # the step computed under backward's last reductions (nothing clips it: every step commits)
        ("trainer overlapped", lambda: run_trainer(out, "overlapped", 2, max_grad_norm=0.0,
                                                   optimizer_kwargs={"overlap_step": True})),
        # HF gradient checkpointing: the forward run again inside backward, non-reentrant and reentrant
        *[(f"trainer gradient checkpointing{' reentrant' * reentrant}",
           lambda reentrant=reentrant: run_trainer(out, f"gc{int(reentrant)}", 2, max_grad_norm=0.0,
                                                   gradient_checkpointing=True,
                                                   gradient_checkpointing_kwargs={"use_reentrant": reentrant}))
          for reentrant in (False, True)],
        ("accelerate", lambda: run_loop(out)),
        ("accelerate resumed", lambda: resumed_loop(out)),
        # overlapped: clipping scales every step of the plain loop (the early updates dropped);
        # with a norm bound nothing reaches, every step commits them
        ("accelerate overlapped", lambda: run_loop(out, overlap_step=True, save=False)),
        ("accelerate unclipped", lambda: run_loop(out, max_norm=LOOSE_NORM, save=False)),
        ("accelerate unclipped overlapped", lambda: run_loop(out, overlap_step=True, max_norm=LOOSE_NORM, save=False)),
        ("accelerate clip every micro-batch", clip_every_micro_batch),
        # accelerator.prepare(model), then accelerator.prepare(opt, loader, sched)
        ("accelerate prepared separately", lambda: run_loop(out, save=False, separately=True)),
        ("accelerate sync_each_batch", lambda: run_loop(out, save=False, sync_each_batch=True)),
        # one pass of 3 batches per rank accumulated by 2: the last step a group of one micro-batch
        ("accelerate partial accumulation", lambda: run_loop(out, save=False, samples=20)),
        # transformers' own TP plan over both ranks, with a plan from `canzona plan --model <config> --tp 2`
        ("hf tp tiny_qwen3", lambda: hf_tensor_parallel(out, "tiny_qwen3")),
        ("hf tp tiny_qwen3_moe", lambda: hf_tensor_parallel(out, "tiny_qwen3_moe")),
        ("hf tp without overrides", lambda: hf_tensor_parallel(out, "tiny_qwen3", overrides=False)),
        ("trainer hf tp", lambda: hf_tensor_parallel_trainer(out)),
        ("trainer hf tp model_init", lambda: hf_tensor_parallel_trainer(out, model_init=True)),
        # the optimizer folders' scenarios (integrations_checkpoint_driver.py), in this launch: one
        # torchrun of 2 ranks importing transformers and accelerate (about 10 s of CPU) fewer
        *[(f"checkpoint {name}", lambda run=run: checkpoint_scenario(run, out)) for name, run in checkpoints.SCENARIOS],
        # last: these fail in the middle of training, with the model wrapped in DDP
        ("plain trainer", lambda: plain_trainer(out)),
        ("plain accelerate", lambda: plain_accelerator(out)),
    ]
    results: dict[str, Any] = {}
    for name, scenario in scenarios:
        try:
            results[name] = scenario()
        except Exception as e:  # noqa: BLE001 - recorded for the test, which says what it expected
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
