"""`canzona.runtime.mesh.axis_groups`: what each device mesh given as `group=` means, in one
process (a one-rank gloo group): a 1-D mesh named 'tp' is TP with DP of the rank alone (PP x TP
stages: tests/runtime/test_fsdp_layouts.py runs them); a mesh with 'tp' beside data-parallel
dimensions named otherwise (torchtitan's stage `mesh['dp_shard', 'tp']`) is one SpecError saying
which mesh to give (torchtitan's flattened 'dp' beside 'tp', which runs)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from canzona.errors import SpecError
from canzona.runtime.mesh import DP, TP, axis_groups


def test_a_tp_mesh_alone_is_tp_with_dp_of_this_rank_alone(one_rank) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    groups = axis_groups(mesh, None)
    assert groups[TP] is mesh.get_group() and dist.get_process_group_ranks(groups[DP]) == [0]
    assert axis_groups(mesh, None)[DP] is groups[DP]  # the routing and the constructor: one group


@pytest.mark.parametrize("names", [("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp")])
def test_tp_beside_data_parallel_dimensions_not_named_dp_says_which_mesh_to_give(one_rank, names) -> None:
    """Before: "a 2-D device mesh needs a dimension named 'dp' (has ('dp_shard', 'tp'))"."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
    with pytest.raises(SpecError) as refused:
        axis_groups(mesh, None)
    message = str(refused.value)
    others = ", ".join(repr(n) for n in names[:-1])
    assert f"mesh[{others}]._flatten('dp')" in message and "group=mesh['dp', 'tp']" in message, message
    assert "\n" not in message


def test_a_tp_mesh_of_a_new_process_group_gets_a_group_of_its_own(one_rank) -> None:
    """After destroy_process_group and a new init, an equal 'tp' mesh (DeviceMesh compares by ranks
    and names) gets a live group, not the destroyed one kept for the old mesh (still alive here).
    Before: the old group, which torch no longer knows (KeyError on first use)."""
    from torch.distributed.device_mesh import init_device_mesh

    old = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    kept = axis_groups(old, None)[DP]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    new = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    assert new == old
    group = axis_groups(new, None)[DP]
    assert group is not kept and dist.get_process_group_ranks(group) == [0]
