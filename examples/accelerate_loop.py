"""Train a Hugging Face Qwen3 with canzona's optimizer in a plain accelerate loop.

The loop is accelerate's documented one (`prepare`, `accumulate`, `backward`, `clip_grad_norm_`,
`save_state` / `load_state`); only the class differs: `canzona.integrations.accelerate.
CanzonaAccelerator`, which leaves the model unwrapped (canzona reduces the gradients), runs
accumulation micro-batches under the optimizer's `no_sync()`, clips by the global norm of the
reduced gradients, and checkpoints the optimizer sharded. The model, data and optimizer are those
of `examples/hf_trainer.py`.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --steps 20 --accumulation 2      # CPU, gloo
    torchrun --nproc-per-node 2 examples/accelerate_loop.py --steps 10 --save /tmp/acc
    torchrun --nproc-per-node 2 examples/accelerate_loop.py --steps 20 --resume /tmp/acc
    torchrun --nproc-per-node 8 examples/accelerate_loop.py --device cuda                    # a GPU node
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import MarkovTokens, Setup, build_model, lr_factor, model_spec  # noqa: E402


class Progress:
    """Optimizer steps taken; `accelerator.register_for_checkpointing` saves it with the rest."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def schedule(setup: Setup, steps: int, processes: int) -> Callable[[int], float]:
    """`examples/hf_trainer.py`'s warm-up + cosine schedule over `steps` optimizer steps. accelerate
    steps a prepared scheduler once per process for each optimizer step (its convention for
    schedules written per process): scheduler step k is optimizer step k / processes."""
    return lambda k: lr_factor(setup, steps, k / processes)


def make_accelerator(accumulation: int, cpu: bool) -> Any:
    """A CanzonaAccelerator whose shuffling depends on the seed and epoch only, so that a resumed
    run (`load_state`, then `skip_first_batches`) sees the batches a straight run would."""
    from accelerate import DataLoaderConfiguration

    from canzona.integrations.accelerate import CanzonaAccelerator

    return CanzonaAccelerator(gradient_accumulation_steps=accumulation, cpu=cpu,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def build(setup: Setup, accelerator: Any, steps: int, optimizer_kwargs: dict[str, Any] | None = None):
    """Model, optimizer, data loader and scheduler, prepared: the optimizer is built on the model
    as it will train, on `accelerator.device`. `optimizer_kwargs` go to `DistributedOptimizer`
    (e.g. `{"overlap_step": True}`)."""
    from torch.utils.data import DataLoader

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    data = MarkovTokens(setup)
    model = build_model(setup).to(accelerator.device)
    pairs = list(named_parameters(model))
    groups = [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": setup.weight_decay},
              {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]
    opt = DistributedOptimizer(groups, model_spec(model, data), "muon", {"lr": setup.matrix_lr}, {"lr": setup.adamw_lr},
                               **(optimizer_kwargs or {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(setup, steps, accelerator.num_processes))
    loader = DataLoader(data, batch_size=setup.batch, shuffle=True)
    return accelerator.prepare(model, opt, loader, sched)


def train(accelerator: Any, model: nn.Module, opt: Any, loader: Any, sched: Any, progress: Progress, steps: int,
          max_norm: float, on_step: Callable[[int, float, float], None] | None = None) -> None:
    """accelerate's loop, from `progress.step` to `steps` optimizer steps (one pass at most)."""
    done = progress.step * accelerator.gradient_accumulation_steps  # micro-batches already trained on
    loader = accelerator.skip_first_batches(loader, done) if done else loader
    total = 0.0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            total += loss.item() / accelerator.gradient_accumulation_steps
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            progress.step += 1
            if on_step is not None:
                on_step(progress.step, total, float(norm))
            total = 0.0
            if progress.step >= steps:
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="train until this optimizer step")
    ap.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--save", default=None, help="accelerator.save_state here at the end")
    ap.add_argument("--resume", default=None, help="accelerator.load_state from here first")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    cli = ap.parse_args()

    setup = Setup()
    accelerator = make_accelerator(cli.accumulation, cpu=cli.device == "cpu")
    model, opt, loader, sched = build(setup, accelerator, cli.steps)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if cli.resume:
        accelerator.load_state(cli.resume)  # model, sharded optimizer, scheduler, RNG, progress

    def report(step: int, loss: float, norm: float) -> None:
        accelerator.print(f"step {step:3d}  loss {loss:.4f}  grad norm {norm:.4f}  lr {sched.get_last_lr()[0]:.5f}")

    train(accelerator, model, opt, loader, sched, progress, cli.steps, setup.max_grad_norm, report)
    if cli.save:
        accelerator.save_state(cli.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
