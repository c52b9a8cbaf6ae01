"""FSDP2 under pipeline parallelism in the simulator (docs/design.md §2.8): torchtitan's PP x FSDP
layout, as it runs with torch's pipelining (torch.distributed.pipelining, torch 2.13).

Each pipeline stage holds its contiguous run of decoder layers (`canzona.pipeline.stage_spec`, the
ZeRO-1 layout's split: the embedding on the first stage, the final norm and head on the last;
torchtitan's default split, `generate_llm_fqn_per_model_part` counting the embedding and the
norm and head as one layer each, is `--account-for-embedding-in-pipeline-split
--account-for-loss-in-pipeline-split` where the stages divide it evenly) and is
`fully_shard`-ed over its own DP shard group (DP = gpus / (tp x pp)): its FSDP units (one a decoder
layer, the root holding the stage's embedding or norm and head) shard its parameters, gradients and
optimizer state over that group, and one FsdpOptimizer steps them over the stage's exchange group
(the runtime's one optimizer a stage, canzona.runtime.fsdp_layout).

Phase A (every stage on its first rank, one engine): torch's `Schedule1F1B` (`pp - stage`
warm-up forwards, then one backward and one forward in turn, then the cool-down's backwards: the
order of `canzona.pipeline.one_f_one_b`). A pass waits for its input (output gradient), received
from the neighbouring stage by a point-to-point transfer that starts once the sender's pass is done
and the receiver has posted its receive; the receive of a stage's next pass is posted with its
current pass's send, and the send is waited for before the next pass where that pass is of the
other kind (torch fuses the two: `fwd_send_bwd_recv`, `bwd_send_fwd_recv`), after the next pass
where it is of the same kind (the warm-up's forwards, the cool-down's backwards).

FSDP2 under the schedule (torch's `_PipelineStageBase.backward_maybe_with_nosync` and
`perform_reduce_grad`): every backward runs with `reshard_after_backward=False` and
`requires_gradient_sync=False`, so a unit's gathered parameters stay gathered after its backward and
its unsharded gradient accumulates over the micro-batches; after the last backward each unit's
gradient is reduce-scattered once (its copy-in first). A unit is all-gathered (one unit ahead, as
at PP 1) by a pass that finds it resharded: by every forward before the first backward, and under
`--reshard-after-forward` (which reshards it after each forward) by every backward whose pass before
was a forward. The root stays gathered once its first forward has gathered it. The memory follows:
once a stage has run a backward it holds every unit's gathered parameters and unsharded gradients
beside its shards (`pipeline_in_flight_bytes`), and the 1F1B schedule's activations
(`canzona.memory.activation_bytes` at the stage: up to `pp - stage` micro-batches in flight).

Phase B (each stage's step over its own exchange group, `_FsdpRun.phase_b`) starts when the stage's
reductions are done; the iteration ends with the slowest stage's step. Each stage's exchange group
is priced as the first stage's (consecutive ranks: stages of equal size have the same shape on the
nodes).

torchtitan's default `reshard_after_forward_policy` ("default") is `not pp_enabled`: under PP it
keeps the units gathered from the forward to the backward, where the simulator's default,
FSDP2's own, reshards (`--reshard-after-forward`); `--no-reshard-after-forward` prices
torchtitan's PP default.
"""

from __future__ import annotations

from dataclasses import replace

import simpy

from canzona.decoder import Architecture
from canzona.fsdp_plan import ROOT
from canzona.hardware import HardwareProfile
from canzona.memory import LayerDims, LayoutMemory, activation_bytes, layer_dims
from canzona.pipeline import one_f_one_b, stage_spec
from canzona.spec import ModelSpec
from canzona.step_options import STEP_DEFAULTS
from sim.engine import Collective, Engine
from sim.fsdp import RS_STREAM, FsdpOutcome, _FsdpRun, check_fsdp, pipeline_in_flight_bytes
from sim.pipeline_p2p import p2p_cost, p2p_stream
from sim.topology import Cluster


class _Pipeline:
    """The stages' phase A on one engine: each stage's program on its first rank."""

    def __init__(self, cfg, cluster: Cluster, hw: HardwareProfile, runs: list[_FsdpRun], head_dim: int) -> None:
        self.cfg, self.runs = cfg, runs
        self.pp = len(runs)
        self.engine = runs[0].engine
        wl = cfg.workload
        self.p2p = p2p_cost(wl.tokens_per_micro_batch * runs[0].arch.hidden * wl.activation_bytes, cluster, hw)
        self.transfers: dict[tuple[str, int, int], Collective] = {}
        self.head_dim = head_dim

    def transfer(self, kind: str, mb: int, receiver: int) -> tuple[Collective, str, int, int]:
        """The transfer of micro-batch `mb`'s activations ("F") or output gradient ("B") to stage
        `receiver`: the rendezvous (made by whichever side asks first), its stream, sender and
        receiver ranks."""
        src = receiver - 1 if kind == "F" else receiver + 1
        ranks = [self.runs[src].rank_a, self.runs[receiver].rank_a]
        key = (kind, mb, receiver)
        if key not in self.transfers:
            what = "activations" if kind == "F" else "gradients"
            self.transfers[key] = self.engine.rendezvous(f"mb{mb} send {what} {src}->{receiver}", ranks, self.p2p)
        return self.transfers[key], p2p_stream(src, receiver, self.pp), ranks[0], ranks[1]

    def receive(self, stage: int, slot: tuple[str, int], at: simpy.Event) -> simpy.Event | None:
        """Stage `stage` posts the receive of pass `slot`'s input at `at`; when it has arrived (None:
        the pass needs none)."""
        kind, mb = slot
        if (kind == "F" and stage == 0) or (kind == "B" and stage == self.pp - 1):
            return None
        coll, stream, _, dst = self.transfer(kind, mb, stage)
        return self.engine.join(coll, dst, stream, [at])

    def send(self, stage: int, slot: tuple[str, int], at: simpy.Event) -> simpy.Event | None:
        """Stage `stage` sends pass `slot`'s output (gradient) after `at`; when the send is done."""
        kind, mb = slot
        if (kind == "F" and stage == self.pp - 1) or (kind == "B" and stage == 0):
            return None
        coll, stream, src, _ = self.transfer(kind, mb, stage + 1 if kind == "F" else stage - 1)
        return self.engine.join(coll, src, stream, [at])

    def stage(self, s: int) -> simpy.Event:
        """Stage `s`'s program; the event: its gradients reduce-scattered."""
        run, cfg = self.runs[s], self.cfg
        eng, rank = self.engine, run.rank_a
        work = run.micro_batch_work(self.head_dim, s)
        fwd = dict(zip(work.layer_ids, work.forward))
        bwd = dict(zip(work.layer_ids, work.backward))
        layers = [u for u in run.units if u.key != ROOT]
        root = next((u for u in run.units if u.key == ROOT), None)
        order = one_f_one_b(s, self.pp, cfg.workload.micro_batches(run.cluster.dp))
        gathered = root_gathered = False
        pending: simpy.Event | None = None  # a send waited for after the next pass (same kind)
        last: simpy.Event = eng.env.event().succeed()
        arrived = self.receive(s, order[0], last)
        for i, (kind, mb) in enumerate(order):
            if arrived is not None:
                last = eng.env.all_of([last, arrived])
            if kind == "F":
                if root is not None and not root_gathered:
                    got = run._gather(f"mb{mb} fwd all-gather root", root, [last])
                    if run.copy_out_s[root.key]:
                        got = eng.compute(rank, f"mb{mb} fwd all-gather copy-out root", run.copy_out_s[root.key],
                                          [last, got])
                    last, root_gathered = eng.env.all_of([last, got]), True
                if work.embed_forward_s:
                    last = eng.compute(rank, f"mb{mb} fwd embedding", work.embed_forward_s, [last])
                last = run._pass(f"mb{mb} fwd", layers, fwd, last, 1, gathered=gathered)
                gathered = not cfg.reshard_after_forward
                if work.head_forward_s:
                    last = eng.compute(rank, f"mb{mb} fwd head", work.head_forward_s, [last])
            else:
                if work.head_backward_s:
                    last = eng.compute(rank, f"mb{mb} bwd head", work.head_backward_s, [last])
                last = run._pass(f"mb{mb} bwd", list(reversed(layers)), bwd, last, 2, gathered=gathered)
                gathered = True  # reshard_after_backward=False
                if work.embed_backward_s:
                    last = eng.compute(rank, f"mb{mb} bwd embedding", work.embed_backward_s, [last])
            if pending is not None:
                last, pending = eng.env.all_of([last, pending]), None
            sent = self.send(s, (kind, mb), last)
            following = order[i + 1] if i + 1 < len(order) else None
            arrived = self.receive(s, following, last) if following is not None else None
            if sent is not None:
                if following is not None and following[0] == kind:
                    pending = sent
                else:
                    last = eng.env.all_of([last, sent])
        if pending is not None:
            last = eng.env.all_of([last, pending])
        return self.reduce(run, last)

    def reduce(self, run: _FsdpRun, last: simpy.Event) -> simpy.Event:
        """torch's `perform_reduce_grad` after the stage's last backward: each unit's gradient
        reduce-scattered (its copy-in first, on the compute stream)."""
        eng, rank = self.engine, run.rank_a
        reduced = []
        for u in run.units:
            name = "root" if u.key == ROOT else f"layer {u.key}"
            if run.copy_in_s[u.key]:
                last = eng.compute(rank, f"reduce-scatter copy-in {name}", run.copy_in_s[u.key], [last])
            reduced.append(run._collective_a(f"reduce-scatter {name}", run.rs_cost(u), RS_STREAM, [last]))
        return eng.env.all_of(reduced + [last])


def simulate_fsdp_pipeline(cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                           dims: LayerDims) -> FsdpOutcome:
    """One iteration of `cfg` (`cfg.fsdp`, `cfg.pp` > 1; checked) under its FSDP policy: the
    slowest stage's pipeline and step, the fullest stage's memory (the module docstring). The
    outcome's engine holds phase A of every stage (stage s on its first rank, `s * dp * tp`) and
    phase B of the slowest stage (its spans and collective records), its exchange group's members
    numbered from 0."""
    shard, runs = _stage_runs(cfg, model, cluster, hw)
    pp = cfg.pp
    own = [run.engine for run in runs]  # each stage's step runs on its own engine
    shared = Engine(slowdown=own[0].slowdown, sms=hw.gpu.sms)  # every stage's phase A
    for s, run in enumerate(runs):
        run.engine, run.rank_a = shared, s * cluster.stage_gpus
    pipeline = _Pipeline(cfg, cluster, hw, runs, dims.head_dim)
    synced = [pipeline.stage(s) for s in range(pp)]
    t_sync = [0.0] * pp
    for s, ev in enumerate(synced):
        ev.callbacks.append(lambda _, s=s: t_sync.__setitem__(s, shared.now))
    shared.run()
    if not all(ev.processed for ev in synced):  # a transfer no program reached: the schedule's, not the input's
        raise RuntimeError("sim.fsdp_pipeline: a pipeline stage never finished its backward (a schedule deadlock)")
    ends = []
    for s, run in enumerate(runs):
        run.engine = own[s]
        run.phase_b(own[s].env.timeout(t_sync[s]))
        ends.append(own[s].run())
    slowest = max(range(pp), key=lambda s: (ends[s], -s))
    shared.spans.extend(own[slowest].spans)
    shared.records.extend(own[slowest].records)  # its step check's (`--collectives runtime`), as its spans
    memory = max(_stage_memories(cfg, runs, model[1], dims, cluster), key=lambda m: m.worst.total)
    return FsdpOutcome(shared, runs[slowest].plan, shard, runs[slowest].size, t_sync[slowest], ends[slowest],
                       sum(runs[slowest].stalls), memory)


def _stage_runs(cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile
                ) -> tuple[int, list[_FsdpRun]]:
    """The shard group's size and each stage's FSDP run over its parameters (`stage_spec`)."""
    spec, arch = model
    shard = check_fsdp(cfg, cluster, spec)
    return shard, [_FsdpRun(cfg, (stage_spec(spec, cfg.pp, s, arch.layers, split=cfg.pipeline_split), arch),
                            cluster, hw, shard) for s in range(cfg.pp)]


def _stage_memories(cfg, runs: list[_FsdpRun], arch: Architecture, dims: LayerDims,
                    cluster: Cluster) -> list[LayoutMemory]:
    setup = cfg.memory_setup(arch, tp_mode=STEP_DEFAULTS.tp_mode)
    return [stage_memory(cfg, run, setup, dims, s, cluster) for s, run in enumerate(runs)]


def fsdp_stage_memories(cfg, model: tuple[ModelSpec, Architecture] | None = None) -> list[LayoutMemory]:
    """Every stage's memory under `cfg` (a `sim.simulate.SimConfig` with `fsdp` and `pp` > 1;
    checked), stage by stage, each rank's of its exchange group (`stage_memory`): what
    `simulate` reports of the fullest stage, for all of them."""
    cluster, model, hw = cfg.checked(model)
    _, runs = _stage_runs(cfg, model, cluster, hw)
    return _stage_memories(cfg, runs, model[1], layer_dims(model[1], model[0]), cluster)


def stage_memory(cfg, run: _FsdpRun, setup, dims: LayerDims, stage: int, cluster: Cluster) -> LayoutMemory:
    """Every rank of stage `stage`'s exchange group: its shards and state as at PP 1
    (`_FsdpRun.memory` over the stage's parameters), the stage's 1F1B activations and, in flight
    beside them, every unit's gathered parameters and unsharded gradient
    (`pipeline_in_flight_bytes`)."""
    base = run.memory(setup, dims)
    acts = activation_bytes(dims, setup, run.tp, cfg.pp, stage, split=cfg.pipeline_split)
    in_flight = pipeline_in_flight_bytes(run.gathered_elements(), setup.param_bytes, setup.grad_bytes)
    ranks = tuple(replace(r, rank=stage * cluster.stage_gpus + r.rank, stage=stage, activations=acts,
                          reduction=in_flight, overhead=setup.overhead(max(acts + in_flight, r.step_buffers)))
                  for r in base.ranks)
    return replace(base, pp=cfg.pp, stage=stage, ranks=ranks)


__all__ = ["fsdp_stage_memories", "pipeline_in_flight_bytes", "simulate_fsdp_pipeline"]
