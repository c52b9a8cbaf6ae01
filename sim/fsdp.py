"""FSDP2 / ZeRO-3 and HSDP in the simulator (docs/design.md §2.8): one iteration of a layout whose
parameters, gradients and optimizer state are sharded over a shard group of S ranks (HSDP: R
replicas of it, DP = R x S), under one of `canzona.step_policies.FSDP_POLICIES`.

Phase A (forward / backward, identical on every rank, simulated on rank 0): per FSDP unit (one
decoder layer; the root unit holds the embedding, the final norm and the head) the bf16 parameters
are all-gathered before the unit's forward and again before its backward (FSDP2 reshards after
forward), one unit ahead of the compute (FSDP2's prefetch: at most two units unsharded); each
unit's gradient is reduce-scattered after its backward (every micro-batch, FSDP2's default), and
under HSDP the reduced shard is all-reduced over the replicate group after the last micro-batch's.

Phase B (the step, simulated on every rank of one shard group): each micro-group (one unit's
matrices, in backward order) under owner policies goes to its owners by one variable-size
all-to-all of the gradient shards, is computed by them, and comes back by one all-to-all of the
update shards; under gather-all every rank all-gathers the unit's full gradients and computes
them all. Micro-groups are pipelined: the next one's exchange runs under this one's compute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import simpy

from canzona.batching import shape_batches
from canzona.cost import (
    DeviceRate,
    adamw_kernels,
    cost_model_for,
    gradient_norm_kernels,
)
from canzona.decoder import Architecture
from canzona.errors import SpecError
from canzona.fsdp_collectives import exchange_bytes
from canzona.fsdp_plan import (
    ROOT,
    FsdpMatrix,
    FsdpUnit,
    backward_order,
    fsdp_matrices,
    fsdp_persistent_memory,
    fsdp_units,
    owner_micro_groups,
)
from canzona.hardware import HardwareProfile
from canzona.memory import (
    FP32,
    LayerDims,
    LayoutMemory,
    MemorySetup,
    RankMemory,
    activation_bytes,
    batched_stack_bytes,
    kernel_workspace_bytes,
)
from canzona.optimizers import default_config, matrix_optimizer
from canzona.plan import Plan
from canzona.spec import ModelSpec
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import (
    FSDP_POLICIES,
    get_fsdp_policy,
)
from sim.collectives import collective_cost, matrix_all_to_all_cost
from sim.engine import Engine
from sim.iteration import APPLY_PASSES, DP_COMM
from sim.model_work import micro_batch_work
from sim.topology import Cluster

AG_STREAM, RS_STREAM = "fsdp-all-gather", "fsdp-reduce-scatter"  # FSDP2's two communication streams


def check_fsdp(cfg, cluster: Cluster, spec: ModelSpec) -> int:
    """The FSDP layout of `cfg` is one the simulator runs; returns the shard size S. One SpecError
    (one line) otherwise."""
    r = cfg.hsdp_replicate
    if not (isinstance(r, int) and r >= 1):
        raise SpecError(f"--hsdp-replicate must be a whole number >= 1, got {r!r}")
    if not cfg.fsdp:
        if r != 1:
            raise SpecError("--hsdp-replicate is HSDP's replicate axis: it needs --fsdp")
        return 0
    if cfg.tp > 1 or cfg.pp > 1 or cfg.ep > 1:
        raise SpecError(f"--fsdp is simulated at tp 1, pp 1 and ep 1 for now (got tp {cfg.tp}, pp {cfg.pp}, ep {cfg.ep}): "
                        "parameters are sharded over all the GPUs")
    get_fsdp_policy(cfg.policy)
    if matrix_optimizer(cfg.optimizer).elementwise:
        raise SpecError(f"--fsdp compares whole-matrix optimizers' step policies; {cfg.optimizer} is elementwise")
    if cfg.options.overlap_step or cfg.options.collectives != "megatron":
        raise SpecError("--fsdp runs with the default --collectives megatron and without --overlap-step")
    if cluster.dp % r:
        raise SpecError(f"--hsdp-replicate {r} must divide the {cluster.dp} data-parallel ranks")
    shard = cluster.dp // r
    if shard < 2:
        raise SpecError(f"--hsdp-replicate {r} leaves a shard group of {shard} rank: shard over at least 2 "
                        f"(replicate at most {cluster.dp // 2})")
    if len(spec.matrix_params()) < 1:
        raise SpecError(f"model {spec.name!r} has no matrices for a matrix optimizer")
    return shard


class _FsdpRun:
    def __init__(self, cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                 shard: int) -> None:
        self.cfg, self.cluster, self.hw, self.shard = cfg, cluster, hw, shard
        self.spec, self.arch = model
        self.policy = get_fsdp_policy(cfg.policy)
        self.rate = DeviceRate.from_profile(hw)
        self.wl = cfg.workload
        self.engine = Engine()
        self.matrices, self.plan = fsdp_matrices(self.spec, shard, cfg.optimizer, self.policy, cfg.settings,
                                                 cost_model_for(hw))
        self.units = fsdp_units(self.spec, self.matrices)
        self.shard_geo = cluster.geometry(list(range(shard)))
        self.replicate_geo = cluster.geometry([k * shard for k in range(cfg.hsdp_replicate)])
        self.stalls: list[float] = []

    # --- phase A ----------------------------------------------------------------------------

    def _gather(self, name: str, unit: FsdpUnit, after: list[simpy.Event]) -> simpy.Event:
        cost = collective_cost("all-gather", unit.numel * self.wl.param_bytes, self.shard_geo, self.hw)
        return self.engine.collective(name, [0], cost, AG_STREAM, {0: after})[0]

    def _probe(self, before: simpy.Event, wanted: simpy.Event):
        yield before
        t0 = self.engine.now
        yield wanted
        self.stalls.append(self.engine.now - t0)

    def _unit_compute(self, name: str, seconds: float, last: simpy.Event, gathered: simpy.Event) -> simpy.Event:
        self.engine.env.process(self._probe(last, gathered))
        return self.engine.compute(0, name, seconds, [last, gathered])

    def _pass(self, name: str, units: Sequence[FsdpUnit], seconds: dict[int, float], last: simpy.Event,
              then=None) -> simpy.Event:
        """One pass over `units` in order: each unit's all-gather one unit ahead of its compute
        (issued once the unit two back is computed: at most two units unsharded), its compute after
        the previous unit's and its gather; `then(unit, computed)` after each compute."""
        gathers: list[simpy.Event] = []
        computed: list[simpy.Event] = []
        for k in range(len(units) + 1):
            if k < len(units):
                freed = [computed[k - 2]] if k >= 2 else []
                gathers.append(self._gather(f"{name} all-gather {_label(units[k])}", units[k], freed))
            if k >= 1:
                unit = units[k - 1]
                last = self._unit_compute(f"{name} {_label(unit)}", seconds[unit.key], last, gathers[k - 1])
                computed.append(last)
                if then is not None:
                    then(unit, last)
        return last

    def phase_a(self) -> simpy.Event:
        """Forward and backward of every micro-batch on rank 0; the event: every gradient reduced."""
        eng, wl, cfg = self.engine, self.wl, self.cfg
        work = micro_batch_work(self.spec, 1, wl.tokens_per_micro_batch, wl.seq_len, self.arch.q_dim,
                                self.arch.hidden, self.arch.vocab, self.rate, recompute=cfg.options.recompute,
                                causal=wl.causal, dtype=wl.dtype, experts=self.arch.moe)
        fwd = {layer: sum(b.seconds for b in blocks) for layer, blocks in zip(work.layer_ids, work.forward)}
        bwd = {layer: sum(b.seconds for b in blocks) for layer, blocks in zip(work.layer_ids, work.backward)}
        layers = [u for u in self.units if u.key != ROOT]
        root = next((u for u in self.units if u.key == ROOT), None)
        m = wl.micro_batches(self.cluster.dp)
        last = eng.env.event().succeed()
        reduced: list[simpy.Event] = []
        rs_cost = {u.key: collective_cost("reduce-scatter", u.numel * wl.grad_bytes, self.shard_geo, self.hw)
                   for u in self.units}
        ar_cost = {u.key: collective_cost("all-reduce", -(-u.numel // self.shard) * wl.grad_bytes, self.replicate_geo,
                                          self.hw) for u in self.units}

        def reduce(unit: FsdpUnit, mb: int, after: simpy.Event) -> None:
            done = eng.collective(f"mb{mb} reduce-scatter {_label(unit)}", [0], rs_cost[unit.key], RS_STREAM,
                                  {0: [after]})[0]
            if cfg.hsdp_replicate > 1 and mb == m - 1:  # the replicas' all-reduce of the reduced shard
                done = eng.collective(f"all-reduce {_label(unit)} over replicas", [0], ar_cost[unit.key], RS_STREAM,
                                      {0: [done]})[0]
            reduced.append(done)

        for mb in range(m):
            # the root's parameters (the embedding first) stay gathered through the micro-batch
            root_gathered = self._gather(f"mb{mb} fwd all-gather root", root, [last]) if root else last
            last = self._pass(f"mb{mb} fwd", layers, fwd, eng.env.all_of([last, root_gathered]))
            last = eng.compute(0, f"mb{mb} fwd head", work.head_forward_s, [last])
            last = eng.compute(0, f"mb{mb} bwd head", work.head_backward_s, [last])
            last = self._pass(f"mb{mb} bwd", list(reversed(layers)), bwd, last,
                              lambda unit, done, mb=mb: reduce(unit, mb, done))
            if root:
                reduce(root, mb, last)
        return eng.env.all_of(reduced + [last])

    # --- phase B ----------------------------------------------------------------------------

    def micro_groups(self) -> list[tuple[FsdpMatrix, ...]]:
        """The step's micro-groups, in order. Gather-all: one unit's matrices each, in backward
        order. Owners: `canzona.fsdp_plan.owner_micro_groups`, as the runtime runs them."""
        if self.policy.gathers_all:
            return [u.matrices for u in reversed(self.units) if u.matrices]
        return owner_micro_groups(backward_order(self.units))

    def compute_seconds(self, mats: Sequence[FsdpMatrix]) -> float:
        """One rank's compute of its matrices of a micro-group: owner policies batch same-shape
        matrices as the runtime does (`batch_kernels`, `canzona.batching`); gather-all runs each
        alone, as `muon_fsdp2` does."""
        total = sum(m.cost for m in mats)
        if self.policy.gathers_all or not self.batching:
            return total
        for batch in shape_batches(mats, True):
            if len(batch) > 1:
                total -= max(self.rate.batch_saving(self.cfg.optimizer, tuple(batch[0].shape), len(batch)), 0.0)
        return total

    @property
    def batching(self) -> bool:
        return self.cfg.options.batch_kernels and matrix_optimizer(self.cfg.optimizer).batchable

    def phase_b(self, start: simpy.Event) -> None:
        eng, wl, s = self.engine, self.wl, self.shard
        eng.phase = "B"
        ranks = list(range(s))
        ub = FP32 if wl.param_bytes < FP32 else wl.grad_bytes  # the update as sent and applied
        total = sum(u.numel for u in self.units)
        norm_s = sum(self.rate.kernel_seconds(k) for k in
                     gradient_norm_kernels(-(-total // s), self.cfg.options.max_grad_norm is not None))
        begin = {r: eng.compute(r, "gradient norm", norm_s, [start]) for r in ranks}
        elementwise = -(-(total - sum(m.numel for m in self.matrices.values())) // s)
        adamw_s = sum(self.rate.kernel_seconds(k) for k in adamw_kernels(elementwise, default_config("adamw")))
        done = [eng.compute(r, "adamw step", adamw_s, [begin[r]]) for r in ranks]
        groups = self.micro_groups()
        nodes = [self.cluster.node_of(r) for r in ranks]
        gathered: list[dict[int, simpy.Event]] = []
        computed: list[dict[int, simpy.Event]] = []

        def gather(g: int) -> None:
            mats = groups[g]
            after = {r: [begin[r]] + ([computed[g - 2][r]] if g >= 2 else []) for r in ranks}
            if self.policy.gathers_all:
                cost = collective_cost("all-gather", sum(x.numel for x in mats) * wl.grad_bytes, self.shard_geo, self.hw)
            else:
                cost = matrix_all_to_all_cost(_to_owners(mats, s, wl.grad_bytes), nodes, self.shard_geo, self.hw)
            gathered.append(eng.collective(f"group {g} gather", ranks, cost, DP_COMM, after))

        if groups:
            gather(0)
        for g, mats in enumerate(groups):
            if g + 1 < len(groups):
                gather(g + 1)
            computed.append({r: eng.compute(r, f"group {g} compute", self.compute_seconds(
                [x for x in mats if x.owner in (None, r)]), [gathered[g][r]]) for r in ranks})
            applied_after = computed[g]
            if not self.policy.gathers_all:
                sent = _to_owners(mats, s, ub, updates=True)  # the owners send each rank its shard
                cost = matrix_all_to_all_cost(sent, nodes, self.shard_geo, self.hw)
                applied_after = eng.collective(f"group {g} scatter", ranks, cost, DP_COMM,
                                               {r: [computed[g][r]] for r in ranks})
            shard_numel = -(-sum(x.numel for x in mats) // s)
            apply_s = shard_numel * APPLY_PASSES * FP32 / self.rate.hbm_bytes_per_s + self.rate.launch_s
            done += [eng.compute(r, f"group {g} apply", apply_s, [applied_after[r]]) for r in ranks]

    # --- memory -----------------------------------------------------------------------------

    def memory(self, setup: MemorySetup, dims: LayerDims) -> LayoutMemory:
        """Every rank of the shard group: its shards of the parameters (fp32 when mixed precision
        keeps masters: FSDP2 gathers bf16 copies of fp32 shards), gradients and elementwise state;
        the matrix optimizer's state of the matrices it owns whole (owner policies), or under
        gather-all its shard of every matrix's row state (moments and momentum, as muon_fsdp2 keeps
        Muon's on the DTensor shard) and the whole of every matrix's Kronecker factors (Shampoo's
        and SOAP's, which every rank computing every matrix holds); transient: two units' gathered parameters and one unit's unsharded gradient beside
        the activations, or the step's buffers."""
        s, opt = self.shard, self.cfg.optimizer
        pb, gb, mb = setup.param_bytes, setup.grad_bytes, setup.master_bytes
        ub = setup.update_bytes
        # each rank's row blocks, as FSDP2 cuts them (with masters, the fp32 shard is the parameter)
        kept = fsdp_persistent_memory(self.spec, s, self.matrices, weight_bytes=0 if mb else pb, grad_bytes=gb,
                                      master_bytes=mb)
        largest = max(u.numel for u in self.units)
        in_flight = 2 * largest * pb + largest * gb
        acts = activation_bytes(dims, setup, 1)
        work = {m.name: kernel_workspace_bytes(opt, m.shape, gb) for m in self.matrices.values()}
        stacks = {m.name: batched_stack_bytes(opt, m.shape) for m in self.matrices.values()}
        groups = self.micro_groups()
        ranks = []
        for r in range(s):
            if self.policy.gathers_all:
                # two micro-groups' gathered gradients, and one matrix's update and workspace
                held = [sum(m.numel for m in g) * gb for g in groups]
                step = max(a + b for a, b in zip(held, held[1:] + [0])) + \
                    max(m.numel * ub + work[m.name] for m in self.matrices.values())
            else:
                held = [sum(m.numel * (gb + ub) for m in g if m.owner == r) for g in groups]
                # the largest kernel's temporaries: a batch's are its matrices' and its stacks
                ws = max((sum(work[m.name] + (stacks[m.name] if len(batch) > 1 else 0) for m in batch)
                          for g in groups for batch in shape_batches([m for m in g if m.owner == r], self.batching)),
                         default=0)
                step = max(a + b for a, b in zip(held, held[1:] + [0])) + ws
            h = kept[r]
            counted = h.weights + h.grads + h.master_weights + h.matrix_state + h.adamw_state + \
                max(acts + in_flight, step)
            ranks.append(RankMemory(r, 0, r, 0, h.weights, h.grads, h.master_weights, h.matrix_state, h.adamw_state,
                                    acts, in_flight, step, setup.overhead(counted)))
        return LayoutMemory(self.policy.name, opt, self.cluster.dp, 1, 1, 0, tuple(ranks))


def _label(unit: FsdpUnit) -> str:
    return "root" if unit.key == ROOT else f"layer {unit.key}"


def _to_owners(mats: Sequence[FsdpMatrix], shard: int, nbytes: int, updates: bool = False) -> list[list[float]]:
    """sent[s][d]: the bytes rank s sends rank d in a micro-group's all-to-all, as the runtime sends
    them (`canzona.fsdp_collectives.exchange_bytes`: its row blocks of the matrices d owns, or of
    the `updates` of those s owns, to d), less its own piece, which no link carries."""
    sent = exchange_bytes(mats, shard, nbytes, updates=updates)
    return [[0.0 if d == src else float(b) for d, b in enumerate(row)] for src, row in enumerate(sent)]


@dataclass(frozen=True)
class FsdpOutcome:
    """One simulated FSDP iteration, before `sim.simulate` makes it a `SimResult`."""

    engine: Engine
    plan: Plan  # canzona's owner plan for the shard group (the owners canzona's policy uses)
    shard: int
    t_sync: float
    t_end: float
    stalls: float  # the forward's waits for its unit gathers
    memory: LayoutMemory


def simulate_fsdp(cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                  dims: LayerDims) -> FsdpOutcome:
    """One iteration of `cfg` (checked, `cfg.fsdp`) under its FSDP policy."""
    spec, _ = model
    shard = check_fsdp(cfg, cluster, spec)
    run = _FsdpRun(cfg, model, cluster, hw, shard)
    synced = run.phase_a()
    sync_times: list[float] = []
    synced.callbacks.append(lambda _: sync_times.append(run.engine.now))
    run.phase_b(synced)
    t_end = run.engine.run()
    setup = MemorySetup.from_workload(cfg.workload, recompute=cfg.options.recompute, tp_mode=STEP_DEFAULTS.tp_mode)
    return FsdpOutcome(run.engine, run.plan, shard, sync_times[0], t_end, sum(run.stalls), run.memory(setup, dims))


__all__ = ["FSDP_POLICIES", "check_fsdp", "simulate_fsdp"]
