"""The DP gradient reduce-scatter's implementations (`canzona.reductions`, docs/design.md §8.1):
`native` (the default: per bucket a reduce-scatter of the buffer when even, of a padded copy when
nearly so, else one reduce per owner), `exact` (the verification mode: an all-to-all and a sum in
rank order), `loops` and `padded`.

- Routes: which route each implementation takes for even, nearly even and uneven segments, and the
  temporary memory each allocates (what `canzona.memory` counts): no receive buffer but under
  `exact` (the reduce-scatters write into their own input, as Megatron's distributed optimizer).
- Collective: each owner's segment becomes the mean, within rounding of the exact form; the rest of
  the buffer is left as it was (gloo uses a non-root's buffer as scratch: the copy keeps it; gloo
  reduce-scatters a clone of its input, so its in-place form equals the out-of-place one bit for
  bit), idle owners (empty segments) included; every form logs the same record; what each form allocates, measured from the
  outside (`tests/runtime/allocations.py`), is what `temporary_elements` says and what
  `Comm.peak_in_flight_bytes` counts: a receive buffer the model omits fails it.
- Training: at DP 2 a sum of two is the same in any order, so every form ends bit for bit where
  `exact` does; at DP 3 (uneven segments, three addends) every rank ends with the same weights,
  within rounding of the single-process run, and the logged collectives equal the exact run's;
  under TP (DP 2 x TP 2) the DP subgroups name their owners right. Gradient accumulation, clipping
  and SOAP run through it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from canzona.errors import SpecError
from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, compare, emulate, many_specs_worker
from canzona.reductions import (
    EVEN,
    EXACT,
    LOOPS,
    PADDED,
    REDUCE_SCATTER_IMPLS,
    bucket_route,
    check_reduce_scatter,
    temporary_elements,
)

DEADLINE_S = 120.0
COLLECTIVE_TIMEOUT_S = 60.0
IMPLS = REDUCE_SCATTER_IMPLS
# per world size: uneven with an idle owner (rank 1), nearly even (native pads), even
CUTS = {3: ([0, 7, 7, 23], [0, 32, 64, 95], [0, 8, 16, 24]), 4: ([0, 5, 5, 12, 23], [0, 40, 80, 120, 158])}


def lengths_of(cuts):
    return [b - a for a, b in zip(cuts, cuts[1:])]


# --- routes and their memory (pure) -----------------------------------------------------------


@pytest.mark.parametrize(("lengths", "native"), [
    ([8, 8, 8], EVEN), ([32, 32, 31], PADDED), ([7, 0, 16], LOOPS), ([5, 0, 7, 11], LOOPS), ([0, 0], EVEN),
])
def test_native_takes_the_backends_cheapest_route(lengths, native):
    assert bucket_route("native", lengths) == native
    assert bucket_route("exact", lengths) == EXACT  # even segments too: the verification mode never changes
    even = len(set(lengths)) == 1
    assert bucket_route("loops", lengths) == (EVEN if even else LOOPS)
    assert bucket_route("padded", lengths) == (EVEN if even else PADDED)


def test_only_exact_receives_a_copy():
    lengths = [32, 32, 31, 0]
    for rank, mine in enumerate(lengths):
        assert temporary_elements("exact", lengths, rank) == 4 * mine  # n copies received, summed in place
        assert temporary_elements("loops", lengths, rank) == 0  # in place (NCCL)
        assert temporary_elements("loops", lengths, rank, scratch=True) == sum(lengths)  # gloo's copy
        assert temporary_elements("padded", lengths, rank) == 4 * 32  # the padded copy, received into
    for impl in ("native", "loops", "padded"):  # even: into the rank's own segment of the bucket
        assert temporary_elements(impl, [8, 8], 1) == temporary_elements(impl, [8, 8], 1, scratch=True) == 0
    assert temporary_elements("exact", [8, 8], 1) == 16
    assert all(temporary_elements(impl, [9], 0) == 0 for impl in REDUCE_SCATTER_IMPLS)  # one rank: nothing


def test_an_unknown_implementation_is_one_line():
    with pytest.raises(SpecError, match="unknown reduce_scatter 'ring'; choose one of native, exact, loops, padded"):
        check_reduce_scatter("ring")


# --- the runtime's collectives ----------------------------------------------------------------

MUON = TrainSpec(optimizer="muon", steps=4, global_batch=12, seq_len=16, bucket_size=16384,
                 matrix_config={"ns_dtype": "fp32"})
SOAP = replace(MUON, optimizer="soap", matrix_config={"precondition_frequency": 2}, accumulation=2,
               global_batch=24, clip_norm=0.5)


def segments_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from canzona.runtime.comm import Comm
    from tests.runtime.allocations import Allocations

    out = {}
    for c, cuts in enumerate(CUTS[world]):
        for impl in IMPLS:
            comm = Comm(None, COLLECTIVE_TIMEOUT_S, reduce_scatter=impl)
            flat = torch.randn(cuts[-1], generator=torch.Generator().manual_seed(rank))
            before = flat.clone()
            with Allocations() as seen:
                comm.reduce_scatter_v(flat, cuts, "t").wait()
            out[c, impl] = {"before": before, "after": flat, "log": comm.log.to_dicts(), "allocated": seen.bytes,
                            "held": comm.peak_in_flight_bytes}
        lengths = lengths_of(cuts)
        if len(set(lengths)) == 1:  # the backend's collective into a receive buffer of its own: the reference
            got = torch.empty(lengths[rank])
            dist.reduce_scatter_single(got, out[c, "native"]["before"].clone())
            out[c, "out of place"] = got.div_(world)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(CUTS))
def test_each_owner_gets_the_mean_and_the_rest_is_left_as_it_was(world):
    ranks = run_ranks(segments_worker, world, deadline_s=DEADLINE_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    for c, cuts in enumerate(CUTS[world]):
        routes = {bucket_route(impl, lengths_of(cuts)) for impl in IMPLS}
        for impl in IMPLS:
            mean = torch.stack([r[c, impl]["before"] for r in ranks]).mean(0)
            for rank, r in enumerate(ranks):
                a, b = cuts[rank], cuts[rank + 1]
                torch.testing.assert_close(r[c, impl]["after"][a:b], mean[a:b], rtol=1e-6, atol=1e-7)
                rest = torch.ones_like(mean, dtype=torch.bool)
                rest[a:b] = False
                assert torch.equal(r[c, impl]["after"][rest], r[c, impl]["before"][rest]), (cuts, impl, rank)
                # every byte it allocated is one the model counts (gloo: the loops' scratch copy) and the runtime holds
                model = 4 * temporary_elements(impl, lengths_of(cuts), rank, scratch=True)
                assert r[c, impl]["allocated"] == model == r[c, impl]["held"], (cuts, impl, rank)
            assert all(r[c, impl]["log"] == r[c, "exact"]["log"] for r in ranks)
        if len(set(lengths_of(cuts))) == 1:  # gloo reduce-scatters a clone: in place is the same, bit for bit
            for rank, r in enumerate(ranks):
                assert torch.equal(r[c, "native"]["after"][cuts[rank]:cuts[rank + 1]], r[c, "out of place"])
        assert len(routes) >= 2, cuts  # each case runs the exact form and at least one other route


BASELINES = ("zero1-gather", "layerwise", "sc")  # their reduce-scatters (and all-reduce forms) too


@functools.cache
def trained(dp: int, impls: tuple[str, ...] = IMPLS, baselines: bool = False) -> dict[tuple[str, str], list[dict]]:
    jobs = [(spec.optimizer, impl, replace(spec, reduce_scatter=impl)) for spec in (MUON, SOAP) for impl in impls]
    if baselines:  # at DP 2 every form is bit for bit the exact form, which test_runtime_equivalence covers
        jobs += [(policy, "native", replace(MUON, policy=policy, reduce_scatter="native")) for policy in BASELINES]
    results = run_ranks(many_specs_worker, dp, [s for _, _, s in jobs], [{"state_dict": False} for _ in jobs],
                        deadline_s=DEADLINE_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    return {(opt, impl): [results[r][i] for r in range(dp)] for i, (opt, impl, _) in enumerate(jobs)}


def trained_at_dp_3(impl: str) -> dict[tuple[str, str], list[dict]]:
    """The default runs in the same spawn as the exact form and the baselines; the others apart."""
    return trained(3, ("exact", impl), baselines=impl == "native")


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["native", pytest.param("loops", marks=pytest.mark.slow),
                                  pytest.param("padded", marks=pytest.mark.slow)])
def test_at_dp_2_every_form_ends_bit_for_bit_where_exact_does(impl):
    runs = trained(2, ("exact", impl))
    for opt in ("muon", "soap"):
        for exact, other in zip(runs[(opt, "exact")], runs[(opt, impl)]):
            assert compare(other["params"], exact["params"])["bit_identical"], (opt, impl)
            assert other["log"] == exact["log"]


@pytest.mark.distributed
def test_under_tp_the_dp_subgroups_reduce_to_their_own_owners():
    """DP 2 x TP 2 (4 ranks): each DP group is a subgroup, whose owners the reduces name by their
    global rank; bit for bit with the exact form at DP 2, every step's records the same."""
    specs = [replace(MUON, tp=2, reduce_scatter=impl) for impl in ("exact", "native")]
    results = run_ranks(many_specs_worker, 4, specs, [{"state_dict": False}] * len(specs), deadline_s=DEADLINE_S,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    for rank in results:
        exact, *others = rank
        for other in others:
            assert compare(other["params"], exact["params"])["bit_identical"]
            assert other["log"] == exact["log"] and other["tp_log"] == exact["tp_log"]


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["native", pytest.param("loops", marks=pytest.mark.slow),
                                  pytest.param("padded", marks=pytest.mark.slow)])
def test_at_dp_3_ranks_agree_within_rounding_of_the_single_process_run(impl):
    runs = trained_at_dp_3(impl)
    for opt, spec in (("muon", MUON), ("soap", SOAP)):
        fast, exact = runs[(opt, impl)], runs[(opt, "exact")]
        first = fast[0]["params"]
        for r in fast[1:]:
            assert compare(r["params"], first)["bit_identical"]  # owners compute, everyone receives
        assert [r["log"] for r in fast] == [r["log"] for r in exact]
        if spec.clip_norm is not None:
            assert all(len(r["norms"]) == spec.steps for r in fast)
        if opt == "muon":  # SOAP's eigenbases amplify rounding; its agreement and records are checked
            assert compare(first, emulate(spec, 3))["max_rel_diff"] < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("policy", BASELINES)
def test_the_baseline_policies_run_on_the_native_reductions_too(policy):
    runs = trained_at_dp_3("native")[(policy, "native")]
    for r in runs[1:]:
        assert compare(r["params"], runs[0]["params"])["bit_identical"]
    assert compare(runs[0]["params"], emulate(MUON, 3))["max_rel_diff"] < 1e-5
