"""The training run every numerical check uses: the tiny model on synthetic data, three ways.

- `distributed_worker`: one rank running `DistributedOptimizer` (spawned by `run_ranks`): a DP
  rank of the tiny model, or, with `tp > 1`, a rank of a 2-D (`dp`, `tp`) mesh running the model
  split over its TP group (`reference.tiny_model_tp`: Megatron-style layers, or DTensors from
  `parallelize_module`).
- `emulate`: the same kernels in one process, given the same global gradients — each rank's
  gradient computed exactly as that rank computes it, summed in rank order and averaged, as the
  runtime's reduce-scatter does. Rung 3 says the distributed run equals this bit for bit. Under TP
  a rank's gradient comes from the TP model, which one process cannot run: the ranks record each
  step's gradients with hooks of their own (`GradientRecorder`, independent of the optimizer's
  buffers) and `global_gradients_from` assembles them (DP mean in rank order, TP shards
  concatenated along `tp_dim`). Under expert parallelism (`ep > 1`, a tiny MoE preset:
  `reference.tiny_moe_ep`, with `tp > 1` its dense layers split over TP too) the expert stacks'
  gradients are assembled as their EDP reductions make them (`global_gradients_from`).
- `reference_run`: the reference optimizers (`reference/`) stepped with those global gradients.

Data: step s uses a fixed global batch of `global_batch` sequences; DP rank r takes rows
`[r * B / dp, (r + 1) * B / dp)` and splits them into `accumulation` micro-batches, each loss
divided by `accumulation`. The TP ranks of one DP rank see the same rows.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from canzona.choices import check_choice
from canzona.dp.layout import ceil_to, even_cuts
from canzona.errors import CanzonaError, SpecError
from canzona.optimizers import config_from_dict, matrix_optimizer
from canzona.plan import PLAN_DEFAULTS, Plan
from canzona.runtime.buffers import accumulate_, accumulation_dtype
from canzona.runtime.kernels import adamw_step_, apply_update_, matrix_kernel
from canzona.runtime.shards import local_tensor, shard_of, unshard
from canzona.spec import stacked_matrices
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import default_policy

TP_STYLES: tuple[str, ...] = ("megatron", "dtensor")  # how distributed_worker splits the model over TP

@dataclass(frozen=True)
class TrainSpec:
    preset: str = "tiny"
    model_seed: int = 0
    data_seed: int = 1
    optimizer: str = "muon"
    policy: str | None = None  # None: the optimizer's default (canzona; zero1 for adamw)
    dp_policy: str = PLAN_DEFAULTS.dp_policy
    alpha: float = PLAN_DEFAULTS.alpha
    bucket_size: int | None = PLAN_DEFAULTS.bucket_size
    steps: int = 4
    global_batch: int = 8
    seq_len: int = 16
    accumulation: int = 1
    matrix_config: dict[str, Any] = field(default_factory=dict)
    adamw_config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "fp32"
    clip_norm: float | None = None  # clip the global gradient norm to this before each update
    master_weights: bool = STEP_DEFAULTS.master_weights  # bf16 / fp16 models: fp32 masters, reduction and state
    zero_grad: str = "optimizer"  # or "model": `model.zero_grad()` (set_to_none), as HF Trainer does
    tp: int = 1  # ranks per TP group; the world is dp x tp
    ep: int = 1  # expert parallelism (a mixture-of-experts preset): EP groups of ep consecutive ranks of dp x tp
    tp_policy: str = PLAN_DEFAULTS.tp_policy  # the canzona policy's TP scheduler (the baselines run tp-sync)
    tp_mode: str = STEP_DEFAULTS.tp_mode  # or "serial"
    tp_style: str = "megatron"  # TP model: "megatron" (explicit layers) or "dtensor" (parallelize_module)
    # DP gradient reduce-scatter (canzona.reductions): "exact", the verification mode, unlike the
    # optimizer's default "native", so that every check is bit for bit at any DP size
    reduce_scatter: str = "exact"
    batch_kernels: bool = STEP_DEFAULTS.batch_kernels  # same-shape matrices of a host as one batched kernel (bit-identical on CPU)
    compile_kernels: bool = STEP_DEFAULTS.compile_kernels  # Newton-Schulz through torch.compile (close to, not equal to, eager)
    overlap_step: bool = STEP_DEFAULTS.overlap_step  # updates computed as buckets land, applied after the check (bit for bit)
    # torch's FSDP2 (`fully_shard` per decoder layer, then the root) over the dp ranks, HSDP with
    # `hsdp_replicate` replicas of shard groups of dp / R ranks: `fsdp_worker`
    fsdp: bool = False
    hsdp_replicate: int = 1

    def __post_init__(self) -> None:
        if self.policy is None:
            object.__setattr__(self, "policy", default_policy(self.optimizer))

    def check(self, dp: int) -> None:
        if self.global_batch % (dp * self.accumulation):
            raise SpecError(f"global batch {self.global_batch} is not divisible by dp x accumulation "
                            f"= {dp} x {self.accumulation}")
        check_choice(self.tp_style, TP_STYLES, "TP style")
        from canzona.fsdp_plan import check_hsdp

        check_hsdp(self.fsdp, dp, self.hsdp_replicate)
        if self.fsdp and self.ep > 1 and (self.optimizer != "adamw" or self.tp > 1 or self.hsdp_replicate != 1):
            # what the runtime runs of FSDP2 with EP (canzona.runtime.fsdp_ep)
            raise SpecError(f"--fsdp --ep {self.ep} runs AdamW at TP 1 without HSDP replicas (torchtitan's layout: "
                            f"the experts over ep x efsdp); got optimizer {self.optimizer}, tp {self.tp}, "
                            f"hsdp_replicate {self.hsdp_replicate}")
        if self.fsdp and self.tp > 1 and (self.hsdp_replicate != 1 or self.tp_style != "dtensor"):
            raise SpecError("FSDP x TP runs torchtitan's composition: tp_style dtensor, no HSDP replicas")
        if self.fsdp and (self.tp_policy, self.tp_mode) != (PLAN_DEFAULTS.tp_policy, STEP_DEFAULTS.tp_mode):
            # FsdpOptimizer refuses them off their defaults (canzona.runtime.fsdp.ZERO1_ONLY), as the simulator does
            raise SpecError(f"--tp-policy {self.tp_policy} / --tp-mode {self.tp_mode} schedule the ZeRO-1 layout's TP "
                            "micro-groups: under --fsdp they change nothing (leave them at their defaults)")

    def dp_size(self, world: int) -> int:
        if world % self.tp:
            raise SpecError(f"world size {world} is not a multiple of tp {self.tp}")
        return world // self.tp


RANK_THREADS = 1  # torch threads per rank; BLAS / LAPACK results depend on it


@contextlib.contextmanager
def torch_threads(n: int = RANK_THREADS) -> Iterator[None]:
    """Run with `n` torch threads (as the ranks do): GEMM, eigh and QR results depend on the count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_model(spec: TrainSpec):
    from reference.tiny_model import TinyQwen3, _torch_dtype
    from reference.tiny_moe import HF_MOE_PRESET, MOE_PRESETS, TinyMoe, tiny_hf_qwen3_moe

    if spec.preset in MOE_PRESETS:  # stacked experts (docs/design.md §2.6)
        return TinyMoe(MOE_PRESETS[spec.preset], seed=spec.model_seed, dtype=_torch_dtype(spec.dtype))
    if spec.preset == HF_MOE_PRESET:
        return tiny_hf_qwen3_moe(seed=spec.model_seed, dtype=_torch_dtype(spec.dtype))
    return TinyQwen3(spec.preset, seed=spec.model_seed, dtype=spec.dtype)


def global_batches(spec: TrainSpec, vocab: int) -> list[Tensor]:
    from reference.data import synthetic_batches

    return list(synthetic_batches(vocab, spec.global_batch, spec.seq_len, spec.steps, seed=spec.data_seed))


def micro_batches(tokens: Tensor, rank: int, dp: int, accumulation: int) -> list[Tensor]:
    rows = tokens.shape[0] // dp
    shard = tokens[rank * rows:(rank + 1) * rows]
    return list(shard.chunk(accumulation))


def build_tp_model(spec: TrainSpec, mesh):
    """The tiny model split over the mesh's TP group, and the (global) spec the optimizer gets."""
    from canzona.spec import ModelSpec
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import TinyQwen3TP, parallelize_tiny

    if spec.tp_style == "megatron":
        model = TinyQwen3TP(spec.preset, mesh.get_group("tp"), seed=spec.model_seed, dtype=spec.dtype)
        return model, model.spec()
    model = parallelize_tiny(TinyQwen3(spec.preset, seed=spec.model_seed, dtype=spec.dtype), mesh["tp"])
    return model, ModelSpec.from_module(model, name=model.spec().name)  # placements read from the DTensors


def parallel_model(spec: TrainSpec, rank: int, world: int) -> tuple[Any, Any, Any, Any, int]:
    """This rank's model and what the optimizer is given with it: (model, the global spec, the
    dense part's group (None: the default group; a (dp, tp) mesh under TP), the expert mesh (None
    without EP), this rank's DP rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = spec.dp_size(world)
    spec.check(dp)
    group, dp_rank, expert_mesh = None, rank, None
    if spec.tp > 1:
        group = init_device_mesh("cpu", (dp, spec.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = group.get_local_rank("dp")
    if spec.ep > 1:  # the experts fold the dp x tp ranks (the dense part's TP group: its layers split)
        from reference.tiny_model import _torch_dtype
        from reference.tiny_moe import MOE_PRESETS
        from reference.tiny_moe_ep import TinyMoeEP

        expert_mesh = init_device_mesh("cpu", (dp * spec.tp // spec.ep, spec.ep), mesh_dim_names=("edp", "ep"))
        model = TinyMoeEP(MOE_PRESETS[spec.preset], expert_mesh.get_group("ep"), seed=spec.model_seed,
                          dtype=_torch_dtype(spec.dtype), tp_group=group.get_group("tp") if group is not None else None)
        mspec = model.spec()
    elif spec.tp > 1:
        model, mspec = build_tp_model(spec, group)
    else:
        model = build_model(spec)
        mspec = model.spec()
    return model, mspec, group, expert_mesh, dp_rank


def distributed_worker(rank: int, world: int, spec: TrainSpec, extra: dict[str, Any] | None = None,
                       on_step: Callable[[int], None] | None = None) -> dict:
    """One rank: train `spec.steps` steps; return final (local) parameters, losses, state, log.
    `on_step(k)` is called after step k (1-based). Under TP the ranks form a (dp, tp) mesh, under
    EP an (edp, ep) one too (`parallel_model`), and they also return each step's gradients as
    their own hooks saw them."""
    from canzona.runtime.optimizer import DistributedOptimizer

    if spec.fsdp:
        return fsdp_worker(rank, world, spec, on_step=on_step)
    extra = extra or {}
    dp = spec.dp_size(world)
    model, mspec, group, expert_mesh, dp_rank = parallel_model(spec, rank, world)
    # under TP or EP a rank's gradient comes from a model one process cannot run: recorded
    recorder = GradientRecorder(model.named_parameters(), spec.master_weights) if spec.tp > 1 or spec.ep > 1 else None
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config or None,
                               spec.adamw_config, plan=extra.get("plan"), policy=spec.policy,
                               dp_policy=spec.dp_policy, alpha=spec.alpha, bucket_size=spec.bucket_size,
                               master_weights=spec.master_weights, group=group, tp_policy=spec.tp_policy,
                               tp_mode=spec.tp_mode, reduce_scatter=spec.reduce_scatter,
                               batch_kernels=spec.batch_kernels, compile_kernels=spec.compile_kernels,
                               overlap_step=spec.overlap_step, expert_mesh=expert_mesh)
    if "load" in extra:  # (full parameters, a state_dict() or the path of a sharded checkpoint)
        params, state = extra["load"]
        if expert_mesh is not None:  # this EP rank's experts of the whole model's
            params = expert_local(params, spec, expert_mesh.get_local_rank("ep"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                tp_dim = mspec.param(name).tp_dim if spec.tp > 1 else None
                local_tensor(p).copy_(shard_of(params[name], tp_dim, spec.tp, opt.tp_rank))
        check_weights = extra.get("check_weights")  # True: the parameters are those it was saved with
        load = functools.partial(opt.load_sharded_state_dict, state, check_weights=check_weights) \
            if isinstance(state, str) else functools.partial(opt.load_state_dict, state)
        if extra.get("refused") == "step":  # a load whose first step may be refused: the error, the weights around it
            load()
            before = {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}
            try:
                train_steps(model, opt, spec, mspec.param("model.embed_tokens.weight").shape[0], dp_rank, dp,
                            lambda k, n: opt.no_sync() if k < n - 1 else contextlib.nullcontext())
                outcome = "stepped"
            except CanzonaError as e:
                outcome = f"{type(e).__name__}: {e}"
            return {"refused": outcome, "params before": before,
                    "params after": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}}
        if extra.get("refused"):  # a load that may be refused: the error, and the state before and after it
            before = opt.state_dict()
            try:
                load()
                outcome = "loaded"
            except CanzonaError as e:
                outcome = f"{type(e).__name__}: {e}"
            return {"refused": outcome, "state before": before, "state after": opt.state_dict()}
        load()
    vocab = mspec.param("model.embed_tokens.weight").shape[0]
    losses, norms, grads = train_steps(
        model, opt, spec, vocab, dp_rank, dp, lambda k, n: opt.no_sync() if k < n - 1 else contextlib.nullcontext(),
        recorder.take if recorder is not None else None, on_step)
    opt.wait_params()  # the parameters are read below, outside a forward
    if "save_sharded" in extra:  # a torch.distributed.checkpoint directory
        import torch.distributed.checkpoint as dcp

        dcp.save(opt.sharded_state_dict(), checkpoint_id=extra["save_sharded"])
    return {
        "params": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "overlapped_steps": opt.overlapped_steps,
        "state": opt.state_dict() if extra.get("state_dict", True) else None,
        "log": opt.comm.log.to_dicts(),
        "tp_log": opt.tp_comm.log.to_dicts() if opt.tp_comm is not None else [],
        "edp_log": opt.experts.comm.log.to_dicts() if opt.experts is not None else [],
        "owned": list(opt.applies),
        "hosted": list(opt.hosted),
        "state_bytes": matrix_state_bytes(opt.matrix_state),
        "plan": opt.plan,
        "dp_rank": opt.rank,
        "tp_rank": opt.tp_rank,
        "tp_dims": {p.name: p.tp_dim if spec.tp > 1 else None for p in mspec.params},
        "grads": grads,
        "ep_rank": expert_mesh.get_local_rank("ep") if expert_mesh is not None else 0,
        "expert_owned": list(opt.experts.applies) if opt.experts is not None else [],
        "expert_overlapped_steps": opt.experts.overlapped_steps if opt.experts is not None else 0,
        "expert_plan": opt.experts.plan if opt.experts is not None else None,
        "edp_rank": opt.experts.rank if opt.experts is not None else 0,
    }


def fsdp_mesh(spec: TrainSpec, world: int):
    """FSDP2's device mesh: 1-D over the `world` ranks, HSDP's (replicate, shard) one, or under TP
    a (dp, tp) one."""
    from torch.distributed.device_mesh import init_device_mesh

    r = spec.hsdp_replicate
    if spec.tp > 1:  # FSDP x TP as torchtitan composes them: fully_shard over `dp`, TP over `tp`
        return init_device_mesh("cpu", (world // spec.tp, spec.tp), mesh_dim_names=("dp", "tp"))
    if r == 1:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    return init_device_mesh("cpu", (r, world // r), mesh_dim_names=("replicate", "shard"))


def shard_tiny(model, mesh, mp_policy=None):
    """`fully_shard` each decoder layer, then the root (torchtitan's wrapping), in place."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def box_of(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, shape) of this rank's piece of a DTensor (its parameter or gradient)."""
    from canzona.runtime.fsdp_layout import local_box

    box = local_box(t)
    return box.start, box.shape


def piece(full: Tensor, box: tuple[tuple[int, ...], tuple[int, ...]]) -> Tensor:
    """The box (`box_of`) of a whole tensor, as a contiguous copy."""
    start, shape = box
    return full[tuple(slice(a, a + n) for a, n in zip(start, shape))].contiguous()


def gather_whole(named: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Whole tensors from every rank's pieces of DTensors (FSDP2's parameters or gradients), with
    ONE all-gather of objects over the default group. Unlike `DTensor.full_tensor`, which fails
    over gloo on an empty local shard (the last ranks of a small dimension hold no row)."""
    import torch.distributed as dist

    mine = {n: (box_of(t), local_tensor(t).detach().cpu().clone()) for n, t in named.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for n, t in named.items():
        whole = torch.empty(tuple(t.shape), dtype=mine[n][1].dtype)
        for pieces in every:  # replicas hold the same pieces
            (start, shape), x = pieces[n]
            whole[tuple(slice(a, a + k) for a, k in zip(start, shape))] = x
        out[n] = whole
    return out


def train_steps(model, opt, spec: TrainSpec, vocab: int, dp_rank: int, dp: int,
                sync: Callable[[int, int], contextlib.AbstractContextManager],
                record: Callable[[], Any] | None = None,
                on_step: Callable[[int], None] | None = None) -> tuple[list[float], list[float], list[Any]]:
    """`spec.steps` training steps of `model` on this DP rank's share of the global batches:
    micro-batch k of n runs its backward inside `sync(k, n)` (the layout's accumulation), then
    `record()` (kept unless None), clipping, the step. Returns the losses, the norms clipping
    returned and the records."""
    losses, norms, grads = [], [], []
    for tokens in global_batches(spec, vocab):
        (model if spec.zero_grad == "model" else opt).zero_grad()
        total = 0.0
        mbs = micro_batches(tokens, dp_rank, dp, spec.accumulation)
        for k, mb in enumerate(mbs):
            with sync(k, len(mbs)):
                loss = model.loss(mb) / spec.accumulation
                loss.backward()
            total += loss.item()
        if record is not None and (kept := record()) is not None:
            grads.append(kept)
        if spec.clip_norm is not None:
            norms.append(float(opt.clip_grad_norm_(spec.clip_norm)))
        opt.step()
        losses.append(total)
        if on_step is not None:
            on_step(len(losses))
    return losses, norms, grads


def fsdp_worker(rank: int, world: int, spec: TrainSpec, on_step: Callable[[int], None] | None = None) -> dict:
    """One rank of the tiny model under torch's FSDP2 (`fully_shard` per decoder layer and the root,
    over `fsdp_mesh`) stepped by `DistributedOptimizer` (an `FsdpOptimizer`): train `spec.steps`
    steps, each step's global gradients gathered whole before the step (rank 0 returns them: the
    single-process check is fed those), and return this rank's final shards with their boxes."""
    from canzona.runtime.optimizer import DistributedOptimizer

    dp = spec.dp_size(world)
    spec.check(dp)
    model = build_model(spec)
    mspec = model.spec()
    if spec.ep > 1:  # torchtitan's layout of the experts (reference.tiny_moe_fsdp_ep): efsdp x ep
        from reference.tiny_model import _torch_dtype
        from reference.tiny_moe import MOE_PRESETS
        from reference.tiny_moe_fsdp_ep import fsdp_ep_model

        model, mesh, _ = fsdp_ep_model(MOE_PRESETS[spec.preset], spec.ep, seed=spec.model_seed,
                                       dtype=_torch_dtype(spec.dtype))
    elif spec.tp > 1:
        from reference.tiny_model_tp import parallelize_tiny

        mesh = fsdp_mesh(spec, world)
        shard_tiny(parallelize_tiny(model, mesh["tp"]), mesh["dp"])
    else:
        mesh = fsdp_mesh(spec, world)
        shard_tiny(model, mesh)
    dp_rank = rank // spec.tp  # TP peers train on their DP rank's data
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config or None,
                               spec.adamw_config, policy=spec.policy, dp_policy=spec.dp_policy, alpha=spec.alpha,
                               bucket_size=spec.bucket_size, master_weights=spec.master_weights,
                               batch_kernels=spec.batch_kernels, compile_kernels=spec.compile_kernels)

    def sync_last(k: int, n: int) -> contextlib.AbstractContextManager:
        model.set_requires_gradient_sync(k == n - 1)  # FSDP2's no_sync: reduce after the last
        return contextlib.nullcontext()

    def record() -> Any:
        named = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        whole = gather_whole(named)  # collective: every rank; rank 0 keeps them
        return (whole, set(named)) if rank == 0 else None

    vocab = mspec.param("model.embed_tokens.weight").shape[0]
    losses, norms, grads = train_steps(model, opt, spec, vocab, dp_rank, dp, sync_last, record, on_step)
    mesh_names = mesh.mesh_dim_names
    return {
        "params": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
        "boxes": {n: box_of(p) for n, p in model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "overlapped_steps": 0,
        "state": None,
        "log": opt.comm.log.to_dicts(),
        "owned": list(opt.hosted),
        "hosted": list(opt.hosted),
        "state_bytes": matrix_state_bytes(opt.matrix_state),
        "plan": opt.plan,
        "dp_rank": dp_rank,
        "tp_rank": rank % spec.tp,
        "ep_rank": mesh.get_local_rank("ep") if "ep" in mesh_names else 0,
        "tp_dims": {p.name: None for p in mspec.params},
        # the rank whose pieces a replica's must equal (FSDP x TP: every rank holds its own)
        "shard_rank": mesh.get_local_rank("shard") if "shard" in mesh_names else rank,
        "replica": mesh.get_local_rank("replicate") if "replicate" in mesh_names else 0,
    }


def matrix_state_bytes(state: dict[str, dict]) -> int:
    """Bytes of every tensor in the matrix optimizers' state on this rank."""
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if isinstance(v, Tensor))


class GradientRecorder:
    """Each step's gradient of every parameter's local tensor, accumulated over micro-batches as
    the optimizer's buffers accumulate it (in fp32 for a low-precision model with master weights,
    `buffers.accumulate_`), seen by tensor hooks of its own (not through the optimizer's buffers):
    what a rank's backward produced, for the single-process emulation under TP. A DTensor
    gradient is first brought to its parameter's placement (a `Partial` gradient of a replicated
    weight summed over TP), as the optimizer does."""

    def __init__(self, named: Iterable[tuple[str, Tensor]], master_weights: bool = True) -> None:
        self._acc: dict[str, Tensor] = {}
        self._master_weights = master_weights
        for name, p in named:
            p.register_hook(lambda g, n=name, p=p: self._add(n, p, g))

    def _add(self, name: str, p: Tensor, g: Tensor) -> None:
        from canzona.runtime.shards import is_dtensor

        if is_dtensor(g):
            if tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
            g = g.to_local()
        g = g.detach()
        if name in self._acc:
            accumulate_(self._acc[name], g)
        else:
            self._acc[name] = g.to(accumulation_dtype(g.dtype, self._master_weights), copy=True)

    def take(self) -> dict[str, Tensor]:
        out, self._acc = self._acc, {}
        return out


def global_gradients(model, spec: TrainSpec, tokens: Tensor, dp: int) -> tuple[dict[str, Tensor], set[str]]:
    """The gradients the runtime's reduce-scatter produces: each rank's accumulated gradient,
    summed in rank order, divided by dp. Also the names that got a gradient on some rank."""
    params = dict(model.named_parameters())
    got: set[str] = set()
    handles = [p.register_post_accumulate_grad_hook(lambda _, n=n: got.add(n)) for n, p in params.items()]
    try:
        per_rank = []
        for rank in range(dp):  # each rank's gradients, accumulated over micro-batches as its buffers do
            acc = {n: torch.zeros_like(p, dtype=reduce_dtype(spec, p.dtype)) for n, p in params.items()}
            for mb in micro_batches(tokens, rank, dp, spec.accumulation):
                for p in params.values():
                    p.grad = torch.zeros_like(p)
                (model.loss(mb) / spec.accumulation).backward()
                for n, p in params.items():
                    accumulate_(acc[n], p.grad)
            per_rank.append(acc)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n in params:
        acc = per_rank[0][n].to(reduce_dtype(spec, per_rank[0][n].dtype), copy=True)
        for r in range(1, dp):
            acc += per_rank[r][n]
        out[n] = acc.div_(dp)
    return out, got


def reduce_dtype(spec: TrainSpec, dtype: torch.dtype) -> torch.dtype:
    """Gradients are accumulated, reduced (and the optimizer runs) in fp32 for low-precision
    models with master weights, in the parameters' dtype otherwise."""
    return accumulation_dtype(dtype, spec.master_weights)


Gradients = Sequence[tuple[dict[str, Tensor], set[str]]]  # per step: global gradients, names that got one


def global_gradients_from(results: Sequence[dict], spec: TrainSpec) -> list[tuple[dict[str, Tensor], set[str]]]:
    """Per step, the global gradients a (dp x tp) run's reductions produce, from the gradients its
    ranks recorded (`distributed_worker(...)["grads"]`, rank order): per TP rank, the DP ranks'
    gradients summed in DP rank order and divided by dp; then the TP shards concatenated along
    `tp_dim`. A TP-replicated parameter must have had the same gradient on every TP rank. Under
    expert parallelism an expert stack's, per EP rank j, summed over its EDP group (the ranks of EP
    rank j) in rank order, divided by edp and scaled by `edp / dp` (`canzona.runtime.expert_part`),
    the EP ranks' experts concatenated in order."""
    tp = spec.tp
    dp = spec.dp_size(len(results))
    tp_dims = results[0]["tp_dims"]
    stacks = _stacks(spec) if spec.ep > 1 else set()
    by_coord = {(r["dp_rank"], r["tp_rank"]): r for r in results}
    steps = []
    for s in range(len(results[0]["grads"])):
        got = {n for r in results for n in r["grads"][s]}
        grads = {}
        for name, tp_dim in tp_dims.items():
            if name in stacks:
                if name in got:
                    grads[name] = _expert_global(results, spec, s, name)
                continue
            shards = []
            for t in range(tp):
                parts = [by_coord[(i, t)]["grads"][s].get(name) for i in range(dp)]
                shards.append(_mean(parts, dp) if any(x is not None for x in parts) else None)
            if all(x is None for x in shards):
                continue
            if tp_dim is None:
                if not all(x is not None and torch.equal(x, shards[0]) for x in shards):
                    raise CanzonaError(f"step {s + 1}: the TP ranks' gradients of replicated {name!r} differ")
                grads[name] = shards[0]
            else:
                grads[name] = unshard(shards, tp_dim)
        steps.append((grads, got))
    return steps


expert_global_gradients = global_gradients_from  # (the name the expert-parallel tests know it by)


def _expert_global(results: Sequence[dict], spec: TrainSpec, s: int, name: str) -> Tensor:
    """Step `s`'s global gradient of expert stack `name` (some rank got one): each EP rank's, reduced
    over its EDP group as `canzona.runtime.expert_part.ExpertReduction` reduces it, concatenated in
    EP order; zeros for an EP rank whose whole EDP group got none, as the runtime steps the stack
    whole with zero gradients there."""
    from canzona.runtime.expert_part import apply_scale, expert_scale

    edp, dp = len(results) // spec.ep, spec.dp_size(len(results))
    parts: list[Tensor | None] = []
    for j in range(spec.ep):
        holders = [r["grads"][s].get(name) for r in results if r["ep_rank"] == j]
        got = any(x is not None for x in holders)
        parts.append(apply_scale(_mean(holders, edp), expert_scale(dp, edp)) if got else None)
    like = next(x for x in parts if x is not None)  # every EP rank holds as many experts
    return torch.cat([x if x is not None else torch.zeros_like(like) for x in parts])


def _stacks(spec: TrainSpec) -> set[str]:
    return {p.name for p in build_model(spec).spec().stacks}


def _mean(parts: Sequence[Tensor | None], n: int) -> Tensor:
    """Sum in order (a missing gradient counts as zero), divided by n: the exact reduction's
    arithmetic (recorded gradients are in the dtype they are reduced in: `GradientRecorder`)."""
    like = next(x for x in parts if x is not None)
    acc = (parts[0] if parts[0] is not None else torch.zeros_like(like)).clone()
    for x in parts[1:]:
        if x is not None:
            acc += x
    return acc.div_(n)


def expert_local(full: dict[str, Tensor], spec: TrainSpec, ep_rank: int) -> dict[str, Tensor]:
    """What EP rank `ep_rank` holds of whole-model tensors: its slice of every stack."""
    stacks = _stacks(spec)
    out = {}
    for name, t in full.items():
        if name in stacks:
            per = t.shape[0] // spec.ep
            t = t[ep_rank * per:(ep_rank + 1) * per]
        out[name] = t.contiguous()
    return out


def expert_full_parameters(results: Sequence[dict], spec: TrainSpec) -> dict[str, Tensor]:
    """The whole model from an expert-parallel run's ranks (rank order): the dense part from DP
    rank 0's TP shards (`full_parameters`), each EP rank's experts from the first rank holding
    them, concatenated in EP order."""
    stacks = _stacks(spec)
    first = {r["ep_rank"]: r for r in reversed(results)}
    out = full_parameters(results)
    for name in stacks:
        out[name] = torch.cat([first[j]["params"][name] for j in range(spec.ep)])
    return out


def held_by(full: dict[str, Tensor], spec: TrainSpec, result: dict) -> dict[str, Tensor]:
    """What one rank of a run (`distributed_worker`'s result) holds of whole-model tensors: its EP
    rank's experts, its TP shards of the dense part (contiguous copies)."""
    local = expert_local(full, spec, result["ep_rank"]) if spec.ep > 1 else full
    return expected_shards(local, result["tp_dims"], spec.tp, result["tp_rank"])


def full_parameters(results: Sequence[dict]) -> dict[str, Tensor]:
    """The whole model from the ranks' local parameters (DP rank 0's shards, in TP order)."""
    first = sorted((r for r in results if r["dp_rank"] == 0), key=lambda r: r["tp_rank"])
    return {n: unshard([r["params"][n] for r in first], tp_dim) for n, tp_dim in first[0]["tp_dims"].items()}


def expected_shards(full: dict[str, Tensor], tp_dims: dict[str, int | None], tp: int, tp_rank: int) -> dict[str, Tensor]:
    """What TP rank `tp_rank` holds of full tensors (contiguous copies)."""
    return {n: shard_of(t, tp_dims[n], tp, tp_rank).contiguous() for n, t in full.items()}


def _steps(model, spec: TrainSpec, dp: int, grads: Gradients | None) -> Iterator[tuple[dict[str, Tensor], set[str]]]:
    """Each step's global gradients: recorded ones, or recomputed from the model as it is now."""
    if grads is not None:
        yield from grads
        return
    vocab = model.spec().param("model.embed_tokens.weight").shape[0]
    for tokens in global_batches(spec, vocab):
        yield global_gradients(model, spec, tokens, dp)


@torch_threads()
def emulate(spec: TrainSpec, dp: int, load: tuple[dict, dict] | None = None,
            grads: Gradients | None = None) -> dict[str, Tensor]:
    """The same kernels in one process, fed the global gradients of a `dp`-rank run (recomputed
    with the single-device model, or `grads` as recorded by the ranks of a TP run)."""
    from canzona.runtime.checkpoint import state_by_name

    spec.check(dp)
    model = build_model(spec)
    mspec = model.spec()
    adamw_cfg = config_from_dict("adamw", spec.adamw_config)
    elementwise = matrix_optimizer(spec.optimizer).elementwise  # AdamW on every parameter
    matrix_cfg = adamw_cfg if elementwise else config_from_dict(spec.optimizer, spec.matrix_config)
    states: dict[str, dict] = {}
    if load is not None:
        params, saved = load
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
        states = {n: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
                  for n, s in state_by_name(saved)[2].items()}
    kernel = matrix_kernel(spec.optimizer)
    masters = {n: p.detach().to(reduce_dtype(spec, p.dtype), copy=True) for n, p in model.named_parameters()}
    for name, state in states.items():  # a checkpoint's fp32 masters are the weights to continue from
        if "master" in state:
            stacked_in = mspec.param(name).stacked_in  # a matrix of a stack: its view of the stack's master
            target = _entry_view(mspec, masters, name) if stacked_in else masters[name]
            target.copy_(state.pop("master").reshape(target.shape))
    for step_grads, got in _steps(model, spec, dp, grads):
        step_grads = {n: g.clone() for n, g in step_grads.items()}
        if spec.clip_norm is not None:
            clip_(step_grads.values(), spec.clip_norm)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name not in got:
                    continue
                master = masters[name]
                for entry, matrix, grad, whole in _entries(mspec.param(name), master, step_grads[name]):
                    state = states.setdefault(entry, {})
                    if whole and not elementwise:
                        update = kernel(grad, state, matrix_cfg, matrix_cfg.lr)
                        if update is not None:
                            apply_update_(matrix, update.direction, update)
                    else:
                        adamw_step_(matrix.view(-1), grad.view(-1), _flat_state(state), adamw_cfg, adamw_cfg.lr)
                p.copy_(master)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _entry_view(mspec, tensors: Mapping[str, Tensor], matrix: str) -> Tensor:
    """Matrix `matrix` of a stack, as a view of the stack's tensor in `tensors`."""
    stack, k = mspec.param(matrix).stacked_in
    numel = mspec.param(matrix).numel
    return tensors[stack].view(-1)[k * numel:(k + 1) * numel].view(mspec.param(matrix).shape)


def _entries(pspec, master: Tensor, grad: Tensor) -> Iterator[tuple[str, Tensor, Tensor, bool]]:
    """(entry name, its master, its gradient, whether the matrix optimizer runs it) of a parameter:
    itself, or each matrix of a stack as a view (the runtime's entries, `canzona.runtime.stacks`)."""
    if pspec.matrix_shape is None:
        yield pspec.name, master, grad, pspec.uses_matrix_optimizer
        return
    for mspec in stacked_matrices(pspec):
        k, numel = mspec.stacked_in[1], mspec.numel
        yield (mspec.name, master.view(-1)[k * numel:(k + 1) * numel].view(mspec.shape),
               grad.reshape(-1)[k * numel:(k + 1) * numel].view(mspec.shape), True)


@torch.no_grad()
def clip_(grads: Iterable[Tensor], max_norm: float) -> float:
    """Scale global gradients to a 2-norm of at most `max_norm` (norm taken in fp64), as
    `DistributedOptimizer.clip_grad_norm_` does; return the norm before clipping."""
    grads = list(grads)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm


def runtime_norm(grads: Mapping[str, Tensor], plan: Plan, adamw_names: Sequence[str]) -> float:
    """The global 2-norm of global gradients as the runtime takes it, to the last bit: laid out as
    its buffers (the plan's buckets, the AdamW buffer padded to a multiple of the plan's `align x dp`), each
    DP rank's segments (its part of every bucket, its slice of the AdamW buffer) summed in order in
    fp64, the ranks' sums added in rank order."""
    from canzona.runtime.gradients import combine_norm_terms, local_norm_term

    dp = plan.dp
    segments: list[list[Tensor]] = [[] for _ in range(dp)]
    for b in plan.dp_plan.buckets:
        flat = torch.zeros(b.size)
        for p in b.params:
            flat[p.offset:p.end] = grads[p.name].reshape(-1)
        for r in range(dp):
            segments[r].append(flat[b.cuts[r]:b.cuts[r + 1]])
    used = sum(grads[n].numel() for n in adamw_names)
    flat = torch.zeros(ceil_to(max(used, 1), plan.dp_plan.align * dp))
    if adamw_names:
        torch.cat([grads[n].reshape(-1) for n in adamw_names], out=flat[:used])
    cuts = even_cuts(flat.numel(), dp)
    for r in range(dp):
        segments[r].append(flat[cuts[r]:cuts[r + 1]])
    return math.sqrt(float(combine_norm_terms(torch.stack([local_norm_term(s) for s in segments]))))


def _flat_state(state: dict) -> dict:
    """AdamW state kept flat (as the runtime's slices are); reshaped views share storage."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key] = state[key].reshape(-1)
    return state


@torch_threads()
def reference_run(spec: TrainSpec, dp: int, grads: Gradients | None = None) -> dict[str, Tensor]:
    """The reference optimizers stepped with the same global gradients."""
    from reference import CombinedOptimizer

    spec.check(dp)
    model = build_model(spec)
    opt = CombinedOptimizer(model.named_parameters(), model.spec(), spec.optimizer,
                            spec.matrix_config or None, spec.adamw_config or None)
    for step_grads, got in _steps(model, spec, dp, grads):
        step_grads = {n: g.clone() for n, g in step_grads.items()}
        if spec.clip_norm is not None:
            clip_(step_grads.values(), spec.clip_norm)
        for name, p in model.named_parameters():
            p.grad = step_grads[name] if name in got else None
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, Any]:
    """Bitwise equality and the worst relative difference (max |a - b| / max |b| per tensor)."""
    equal = all(torch.equal(got[n], want[n]) for n in want)
    worst, where = 0.0, ""
    for n in want:
        if not want[n].numel():  # an empty piece (FSDP2's last ranks of a short dimension): equal or not
            continue
        scale = want[n].abs().max().item() or 1.0
        rel = (got[n] - want[n]).abs().max().item() / scale
        if not math.isfinite(rel):
            rel = math.inf  # NaN compares false with everything: count it as the worst
        if rel > worst:
            worst, where = rel, n
    return {"bit_identical": equal, "max_rel_diff": worst, "worst_param": where}


def many_specs_worker(rank: int, world: int, specs: list[TrainSpec], extras: list[dict] | None = None) -> list[dict]:
    """Run several training specs one after another in the same process group (one spawn, many
    checks): spawning costs seconds, a tiny run costs a fraction of one."""
    from canzona.harness.launch import report_progress

    extras = extras or [{} for _ in specs]
    total = sum(spec.steps for spec in specs)
    results, done = [], 0
    for spec, extra in zip(specs, extras):
        label = f"training {spec.optimizer} / {spec.policy} on {world} rank(s)"

        def on_step(k: int, before: int = done, label: str = label, steps: int = spec.steps) -> None:
            report_progress(before + k, total, f"{label}: step {k} of {steps}")

        results.append(distributed_worker(rank, world, spec, extra, on_step=on_step))
        done += spec.steps
    return results
