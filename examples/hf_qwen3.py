"""Train a Hugging Face Qwen3 with canzona's DistributedOptimizer, as a real training script does.

A tiny `Qwen3ForCausalLM` (random init, nothing downloaded) on synthetic Markov-chain tokens:
the spec comes from the module (`ModelSpec.from_module`, forward order measured by one backward),
norms and biases go to a no-decay group, gradients are clipped by their global norm, a warm-up +
cosine schedule drives `param_groups`, and `torch.distributed.checkpoint` saves model and
optimizer (each rank writes what it owns) so that a run can resume, at any DP size.

    torchrun --nproc-per-node 2 examples/hf_qwen3.py --steps 20                 # CPU, gloo
    torchrun --nproc-per-node 2 examples/hf_qwen3.py --steps 10 --save /tmp/q   # checkpoint at the end
    torchrun --nproc-per-node 3 examples/hf_qwen3.py --steps 20 --resume /tmp/q # at another DP size
    torchrun --nproc-per-node 8 examples/hf_qwen3.py --device cuda              # one GPU node, NCCL

The gradients are reduce-scattered with the backend's own reductions (`--reduce-scatter native`, the
default): they sum in the backend's order, the same as any order at DP 2 (a sum of two), within
rounding beyond. `--reduce-scatter exact` sums in rank order, so that a run equals the same kernels
in one process bit for bit at any DP size (`canzona.reductions`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn


@dataclass(frozen=True)
class Setup:
    """Everything that fixes the run's numbers (the test emulates the same run in one process)."""

    seed: int = 0
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    global_batch: int = 12  # divisible by DP 1, 2, 3, 4
    seq_len: int = 16
    matrix_lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.1
    clip_norm: float = 0.5
    warmup: int = 3
    total_steps: int = 20


def build_model(setup: Setup) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=setup.vocab, hidden_size=setup.hidden, intermediate_size=2 * setup.hidden,
                         num_hidden_layers=setup.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=setup.hidden // 4, max_position_embeddings=64, tie_word_embeddings=True,
                         attn_implementation="eager")
    torch.manual_seed(setup.seed)  # every rank builds the same weights (the optimizer checks it)
    return Qwen3ForCausalLM(config)


def batches(setup: Setup) -> Iterator[torch.Tensor]:
    """The global batch of every step, the same on every rank."""
    from reference.data import synthetic_batches

    return synthetic_batches(setup.vocab, setup.global_batch, setup.seq_len, setup.total_steps, seed=setup.seed + 1)


def shard(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    from reference.data import shard_batch

    return shard_batch(tokens, rank, world)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def lr_factor(setup: Setup, step: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < setup.warmup:
        return (step + 1) / setup.warmup
    progress = (step - setup.warmup) / max(1, setup.total_steps - setup.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def param_groups(model: nn.Module, setup: Setup) -> list[dict]:
    """Decay for 2-D weights; none for norms and biases (as users configure AdamW)."""
    from canzona.runtime.modules import named_parameters

    pairs = list(named_parameters(model))
    return [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": setup.weight_decay},
            {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, setup: Setup, sample: torch.Tensor, reduce_scatter: str | None = None):
    from canzona.reductions import DEFAULT_REDUCE_SCATTER
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import backward_order
    from canzona.spec import ModelSpec

    spec = ModelSpec.from_module(model, order=backward_order(model, lambda m: loss_of(m, sample)))
    return DistributedOptimizer(param_groups(model, setup), spec, "muon", {"lr": setup.matrix_lr},
                                {"lr": setup.adamw_lr}, policy="canzona",
                                reduce_scatter=reduce_scatter or DEFAULT_REDUCE_SCATTER)


def main() -> None:
    from canzona.reductions import DEFAULT_REDUCE_SCATTER, REDUCE_SCATTER_IMPLS
    from canzona.reductions import HELP as REDUCE_SCATTER_HELP

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=Setup.total_steps, help="train until this step")
    ap.add_argument("--save", default=None, help="save a torch.distributed.checkpoint here at the end")
    ap.add_argument("--resume", default=None, help="continue from this checkpoint (any DP size)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--reduce-scatter", default=DEFAULT_REDUCE_SCATTER, choices=REDUCE_SCATTER_IMPLS,
                    help=f"DP gradient reduce-scatter ({REDUCE_SCATTER_HELP})")
    ap.add_argument("--out", default=None, help="rank 0 saves the final parameters here (torch.save)")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    setup = Setup(total_steps=max(args.steps, Setup.total_steps))
    all_batches = [b.to(device) for b in batches(setup)]
    model = build_model(setup).to(device)
    opt = build_optimizer(model, setup, shard(all_batches[0], rank, world), args.reduce_scatter)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(setup, s))

    start = 0
    if args.resume:
        holder = {"model": model.state_dict(), "step": 0}
        dcp.load(holder, checkpoint_id=args.resume)  # the model's weights, replicated
        # only what this rank's layout needs; refused if the weights just loaded are not those saved with it
        opt.load_sharded_state_dict(args.resume, check_weights=True)
        start = int(holder["step"])
        for _ in range(start):
            sched.step()

    for step in range(start, args.steps):
        model.zero_grad()  # set_to_none, as HF Trainer does: safe with canzona
        loss = loss_of(model, shard(all_batches[step], rank, world))
        loss.backward()
        norm = opt.clip_grad_norm_(setup.clip_norm)
        opt.step()
        sched.step()
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}  grad norm {norm.item():.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.5f}", flush=True)

    if args.save:
        dcp.save({"model": model.state_dict(), "step": args.steps, **opt.sharded_state_dict()},
                 checkpoint_id=args.save)
    opt.wait_params()  # model.state_dict() waits by itself; named_parameters() by hand does not
    if args.out and rank == 0:
        torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
