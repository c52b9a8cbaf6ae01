"""Cluster layout: nodes of GPUs, Megatron rank order (TP fastest, then CP), TP groups inside nodes."""

from __future__ import annotations

from dataclasses import dataclass

from canzona.errors import SpecError


@dataclass(frozen=True)
class GroupGeometry:
    """How a process group sits on the cluster, which decides its links."""

    size: int
    nodes: int
    per_node: int  # members on each node it touches

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


MAX_GPUS = 16384  # a few seconds per simulated iteration (docs/design.md §9.8)


def dp_size(gpus: int, tp: int, pp: int, ep: int = 1) -> int:
    """The ranks of one DP group (`Cluster.dp`): what `gpus` leave after TP (ETP in expert order),
    EP and PP; under CP, the DP x CP ranks the gradients are reduced over."""
    return gpus // (tp * ep * pp)


@dataclass(frozen=True)
class Cluster:
    """`gpus` = dp x ep x tp x pp, ranks ordered TP fastest, then EP, then DP, then the pipeline
    stage (PP outermost, Megatron's default order).

    `cp` > 1: context parallelism (Megatron's `--context-parallel-size`, its rank order
    "tp-cp-ep-dp-pp": CP right after TP). `dp` is then the data-parallel group of the gradients
    and the optimizer step, Megatron's "dp-cp" group of DP x CP ranks (the weights are replicated
    over CP: the distributed optimizer shards over that group); with CP right after TP, its
    members at one TP index are every `tp`-th rank of the stage, as a DP group's are without CP.
    `batch_dp` = dp / cp is the DP the batch is split over; a CP group is the `cp` consecutive
    members of a dp-cp group (`cp_group`), which share every micro-batch, seq / cp tokens each.

    `ep` > 1 is the expert order of the same GPUs (`sim.simulate.SimConfig.expert_cluster`,
    Megatron's MoE folding): `tp` is the expert TP size (ETP groups: `tp` consecutive ranks, inside
    a node), `ep` the EP size (EP groups: the ranks at one ETP position of `ep` consecutive ETP
    groups, which may span whole nodes: the token all-to-alls cross the NICs) and `dp` the EDP
    size (EDP groups: the ranks at one (EP, ETP) position)."""

    gpus: int
    tp: int
    gpus_per_node: int
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.pp < 1 or self.ep < 1 or self.cp < 1:
            raise SpecError(f"gpus, tp, pp, ep and cp must be >= 1, got gpus={self.gpus} tp={self.tp} pp={self.pp} "
                            f"ep={self.ep} cp={self.cp}")
        if self.cp > 1 and self.ep > 1:
            raise SpecError("context parallelism (cp > 1) with expert parallelism (ep > 1) is not modelled")
        if self.cp > 1 and self.gpus % (self.tp * self.cp * self.pp):
            raise SpecError(f"{self.gpus} GPUs are not divisible by tp x cp x pp = {self.tp} x {self.cp} x {self.pp}")
        if self.gpus > MAX_GPUS:
            raise SpecError(f"the simulator runs at most {MAX_GPUS} GPUs, got {self.gpus}")
        if self.gpus % self.tp:
            raise SpecError(f"{self.gpus} GPUs are not divisible by tp={self.tp}")
        if self.gpus % (self.tp * self.pp):
            raise SpecError(f"{self.gpus} GPUs are not divisible by tp x pp = {self.tp} x {self.pp}")
        if self.gpus % (self.ep * self.tp * self.pp):
            raise SpecError(f"{self.gpus} GPUs are not divisible by ep x etp x pp = {self.ep} x {self.tp} x {self.pp}")
        block = self.ep * self.tp  # an EP group's ETP groups: their all-to-alls' span
        if self.ep > 1 and self.gpus_per_node % block and block % self.gpus_per_node:
            what = f"ep={self.ep}" if self.tp == 1 else f"ep x etp = {self.ep} x {self.tp}"
            raise SpecError(f"{what} must divide the {self.gpus_per_node} GPUs of a node or be a multiple of them "
                            "(EP groups are parts of a node or whole nodes)")
        if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
            name = "etp" if self.ep > 1 else "tp"
            raise SpecError(f"{name}={self.tp} must divide the {self.gpus_per_node} GPUs of a node "
                            f"({name.upper()} groups stay inside a node)")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise SpecError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")

    @property
    def dp(self) -> int:
        return dp_size(self.gpus, self.tp, self.pp, self.ep)

    @property
    def batch_dp(self) -> int:
        """The data-parallel size the batch is split over: `dp` / `cp` (`dp` without CP)."""
        return self.dp // self.cp

    @property
    def stage_gpus(self) -> int:
        return self.dp * self.ep * self.tp

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def rank(self, dp_index: int, tp_index: int, stage: int = 0, ep_index: int = 0) -> int:
        return stage * self.stage_gpus + (dp_index * self.ep + ep_index) * self.tp + tp_index

    def dp_index(self, rank: int) -> int:
        """`rank`'s DP (EDP) index in its stage."""
        return (rank % self.stage_gpus) // (self.tp * self.ep)

    def stage_ranks(self, stage: int = 0) -> range:
        return range(stage * self.stage_gpus, (stage + 1) * self.stage_gpus)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def tp_group(self, dp_index: int, stage: int = 0, ep_index: int = 0) -> list[int]:
        return [self.rank(dp_index, t, stage, ep_index) for t in range(self.tp)]

    def dp_group(self, tp_index: int, stage: int = 0, ep_index: int = 0) -> list[int]:
        return [self.rank(i, tp_index, stage, ep_index) for i in range(self.dp)]

    def ep_group(self, dp_index: int, tp_index: int, stage: int = 0) -> list[int]:
        return [self.rank(dp_index, tp_index, stage, e) for e in range(self.ep)]

    def cp_group(self, batch_index: int = 0, tp_index: int = 0, stage: int = 0) -> list[int]:
        """The CP group of DP index `batch_index` (of `batch_dp`): `cp` consecutive members of a
        dp-cp group, the ring of the context-parallel attention."""
        return [self.rank(batch_index * self.cp + c, tp_index, stage) for c in range(self.cp)]

    def cp_groups(self, stage: int = 0) -> list[list[int]]:
        """Every CP group of the stage."""
        return [self.cp_group(i, t, stage) for i in range(self.batch_dp) for t in range(self.tp)]

    def cp_geometry(self) -> GroupGeometry:
        """A CP ring's slowest hop: its last rank sending to its first, which crosses nodes when
        the group does (two members, as `pp_geometry`'s point-to-point link)."""
        g = self.cp_group()
        return self.geometry([g[-1], g[0]])

    def tp_groups(self, stage: int = 0) -> list[list[int]]:
        """Every TP (ETP) group of the stage, in rank order."""
        return [self.tp_group(i, stage, e) for i in range(self.dp) for e in range(self.ep)]

    def dp_groups(self, stage: int = 0) -> list[list[int]]:
        """Every DP (EDP) group of the stage."""
        return [self.dp_group(t, stage, e) for e in range(self.ep) for t in range(self.tp)]

    def ep_groups(self, stage: int = 0) -> list[list[int]]:
        """Every EP group of the stage."""
        return [self.ep_group(i, t, stage) for i in range(self.dp) for t in range(self.tp)]

    def geometry(self, ranks: list[int]) -> GroupGeometry:
        nodes = {self.node_of(r) for r in ranks}
        return GroupGeometry(len(ranks), len(nodes), -(-len(ranks) // len(nodes)))

    def tp_geometry(self) -> GroupGeometry:
        return self.geometry(self.tp_group(0))

    def dp_geometry(self) -> GroupGeometry:
        return self.geometry(self.dp_group(0))

    def ep_geometry(self) -> GroupGeometry:
        return self.geometry(self.ep_group(0, 0))

    def pp_geometry(self) -> GroupGeometry:
        """Two neighbouring stages' ranks of the same (DP, TP) index: a point-to-point link."""
        return self.geometry([self.rank(0, 0, 0), self.rank(0, 0, min(1, self.pp - 1))])
