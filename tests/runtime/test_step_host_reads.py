"""The host reads tensor values a fixed number of times per `step()`, however many matrices and
buckets the model has (issue 18 #3; docs/design.md §8.2).

On a GPU every read of a device tensor's value by the host (`.item()`, `.tolist()`, `.cpu()`,
`bool(t)`, `float(t)`, ...) waits for the device. On CPU there is no device to wait for, so the
test counts every such read inside `step()` (CPU tensors' included, a fixed handful) and checks
that the count does not grow with the model: the same for one bucket and for one per matrix, for
two layers and for four, at DP 2 and at DP 2 x TP 2 (gloo, spawned ranks). Under TP the count does
not grow with the micro-groups either (2 on the two-layer model, 7 on the four-layer one): the TP
ranks that receive update chunks compute how to apply them themselves, from the step count they
keep alike, instead of reading scalars their hosts sent (docs/design.md §8.3).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec

pytestmark = pytest.mark.distributed

DEADLINE_S = 180.0
TIMEOUT_S = 60.0
BASE = TrainSpec(optimizer="muon", steps=1, global_batch=4, seq_len=8, matrix_config={"ns_steps": 1})
# (preset, bucket size): one bucket of every matrix, or about one per matrix; two layers or four
SHAPES = [("tiny", 10**7), ("tiny", 16384), ("tiny-l4", 10**7), ("tiny-l4", 16384)]
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counting_reads(counts: Counter):
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_worker(rank: int, world: int, tp: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.harness.training import build_model, build_tp_model, global_batches, micro_batches
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_model import get_preset

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    out = []
    for preset, bucket_size in SHAPES:
        spec = replace(BASE, preset=get_preset("tiny", layers=4) if preset == "tiny-l4" else preset,
                       bucket_size=bucket_size, tp=tp)
        model, mspec = build_tp_model(spec, mesh) if tp > 1 else (build_model(spec), None)
        mspec = mspec or model.spec()
        opt = DistributedOptimizer(model.named_parameters(), mspec, "muon", spec.matrix_config,
                                   bucket_size=bucket_size, group=mesh, timeout_s=TIMEOUT_S)
        (tokens,) = global_batches(spec, mspec.param("model.embed_tokens.weight").shape[0])
        (mb,) = micro_batches(tokens, opt.rank, world // tp, 1)
        model.loss(mb).backward()
        counts: Counter = Counter()
        with counting_reads(counts):
            opt.step()
        opt.wait_params()
        groups = sum(1 for g in opt.schedule.groups if any(tasks for _, tasks in g.sources(opt.tp_rank)))
        out.append({"shape": (preset, bucket_size), "reads": sum(counts.values()), "by_kind": dict(counts),
                    "buckets": len(opt.plan.dp_plan.buckets), "matrices": len(mspec.matrix_params()),
                    "groups": groups})
    return out


def test_reads_per_step_do_not_grow_with_matrices_or_buckets():
    ranks = run_ranks(reads_worker, 2, 1, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)
    for rank in ranks:
        assert len({r["buckets"] for r in rank}) > 1 and len({r["matrices"] for r in rank}) > 1  # the shapes differ
        assert len({r["reads"] for r in rank}) == 1, rank  # ... and the reads do not
        assert rank[0]["reads"] <= 12, rank[0]["by_kind"]  # 9 today


def test_under_tp_reads_per_step_do_not_grow_with_micro_groups():
    ranks = run_ranks(reads_worker, 4, 2, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)
    for rank in ranks:
        assert len({r["groups"] for r in rank}) > 1  # micro-groups that receive update chunks differ
        assert len({r["buckets"] for r in rank}) > 1 and len({r["matrices"] for r in rank}) > 1
        assert len({r["reads"] for r in rank}) == 1, rank  # ... and the reads do not
        assert rank[0]["reads"] <= 20, rank[0]["by_kind"]  # DP's, plus the TP check's (17 today)
