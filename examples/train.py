"""Train from a canzona plan under torchrun: plan file, DP x TP mesh, training loop, checkpoints.

    canzona plan --model examples/tiny_qwen3/config.json --dp 2 --tp 2 --out plan.json
    torchrun --nproc-per-node 4 examples/train.py --plan plan.json --steps 20 --save ckpt --save-every 10
    torchrun --nproc-per-node 4 examples/train.py --plan plan.json --steps 20 --resume ckpt/step_10

The plan fixes the layout: torchrun must start `dp x tp` ranks, which form a (`dp`, `tp`) device
mesh (TP groups are consecutive ranks). The model is built from the description the plan was made
from (`--model`: a Qwen3 `config.json` or a catalog name, read by the same resolver as `canzona
plan`), so its fingerprint is the plan's; the optimizer checks the plan against the model and the
ranks against each other. A plan made with `canzona plan --matrix-config X` runs with
`--matrix-config X` (the same option; a plan priced at another configuration is refused before training). The model is the project's pure-torch Qwen3 (`reference.tiny_model`),
split Megatron-style over the TP ranks (`reference.tiny_model_tp.TinyQwen3TP`) when tp > 1. The
data are synthetic Markov-chain tokens: step s uses the same global batch in every run and at every
layout, DP rank r its rows `[r B / dp, (r + 1) B / dp)`.

Mixture-of-experts (a `qwen3_moe` `config.json`, every layer sparse; TP 1): the model is the same
decoder with top-k routed, stacked experts (`reference.tiny_qwen3_moe`). A plan made with `--ep N`
runs it under expert parallelism (`--ep`, if given, must be the plan's): the DP ranks form EP
groups of N consecutive ranks, each holding experts / N of every layer (tokens dispatched to them by
all-to-alls), and `DistributedOptimizer` steps the dense part over DP and the experts over their
expert-data-parallel groups, as the plan's two parts say:

    canzona plan --model examples/tiny_qwen3_moe/config.json --dp 4 --tp 1 --ep 2 --out plan.json
    torchrun --nproc-per-node 4 examples/train.py --model examples/tiny_qwen3_moe/config.json --plan plan.json --ep 2 --steps 20

Checkpoints hold each expert stack as a DTensor sharded over the EP ranks, so a run at another EP
size (or none) resumes from them.

A checkpoint (`--save DIR` writes `DIR/step_K`) is one `torch.distributed.checkpoint`: the weights
(under TP as DTensors over the mesh's `tp` dimension, so any TP size reads them), the optimizer's
sharded state (each rank writes what it holds) and the run's settings. It is saved with
`canzona.runtime.checkpoint_files.save_checkpoint`: written beside its final name, listed with the
size and sha256 of every file in `manifest.json`, and made visible by one rename, so a killed save
never leaves a partial or mixed checkpoint. `--resume` verifies the manifest before reading
anything, reads the files without running code from them, and continues at any DP x TP layout
(give a plan for the new layout); at the same layout and with the same flags, bit for bit. Flags
given on resume win over the checkpoint's (`--lr`, `--adamw-lr`, `--weight-decay`, `--warmup`,
`--clip`, `--steps`, and `--matrix-config` where it keeps the same optimizer state); each difference
is logged. A `--matrix-config` whose optimizer keeps other state than the checkpoint's run kept
(SOAP's `max_precond_dim`, Shampoo's `max_preconditioner_dim`: the state a plan prices) is refused,
as another model or data stream is: the checkpoint's state does not fit it.

Bad input (a missing or malformed plan, a plan for another model, a world size that is not the
plan's `dp x tp`, ranks given different arguments, an output path that cannot be written, a
checkpoint that is incomplete, damaged, or of another model or data stream) is one `error:` line on
every rank and exit code 2, before training starts; a failure during the run is one `error:` line
and exit code 1 (torchrun itself then exits with 1 and prints its failure summary). The ranks stop
within a second when torchrun dies (`canzona.runtime.lifecycle.exit_with_launcher`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from canzona.runtime.lifecycle import exit_with_launcher

# ruff: noqa: E402 - the imports below come after the launcher watch starts
if __name__ == "__main__":
    # First, before the seconds that importing torch takes: a rank whose torchrun is killed
    # meanwhile would otherwise wait for torchrun's store until --timeout.
    exit_with_launcher()

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from canzona.cost import state_difference
from canzona.errors import CanzonaError, CheckpointError, PlanError, SpecError
from canzona.models import read_model, resolve_spec
from canzona.optimizers import MATRIX_REGISTRY, config_changes, default_config, matrix_config_json
from canzona.plan import Plan, check_plan_config, check_plan_matches, load_plan
from canzona.reductions import DEFAULT_REDUCE_SCATTER, REDUCE_SCATTER_IMPLS
from canzona.reductions import HELP as REDUCE_SCATTER_HELP
from canzona.runtime.atomic_files import check_output_file, check_output_folder, write_atomically
from canzona.runtime.checkpoint_files import (
    MANIFEST,
    Manifest,
    SafeFileSystemReader,
    latest_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from canzona.runtime.comm import Comm
from canzona.runtime.gradients import NONFINITE_POLICIES
from canzona.spec import ModelSpec
from canzona.step_policies import default_policy, get_step_policy
from cli.units import MATRIX_CONFIG_HELP, parse_matrix_config

# reference.tiny_model_tp gathers with all_gather_into_tensor, which torch 2.13 marks deprecated
warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "tiny_qwen3" / "config.json"
# --lr when not given, where this example departs from the optimizer's own default (its config's
# `lr`, which every other matrix optimizer, a new one included, runs at: `matrix_lr`); an elementwise
# optimizer's plan (`canzona plan --optimizer adamw`, what `canzona search --optimizer adamw`
# prints) steps its matrices at --adamw-lr
TUNED_LR = {"muon": 0.02, "shampoo": 3e-3}
RUN_KEY = "train"  # the checkpoint's entry holding the run's settings (JSON)
SAME_DATA = ("seed", "batch", "seq_len")  # a resumed run must see the same data stream
# recorded with each checkpoint; on resume the command line's values win, and differences are logged
HYPER_FLAGS = ("steps", "lr", "adamw_lr", "weight_decay", "warmup", "clip")
# the matrix optimizer's fields this script's own flags set (a --matrix-config value would be overridden)
OWN_FIELDS = {"lr": "--lr", "weight_decay": "--weight-decay"}
MAX_ERROR_BYTES = 2048  # of an error line carried to every rank
T = TypeVar("T")


def error_line(text: str) -> None:
    """One write, so that lines of ranks sharing a terminal or pipe never interleave."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def describe(e: BaseException) -> str:
    """The first line of an error; for a checkpoint failure, of the first rank's cause."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = min(e.failures.items(), key=lambda item: item[0])
        return f"checkpoint failed on rank {rank}: {describe(cause)}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class BadInput(Exception):
    """Bad input: one `error:` line and exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise BadInput(f"{message} (see --help)")


def number(kind, allow_zero: bool = False):
    """An argparse type: a finite `kind` above 0 (or at least 0 with `allow_zero`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if allow_zero else 'positive'}, got {text}")
        return value
    return parse


non_negative_int = number(int, allow_zero=True)
non_negative_float = number(float, allow_zero=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan file written by `canzona plan --out` (fixes dp x tp)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL),
                    help="the model the plan was made for: a Qwen3 config.json or a catalog name "
                         "(default: examples/tiny_qwen3/config.json)")
    ap.add_argument("--ep", type=number(int), default=None,
                    help="expert parallelism of a mixture-of-experts model; the plan fixes it (default: the plan's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (gloo) or cuda (NCCL, one GPU per rank by LOCAL_RANK)")
    ap.add_argument("--steps", type=number(int), default=20, help="total steps (the LR schedule's length)")
    ap.add_argument("--lr", type=number(float), default=None,
                    help="matrix optimizer's peak learning rate (default: muon 0.02, shampoo 3e-3, any other its config's "
                         "default lr, adamw --adamw-lr)")
    ap.add_argument("--matrix-config", default=None, help=f"{MATRIX_CONFIG_HELP} As the plan was made with: "
                    "`canzona plan --matrix-config`. --lr and --weight-decay set those two.")
    ap.add_argument("--adamw-lr", type=number(float), default=3e-3, help="AdamW's peak learning rate")
    ap.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="on 2-D weights only")
    ap.add_argument("--warmup", type=non_negative_float, default=0.1,
                    help="linear warm-up, as a fraction of --steps; then cosine decay to 10%%")
    ap.add_argument("--clip", type=non_negative_float, default=1.0,
                    help="clip the global gradient norm to this (0: no clipping)")
    ap.add_argument("--batch", type=number(int), default=8, help="global batch, in sequences (divisible by dp)")
    ap.add_argument("--seq-len", type=number(int), default=32, help="tokens per sequence")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="model initialisation and data")
    ap.add_argument("--save", default=None, help="write checkpoints to DIR/step_K (at the end, and see --save-every)")
    ap.add_argument("--save-every", type=number(int), default=None, help="also checkpoint every this many steps")
    ap.add_argument("--resume", default=None,
                    help="a checkpoint folder (DIR/step_K), or DIR for its latest; any DP x TP layout")
    ap.add_argument("--out", default=None, help="rank 0 writes the final weights here (torch.save, full tensors)")
    ap.add_argument("--timeout", type=number(float), default=300.0,
                    help="seconds any collective may wait for the other ranks")
    ap.add_argument("--reduce-scatter", default=DEFAULT_REDUCE_SCATTER, choices=REDUCE_SCATTER_IMPLS,
                    help=f"DP gradient reduce-scatter ({REDUCE_SCATTER_HELP}); canzona simulate "
                         "--reduce-scatter prices the same choice")
    ap.add_argument("--nonfinite", default="raise", choices=NONFINITE_POLICIES,
                    help="a step whose global gradient norm is NaN or Inf (a NaN loss, an overflow): raise (stop "
                         "with an error, nothing updated or saved) or skip it on every rank (counted and logged)")
    args = ap.parse_args(argv)
    if args.save_every is not None and args.save is None:
        raise BadInput("--save-every needs --save DIR")
    return args


# --- everything checked before the process group starts -----------------------------------------


@dataclass(frozen=True, kw_only=True)
class Job:
    rank: int
    world: int
    local_rank: int
    plan: Plan
    spec: ModelSpec
    model_cfg: Any  # reference.tiny_model.TinyQwen3Config (of a mixture of experts: its decoder's)
    experts: Any = None  # a mixture of experts' canzona.decoder.DecoderConfig; None: a dense Qwen3
    resume: Path | None  # the checkpoint folder, verified by `with_checkpoint` before it is read
    manifest: Manifest | None = None  # the verified checkpoint's
    start: int = 0  # the step the run starts from (the checkpoint's)
    saved_flags: dict[str, Any] = field(default_factory=dict)  # HYPER_FLAGS of the checkpoint's run
    saved_matrix_config: str | None = None  # the checkpoint's run's (`matrix_config_text`); None: not recorded
    matrix_cfg: Any = None  # --matrix-config's configuration (None: the optimizer's defaults)

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def ep(self) -> int:
        return self.plan.ep


def launched_world() -> tuple[int, int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except (KeyError, ValueError):
        raise BadInput("RANK and WORLD_SIZE are not set: launch with torchrun "
                       "(torchrun --nproc-per-node N examples/train.py ...)") from None


def tiny_config(model: str, seq_len: int):
    """The Qwen3 the script builds from `model`, checked to be one it can build: its
    `TinyQwen3Config` (of a Qwen3-MoE: the decoder's), and a Qwen3-MoE's `DecoderConfig` (None for a
    dense Qwen3)."""
    from reference.tiny_model import TinyQwen3Config

    source = read_model(model)
    cfg = source.config
    if cfg is None:
        what = "a spec file (no configuration to build the model from)"
    elif cfg.family not in ("qwen3", "qwen3_moe"):
        what = f"a {cfg.family} model"
    elif cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        what = "a Qwen3 with biases"
    else:
        what = None
    if what is not None:
        raise SpecError(f"{model}: this script builds Qwen3 and Qwen3-MoE models (a qwen3 or qwen3_moe config.json "
                        f"or a catalog name), not {what}")
    extra: dict[str, Any] = {"max_seq_len": seq_len}  # a catalog model: rotary positions have no limit
    if source.kind == "hf-config":  # sizes the planner does not need, as the config gives them
        raw = json.loads(Path(source.path).read_text())
        for key, name in (("rope_theta", "rope_theta"), ("rms_norm_eps", "rms_eps"),
                          ("max_position_embeddings", "max_seq_len")):
            if raw.get(key) is not None:
                extra[name] = raw[key]
    if cfg.experts:
        from reference.tiny_qwen3_moe import TinyQwen3Moe

        tiny = TinyQwen3Moe.decoder_config(cfg, extra)  # refuses what the Qwen3-MoE model does not build
    else:
        tiny = TinyQwen3Config(vocab=cfg.vocab, hidden=cfg.hidden, layers=cfg.layers, q_heads=cfg.q_heads,
                               kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, ffn=cfg.ffn,
                               tied_embeddings=cfg.tied_embeddings, name=cfg.name, **extra)
    if seq_len > tiny.max_seq_len:
        raise SpecError(f"--seq-len {seq_len} is longer than the model's {tiny.max_seq_len} positions")
    return tiny, (cfg if cfg.experts else None)


def prepare(args: argparse.Namespace) -> Job:
    """Everything that can be wrong locally, identically on every rank: no collective."""
    rank, world, local_rank = launched_world()
    plan = load_plan(args.plan)
    if plan.dp * plan.tp != world:
        raise PlanError(f"{args.plan} is a plan for dp {plan.dp} x tp {plan.tp} = {plan.dp * plan.tp} ranks, "
                        f"but torchrun started {world}: launch {plan.dp * plan.tp} ranks, or make a plan "
                        f"for {world} (canzona plan --dp ... --tp ... --out)")
    if args.ep is not None and args.ep != plan.ep:
        raise PlanError(f"--ep {args.ep}, but {args.plan} is a plan for ep {plan.ep}: make a plan with --ep "
                        f"{args.ep} (canzona plan --ep {args.ep} --out), or leave --ep out")
    model_cfg, experts = tiny_config(args.model, args.seq_len)
    if experts is not None and plan.tp > 1:
        raise SpecError(f"{args.model}: the Qwen3-MoE model is built at tp 1 (its attention is not split), but the "
                        f"plan has tp {plan.tp}")
    spec = resolve_spec(args.model, plan.tp)  # as `canzona plan --model` read it: the same fingerprint
    matrix_cfg = parse_matrix_config(args.matrix_config, plan.optimizer)
    own = next((f for f in config_changes(plan.optimizer, matrix_cfg) if f in OWN_FIELDS), None) \
        if matrix_cfg is not None else None
    if own is not None:
        raise SpecError(f"--matrix-config: give {own} with {OWN_FIELDS[own]}")
    try:
        # the plan's layout is the job's: what a job refuses (expert TP) is refused here, before training
        check_plan_matches(plan, spec, dp=plan.dp, tp=plan.tp, ep=plan.ep)
        # and the configuration it was priced at (as the optimizer checks it, but before the process group)
        check_plan_config(plan, spec, matrix_cfg)
        policy = get_step_policy(plan_policy(plan))
        for part in (plan, plan.experts) if plan.experts is not None else (plan,):
            policy.check_dp_plan(part.dp_plan)
            policy.check_tp_plan(part.tp_plan.policy, part.tp)
    except CanzonaError as e:
        raise PlanError(f"{args.plan}: {e}") from None
    if args.lr is not None and MATRIX_REGISTRY[plan.optimizer].elementwise:
        raise SpecError(f"--lr is a matrix optimizer's rate; the plan's {plan.optimizer} steps every parameter at "
                        "--adamw-lr")
    if args.batch % plan.dp:
        raise SpecError(f"--batch {args.batch} is not divisible by the plan's dp {plan.dp}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SpecError("--device cuda, but CUDA is not available here")
    # only rank 0 writes --out (its folder may be on a disk the other ranks do not see); every
    # rank writes into --save
    if args.out is not None and rank == 0:
        check_output_file(args.out, "--out")
    if args.save is not None:
        check_output_folder(args.save, "--save")
    resume = find_checkpoint(args.resume) if args.resume is not None else None
    return Job(rank=rank, world=world, local_rank=local_rank, plan=plan, spec=spec, model_cfg=model_cfg,
               experts=experts, resume=resume, matrix_cfg=matrix_cfg)


def find_checkpoint(path: str) -> Path:
    """`path` itself if it is a checkpoint folder (complete or not: `with_checkpoint` says what is
    wrong with it), else its latest complete `step_K` folder."""
    p = Path(path)
    if (p / MANIFEST).exists() or (p / ".metadata").exists():
        return p
    if not p.is_dir():
        raise SpecError(f"--resume {path}: no such checkpoint folder")
    latest = latest_checkpoint(p)
    if latest is None:
        raise SpecError(f"--resume {path}: not a checkpoint, and holds no complete step_K checkpoint")
    return latest


def with_checkpoint(job: Job, args: argparse.Namespace) -> Job:
    """The job resuming from its verified checkpoint. Collective: the ranks share the hashing."""
    manifest = verify_checkpoint(job.resume, {"model": job.spec.name, "fingerprint": job.spec.fingerprint()},
                                 process_group=dist.group.WORLD)
    run = check_checkpoint(job.resume, manifest, job.spec, job.plan, args, job.matrix_cfg)
    return replace(job, manifest=manifest, start=run["step"], saved_flags=run.get("flags", {}),
                   saved_matrix_config=run.get("matrix_config"))


RUN_FIELDS = ("step", "model", "fingerprint", "optimizer", *SAME_DATA)


def read_run(folder: Path, manifest: Manifest, writer: str = "examples/train.py") -> dict[str, Any]:
    """The run settings saved with a verified checkpoint (read by this rank alone); `writer`: the
    script that writes such checkpoints (examples/fsdp2_train.py reads its own with this too)."""
    reader = SafeFileSystemReader(folder, manifest)
    holder = {RUN_KEY: ""}
    try:
        reader.read_metadata()  # its refusal as it is, before DCP (which logs a traceback for it)
        with warnings.catch_warnings():  # that it loads in this process alone: as meant
            warnings.simplefilter("ignore")
            dcp.load(holder, storage_reader=reader, no_dist=True)
        run = json.loads(holder[RUN_KEY])
        missing = [k for k in RUN_FIELDS if k not in run]
        if missing:
            raise ValueError(f"no {missing[0]!r} in its run settings")
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - dcp wraps every failure
        raise SpecError(f"--resume {folder}: not a checkpoint written by {writer} ({describe(e)})") from None
    return run


def check_checkpoint(folder: Path, manifest: Manifest, spec: ModelSpec, plan: Plan,
                     args: argparse.Namespace, matrix_cfg: Any = None) -> dict[str, Any]:
    run = read_run(folder, manifest)
    if run["fingerprint"] != spec.fingerprint():
        raise SpecError(f"--resume {folder}: a checkpoint of model {run['model']!r} ({run['fingerprint']}), "
                        f"not {spec.name!r} ({spec.fingerprint()})")
    if run["optimizer"] != plan.optimizer:
        raise SpecError(f"--resume {folder}: a checkpoint of a {run['optimizer']} run, but the plan is for "
                        f"{plan.optimizer}")
    differ = [k for k in SAME_DATA if run[k] != getattr(args, k)]
    if differ:
        given = " ".join(f"--{k.replace('_', '-')} {run[k]}" for k in differ)
        raise SpecError(f"--resume {folder}: the checkpoint's run had {given}; resume with the same data "
                        "settings")
    if run["step"] > args.steps:
        raise SpecError(f"--resume {folder}: the checkpoint is at step {run['step']}, past --steps {args.steps}")
    saved = run.get("matrix_config")  # a checkpoint of an older script has none: not compared
    if saved is not None and saved != matrix_config_text(plan.optimizer, matrix_cfg):
        try:
            before = parse_matrix_config(saved, plan.optimizer)
        except SpecError as e:
            raise SpecError(f"--resume {folder}: its run's --matrix-config {saved}: {e}") from None
        differs = state_difference(plan.optimizer, spec.matrix_params(), before, matrix_cfg)
        if differs is not None:
            raise SpecError(f"--resume {folder}: the checkpoint's run had --matrix-config {saved}, which keeps other "
                            f"optimizer state than --matrix-config {matrix_config_text(plan.optimizer, matrix_cfg)} "
                            f"({differs}): resume with the checkpoint's --matrix-config and a plan made at it")
    return run


def matrix_config_text(optimizer: str, cfg: Any) -> str:
    """A --matrix-config as the run records and logs it: its fields off the defaults, as JSON."""
    return "{}" if cfg is None else matrix_config_json(optimizer, cfg)


# --- the run ------------------------------------------------------------------------------------


def lr_factor(step: int, steps: int, warmup: float) -> float:
    """Linear warm-up over `warmup x steps` steps, then cosine decay to 10% at `steps`."""
    w = round(warmup * steps)
    if step < w:
        return (step + 1) / w
    progress = (step - w) / max(1, steps - w)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_model(job: Job, mesh, expert_mesh, seed: int, device: torch.device) -> torch.nn.Module:
    """Every rank builds the same weights; under TP each keeps its shards, under EP its experts."""
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import TinyQwen3TP
    from reference.tiny_qwen3_moe import TinyQwen3Moe

    if job.experts is not None:
        c = job.model_cfg
        model = TinyQwen3Moe(job.experts, ep_group=expert_mesh.get_group("ep") if expert_mesh is not None else None,
                             seed=seed, rope_theta=c.rope_theta, rms_eps=c.rms_eps, max_seq_len=c.max_seq_len)
    elif job.tp == 1:
        model = TinyQwen3(job.model_cfg, seed=seed)
    else:
        model = TinyQwen3TP(job.model_cfg, mesh.get_group("tp"), seed=seed)
    return model.to(device)


def plan_policy(plan: Plan) -> str:
    """The step policy that executes a plan made by `canzona plan`: its optimizer's default (canzona for
    a matrix optimizer, ZeRO-1 for AdamW), the one `canzona plan` planned for."""
    return default_policy(plan.optimizer)


def matrix_lr(optimizer: str) -> float:
    """A matrix optimizer's peak learning rate without --lr: `TUNED_LR`'s, else its config default."""
    return TUNED_LR.get(optimizer, default_config(optimizer).lr)


def hyper_flags(job: Job, args: argparse.Namespace) -> dict[str, Any]:
    """The HYPER_FLAGS of this run, as it uses them (--lr resolved to the optimizer's default)."""
    elementwise = MATRIX_REGISTRY[job.plan.optimizer].elementwise  # AdamW: --adamw-lr, its own
    lr = args.lr if args.lr is not None else args.adamw_lr if elementwise else matrix_lr(job.plan.optimizer)
    return {**{k: getattr(args, k) for k in HYPER_FLAGS}, "lr": lr}


def build_optimizer(job: Job, model: torch.nn.Module, mesh, expert_mesh, args: argparse.Namespace):
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    pairs = list(named_parameters(model))
    groups = [{"params": [(n, p) for n, p in pairs if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]
    # an elementwise optimizer (AdamW) steps every parameter with the AdamW settings: no matrix ones
    lr = hyper_flags(job, args)["lr"]
    matrix = None if MATRIX_REGISTRY[job.plan.optimizer].elementwise else \
        {"lr": lr} if job.matrix_cfg is None else replace(job.matrix_cfg, lr=lr)
    return DistributedOptimizer(groups, job.spec, job.plan.optimizer, matrix, {"lr": args.adamw_lr}, plan=job.plan,
                                policy=plan_policy(job.plan), group=mesh,
                                timeout_s=args.timeout, reduce_scatter=args.reduce_scatter, nonfinite=args.nonfinite,
                                expert_mesh=expert_mesh)


def hyper_parameters(opt) -> list[dict[str, Any]]:
    """Every parameter group's hyper-parameters (peak learning rate, weight decay, betas, ...)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def resume_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One log line per flag given otherwise than in the checkpoint's run (the command line wins)."""
    return [f"resume: --{k.replace('_', '-')} {now[k]} (the checkpoint's run had {saved[k]})"
            for k in HYPER_FLAGS if k in saved and saved[k] != now[k]]


def schedule(opt, args: argparse.Namespace, start: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine from each group's `lr` as the peak, at step `start`. Built after a resume
    has loaded the optimizer, from the command line's peaks: a resumed run follows the schedule
    its flags describe, and with unchanged flags the learning rates of the run it continues."""
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, args.warmup),
                                             last_epoch=start - 1)


def weights(job: Job, model: torch.nn.Module, mesh, expert_mesh) -> dict[str, torch.Tensor]:
    """The model's weights as checkpoint entries: plain tensors at TP 1; under TP, each rank's shard
    as a DTensor over the mesh's `tp` dimension, so that any TP size can read them; under EP, each
    expert stack's experts of this rank as a DTensor sharded over the expert mesh's `ep`
    dimension, so that any EP size can read them. They share storage with the parameters: loading
    writes into the model."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from canzona.runtime.modules import named_parameters

    stacks = {p.name for p in job.spec.stacks}
    out = {}
    for name, p in named_parameters(model):
        t = p.detach()
        if expert_mesh is not None and name in stacks:
            t = DTensor.from_local(t, expert_mesh["ep"], [Shard(0)], run_check=False)
        elif job.tp > 1:
            d = job.spec.param(name).tp_dim
            t = DTensor.from_local(t, mesh["tp"], [Replicate() if d is None else Shard(d)], run_check=False)
        out[f"model/{name}"] = t
    return out


def run_settings(job: Job, args: argparse.Namespace, step: int) -> str:
    return json.dumps({"step": step, "model": job.spec.name, "fingerprint": job.spec.fingerprint(),
                       "optimizer": job.plan.optimizer, "dp": job.dp, "tp": job.tp, "ep": job.ep,
                       **{k: getattr(args, k) for k in SAME_DATA}, "flags": hyper_flags(job, args),
                       "matrix_config": matrix_config_text(job.plan.optimizer, job.matrix_cfg)})


def manifest_info(job: Job, step: int) -> dict[str, Any]:
    """What `verify_checkpoint` can check before reading anything (the writer's layout, for people)."""
    return {"step": step, "model": job.spec.name, "fingerprint": job.spec.fingerprint(),
            "optimizer": job.plan.optimizer, "dp": job.dp, "tp": job.tp, "ep": job.ep}


def train(job: Job, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from reference.data import synthetic_batches

    device = torch.device("cuda", job.local_rank) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (job.dp, job.tp), mesh_dim_names=("dp", "tp"))
    # expert parallelism: EP groups of ep consecutive DP ranks (the optimizer's expert_mesh)
    expert_mesh = init_device_mesh(device.type, (job.dp // job.ep, job.ep), mesh_dim_names=("edp", "ep")) \
        if job.ep > 1 else None
    dp_rank = mesh.get_local_rank("dp")
    dp_group = mesh.get_group("dp")
    say = print if job.rank == 0 else (lambda *a, **k: None)

    model = build_model(job, mesh, expert_mesh, args.seed, device)
    opt = build_optimizer(job, model, mesh, expert_mesh, args)
    # the command line's configurations and group hyper-parameters, before a checkpoint's are loaded
    chosen, configs = hyper_parameters(opt), (opt.matrix_cfg, opt.adamw_cfg)
    params = sum(p.numel for p in job.spec.params)
    layout = f"dp {job.dp} x tp {job.tp}" + (f", ep {job.ep}" if job.ep > 1 else "")
    say(f"plan {args.plan}: {job.plan.optimizer}, {layout}, hash {job.plan.hash()[:12]}; "
        f"model {job.spec.name} ({params:,} parameters); {job.world} ranks on {args.device} "
        f"({dist.get_backend()})", flush=True)

    if job.resume is not None:
        reader = SafeFileSystemReader(job.resume, job.manifest)
        dcp.load(weights(job, model, mesh, expert_mesh), storage_reader=reader)  # into the parameters
        # the pieces this rank's layout needs; the weights just loaded must be those saved with them
        opt.load_sharded_state_dict(reader, check_weights=True)
        # loading restored the checkpoint's (the same state: check_checkpoint); the command line's win,
        # in the groups and in the configurations the optimizer's next checkpoint header records
        for group, mine in zip(opt.param_groups, chosen):
            group.update(mine)
        opt.matrix_cfg, opt.adamw_cfg = configs
        say(f"resumed from {job.resume} at step {job.start}", flush=True)
        for line in resume_changes(job.saved_flags, hyper_flags(job, args)):
            say(line, flush=True)
        now = matrix_config_text(job.plan.optimizer, job.matrix_cfg)
        if job.saved_matrix_config not in (None, now):  # the same state (check_checkpoint): the command line's
            say(f"resume: --matrix-config {now} (the checkpoint's run had {job.saved_matrix_config})", flush=True)
    sched = schedule(opt, args, job.start)

    rows = args.batch // job.dp
    saved: Path | None = None  # the last checkpoint written
    data = synthetic_batches(job.model_cfg.vocab, args.batch, args.seq_len, args.steps, seed=args.seed + 1)
    for step, tokens in enumerate(data):
        if step < job.start:
            continue
        t0 = time.perf_counter()
        model.zero_grad()
        loss = model.loss(tokens[dp_rank * rows:(dp_rank + 1) * rows].to(device))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)  # for the log: the global batch's loss
        mean = mean.item() / job.dp
        # the optimizer checks the global gradient norm before any update: a NaN loss's gradients
        # stop the run there (--nonfinite raise) or skip the step on every rank (skip)
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
            saved = Path(args.save) / f"step_{done}"
            opt.wait_params()  # the step's parameter all-gathers run under the next forward
            save_checkpoint({**weights(job, model, mesh, expert_mesh), RUN_KEY: run_settings(job, args, done),
                             **opt.sharded_state_dict()}, saved, manifest_info=manifest_info(job, done))
            say(f"saved {saved}", flush=True)

    if args.out:
        opt.wait_params()
        full = {}
        for key, t in weights(job, model, mesh, expert_mesh).items():
            full[key[len("model/"):]] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        if job.rank == 0:
            write_final_weights(args.out, full, saved)
            say(f"final weights written to {args.out}", flush=True)


def write_final_weights(path: str, full: dict[str, torch.Tensor], saved: Path | None) -> None:
    """All of it or nothing at `path`; a failure says where else the result is."""
    try:
        write_atomically(path, lambda f: torch.save(full, f))
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        kept = f"; they are in the checkpoint {saved}" if saved is not None and saved.is_dir() else ""
        raise CanzonaError(f"--out {path}: cannot write the final weights ({describe(e)}){kept}") from None


def gather(mine: torch.Tensor, wait_s: float) -> torch.Tensor:
    """Every rank's `mine` (a small CPU tensor of the same shape on each), one row per rank in rank
    order, over gloo; waits at most `wait_s` for the other ranks. Through canzona's `Comm`, which
    returns only once gloo has let go of the tensors: the script's last collective is one of these,
    and a gloo thread releasing them while the interpreter exits aborts the process
    (`canzona.runtime.comm.Handoff`)."""
    return Comm(None, wait_s, "world").all_gather_values(mine.flatten(), "exit status")


def exit_together(status: torch.Tensor, wait_s: float) -> torch.Tensor:
    """Every rank's status: torchrun stops all ranks as soon as one exits with an error, so ranks
    meet here before any of them leaves (at most `wait_s`)."""
    return gather(status, wait_s)


def fail_together(error: str | None, wait_s: float) -> bool:
    """Bad input found before training, on some ranks or all: every rank prints the same `error:`
    line (the lowest failing rank's error, naming that rank unless every rank found the same) and
    all return True together."""
    failed = exit_together(torch.tensor([int(error is not None)]), wait_s).flatten()
    if not failed.any():
        return False
    text = torch.zeros(MAX_ERROR_BYTES, dtype=torch.uint8)
    encoded = list((error or "").encode()[:MAX_ERROR_BYTES])
    text[:len(encoded)] = torch.tensor(encoded, dtype=torch.uint8)
    texts = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gather(text, wait_s)]
    ranks = [int(r) for r in torch.nonzero(failed).flatten()]
    first = texts[ranks[0]]
    alike = len(ranks) == len(texts) and all(t == first for t in texts)
    error_line(f"error: {first}" if alike else f"error: rank {ranks[0]}: {first}")
    exit_together(torch.zeros(1, dtype=torch.int64), wait_s)  # everyone has printed
    return True


def value_digest(value: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(value, default=str).encode()).digest()[:8], "little",
                          signed=True)


def disagreement(args: argparse.Namespace, wait_s: float) -> str | None:
    """The flags the ranks were given differently (compared by a digest of each parsed value), in a
    message that is the same on every rank; None when they agree. Collective."""
    names = sorted(vars(args))
    every = gather(torch.tensor([value_digest(getattr(args, n)) for n in names], dtype=torch.int64), wait_s)
    differ = []
    for i, name in enumerate(names):
        others = [int(r) for r in torch.nonzero(every[:, i] != every[0, i]).flatten()]
        if others:
            differ.append(f"--{name.replace('_', '-')} (rank(s) {others} differ from rank 0)")
    if not differ:
        return None
    return f"the ranks were given different arguments: {', '.join(differ)}; give every rank the same"


def checked(step: Callable[[], T]) -> tuple[T | None, str | None]:
    """(step's result, None), or (None, its one-line error) for bad input (an unreadable path too)."""
    try:
        return step(), None
    except (BadInput, CanzonaError) as e:
        return None, str(e)
    except OSError as e:
        return None, describe(e)


def main(argv: list[str] | None = None) -> int:
    return run_script(argv, parse_args=parse_args, prepare=prepare, with_checkpoint=with_checkpoint, train=train)


def run_script(argv: list[str] | None, *, parse_args: Callable, prepare: Callable, with_checkpoint: Callable,
               train: Callable) -> int:
    """A training script's life under torchrun, given its steps (this script's, or another built
    on it, `fsdp2_train.py`): arguments, the process group, the checks that end in one `error:`
    line on every rank before any training, a resume, training, leaving together."""
    try:
        rank, _, local_rank = launched_world()
    except BadInput as e:  # not under torchrun: no peers to wait for
        error_line(f"error: {e}")
        return 2
    args, error = checked(lambda: parse_args(argv))
    cuda = args is not None and args.device == "cuda" and torch.cuda.is_available()
    timeout = args.timeout if args is not None else 300.0
    if cuda:  # before any collective: NCCL (and DCP's object collectives) use the current device
        torch.cuda.set_device(local_rank)
    # NCCL for the model's and the optimizer's GPU tensors, gloo for their small CPU tensors
    # (agreement checks, norms, checkpoint metadata) and for the start and exit handshakes
    try:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    except (dist.DistError, RuntimeError, ValueError) as e:
        error_line(f"error: rank {rank}: cannot start the process group: {describe(e)}")
        return 1
    try:
        # each check that can refuse the run ends with a meeting of every rank, so that all print
        # the same error line and leave together, before any training
        if fail_together(error, timeout) or fail_together(disagreement(args, timeout), timeout):
            return 2
        job, error = checked(lambda: prepare(args))
        if fail_together(error, timeout):
            return 2
        if job.resume is not None:
            job, error = checked(lambda: with_checkpoint(job, args))
            if fail_together(error, timeout):
                return 2
        train(job, args)
        # meet before leaving: the exit below closes this rank's connections at once, which a peer
        # still finishing a collective with it would see as a lost peer
        exit_together(torch.zeros(1, dtype=torch.int64), timeout)
    except (CanzonaError, dist.DistError, dcp.CheckpointException, OSError) as e:
        error_line(f"error: rank {rank}: {describe(e)}")
        try:  # ranks that failed alike leave together; a rank whose peers are gone waits briefly
            exit_together(torch.ones(1, dtype=torch.int64), 10.0)
        except Exception:  # noqa: BLE001, S110 - leaving anyway
            pass
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    if status:
        # A run that failed can leave a collective in flight that a failed peer never joins: gloo
        # cannot cancel it, and its worker thread releases the collective's tensors (taking the
        # GIL) only when it ends, which during interpreter finalization aborts the process
        # (SIGABRT instead of this exit code). Everything is printed: leave without finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
