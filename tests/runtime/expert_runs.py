"""What the expert-parallel tests share: checkpoints saved by the jobs of one spawn, resumed by
another at another layout; the spawn's outcome replayed by every test that reads it; a rank's
collective logs step by step, and the simulator's records of the same run."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    expert_full_parameters,
    many_specs_worker,
)


def saving_spawn(worker: Callable[..., Any], world: int, jobs: Mapping[str, TrainSpec], saved: Sequence[str],
                 prefix: str, deadline_s: float) -> tuple[list[Any], str]:
    """One spawn of `world` ranks running `worker(rank, world, specs, extras)` over every job (in
    order), the `saved` ones keeping their state dict and writing a sharded checkpoint into a fresh
    folder, the others neither: (the ranks' results, the folder)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    extras = [{"state_dict": label in saved, **({"save_sharded": os.path.join(folder, label)} if label in saved else {})}
              for label in jobs]
    return run_ranks(worker, world, list(jobs.values()), extras, deadline_s=deadline_s, collective_timeout_s=60), folder


def resumed_runs(out: Mapping[str, Any], jobs: Mapping[str, TrainSpec], saved: Sequence[str], folder: str,
                 world: int, key: tuple, deadline_s: float, **changes: Any) -> dict:
    """Every saved job's checkpoint, full and sharded, loaded by `world` ranks (one spawn) running
    its spec with `changes`, 2 steps on other data: `{(*key, job, form): (spec, whole-model
    parameters loaded, the ranks' results)}`."""
    runs = []
    for label in saved:
        params = expert_full_parameters(out[label], jobs[label])
        later = replace(jobs[label], steps=2, data_seed=7, **changes)
        runs += [((*key, label, "full"), later, {"load": (params, out[label][0]["state"]), "state_dict": False}),
                 ((*key, label, "sharded"), later, {"load": (params, os.path.join(folder, label)), "state_dict": False,
                                                    "check_weights": True})]  # its own weights: not refused
    resumed = run_ranks(many_specs_worker, world, [s for _, s, _ in runs], [e for _, _, e in runs],
                        deadline_s=deadline_s, collective_timeout_s=60)
    return {label: (spec, extra["load"][0], [resumed[r][i] for r in range(world)])
            for i, (label, spec, extra) in enumerate(runs)}


def replay(got: Mapping[Any, Any], label: Any) -> Any:
    """A spawn's result for `label`, or the spawn's failure as this test's."""
    if "error" in got:
        err = got["error"]
        pytest.fail(f"a spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return got[label]


def logged_steps(res: dict) -> list[list[tuple]]:
    """Per step, (op, group, name, bytes per rank) of every collective a rank logged, its DP, TP and
    EDP logs together in the order it issued them (their shared `seq`)."""
    logs = (res["log"], res["tp_log"], res["edp_log"])
    for log in logs:
        assert [x["order"] for x in log] == list(range(len(log)))
    records = sorted((x for log in logs for x in log), key=lambda x: x["seq"])
    assert [x["seq"] for x in records] == list(range(len(records)))
    assert [x["step"] for x in records] == sorted(x["step"] for x in records)
    return [[(x["op"], x["group"], x["name"], tuple(x["bytes_per_rank"])) for x in records if x["step"] == s]
            for s in range(1 + max(x["step"] for x in records))]


def check_logged_collectives(train: TrainSpec, ranks: Sequence[dict], label: str) -> None:
    """Every rank's logs, step by step, are `step_collectives` of its DP (and TP) rank and its
    EDP rank (the first step with what construction logged)."""
    from canzona.experts import dense_part, expert_part
    from canzona.step_collectives import EDP_GROUP, Experts, step_collectives, step_records

    model = build_model(train).spec()
    for res in ranks:
        steps = logged_steps(res)[:train.steps]  # (a state dict taken after training logs after them)
        assert len(steps) == train.steps
        experts = Experts(res["expert_plan"], expert_part(model, train.ep), res["edp_rank"])
        for s, got in enumerate(steps):
            want = step_collectives(res["plan"].dense, dense_part(model), train.policy, res["dp_rank"], res["tp_rank"],
                                    master_weights=train.master_weights, first_step=s == 0, experts=experts,
                                    overlap_step=train.overlap_step, clipped=train.clip_norm is not None)
            assert got == step_records(want), (label, res["dp_rank"], res["tp_rank"], s)
            assert {g for _, g, _, _ in got} == {"dp", EDP_GROUP} | ({"tp"} if train.tp > 1 else set())


def check_simulated_collectives(train: TrainSpec, ranks: Sequence[dict], label: str) -> None:
    """The simulator in the runtime's collectives mode (`--collectives runtime --ep`) on the same
    model and layout plans the runtime's two plans (no plan file: it plans both parts itself) and
    issues on every rank the records the rank logged in its last step."""
    from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
    from canzona.spec import DTYPE_BYTES
    from sim.engine import issued_records
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    world, model = len(ranks), build_model(train).spec()
    arch = moe_architecture(model.name, train.preset)
    low = train.dtype in ("bf16", "fp16") and train.master_weights
    wl = Workload(seq_len=train.seq_len, global_batch=world, grad_bytes=4 if low else DTYPE_BYTES[train.dtype],
                  param_bytes=DTYPE_BYTES[train.dtype], dtype="fp32")
    cfg = SimConfig(model=model.name, gpus=world, tp=train.tp, ep=train.ep, optimizer=train.optimizer,
                    policy=train.policy, workload=wl, bucket_size=train.bucket_size,
                    expert_buckets=DEFAULT_EXPERT_BUCKETS, zero1_fallback=False,
                    options=RunOptions(overlap_param_gather=False, collectives="runtime",
                                       overlap_step=train.overlap_step, explicit_clip=train.clip_norm is not None),
                    matrix_config=train.matrix_config or None)  # what the runtime planned with
    result = simulate(cfg, model=(model, arch), replicate_phase_a=False)  # every rank's own records
    # the runtime's plan: the dense part's, holding the experts' (one plan file under EP)
    plan = ranks[0]["plan"]
    assert result.plan.hash() == plan.dense.hash() and result.expert_plan.hash() == ranks[0]["expert_plan"].hash()
    assert replace(result.plan, experts=result.expert_plan, ep=train.ep).hash() == plan.hash()
    for res in ranks:
        rank = res["dp_rank"] * train.tp + res["tp_rank"]  # the (dp, tp) mesh's rank order
        simulated = [tuple(r) for r in issued_records(result.collective_records, rank)]
        assert simulated == logged_steps(res)[train.steps - 1], (label, rank)


def moe_architecture(name: str, preset: str) -> Any:
    """The simulator's `Architecture` of a tiny MoE preset (`reference.tiny_moe.MOE_PRESETS`),
    its attention's heads where it has attention."""
    from canzona.decoder import Architecture
    from reference.tiny_moe import MOE_PRESETS

    moe = MOE_PRESETS[preset]
    heads = dict(kv_dim=moe.heads * moe.head_dim, q_heads=moe.heads, kv_heads=moe.heads, head_dim=moe.head_dim) \
        if moe.heads else {}
    return Architecture(name, moe.layers, moe.hidden, moe.vocab, moe.heads * moe.head_dim or moe.hidden,
                        experts=moe.experts, experts_per_token=moe.experts_per_token, **heads)


def check_same_kernels(spec: TrainSpec, ranks: Sequence[dict], dp: int, label: str, rel_tol: float) -> None:
    """Rung 3: every rank's parameters are what the same kernels compute in one process fed the
    global gradients the ranks' reductions made, bit for bit (each rank against its experts and TP
    shards), and in fp32 within `rel_tol` of the reference optimizers."""
    from canzona.harness.training import (
        compare,
        emulate,
        global_gradients_from,
        held_by,
        reference_run,
    )

    grads = global_gradients_from(ranks, spec)
    want = emulate(spec, dp, grads=grads)
    for r, res in enumerate(ranks):
        cmp = compare(res["params"], held_by(want, spec, res))
        assert cmp["bit_identical"], f"{label}, rank {r} (EP rank {res['ep_rank']}, TP rank {res['tp_rank']}): {cmp}"
    if spec.dtype == "fp32":
        ref = reference_run(spec, dp, grads=grads)
        for res in ranks:
            cmp = compare(res["params"], held_by(ref, spec, res))
            assert cmp["max_rel_diff"] <= rel_tol, f"{label} against the references: {cmp}"


def check_resumed(resumed: tuple, saved: Sequence[dict], label: str) -> None:
    """A resumed run (`resumed_runs`' value) is what the same kernels compute in one process from
    the checkpoint (the saving run's parameters and state) and the resumed ranks' gradients, bit
    for bit."""
    from canzona.harness.training import compare, emulate, global_gradients_from, held_by

    spec, params, ranks = resumed
    grads = global_gradients_from(ranks, spec) if spec.tp > 1 or spec.ep > 1 else None
    want = emulate(spec, spec.dp_size(len(ranks)), load=(params, saved[0]["state"]), grads=grads)
    for r, res in enumerate(ranks):
        cmp = compare(res["params"], held_by(want, spec, res))
        assert cmp["bit_identical"], f"{label}, rank {r}: {cmp}"


Staging = Callable[[Any, int], Callable[[], None] | None]  # (model, step) -> what undoes it, or None


def staged_job(rank: int, world: int, spec: TrainSpec, stage: Staging) -> dict:
    """`spec` trained with `stage(model, s)` changing this rank's model before step `s`'s forward
    (0-based), undone after the step. What `check_same_kernels` reads of a rank: its parameters,
    the gradients its own hooks saw, its place in the layout; and its state dict's entries."""
    from canzona.harness.training import (
        GradientRecorder,
        global_batches,
        micro_batches,
        parallel_model,
    )
    from canzona.runtime.optimizer import DistributedOptimizer
    from canzona.runtime.shards import local_tensor

    model, mspec, group, expert_mesh, dp_rank = parallel_model(spec, rank, world)
    recorder = GradientRecorder(model.named_parameters(), spec.master_weights)
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config or None,
                               spec.adamw_config, policy=spec.policy, bucket_size=spec.bucket_size, group=group,
                               reduce_scatter=spec.reduce_scatter, expert_mesh=expert_mesh)
    grads = []
    for s, tokens in enumerate(global_batches(spec, mspec.param("model.embed_tokens.weight").shape[0])):
        undo = stage(model, s)
        opt.zero_grad()
        model.loss(micro_batches(tokens, dp_rank, spec.dp_size(world), 1)[0]).backward()
        grads.append(recorder.take())
        opt.step()
        if undo is not None:
            undo()
    opt.wait_params()
    return {"params": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}, "grads": grads,
            "tp_dims": {p.name: p.tp_dim if spec.tp > 1 else None for p in mspec.params},
            "dp_rank": opt.rank, "tp_rank": opt.tp_rank, "ep_rank": expert_mesh.get_local_rank("ep"),
            "state entries": opt.state_dict()["param_names"]}


def skipped_layer_job(rank: int, world: int, spec: TrainSpec, layer: int, skipped_steps: Sequence[int]) -> dict:
    """`spec` trained with decoder layer `layer` skipped by every rank's forward in `skipped_steps`
    (0-based; LayerDrop, a skipped layer): none of its parameters, its expert stacks included, gets
    a gradient on any rank there, which one process's optimizer skips (`staged_job`)."""
    import contextlib

    def stage(model: Any, s: int) -> Callable[[], None] | None:
        if s not in skipped_steps:
            return None
        skipped = model.model.layers[layer]
        skipped.forward = lambda x, rope=None: x

        def undo() -> None:
            with contextlib.suppress(AttributeError):
                del skipped.forward  # the class's forward again
        return undo

    return staged_job(rank, world, spec, stage)


def idle_ep_rank_job(rank: int, world: int, spec: TrainSpec, idle_ep_rank: int, idle_steps: Sequence[int]) -> dict:
    """`spec` (under EP) trained with the experts of EP rank `idle_ep_rank` given no token in
    `idle_steps` (0-based) on every rank of that EP rank (its whole EDP group), in every layer:
    their experts module skips them (their output zeros without reading the weights, as
    transformers' loops over experts do), so none of those ranks' hooks sees a gradient of the
    stacks the other EP ranks' experts got one of (`staged_job`)."""
    def stage(model: Any, s: int) -> Callable[[], None] | None:
        import torch.distributed as dist

        modules = [layer.mlp.experts for layer in model.model.layers]
        if s not in idle_steps or dist.get_rank(modules[0].group) != idle_ep_rank:
            return None
        real = [m.expert for m in modules]
        for m in modules:
            m.expert = lambda e, x, m=m: x.new_zeros(x.shape[0], m.down_proj.shape[1]) + 0 * x[:, :1]

        def undo() -> None:
            for m, forward in zip(modules, real):
                m.expert = forward
        return undo

    return staged_job(rank, world, spec, stage)
