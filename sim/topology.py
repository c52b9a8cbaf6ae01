"""Cluster layout: nodes of GPUs, Megatron rank order (TP fastest), TP groups inside nodes."""

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


MAX_GPUS = 16384  # about 10 s per simulated iteration on one core, and memory to match


@dataclass(frozen=True)
class Cluster:
    """`gpus` = dp x tp x pp, ranks ordered TP fastest, then DP, then the pipeline stage (PP
    outermost, Megatron's default order)."""

    gpus: int
    tp: int
    gpus_per_node: int
    pp: int = 1
    # the expert order of the same GPUs (sim.simulate.SimConfig.expert_cluster): `tp` is the EP
    # size, whose groups may span whole nodes (the token all-to-alls cross the NICs)
    tp_spans_nodes: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.pp < 1:
            raise SpecError(f"gpus, tp and pp must be >= 1, got gpus={self.gpus} tp={self.tp} pp={self.pp}")
        if self.gpus > MAX_GPUS:
            raise SpecError(f"the simulator runs at most {MAX_GPUS} GPUs, got {self.gpus}")
        if self.gpus % self.tp:
            raise SpecError(f"{self.gpus} GPUs are not divisible by tp={self.tp}")
        if self.gpus % (self.tp * self.pp):
            raise SpecError(f"{self.gpus} GPUs are not divisible by tp x pp = {self.tp} x {self.pp}")
        if self.tp_spans_nodes:
            if self.gpus_per_node % self.tp and self.tp % self.gpus_per_node:
                raise SpecError(f"ep={self.tp} must divide the {self.gpus_per_node} GPUs of a node or be a multiple "
                                "of them (EP groups are parts of a node or whole nodes)")
        elif self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
            raise SpecError(f"tp={self.tp} must divide the {self.gpus_per_node} GPUs of a node "
                            "(TP groups stay inside a node)")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise SpecError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def stage_gpus(self) -> int:
        return self.dp * self.tp

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def rank(self, dp_index: int, tp_index: int, stage: int = 0) -> int:
        return stage * self.stage_gpus + dp_index * self.tp + tp_index

    def stage_ranks(self, stage: int = 0) -> range:
        return range(stage * self.stage_gpus, (stage + 1) * self.stage_gpus)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def tp_group(self, dp_index: int, stage: int = 0) -> list[int]:
        return [self.rank(dp_index, t, stage) for t in range(self.tp)]

    def dp_group(self, tp_index: int, stage: int = 0) -> list[int]:
        return [self.rank(i, tp_index, stage) for i in range(self.dp)]

    def geometry(self, ranks: list[int]) -> GroupGeometry:
        nodes = {self.node_of(r) for r in ranks}
        return GroupGeometry(len(ranks), len(nodes), -(-len(ranks) // len(nodes)))

    def tp_geometry(self) -> GroupGeometry:
        return self.geometry(self.tp_group(0))

    def dp_geometry(self) -> GroupGeometry:
        return self.geometry(self.dp_group(0))

    def pp_geometry(self) -> GroupGeometry:
        """Two neighbouring stages' ranks of the same (DP, TP) index: a point-to-point link."""
        return self.geometry([self.rank(0, 0, 0), self.rank(0, 0, min(1, self.pp - 1))])
