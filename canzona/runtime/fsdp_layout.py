"""Where each rank's piece of each parameter lies in a model sharded by torch's FSDP2
(`fully_shard`), alone, as HSDP (a replicate x shard mesh) or composed with TP on a 2-D mesh as
torchtitan composes them (docs/design.md §2.8).

Every parameter is a DTensor on one device mesh. A mesh dimension on which every parameter is
`Replicate()` is a *replica* dimension (HSDP's replicate axis): the ranks along it hold the same
pieces and reach the same gradients (FSDP2 all-reduces them), so each replica's ranks run the step
alike, on their own. The other dimensions form the *exchange group*: the ranks among which each
matrix's pieces tile it. Each rank's piece is a box of the global tensor (its offset and shape, as
DTensor computes them: `torch.chunk`'s blocks, possibly empty; under FSDP x TP a TP shard's row
block). A box that several ranks of the exchange group hold alike (a parameter replicated over
TP) is sent by the lowest of them and its update received by all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from canzona.errors import SpecError

EXHAUSTIVE_OVERLAP_CHECK = 64  # boxes per parameter up to which the tiling is checked pairwise


@dataclass(frozen=True, kw_only=True)
class Box:
    """One rank's piece of a parameter: the global offset of its first element and its shape."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def index(self) -> tuple[slice, ...]:
        """The box as an index of the global tensor."""
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape))

    def overlaps(self, other: Box) -> bool:
        return self.numel > 0 and other.numel > 0 and all(
            a < b + m and b < a + n for a, n, b, m in zip(self.start, self.shape, other.start, other.shape))


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """One parameter over the exchange group: every member's box, who sends each distinct one."""

    name: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]  # by member of the exchange group
    sources: tuple[bool, ...]  # member r sends its box (the lowest member holding that box)

    def source_of(self, member: int) -> int:
        """The member that sends `member`'s box."""
        return self.boxes.index(self.boxes[member])


def local_box(p: Tensor) -> Box:
    """This rank's box of a DTensor parameter (DTensor's own offset rule, `_StridedShard` too)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
    return Box(start=tuple(int(x) for x in offset), shape=tuple(int(x) for x in shape))


def root_mesh(params: Mapping[str, Tensor]):
    """The mesh every parameter lives on or on a named part of (FSDP x TP: the 2-D mesh of the TP
    weights; the norms live on its `dp` part alone). One SpecError otherwise."""
    meshes = []
    for p in params.values():
        if p.device_mesh not in meshes:
            meshes.append(p.device_mesh)
    # of meshes over as many ranks, the one of most dimensions (FSDP2 with EP: the experts' (efsdp,
    # ep) mesh, the dense part on its ranks flattened)
    root = max(meshes, key=lambda m: (m.mesh.numel(), m.ndim))
    for name, p in params.items():
        mesh = p.device_mesh
        if mesh == root or flattened(mesh, root):
            continue
        names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
        if not names or not set(names) <= set(root_names) or not _inside(mesh, root):
            raise SpecError(f"parameter {name!r} lives on mesh {mesh}, others on {root}: shard every module "
                            "over one device mesh, or named parts of it (torchtitan's mesh['dp'] beside "
                            "mesh['dp', 'tp'])")
    return root


def flattened(mesh, root) -> bool:
    """`mesh` is `root`'s ranks in `root`'s order along one dimension (torchtitan's dp mesh beside
    the experts' (efsdp, ep) mesh): a placement on it spans every dimension of `root`."""
    return mesh.ndim == 1 and root.ndim > 1 and mesh.mesh.tolist() == root.mesh.flatten().tolist()


def _inside(mesh, root) -> bool:
    """`mesh` is this rank's slice of `root` along its named dimensions."""
    try:
        return root[tuple(mesh.mesh_dim_names)].mesh.tolist() == mesh.mesh.tolist() if mesh.ndim > 1 else \
            root[mesh.mesh_dim_names[0]].mesh.tolist() == mesh.mesh.tolist()
    except (KeyError, RuntimeError, ValueError):
        return False


def placement_on(p: Tensor, root, d: int):
    """`p`'s placement on dimension `d` of the root mesh (a dimension its own mesh lacks: Replicate)."""
    from torch.distributed.tensor import Replicate

    if p.device_mesh == root:
        return p.placements[d]
    if flattened(p.device_mesh, root):  # over every dimension: replicated on each, or on none
        return p.placements[0]
    names = p.device_mesh.mesh_dim_names
    want = root.mesh_dim_names[d]
    return p.placements[names.index(want)] if want in names else Replicate()


def replica_dims(params: Mapping[str, Tensor], root) -> tuple[int, ...]:
    """The root mesh's dimensions on which every parameter is replicated (HSDP's replicate axis)."""
    from torch.distributed.tensor import Replicate

    return tuple(d for d in range(root.ndim)
                 if all(isinstance(placement_on(p, root, d), Replicate) for p in params.values()))


def exchange_ranks(mesh, replicas: tuple[int, ...]) -> list[list[int]]:
    """Every exchange group of `mesh` (global ranks, in mesh order): one per coordinate on the
    replica dimensions, over all the other dimensions."""
    grid = mesh.mesh
    keep = [d for d in range(grid.dim()) if d not in replicas]
    moved = grid.permute(*replicas, *keep).reshape(math.prod(grid.shape[d] for d in replicas) if replicas else 1, -1)
    return [[int(r) for r in row] for row in moved]


def new_groups(rank_lists: list[list[int]], me: int, mesh=None) -> tuple[dist.ProcessGroup | None, list[int]]:
    """The process group of the list holding `me`: None when it is the whole world; else a group
    the mesh already has with exactly these ranks in this order (`mesh_group`: one of its
    dimensions, or a flattening of its dimensions that `DeviceMesh._flatten` made on every rank, as
    torchtitan makes its `dp`); else a new one over these ranks alone. Plain `dist.new_group` is a
    collective over every rank of the job, so a pipeline stage whose optimizer is built while the
    other stages do anything else (or build theirs over other ranks) would wait for them, or pair
    with their group: `use_local_synchronization` makes only the members take part (each builds its
    own list only). torch names such a group by its ranks and the number of groups this rank has,
    so its members must have made as many groups before: they have, running the same code."""
    mine = next(r for r in rank_lists if me in r)
    if len(rank_lists) == 1 and sorted(mine) == list(range(dist.get_world_size())) and \
            mine == sorted(mine):
        return None, mine
    own = mesh_group(mesh, mine) if mesh is not None else None
    if own is not None:
        return own, mine
    return dist.new_group(mine, use_local_synchronization=True, sort_ranks=False), mine


def mesh_group(mesh, ranks: list[int]) -> dist.ProcessGroup | None:
    """`mesh`'s group along the dimension, or its root mesh's flattened dimension, whose ranks
    through this one are `ranks`, in order; None where none's are. Only groups that exist already:
    `DeviceMesh._flatten` would create one on every rank of the job at once."""
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        if dist.get_process_group_ranks(group) == ranks:
            return group
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for flat in getattr(root, "_flatten_mapping", {}).values():
        group = flat.get_group(0)
        if dist.get_process_group_ranks(group) == ranks:
            return group
    return None


def param_layout(name: str, shape: tuple[int, ...], boxes: list[Box]) -> ParamLayout:
    """The layout of a parameter from every member's box; one SpecError when the distinct boxes
    do not tile it exactly (a sharding this step cannot reassemble)."""
    distinct: list[Box] = []
    for b in boxes:
        if b not in distinct:
            distinct.append(b)
    for b in distinct:
        if len(b.shape) != len(shape) or any(a < 0 or a + n > s for a, n, s in zip(b.start, b.shape, shape)):
            raise SpecError(f"{name}: a rank's piece {b} lies outside its global shape {shape}")
    nonempty = [b for b in distinct if b.numel]
    if sum(b.numel for b in nonempty) != math.prod(shape) or (
            len(nonempty) <= EXHAUSTIVE_OVERLAP_CHECK and
            any(a.overlaps(b) for i, a in enumerate(nonempty) for b in nonempty[i + 1:])):
        raise SpecError(f"{name}: the ranks' pieces do not tile its {shape} exactly (pieces: "
                        f"{[(b.start, b.shape) for b in distinct][:6]}): shard it with fully_shard "
                        "(and parallelize_module) as torch lays DTensors out")
    sources = tuple(boxes.index(b) == r for r, b in enumerate(boxes))
    return ParamLayout(name=name, shape=shape, boxes=tuple(boxes), sources=sources)
