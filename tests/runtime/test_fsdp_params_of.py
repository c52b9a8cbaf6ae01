"""`canzona.runtime.param_gather.fsdp_params_of`: one walk of `gc` at FSDP2 construction finds FSDP2's
records of the parameters it shards and, for every other parameter, the modules holding it (what
`param_gather.param_holders`' own walk finds). In this process, no process group: a model FSDP2
never touched, so every parameter is of the second kind."""

from __future__ import annotations

from torch import nn

from canzona.runtime.param_gather import Holders, fsdp_params_of, param_holders


def _held_by(holders: Holders) -> dict[str, set[tuple[int, str]]]:
    return {name: {(id(ref()), attr) for ref, attr in refs} for name, refs in holders.items()}


def test_one_walk_finds_the_modules_holding_the_parameters_fsdp2_does_not_shard():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied: held by two modules
    params = dict(model.named_parameters())
    found, groups, holders = fsdp_params_of(params)
    assert (found, groups) == ({}, [])
    assert _held_by(holders) == _held_by(param_holders(params))
    assert _held_by(holders)["0.weight"] == {(id(model[0]), "weight"), (id(model[1]), "weight")}
    assert set(holders) == {"0.weight", "0.bias", "1.bias"}
