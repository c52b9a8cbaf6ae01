"""The runtime's mesh: one communicator (`Comm`) per named parallel axis.

Axes are named as in the plan file's `layout` (`canzona.plan.PLAN_AXES`): `dp` (data parallel:
gradients reduced over it, optimizer work partitioned across it) and `tp` (tensor parallel: each
rank holds shards, micro-groups gather them to hosts). Mixture-of-experts (`ep`) and FSDP2
(`fsdp`) axes come next (issues 20 and 21); each adds its name to `PLAN_AXES` and its groups here,
and the parts of the runtime that work on it ask `Mesh.comm(name)`, never a positional group.

The groups come from a `torch.distributed.DeviceMesh` with named dimensions (as torchtitan and
`init_device_mesh(..., mesh_dim_names=("dp", "tp"))` build it), or from process groups (the DP
group, and the TP group beside it), as Megatron's parallel state hands them out.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from canzona.errors import SpecError
from canzona.plan import PLAN_AXES
from canzona.runtime.comm import Comm

DP, TP = "dp", "tp"


class Mesh:
    """One `Comm` per axis of size > 1 (and always `dp`, which the step's checks travel on), their
    logs numbering collectives in one issue order (`CollectiveRecord.seq`)."""

    def __init__(self, comms: Mapping[str, Comm]) -> None:
        unknown = sorted(set(comms) - set(PLAN_AXES))
        if unknown or DP not in comms:
            raise SpecError(f"a mesh has the axes {', '.join(PLAN_AXES)} (dp always), got {sorted(comms)}")
        self._comms = dict(comms)
        clock = self._comms[DP].log.clock
        for comm in self._comms.values():  # one issue order over every log
            comm.log.clock = clock

    def comm(self, axis: str) -> Comm | None:
        """The communicator of `axis` (None: the axis has size 1 here: nothing to communicate)."""
        self._check(axis)
        return self._comms.get(axis)

    def size(self, axis: str) -> int:
        comm = self.comm(axis)
        return 1 if comm is None else comm.size

    def rank(self, axis: str) -> int:
        comm = self.comm(axis)
        return 0 if comm is None else comm.rank

    @property
    def layout(self) -> dict[str, int]:
        """Each axis's size, as the plan file's `layout` records it."""
        return {axis: self.size(axis) for axis in PLAN_AXES}

    def _check(self, axis: str) -> None:
        if axis not in PLAN_AXES:
            raise SpecError(f"unknown mesh axis {axis!r}; this canzona runs {', '.join(PLAN_AXES)}")


def build_mesh(groups: Mapping[str, dist.ProcessGroup | None], timeout_s: float, reduce_scatter: str) -> Mesh:
    """The mesh of each axis's process group (`axis_groups`; None for dp: the default group).
    No collective: the groups' sizes and ranks only."""
    comms = {DP: Comm(groups[DP], timeout_s, DP, reduce_scatter=reduce_scatter)}
    for axis, pg in groups.items():
        if axis != DP and pg is not None and dist.get_world_size(pg) > 1:
            comms[axis] = Comm(pg, timeout_s, axis)
    return Mesh(comms)


# id(a 'tp' mesh given alone) -> (the mesh, weakly; the group of this rank alone): the optimizer's
# routing and its constructor both ask, one group serves. By identity: DeviceMesh compares by ranks
# and names, and an equal mesh of a later process group must not get a destroyed group
_ALONE: dict[int, tuple[weakref.ref, dist.ProcessGroup]] = {}


def alone(tp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The data-parallel group of a job whose mesh is TP alone: this rank by itself, made by this
    rank alone (`use_local_synchronization`: `dist.new_group` is otherwise a collective over every
    rank of the job, which a pipeline stage built while the others train would wait for)."""
    key = id(tp_mesh)
    kept = _ALONE.get(key)
    if kept is None or kept[0]() is not tp_mesh:
        mesh_ref = weakref.ref(tp_mesh, lambda _: _ALONE.pop(key, None))
        kept = _ALONE[key] = (mesh_ref, dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return kept[1]


def axis_groups(group: dist.ProcessGroup | DeviceMesh | None,
                tp_group: dist.ProcessGroup | None) -> dict[str, dist.ProcessGroup | None]:
    """The process group of each axis: from a process group (plus `tp_group`), a 1-D mesh, or a
    mesh whose dimensions are named after axes (`dp`, and `tp` for tensor parallelism)."""
    if not isinstance(group, DeviceMesh):
        return {DP: group, TP: tp_group}
    names = group.mesh_dim_names or ()
    if tp_group is not None:
        raise SpecError("give the TP group either as the mesh's 'tp' dimension or as tp_group, not both")
    if group.ndim == 1:
        if names == (TP,):  # TP alone (torchtitan's PP x TP stage: its mesh has no 'dp'): DP of one rank
            return {DP: alone(group), TP: group.get_group()}
        return {DP: group.get_group(), TP: None}
    if DP not in names:
        if TP in names:  # torchtitan's stage of PP x FSDP x TP: its world mesh has the flattened 'dp'
            others = ", ".join(repr(n) for n in names if n != TP)
            raise SpecError(f"a {group.ndim}-D device mesh needs its data-parallel dimensions as one named 'dp' "
                            f"beside 'tp' (has {names}): flatten them on every rank at the start, as torchtitan "
                            f"does (mesh[{others}]._flatten('dp') of the world mesh), and give "
                            "group=mesh['dp', 'tp']")
        raise SpecError(f"a {group.ndim}-D device mesh needs a dimension named 'dp' (has {names})")
    other = [n for n in names if n not in PLAN_AXES]
    if other:
        raise SpecError(f"the device mesh has dimensions {names}; canzona runs over {', '.join(PLAN_AXES)} "
                        f"only (give it mesh[{', '.join(repr(a) for a in PLAN_AXES if a in names)}])")
    return {axis: group.get_group(axis) if axis in names else None for axis in PLAN_AXES}
