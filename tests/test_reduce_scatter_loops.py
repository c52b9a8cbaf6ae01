"""`reduce_scatter="loops"`: the DP gradients reduce-scattered as one reduce per owner (which NCCL
runs over every NIC) instead of the default exact all-to-all (docs/design.md §8.1).

- Collective: each owner's segment becomes the mean, within rounding of the exact form; the rest of
  the buffer is left as it was (gloo uses a non-root's buffer as scratch: the copy keeps it), idle
  owners (empty segments) included; both forms log the same record.
- Training: at DP 2 a sum of two is the same in any order, so `loops` ends bit for bit where `exact`
  does; at DP 3 (uneven segments, three addends) every rank ends with the same weights, within
  rounding of the single-process run, and the logged collectives equal the exact run's; under TP
  (DP 2 x TP 2) the DP subgroups name their owners right. Gradient accumulation, clipping and SOAP
  run through it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from canzona.runtime.launch import run_ranks
from canzona.runtime.training import TrainSpec, compare, emulate, many_specs_worker

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 120.0
COLLECTIVE_TIMEOUT_S = 60.0
IMPLS = ("exact", "loops")
CUTS = {3: [0, 7, 7, 23], 4: [0, 5, 5, 12, 23]}  # uneven, and an idle owner (rank 1)

MUON = TrainSpec(optimizer="muon", steps=4, global_batch=12, seq_len=16, bucket_size=16384,
                 matrix_config={"ns_dtype": "fp32"})
SOAP = replace(MUON, optimizer="soap", matrix_config={"precondition_frequency": 2}, accumulation=2,
               global_batch=24, clip_norm=0.5)


def segments_worker(rank: int, world: int) -> dict:
    from canzona.runtime.comm import Comm

    out = {}
    for impl in IMPLS:
        comm = Comm(None, COLLECTIVE_TIMEOUT_S, reduce_scatter=impl)
        flat = torch.randn(CUTS[world][-1], generator=torch.Generator().manual_seed(rank))
        before = flat.clone()
        comm.reduce_scatter_v(flat, CUTS[world], "t").wait()
        out[impl] = {"before": before, "after": flat, "log": comm.log.to_dicts()}
    return out


@pytest.mark.parametrize("world", sorted(CUTS))
def test_each_owner_gets_the_mean_and_the_rest_is_left_as_it_was(world):
    ranks = run_ranks(segments_worker, world, deadline_s=DEADLINE_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    cuts = CUTS[world]
    for impl in IMPLS:
        mean = torch.stack([r[impl]["before"] for r in ranks]).mean(0)
        for rank, r in enumerate(ranks):
            a, b = cuts[rank], cuts[rank + 1]
            torch.testing.assert_close(r[impl]["after"][a:b], mean[a:b], rtol=1e-6, atol=1e-7)
            rest = torch.ones_like(mean, dtype=torch.bool)
            rest[a:b] = False
            assert torch.equal(r[impl]["after"][rest], r[impl]["before"][rest]), (impl, rank)
    assert all(r["loops"]["log"] == r["exact"]["log"] for r in ranks)


BASELINES = ("zero1-gather", "layerwise", "sc")  # their reduce-scatters (and all-reduce forms) too


@functools.cache
def trained(dp: int) -> dict[tuple[str, str], list[dict]]:
    jobs = [(spec.optimizer, impl, replace(spec, reduce_scatter=impl)) for spec in (MUON, SOAP) for impl in IMPLS]
    if dp > 2:  # at DP 2 loops is bit for bit the exact form, which test_runtime_equivalence covers
        jobs += [(policy, "loops", replace(MUON, policy=policy, reduce_scatter="loops")) for policy in BASELINES]
    results = run_ranks(many_specs_worker, dp, [s for _, _, s in jobs], [{"state_dict": False} for _ in jobs],
                        deadline_s=DEADLINE_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    return {(opt, impl): [results[r][i] for r in range(dp)] for i, (opt, impl, _) in enumerate(jobs)}


def test_at_dp_2_loops_ends_bit_for_bit_where_exact_does():
    runs = trained(2)
    for opt in ("muon", "soap"):
        for exact, loops in zip(runs[(opt, "exact")], runs[(opt, "loops")]):
            assert compare(loops["params"], exact["params"])["bit_identical"], opt
            assert loops["log"] == exact["log"]


def test_under_tp_the_dp_subgroups_reduce_to_their_own_owners():
    """DP 2 x TP 2 (4 ranks): each DP group is a subgroup, whose owners the reduces name by their
    global rank; bit for bit with the exact form at DP 2, every step's records the same."""
    specs = [replace(MUON, tp=2, reduce_scatter=impl) for impl in IMPLS]
    results = run_ranks(many_specs_worker, 4, specs, [{"state_dict": False}] * 2, deadline_s=DEADLINE_S,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    for rank in results:
        exact, loops = rank
        assert compare(loops["params"], exact["params"])["bit_identical"]
        assert loops["log"] == exact["log"] and loops["tp_log"] == exact["tp_log"]


def test_at_dp_3_ranks_agree_within_rounding_of_the_single_process_run():
    runs = trained(3)
    for opt, spec in (("muon", MUON), ("soap", SOAP)):
        loops, exact = runs[(opt, "loops")], runs[(opt, "exact")]
        first = loops[0]["params"]
        for r in loops[1:]:
            assert compare(r["params"], first)["bit_identical"]  # owners compute, everyone receives
        assert [r["log"] for r in loops] == [r["log"] for r in exact]
        if spec.clip_norm is not None:
            assert all(len(r["norms"]) == spec.steps for r in loops)
        if opt == "muon":  # SOAP's eigenbases amplify rounding; its agreement and records are checked
            assert compare(first, emulate(spec, 3))["max_rel_diff"] < 1e-5


@pytest.mark.parametrize("policy", BASELINES)
def test_the_baseline_policies_run_on_loops_too(policy):
    runs = trained(3)[(policy, "loops")]
    for r in runs[1:]:
        assert compare(r["params"], runs[0]["params"])["bit_identical"]
    assert compare(runs[0]["params"], emulate(MUON, 3))["max_rel_diff"] < 1e-5
