"""Train a Hugging Face Qwen3 with transformers' `Trainer` and canzona's optimizer.

`canzona.integrations.hf.CanzonaTrainer` is a `Trainer`: the usual `TrainingArguments` (learning
rate, AdamW betas, weight decay, `max_grad_norm=1.0`, gradient accumulation, logging, checkpoints)
drive a canzona `DistributedOptimizer` (Muon on the matrices, AdamW on the rest) instead of DDP +
AdamW. A tiny `Qwen3ForCausalLM` (random init, nothing downloaded) learns synthetic Markov-chain
tokens from a `torch.utils.data.Dataset`; loss and the global gradient norm are logged each step.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 20                        # CPU, gloo
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 20 --accumulation 2 --save-steps 10
    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 20 --resume /tmp/hf_trainer/checkpoint-10
    torchrun --nproc-per-node 2 examples/hf_trainer.py --own-optimizer                   # build it yourself
    torchrun --nproc-per-node 8 examples/hf_trainer.py --device cuda                     # a GPU node, NCCL
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Setup:
    """Everything that fixes the run's numbers (the tests emulate the same run in one process)."""

    seed: int = 0
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    samples: int = 256  # sequences in the data set
    seq_len: int = 16
    batch: int = 4  # sequences per rank and micro-batch
    matrix_lr: float = 0.02  # Muon
    adamw_lr: float = 3e-3  # TrainingArguments.learning_rate
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # the Trainer's default
    warmup: int = 2  # own optimizer's schedule: linear warm-up, then cosine decay to 10%


def build_model(setup: Setup) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=2 * setup.hidden,
                         num_hidden_layers=setup.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=setup.hidden // 4, max_position_embeddings=64, tie_word_embeddings=True,
                         attn_implementation="eager")
    torch.manual_seed(setup.seed)  # every rank builds the same weights (the optimizer checks it)
    return Qwen3ForCausalLM(config)


class MarkovTokens(Dataset):
    """Sequences of a random sparse Markov chain (`reference.data`), as causal-LM examples."""

    def __init__(self, setup: Setup) -> None:
        from reference.data import synthetic_batches

        self.tokens = next(synthetic_batches(setup.vocab, setup.samples, setup.seq_len, 1, seed=setup.seed + 1))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def model_spec(model: nn.Module, data: MarkovTokens):
    """The spec in backward order (measured on one example), so that each bucket of gradients is
    reduced as soon as backward has produced it."""
    from canzona.runtime.modules import backward_order
    from canzona.spec import ModelSpec

    sample = data[0]["input_ids"][None].to(next(model.parameters()).device)
    return ModelSpec.from_module(model, order=backward_order(model, lambda m: m(input_ids=sample, labels=sample).loss))


def training_arguments(setup: Setup, output_dir: str, steps: int, accumulation: int = 1, save_steps: int = 0,
                       device: str = "cpu", **overrides):
    from transformers import TrainingArguments

    values = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=setup.batch,
        gradient_accumulation_steps=accumulation, learning_rate=setup.adamw_lr, weight_decay=setup.weight_decay,
        max_grad_norm=setup.max_grad_norm, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, seed=setup.seed, report_to=[], disable_tqdm=True, use_cpu=device == "cpu")
    return TrainingArguments(**{**values, **overrides})


def lr_factor(setup: Setup, steps: int, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% (the --own-optimizer schedule)."""
    if step < setup.warmup:
        return (step + 1) / setup.warmup
    progress = (step - setup.warmup) / max(1, steps - setup.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def own_optimizer(setup: Setup, model: nn.Module, args, data: MarkovTokens):
    """A DistributedOptimizer and scheduler built by hand, for `optimizers=(opt, sched)`: after
    the model is on its device (`args.device` also sets up the process group)."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model.to(args.device)
    pairs = list(named_parameters(model))
    groups = [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": setup.weight_decay},
              {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]
    opt = DistributedOptimizer(groups, model_spec(model, data), "muon", {"lr": setup.matrix_lr},
                               {"lr": setup.adamw_lr})
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(setup, args.max_steps, s))


def build_trainer(setup: Setup, model: nn.Module, args, data: MarkovTokens, own: bool = False,
                  optimizer_kwargs: dict | None = None):
    """`optimizer_kwargs`: further DistributedOptimizer arguments (e.g. `{"overlap_step": True}`)."""
    from canzona.integrations.hf import CanzonaTrainer

    if own:
        return CanzonaTrainer(model=model, args=args, train_dataset=data,
                              optimizers=own_optimizer(setup, model, args, data))
    # the optimizer is built when training starts: Muon (matrix_config) on the 2-D weights, AdamW
    # (learning_rate, adam_beta1/2, adam_epsilon) on the rest, weight_decay on the Trainer's decay set
    return CanzonaTrainer(model=model, args=args, train_dataset=data, matrix_optimizer="muon",
                          matrix_config={"lr": setup.matrix_lr}, spec=model_spec(model, data),
                          optimizer_kwargs=optimizer_kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (max_steps)")
    ap.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every this many steps")
    ap.add_argument("--output", default="/tmp/hf_trainer", help="output_dir (checkpoints)")
    ap.add_argument("--resume", default=None, help="a checkpoint-<step> directory to resume from")
    ap.add_argument("--own-optimizer", action="store_true", help="pass optimizers=(DistributedOptimizer, sched)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    cli = ap.parse_args()

    setup = Setup()
    args = training_arguments(setup, cli.output, cli.steps, cli.accumulation, cli.save_steps, cli.device)
    data = MarkovTokens(setup)
    trainer = build_trainer(setup, build_model(setup), args, data, own=cli.own_optimizer)
    trainer.train(resume_from_checkpoint=cli.resume)  # the Trainer prints loss and grad_norm each step


if __name__ == "__main__":
    main()
