"""How a mixture-of-experts layer's tokens reach their experts' EP ranks and come back: Megatron's
token dispatchers (docs/design.md §2.7, §9.6).

Megatron's `--moe-token-dispatcher-type`:
- `alltoall` (`MoEAlltoAllTokenDispatcher`, and what canzona's reference EP model runs:
  `reference/tiny_moe_ep.py`, `torch.distributed.all_to_all_single`): every token-expert pair is
  sent, so a token routed to two experts of one rank crosses twice; priced by the hierarchical
  all-to-all model (`sim.collectives`). The default, as canzona's runtime's.
- `flex` with `--moe-flex-dispatcher-backend deepep` or `hybridep` (`MoEFlexTokenDispatcher`:
  DeepEP's normal kernels, or NVIDIA's HybridEP in DeepEP's `hybrid_ep` branch): a token crosses
  the network once to each node holding one of its experts and is forwarded over NVLink there, and
  reaches each destination rank once whatever its number of experts there.

With uniform routing (every token's `top_k` distinct experts drawn evenly from `experts`, laid
out in equal contiguous groups per rank and per node) the expected number of groups a token
reaches has a closed form (`expected_groups`).
Under NeMo AutoModel's FakeBalancedGate (`EpDispatcher.fake_balanced_gate`, its benchmark
recipes' `fake_balanced_gate: true`) each token goes to `top_k` consecutive experts instead, which
lie on one or two ranks (`fake_gate_groups`): at 128 experts, top-8 and EP 8 every token reaches
exactly one rank, where uniform routing reaches 5.3 of the 8.

Pricing of `flex`:
- inside one node (the EP group on one node's NVLink): each rank sends each token once to each
  other rank it is routed to, priced by the same hierarchical all-to-all model as `alltoall`, on
  the de-duplicated bytes (no measurement of DeepEP's or HybridEP's intranode kernels on H100 is
  published; DeepEP's on H800 reaches 153 GB/s of its ~160 GB/s NVLink: `docs/legacy.md`);
- across nodes, from the backend's published measurement on the profile's hardware where there is
  one (`MEASURED`): the measurement's own byte count, each token's hidden bytes once per distinct
  node it reaches, the rank's own node included (HybridEP's `count_rdma_send_from_routing_map`,
  `tests/utils.py`: "we do not set the local node map to zeros ... to align with DeepEP"), over
  the measured algorithm bandwidth, at the measured rank count nearest the EP size and the
  measured SM count nearest below the dispatcher's (the bandwidths have levelled off by 8 SMs);
- across nodes without a measurement: the cross-node copies (one per distinct remote node) on
  the NIC and the rest over NVLink, by the hierarchical all-to-all model (modelled, not measured).

While a flex kernel runs it holds its own SMs, taken from any compute beside it (the EP
all-to-all overlap of `sim.ep_overlap` runs it under another micro-batch's GEMMs): HybridEP's
`moe_hybridep_num_sms`, DeepEP's `moe_deepep_num_sms` (`EpDispatcher.sms`, `FlexTraffic.sms`), not
NCCL's channel count.

HybridEP's per-layer preprocessing (`hybridep_preprocess_cost`), on the forward's dispatch of each
expert layer and micro-batch only: the forward's first `dispatch_with_permute` has no handle, so it
all-gathers every rank's routing map (`torch.distributed.all_gather_into_tensor`, a bool of tokens x
experts per rank) over the EP group, runs the metadata-preprocessing kernel over the gathered map,
and (Megatron's `_HybridEPManager` passes no `num_permuted_tokens` without drop-and-pad) synchronises
the host with the stream to read the received-token count from pinned memory
(deepseek-ai/DeepEP hybrid-ep branch, `deep_ep/hybrid_ep_buffer.py` `dispatch_with_permute`,
`non_blocking` False; Megatron-LM `megatron/core/transformer/moe/fused_a2a.py`: "If not provided,
HybridEP obtains the size from a GPU tensor, which causes a D2H synchronization"). The combine and
the backward's dispatch reuse the handle (no exchange; the backward's receives the forward's count).
TE CUDA graphs (`cuda_graph_scope` moe_router, moe_preprocess) capture the router and the
dispatcher's `dispatch_preprocess` (Megatron's `MoECudaGraphPartialCaptureSignal` ends the capture
at "preprocess"), which for the flex dispatcher only reshapes the routing map: the all-gather, the
preprocessing kernel and the host sync run outside the graph, and are priced whether or not it is on.
Not modelled: DeepEP's own layout exchange (`get_dispatch_layout`, `notify_dispatch`) and its CPU wait.

What Megatron's `alltoall` dispatcher exchanges beside the tokens (`AlltoallMetadata`,
`alltoall_metadata_costs`; Megatron-LM `megatron/core/transformer/moe/token_dispatcher.py`,
`MoEAlltoAllTokenDispatcher`): its `preprocess`, before each forward dispatch, all-gathers every
rank's count of tokens per expert (`routing_map.sum(dim=0).long()`: the model's experts as int64)
over the expert TP x EP group (`gather_from_sequence_parallel_region(..., group=self.tp_ep_group)`)
and, without drop-and-pad, synchronises the host with the copy of the splits to it at
`before_ep_alltoall` (`_maybe_dtoh_and_synchronize`: `d2h_event.synchronize()`; the all-to-all
takes its split sizes on the host); `dispatch_all_to_all` then sends the routing probabilities of
every token-expert pair by a second all-to-all over the EP group beside the tokens' (`global_probs =
all_to_all(self.ep_group, permuted_probs, ...)`), which autograd sends back in the backward with the
tokens' gradient (the all-to-all's backward). Each is priced by the collective model; the
synchronisation as one launch (the least it costs, as HybridEP's: an assumption). The gather is
priced over the EP group (expert TP x EP under expert TP: an approximation) and with the dispatch on
the EP stream, where Megatron issues it among the router's kernels just before (the same chain).

HybridEP permutes the tokens itself (`hybridep_permute_s`): Megatron's `_HybridEPManager` always
dispatches by `dispatch_with_permute` and combines by `combine_with_unpermute` (Megatron-LM
`megatron/core/transformer/moe/fused_a2a.py`, `HybridEPDispatch` / `HybridEPCombine`, "fused dispatch
for permute + dispatch a2a + permute"), so its dispatcher's `dispatch_postprocess` and
`combine_preprocess` hand the tokens through unchanged: the permute to expert order and the
unpermute (with the sum of each token's local experts' outputs) run inside the dispatch and combine
ops, on the dispatcher's stream (the EP stream under the EP all-to-all overlap), not among the
experts' kernels (`sim.model_work` leaves them out of a HybridEP expert block). In DeepEP's
`hybrid_ep` executor (`csrc/hybrid_ep/executor/executor.cu`, `dispatch_postprocess`: "Use permute
kernel to avoid standalone D2D memory copy"; `combine_preprocess`: `unpermute_launcher`) the permute
kernel takes the place of the copy of the received tokens out of HybridEP's buffer, and the unpermute
that of the copy into it; `moe_permute_fusion_into_hybridep` (DeepEP's `fuse_permute_dispatch`)
folds them into the communication kernels themselves (priced alike: an assumption). The published
"Torch API" figures are taken to be the benchmark's `dispatch` / `combine` without permute
(`tests/test_hybrid_ep.py`, whose first timed figures they are: an assumption), copies included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from canzona.errors import SpecError
from canzona.hardware import HardwareProfile
from canzona.routing import BALANCED, RANDOM, Busiest, check_routing
from sim.collectives import FREE, CollectiveCost, all_to_all_cost, collective_cost
from sim.topology import Cluster

ALLTOALL = "alltoall"
FLEX = "flex"
DISPATCHERS = (ALLTOALL, FLEX)  # Megatron's --moe-token-dispatcher-type (allgather: not modelled)
DEEPEP = "deepep"
HYBRIDEP = "hybridep"
FLEX_BACKENDS = (DEEPEP, HYBRIDEP)  # Megatron's --moe-flex-dispatcher-backend
# Megatron's TransformerConfig.moe_hybridep_num_sms default ("In pure NVL scenarios, 16 SMs can
# generally achieve good bandwidth": megatron/core/transformer/transformer_config.py)
DEFAULT_HYBRIDEP_SMS = 16
# Megatron's TransformerConfig.moe_deepep_num_sms default, 20 (megatron/core/transformer/
# transformer_config.py: "Number of SMs to use for DeepEP"); NeMo AutoModel's DeepEP recipe sets
# the same (examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml, dispatcher_num_sms: 20)
DEEPEP_SMS = 20
# the alltoall dispatcher's per-pair routing probability (the router's softmax, float32: an
# assumption, its bytes are immaterial beside the call's latency) and per-expert token count
# (`routing_map.sum(dim=0).long()`, int64)
PROBS_BYTES = 4
COUNT_BYTES = 8


@dataclass(frozen=True, kw_only=True)
class EpDispatcher:
    """Megatron's token dispatcher options: `moe_token_dispatcher_type`, under `flex` its
    `moe_flex_dispatcher_backend` (required), HybridEP's `moe_hybridep_num_sms` and DeepEP's
    `moe_deepep_num_sms`."""

    moe_token_dispatcher_type: str = ALLTOALL
    moe_flex_dispatcher_backend: str | None = None
    moe_hybridep_num_sms: int = DEFAULT_HYBRIDEP_SMS
    # DeepEP's SMs (`deep_ep.Buffer.set_num_sms`): the SMs its kernels take from the GEMMs, and its
    # buffer's channels (two SMs each: `canzona.memory.deepep_buffer_bytes`)
    moe_deepep_num_sms: int = DEEPEP_SMS
    # NeMo AutoModel's BackendConfig.fake_balanced_gate (default False): its FakeBalancedGate in place
    # of the learned router, which sends each token to `top_k` consecutive experts (`fake_gate_groups`):
    # under a flex dispatcher a token then reaches fewer ranks and nodes than under uniform routing
    fake_balanced_gate: bool = False
    # how the router routes each token (`canzona.routing`): `random`, its top-k drawn afresh per token
    # (Megatron's moe_router_force_load_balancing, and at least as unevenly a learned router), each
    # layer then waiting for the EP group's busiest rank; `balanced`, every rank exactly its mean
    # (exact balance). The FakeBalancedGate's routing is deterministic: balanced whatever this says
    routing: str = RANDOM

    def check(self) -> None:
        if self.moe_token_dispatcher_type not in DISPATCHERS:
            raise SpecError(f"unknown --moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}; choose one of "
                            f"{', '.join(DISPATCHERS)}")
        backend = self.moe_flex_dispatcher_backend
        if backend is not None and backend not in FLEX_BACKENDS:
            raise SpecError(f"unknown --moe-flex-dispatcher-backend {backend!r}; choose one of {', '.join(FLEX_BACKENDS)}")
        if self.moe_token_dispatcher_type == FLEX and backend is None:
            raise SpecError(f"--moe-token-dispatcher-type flex needs --moe-flex-dispatcher-backend, one of "
                            f"{', '.join(FLEX_BACKENDS)}")
        if self.moe_token_dispatcher_type != FLEX and backend is not None:
            raise SpecError(f"--moe-flex-dispatcher-backend {backend} is for --moe-token-dispatcher-type flex")
        sms = self.moe_hybridep_num_sms
        # at most the GPU's SMs: `SimConfig.check`, which knows the hardware
        if not (isinstance(sms, int) and not isinstance(sms, bool) and sms >= 1):
            raise SpecError(f"--moe-hybridep-num-sms must be a whole number of SMs >= 1, got {sms!r}")
        if sms != DEFAULT_HYBRIDEP_SMS and backend != HYBRIDEP:
            raise SpecError(f"--moe-hybridep-num-sms {sms} is HybridEP's: it needs --moe-token-dispatcher-type flex "
                            f"--moe-flex-dispatcher-backend {HYBRIDEP}")
        sms = self.moe_deepep_num_sms
        if not (isinstance(sms, int) and not isinstance(sms, bool) and sms >= 2 and sms % 2 == 0):
            raise SpecError(f"--moe-deepep-num-sms must be an even number of SMs >= 2 (DeepEP runs two a "
                            f"channel), got {sms!r}")
        if sms != DEEPEP_SMS and backend != DEEPEP:
            raise SpecError(f"--moe-deepep-num-sms {sms} is DeepEP's: it needs --moe-token-dispatcher-type flex "
                            f"--moe-flex-dispatcher-backend {DEEPEP}")
        if not isinstance(self.fake_balanced_gate, bool):
            raise SpecError(f"fake_balanced_gate must be true or false, got {self.fake_balanced_gate!r}")
        check_routing(self.routing)
        if self.fake_balanced_gate and self.routing != RANDOM:  # `load_routing`: the gate's own, whatever this says
            raise SpecError(f"--routing {self.routing} changes nothing with --fake-balanced-gate: the FakeBalancedGate "
                            "routes every token deterministically, exactly balanced over the EP ranks")

    def at_ep(self, ep: int) -> EpDispatcher:
        """These settings as a layout at `ep` runs them: under EP all of them; at EP 1 the ones that act
        on the dispatch between EP ranks (`check_ep`: the dispatcher, its backend and SMs, the routing)
        at their defaults, which is the same run (every GPU computes every expert on its own tokens),
        and FakeBalancedGate's (no router GEMM at any EP) as set. The search applies one question's
        dispatcher to every layout it tries (sim.search.config_of): a layout at EP 1 runs this, so
        that `canzona simulate`, which refuses those settings at EP 1, reproduces it."""
        return self if ep > 1 else EpDispatcher(fake_balanced_gate=self.fake_balanced_gate)

    def check_ep(self, ep: int) -> None:
        """The settings that act on the token dispatch between EP ranks need some: at EP 1 every GPU
        computes every expert on its own tokens, so a non-default dispatcher (Megatron's flex
        dispatcher targets expert-parallel ranks) or routing (which balances the EP ranks' loads,
        as `--router-imbalance` skews them) would change nothing. A command's layout rule, not
        `SimConfig.check`'s: the search applies one dispatcher to every layout it tries, EP 1 ones
        too (sim.search.Question). One `SpecError` line each."""
        if ep > 1:
            return
        if self.moe_token_dispatcher_type != ALLTOALL:
            raise SpecError(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type} dispatches tokens to "
                            "expert-parallel ranks: it needs --ep > 1")
        if self.routing != RANDOM:
            raise SpecError(f"--routing {self.routing} balances the tokens over the EP ranks: it needs --ep > 1 (at "
                            "ep 1 every GPU computes every expert on its own tokens, as --router-imbalance needs it)")

    @property
    def flex(self) -> bool:
        return self.moe_token_dispatcher_type == FLEX

    @property
    def sms(self) -> int:
        """The SMs the flex backend's kernels run on (its option's; under alltoall, none is used)."""
        return self.moe_hybridep_num_sms if self.moe_flex_dispatcher_backend == HYBRIDEP else self.moe_deepep_num_sms

    @property
    def load_routing(self) -> str:
        """The routing the EP ranks' loads follow, in time and memory: AutoModel's FakeBalancedGate
        is deterministic and balanced (`canzona.routing`) whatever `routing` says."""
        return BALANCED if self.fake_balanced_gate else self.routing


def expected_groups(experts: int, groups: int, top_k: int) -> float:
    """Expected number of `groups` (equal contiguous groups of `experts`: ranks, nodes) that hold at
    least one of a token's `top_k` distinct experts, drawn uniformly: each group is missed with
    probability C(experts - experts / groups, top_k) / C(experts, top_k)."""
    _check_groups(experts, groups, top_k)
    return groups * group_hit(experts, groups, top_k)


def _check_groups(experts: int, groups: int, top_k: int) -> None:
    if groups < 1 or experts % groups or not 1 <= top_k <= experts:
        raise SpecError(f"{experts} experts in {groups} groups with top-{top_k} routing: groups must divide the "
                        "experts and top-k be 1..experts")


def group_hit(experts: int, groups: int, top_k: int) -> float:
    """The probability that one given group of `expected_groups`' holds at least one of a token's
    experts."""
    return 1.0 - math.comb(experts - experts // groups, top_k) / math.comb(experts, top_k)


def fake_gate_groups(experts: int, groups: int, top_k: int) -> float:
    """The mean number of `groups` (equal contiguous groups of `experts`) a token's experts fall in
    under NeMo AutoModel's FakeBalancedGate without noise (`fake_gate_noise` 0.0, its default): the
    rank's t-th token goes to experts `(t * top_k + j) mod experts`, j < top_k, at equal weights
    (NVIDIA-NeMo/Automodel nemo_automodel/components/moe/layers.py, FakeBalancedGate.forward:
    `torch.arange(n_tokens * a_exp).view(-1, a_exp) % available_experts`, `skip_first_n_experts` 0).
    The pattern repeats every `experts / gcd(experts, top_k)` tokens; the mean over one period (exact
    for a whole number of periods, every rank's micro-batch here). Every expert gets the same pairs:
    the gate is balanced by construction."""
    _check_groups(experts, groups, top_k)
    per = experts // groups
    period = experts // math.gcd(experts, top_k)
    return sum(len({(t * top_k + j) % experts // per for j in range(top_k)}) for t in range(period)) / period


@dataclass(frozen=True)
class FlexTraffic:
    """What a flex dispatch of one expert block moves: each of the rank's tokens (`token_bytes`
    in all) to the experts of its top-k of `experts`; `imbalance`: the router's persistent skew,
    the busiest rank's mean share over the mean (`canzona.experts.router_imbalance`); `busiest`:
    the busiest rank's expected pairs and distinct tokens over the mean under the run's routing,
    skew and random fluctuation together (`canzona.routing.busiest_rank`; None: the skew alone).
    A measured cross-node price takes the skew alone: the benchmark it comes from routes each token
    at random itself (DeepEP's tests/test_internode.py: top-k of `torch.randn(...).abs() + 1` per
    token; HybridEP's "random uniform routing"), so its time holds the fluctuation already."""

    backend: str
    sms: int
    token_bytes: float
    experts: int
    top_k: int
    imbalance: float = 1.0
    tokens: float = 0.0  # the rank's tokens: rows of the routing map HybridEP gathers, and of its permute
    forward: bool = False  # the forward's dispatch, which runs HybridEP's preprocessing (module docstring)
    # the run's router is AutoModel's FakeBalancedGate (`EpDispatcher.fake_balanced_gate`): each token
    # reaches `fake_gate_groups` ranks and nodes, not uniform routing's `expected_groups`
    fake_balanced_gate: bool = False
    busiest: Busiest | None = None

    @property
    def pair_factor(self) -> float:
        """The busiest rank's token-expert pairs over the mean."""
        return self.imbalance if self.busiest is None else self.busiest.pairs

    @property
    def token_factor(self) -> float:
        """The busiest rank's distinct tokens received over the mean."""
        return self.imbalance if self.busiest is None else self.busiest.tokens

    def reached(self, groups: int) -> float:
        """The mean number of `groups` (ranks, nodes) of the EP group a token reaches."""
        count = fake_gate_groups if self.fake_balanced_gate else expected_groups
        return count(self.experts, groups, self.top_k)

    def hit(self, groups: int) -> float:
        """The share of a token's copies a given one of `groups` receives, averaged over the senders:
        uniform routing's `group_hit`; under the fake gate, whose pattern does not depend on the
        sending rank, `reached / groups` too (over the ranks, each sender's own group is hit as
        often as the mean group)."""
        if not self.fake_balanced_gate:
            return group_hit(self.experts, groups, self.top_k)
        return self.reached(groups) / groups


@dataclass(frozen=True, kw_only=True)
class AlltoallMetadata:
    """What Megatron's `alltoall` dispatcher exchanges beside one expert block's tokens (the module
    docstring): the count all-gather and host synchronisation before the forward's dispatch
    (`forward`), and the probabilities' all-to-all beside the forward's dispatch and the backward's
    dispatch gradient: `probs_sent` bytes from each rank, `probs_received` into the busiest."""

    experts: int  # the model's experts: the int64 counts each rank contributes to the gather
    probs_sent: float
    probs_received: float
    forward: bool


@dataclass(frozen=True)
class Measured:
    """One published dispatch / combine measurement: algorithm bandwidths in bytes/s, each token's
    hidden bytes counted once per distinct node it reaches (own node included)."""

    ranks: int
    sms: int
    dispatch: float
    combine: float


# HybridEP on H100 (two or more 8-GPU nodes), 4096 tokens a rank, hidden 7168, top-8, 8 local
# experts a rank, random uniform routing; "Torch API" BF16 dispatch and combine, "IB bandwidth"
# (algorithm bandwidth). deepseek-ai/DeepEP, docs/README_Hybrid-EP.md, "H100 Platform" table
# (https://github.com/deepseek-ai/DeepEP/blob/hybrid-ep/docs/README_Hybrid-EP.md); the byte count:
# tests/test_hybrid_ep.py with tests/utils.py count_rdma_send_from_routing_map.
_HYBRIDEP_H100 = tuple(Measured(r, s, d * 1e9, c * 1e9) for r, s, d, c in (
    (16, 4, 37.08, 42.47), (16, 8, 57.74, 56.96), (16, 16, 54.47, 53.35),
    (32, 4, 44.88, 43.60), (32, 8, 46.54, 50.68), (32, 16, 47.36, 52.53),
    (64, 4, 40.63, 41.00), (64, 8, 41.46, 47.68), (64, 16, 41.24, 46.57),
))
# DeepEP V1 normal kernels on H800 with one CX7 InfiniBand 400 Gb/s NIC a GPU (the NIC of a DGX
# H100: the internode kernels are RDMA-bound, so the figures stand for H100 too, an assumption),
# 4096 tokens, hidden 7168, top-8 (DeepSeek-V3's node-limited routing), FP8 dispatch and BF16
# combine, "bottleneck bandwidth" (RDMA), with the README's 24 SMs (`Buffer.set_num_sms(24)`):
# deepseek-ai/DeepEP docs/legacy.md (https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md),
# "Normal kernels with NVLink and RDMA forwarding"; the byte count counts the own node's share
# (deepseek-ai/DeepEP issue #285). The BF16 dispatch is priced at the BF16 combine's rate.
_DEEPEP_CX7 = tuple(Measured(r, 24, c * 1e9, c * 1e9) for r, c in ((16, 43.0), (32, 57.0), (64, 50.0)))

# DeepEP V1 normal kernels on two nodes of H200 with CX7 InfiniBand 400 Gb/s, test_internode.py's
# defaults (4096 tokens, hidden 7168, top-8), 24 SMs, the best tuned BF16 dispatch and combine
# (RDMA): a user's report, deepseek-ai/DeepEP issue #493 ("Unexpectedly low bandwidth when scaling
# from 2 nodes to 4 nodes", https://github.com/deepseek-ai/DeepEP/issues/493); the 4-node figures
# there (12.3 / 12.5 GB/s) are the unexplained fault, not kept.
_DEEPEP_H200 = (Measured(16, 24, 40.89e9, 44.37e9),)

# (backend, hardware profile) -> its measurements
MEASURED: dict[tuple[str, str], tuple[Measured, ...]] = {
    (HYBRIDEP, "h100-sxm"): _HYBRIDEP_H100,
    (DEEPEP, "h100-sxm"): _DEEPEP_CX7,
    (DEEPEP, "h200"): _DEEPEP_H200,
}


def measurement(backend: str, hardware: str, ranks: int, sms: int) -> Measured | None:
    """The published measurement that stands for `ranks` EP ranks on `sms` SMs: the measured rank
    count nearest `ranks` (in ratio), then the largest measured SM count at most `sms` (the
    smallest when `sms` is below every one); None: nothing published for this backend and hardware."""
    table = MEASURED.get((backend, hardware))
    if not table:
        return None
    nearest = min({m.ranks for m in table}, key=lambda r: (abs(math.log(r / ranks)), r))
    rows = sorted((m for m in table if m.ranks == nearest), key=lambda m: m.sms)
    below = [m for m in rows if m.sms <= sms]
    return below[-1] if below else rows[0]


def alltoall_cost(sent: float, received: float, experts: Cluster, hw: HardwareProfile) -> CollectiveCost:
    """An EP group's token dispatch (or combine) all-to-all: every member sends `sent` bytes to the
    others and the busiest receives `received` (the combine returns the same bytes the other way:
    its busiest sender sends `received`, which takes as long); `experts`: the GPUs in expert order."""
    ep = experts.ep
    return all_to_all_cost([sent] * ep, [received] + [sent] * (ep - 1), experts.ep_geometry(), hw)


def hybridep_preprocess_cost(t: FlexTraffic, experts: Cluster, hw: HardwareProfile) -> CollectiveCost:
    """HybridEP's preprocessing before the forward's dispatch (the module docstring): the EP group's
    all-gather of the routing map (one byte per token and expert, `torch.bool`), priced by the
    collective model; the metadata-preprocessing kernel, one pass over the gathered map at the
    achievable HBM rate plus its launch; the host's stream synchronisation, priced as one more
    launch (the GPU idles while the host resumes issuing: an assumption, the least it costs).
    FREE for DeepEP, the backward's dispatch, or one rank."""
    if t.backend != HYBRIDEP or not t.forward or experts.ep <= 1 or t.tokens <= 0:
        return FREE
    gathered = t.tokens * t.experts * experts.ep  # bytes of the gathered map
    gather = collective_cost("all-gather", gathered, experts.ep_geometry(), hw)
    scan = gathered / hw.gpu.hbm_achievable_bytes_per_s + hw.gpu.launch_s
    sync = hw.gpu.launch_s
    return CollectiveCost(gather.latency_s + sync, gather.transfer_s, gather.link, gather.algorithm,
                          gather.local_s + scan)


def _then(first: CollectiveCost, cost: CollectiveCost) -> CollectiveCost:
    """`first` and then `cost` in one kernel sequence on the same stream, labelled as `cost`."""
    if first == FREE:
        return cost
    return CollectiveCost(first.latency_s + cost.latency_s, first.transfer_s + cost.transfer_s, cost.link,
                          cost.algorithm, first.local_s + cost.local_s)


def flex_costs(t: FlexTraffic, experts: Cluster, hw: HardwareProfile) -> tuple[CollectiveCost, CollectiveCost]:
    """The dispatch's (after HybridEP's preprocessing on the forward's) and the combine's cost of a
    flex dispatcher, HybridEP's with its permute and unpermute (the module docstring)."""
    dispatch, combine = _flex_transfer(t, experts, hw)
    permute = hybridep_permute_s(t, experts, hw)
    if permute:
        dispatch, combine = _plus_local(dispatch, permute), _plus_local(combine, permute)
    return _then(hybridep_preprocess_cost(t, experts, hw), dispatch), combine


def _plus_local(cost: CollectiveCost, seconds: float) -> CollectiveCost:
    """`cost` with `seconds` more of local (on-GPU, unhidden) work in its kernel sequence."""
    return CollectiveCost(cost.latency_s, cost.transfer_s, cost.link, cost.algorithm, cost.local_s + seconds)


def _measured(t: FlexTraffic, experts: Cluster, hw: HardwareProfile) -> Measured | None:
    """The published measurement a cross-node flex transfer is priced at (None: inside one node,
    or nothing published for the backend on this hardware)."""
    if experts.ep <= 1 or not experts.ep_geometry().crosses_nodes:
        return None
    return measurement(t.backend, hw.name, experts.ep, t.sms)


def hybridep_permute_s(t: FlexTraffic, experts: Cluster, hw: HardwareProfile) -> float:
    """Seconds HybridEP's permute adds to each of its dispatches (its unpermute to each combine),
    beyond the transfer's price (the module docstring): the busiest rank receives `R` distinct tokens
    (each token of its EP group that reaches one of its experts) and `P` token-expert pairs; the
    permute reads the `R` and writes the `P` in expert order (the unpermute reads the `P` and writes
    the `R` sums), one pass at the achievable HBM rate. A measured cross-node price already holds the
    benchmark's copy of the `R` tokens out of HybridEP's buffer (read and write `R`), which the
    permute replaces: it adds only the `P - R` rows more it moves; inside a node (the all-to-all model,
    no copy) it adds its whole pass and a launch. 0 for DeepEP (Megatron permutes its tokens on the
    compute stream), one rank, or a block that does not say its tokens."""
    if t.backend != HYBRIDEP or experts.ep <= 1 or t.tokens <= 0 or t.token_bytes <= 0:
        return 0.0
    ep = experts.ep
    per_token = t.token_bytes / t.tokens
    pairs = t.tokens * t.top_k * t.pair_factor
    received = ep * t.tokens * t.hit(ep) * t.token_factor
    if _measured(t, experts, hw) is not None:
        return max(pairs - received, 0.0) * per_token / hw.gpu.hbm_achievable_bytes_per_s
    return (pairs + received) * per_token / hw.gpu.hbm_achievable_bytes_per_s + hw.gpu.launch_s


def _flex_transfer(t: FlexTraffic, experts: Cluster, hw: HardwareProfile) -> tuple[CollectiveCost, CollectiveCost]:
    """The dispatch's and the combine's token transfer of a flex dispatcher."""
    ep, geo = experts.ep, experts.ep_geometry()
    if ep <= 1 or t.token_bytes <= 0:
        return FREE, FREE
    # each token once to each other rank holding one of its experts
    other_ranks = (ep - 1) * t.hit(ep)
    if not geo.crosses_nodes:
        cost = alltoall_cost(t.token_bytes * other_ranks, t.token_bytes * other_ranks * t.token_factor, experts, hw)
        return cost, cost
    nodes = geo.nodes
    m = _measured(t, experts, hw)
    if m is not None:
        logical = t.token_bytes * t.reached(nodes) * t.imbalance  # the skew alone (the class docstring)
        label = f"{t.backend} (measured)"
        return (CollectiveCost(0.0, logical / m.dispatch, "network", label),
                CollectiveCost(0.0, logical / m.combine, "network", label))
    # one copy per distinct remote node on the NICs, the rest over NVLink (modelled, not measured)
    # the busiest rank's distinct tokens' factor on its node's too (a node's fluctuation is smaller:
    # slightly conservative)
    remote = t.token_bytes * (nodes - 1) * t.hit(nodes) * t.token_factor
    total = t.token_bytes * other_ranks * t.token_factor
    cost = all_to_all_cost([total], [total], geo, hw, [remote], [remote])
    return cost, cost


def dispatcher_sms(flex: FlexTraffic | None) -> int | None:
    """SMs the dispatch / combine kernel of a block holds: the flex backend's own (`FlexTraffic.sms`);
    None for the all-to-all, whose NCCL kernel holds NCCL's (`sim.comm_sms.nccl_sms`)."""
    return None if flex is None else flex.sms


def alltoall_metadata_costs(meta: AlltoallMetadata, experts: Cluster,
                            hw: HardwareProfile) -> tuple[CollectiveCost, CollectiveCost]:
    """The `alltoall` dispatcher's exchanges beside the tokens (the module docstring): what runs
    before the forward's token all-to-all (the count all-gather and the host synchronisation; FREE
    in the backward) and the probabilities' all-to-all. FREE, FREE on one rank."""
    if experts.ep <= 1:
        return FREE, FREE
    probs = alltoall_cost(meta.probs_sent, meta.probs_received, experts, hw)
    if not meta.forward:
        return FREE, probs
    gather = collective_cost("all-gather", meta.experts * COUNT_BYTES * experts.ep, experts.ep_geometry(), hw)
    before = CollectiveCost(gather.latency_s + hw.gpu.launch_s, gather.transfer_s, gather.link, gather.algorithm,
                            gather.local_s)
    return before, probs


def ep_costs(sent: float, received: float, flex: FlexTraffic | None, experts: Cluster,
             hw: HardwareProfile, meta: AlltoallMetadata | None = None) -> tuple[CollectiveCost, CollectiveCost]:
    """An expert block's dispatch and combine (`sim.model_work.Block`: `ep_bytes`, `ep_received`,
    `ep_flex`, `ep_meta`): the flex dispatcher's when it runs one, else the all-to-all of every
    pair, with the `alltoall` dispatcher's `meta` exchanges (the module docstring): the forward's
    dispatch after the count all-gather and host synchronisation and beside the probabilities'
    all-to-all; in the backward (whose combine gradient runs as a dispatch, its dispatch gradient as
    a combine: `sim.ep_overlap._expert_comm`) the probabilities' gradient beside the dispatch
    gradient, the second of the pair."""
    if flex is not None:
        return flex_costs(flex, experts, hw)
    cost = alltoall_cost(sent, received, experts, hw)
    if meta is None:
        return cost, cost
    before, probs = alltoall_metadata_costs(meta, experts, hw)
    if meta.forward:
        return _then(before, _then(probs, cost)), cost
    return cost, _then(probs, cost)
