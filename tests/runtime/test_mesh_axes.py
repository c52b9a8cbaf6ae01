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
