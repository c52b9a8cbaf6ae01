"""Train a Qwen3 sharded by torch's FSDP2 (`fully_shard`) with canzona's optimizer, under torchrun.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 20 --save ckpt --save-every 10
    torchrun --nproc-per-node 4 examples/fsdp2_train.py --steps 20 --resume ckpt/step_10

torchtitan's recipe: the model (the project's pure-torch Qwen3, `reference.tiny_model`, built from a
Qwen3 `config.json` or a catalog name as `canzona plan --model` reads it) is built whole on every
rank, then `fully_shard` wraps each decoder layer and then the root over a 1-D mesh of every rank,
with `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
(`--no-mixed-precision`: fp32 throughout). The sharded parameters stay fp32.
`DistributedOptimizer(model.named_parameters(), spec, "muon", ...)` on such a model is
`canzona.runtime.fsdp.FsdpOptimizer`: no plan file, its whole-matrix owners are planned at
construction from the model and the mesh. The loop clips with `opt.clip_grad_norm_`, steps, and
steps a `torch.optim.lr_scheduler.LambdaLR` (warm-up, then cosine decay to 10%). The data are
synthetic Markov-chain tokens: step s uses the same global batch at every world size, rank r its
rows `[r B / N, (r + 1) B / N)`.

A checkpoint (`--save DIR` writes `DIR/step_K`, at the end and every `--save-every` steps) is
torch's distributed state dict, `get_state_dict(model, opt)`: the FSDP2 weights and the optimizer's
state as DTensors, each rank writing its shards, saved with `torch.distributed.checkpoint` through
`canzona.runtime.checkpoint_files.save_checkpoint` (complete or invisible, with a manifest), with
the run's settings. `--resume` (a `step_K` folder, or DIR for its latest) verifies the manifest,
reads the checkpoint with `dcp.load` into the state dict of the model and optimizer as this run
shards them, and hands it back with `set_state_dict` (through `FsdpOptimizer.state_dict` /
`load_state_dict`): any world size resumes it (FSDP 2 -> 4).

Bad input (a model the script cannot build, a batch that the ranks cannot split, ranks given
different arguments, an unusable output folder, a checkpoint that is incomplete, damaged, or of
another model or data stream) is one `error:` line on every rank and exit code 2, before training;
a failure during the run is one `error:` line and exit code 1, as in `examples/train.py`, whose
helpers this script shares.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from canzona.runtime.lifecycle import exit_with_launcher

# ruff: noqa: E402 - the imports below come after the launcher watch starts
if __name__ == "__main__":
    exit_with_launcher()  # before importing torch (seconds): see examples/train.py

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import (  # examples/train.py: the same arguments, errors, data and checkpoint checks
    DEFAULT_MODEL,
    HYPER_FLAGS,
    SAME_DATA,
    BadInput,
    Parser,
    find_checkpoint,
    launched_world,
    lr_factor,
    matrix_lr,
    non_negative_float,
    non_negative_int,
    number,
    read_run,
    resume_changes,
    run_script,
    tiny_config,
)

from canzona.errors import SpecError
from canzona.models import resolve_spec
from canzona.optimizers import MATRIX_OPTIMIZERS
from canzona.runtime.atomic_files import check_output_folder
from canzona.runtime.checkpoint_files import (
    Manifest,
    SafeFileSystemReader,
    save_checkpoint,
    verify_checkpoint,
)
from canzona.runtime.gradients import NONFINITE_POLICIES
from canzona.spec import ModelSpec
from canzona.step_policies import FSDP_POLICIES

RUN_KEY = "train"  # the checkpoint's entry holding the run's settings (JSON)
WHOLE_MATRIX = MATRIX_OPTIMIZERS  # whole-matrix owners under FSDP2 (FsdpOptimizer takes each)
OWNER_POLICIES = tuple(n for n, p in FSDP_POLICIES.items() if not p.gathers_all)  # what the runtime runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL),
                    help="a Qwen3 config.json or a catalog name (default: examples/tiny_qwen3/config.json)")
    ap.add_argument("--optimizer", default="muon", choices=WHOLE_MATRIX, help="the matrices' optimizer")
    ap.add_argument("--policy", default="canzona", choices=OWNER_POLICIES,
                    help="who computes each matrix: canzona (owners balanced by cost) or round-robin owners")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (gloo) or cuda (NCCL, one GPU per rank by LOCAL_RANK)")
    ap.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=True,
                    help="FSDP2's MixedPrecisionPolicy: bf16 parameters in forward and backward, fp32 gradient "
                         "reduction (--no-mixed-precision: fp32 throughout)")
    ap.add_argument("--steps", type=number(int), default=20, help="total steps (the LR schedule's length)")
    ap.add_argument("--lr", type=number(float), default=None,
                    help="matrix optimizer's peak learning rate (default: examples/train.py's `matrix_lr`: muon "
                         "0.02, shampoo 3e-3, any other its config's default lr)")
    ap.add_argument("--adamw-lr", type=number(float), default=3e-3, help="AdamW's peak learning rate")
    ap.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="on 2-D weights only")
    ap.add_argument("--warmup", type=non_negative_float, default=0.1,
                    help="linear warm-up, as a fraction of --steps; then cosine decay to 10%%")
    ap.add_argument("--clip", type=non_negative_float, default=1.0,
                    help="clip the global gradient norm to this (0: no clipping)")
    ap.add_argument("--batch", type=number(int), default=8, help="global batch, in sequences (divisible by ranks)")
    ap.add_argument("--seq-len", type=number(int), default=32, help="tokens per sequence")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="model initialisation and data")
    ap.add_argument("--save", default=None, help="write checkpoints to DIR/step_K (at the end, and see --save-every)")
    ap.add_argument("--save-every", type=number(int), default=None, help="also checkpoint every this many steps")
    ap.add_argument("--resume", default=None,
                    help="a checkpoint folder (DIR/step_K), or DIR for its latest; any world size")
    ap.add_argument("--timeout", type=number(float), default=300.0,
                    help="seconds any collective may wait for the other ranks")
    ap.add_argument("--nonfinite", default="raise", choices=NONFINITE_POLICIES,
                    help="a step whose global gradient norm is NaN or Inf: raise (stop, nothing updated or "
                         "saved) or skip it on every rank (counted and logged)")
    args = ap.parse_args(argv)
    if args.save_every is not None and args.save is None:
        raise BadInput("--save-every needs --save DIR")
    return args


# --- everything checked before training ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Job:
    rank: int
    world: int
    local_rank: int
    spec: ModelSpec
    model_cfg: Any  # reference.tiny_model.TinyQwen3Config
    resume: Path | None
    manifest: Manifest | None = None
    start: int = 0  # the step the run starts from (the checkpoint's)
    saved_flags: dict[str, Any] = field(default_factory=dict)


def prepare(args: argparse.Namespace) -> Job:
    """Everything that can be wrong locally, identically on every rank: no collective."""
    rank, world, local_rank = launched_world()
    if world < 2:
        raise SpecError("FSDP2 shards the model over the ranks: launch 2 or more (torchrun --nproc-per-node 2)")
    model_cfg, experts = tiny_config(args.model, args.seq_len)
    if experts is not None:
        raise SpecError(f"{args.model}: a Qwen3-MoE; this script shards dense Qwen3 models (stacked experts are not "
                        "run under FSDP2 yet): use examples/train.py")
    spec = resolve_spec(args.model, 1)  # as `canzona plan --model` reads it: the same fingerprint
    if args.batch % world:
        raise SpecError(f"--batch {args.batch} is not divisible by the {world} ranks")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SpecError("--device cuda, but CUDA is not available here")
    if args.save is not None:
        check_output_folder(args.save, "--save")
    resume = find_checkpoint(args.resume) if args.resume is not None else None
    return Job(rank=rank, world=world, local_rank=local_rank, spec=spec, model_cfg=model_cfg, resume=resume)


def hyper_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The HYPER_FLAGS of this run, as it uses them (--lr resolved to the optimizer's default)."""
    lr = args.lr if args.lr is not None else matrix_lr(args.optimizer)
    return {**{k: getattr(args, k) for k in HYPER_FLAGS}, "lr": lr}


def run_settings(job: Job, args: argparse.Namespace, step: int) -> str:
    return json.dumps({"step": step, "model": job.spec.name, "fingerprint": job.spec.fingerprint(),
                       "optimizer": args.optimizer, "world": job.world,
                       **{k: getattr(args, k) for k in SAME_DATA}, "flags": hyper_flags(args)})


def manifest_info(job: Job, args: argparse.Namespace, step: int) -> dict[str, Any]:
    return {"step": step, "model": job.spec.name, "fingerprint": job.spec.fingerprint(),
            "optimizer": args.optimizer, "fsdp": job.world}


def with_checkpoint(job: Job, args: argparse.Namespace) -> Job:
    """The job resuming from its verified checkpoint (its run settings checked). Collective."""
    folder = job.resume
    manifest = verify_checkpoint(folder, {"model": job.spec.name, "fingerprint": job.spec.fingerprint()},
                                 process_group=dist.group.WORLD)
    run = read_run(folder, manifest, writer="examples/fsdp2_train.py")
    if run["optimizer"] != args.optimizer:
        raise SpecError(f"--resume {folder}: a checkpoint of a {run['optimizer']} run, not --optimizer "
                        f"{args.optimizer}")
    differ = [k for k in SAME_DATA if run[k] != getattr(args, k)]
    if differ:
        given = " ".join(f"--{k.replace('_', '-')} {run[k]}" for k in differ)
        raise SpecError(f"--resume {folder}: the checkpoint's run had {given}; resume with the same data settings")
    if run["step"] > args.steps:
        raise SpecError(f"--resume {folder}: the checkpoint is at step {run['step']}, past --steps {args.steps}")
    return replace(job, manifest=manifest, start=run["step"], saved_flags=run.get("flags", {}))


# --- the run ------------------------------------------------------------------------------------


def build_model(job: Job, args: argparse.Namespace, device: torch.device):
    """The whole model on every rank (the same seed), then `fully_shard` per decoder layer and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from reference.tiny_model import TinyQwen3

    model = TinyQwen3(job.model_cfg, seed=args.seed).to(device)
    mesh = init_device_mesh(device.type, (job.world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.mixed_precision else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_optimizer(job: Job, model: torch.nn.Module, args: argparse.Namespace):
    from canzona.runtime import DistributedOptimizer

    pairs = list(model.named_parameters())
    groups = [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]
    return DistributedOptimizer(groups, job.spec, args.optimizer, {"lr": hyper_flags(args)["lr"]},
                                {"lr": args.adamw_lr}, policy=args.policy, timeout_s=args.timeout,
                                nonfinite=args.nonfinite)


def checkpoint_state(model: torch.nn.Module, opt) -> dict[str, Any]:
    """torch's distributed state dict of the model and the optimizer (DTensors: this rank's shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def load_checkpoint(job: Job, model: torch.nn.Module, opt) -> None:
    """`dcp.load` into this run's state dict (resharded to its world size), then `set_state_dict`."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = checkpoint_state(model, opt)
    dcp.load(state, storage_reader=SafeFileSystemReader(job.resume, job.manifest))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def schedule(opt, args: argparse.Namespace, start: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine from each group's `lr` as the peak, at step `start` (as examples/train.py)."""
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, args.warmup),
                                             last_epoch=start - 1)


def train(job: Job, args: argparse.Namespace) -> None:
    from reference.data import synthetic_batches

    device = torch.device("cuda", job.local_rank) if args.device == "cuda" else torch.device("cpu")
    say = print if job.rank == 0 else (lambda *a, **k: None)
    model = build_model(job, args, device)
    opt = build_optimizer(job, model, args)
    chosen = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]  # the command line's
    params = sum(p.numel for p in job.spec.params)
    say(f"fsdp2: {args.optimizer} ({args.policy} owners), {job.world} ranks on {args.device} "
        f"({dist.get_backend()}), mixed precision {'bf16 / fp32 reduce' if args.mixed_precision else 'off'}; "
        f"model {job.spec.name} ({params:,} parameters)", flush=True)
    if job.resume is not None:
        load_checkpoint(job, model, opt)
        for group, mine in zip(opt.param_groups, chosen):  # the command line's hyper-parameters win
            group.update(mine)
        say(f"resumed from {job.resume} at step {job.start} (saved at {job.manifest.info.get('fsdp', '?')} ranks)",
            flush=True)
        for line in resume_changes(job.saved_flags, hyper_flags(args)):
            say(line, flush=True)
    sched = schedule(opt, args, job.start)

    rows = args.batch // job.world
    data = synthetic_batches(job.model_cfg.vocab, args.batch, args.seq_len, args.steps, seed=args.seed + 1)
    for step, tokens in enumerate(data):
        if step < job.start:
            continue
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model.loss(tokens[job.rank * rows:(job.rank + 1) * rows].to(device))
        loss.backward()  # FSDP2 reduce-scatters every gradient: each rank holds its shards
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)  # for the log: the global batch's loss
        mean = mean.item() / job.world
        norm = opt.clip_grad_norm_(args.clip if args.clip > 0 else math.inf)
        lr = opt.param_groups[0]["lr"]
        skipped = opt.skipped_steps
        opt.step()
        sched.step()
        if opt.skipped_steps > skipped:
            say(f"step {step + 1:4d}/{args.steps}  skipped: loss {mean}, grad norm {norm.item()} "
                f"({opt.skipped_steps} skipped so far)", flush=True)
        else:
            say(f"step {step + 1:4d}/{args.steps}  loss {mean:.4f}  grad norm {norm.item():.4f}  lr {lr:.5f}  "
                f"{time.perf_counter() - t0:.3f} s", flush=True)
        done = step + 1
        if args.save and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            folder = Path(args.save) / f"step_{done}"
            save_checkpoint({**checkpoint_state(model, opt), RUN_KEY: run_settings(job, args, done)}, folder,
                            manifest_info=manifest_info(job, args, done))
            say(f"saved {folder}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_script(argv, parse_args=parse_args, prepare=prepare, with_checkpoint=with_checkpoint, train=train)

if __name__ == "__main__":
    status = main()
    if status:  # leave without finalizing: see examples/train.py
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
