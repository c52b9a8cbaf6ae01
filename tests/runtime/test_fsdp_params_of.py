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


def test_the_walk_keeps_every_module_and_the_types_asked_for_in_gcs_order():
    """`live_modules` keeps what a look at each of gc's objects keeps (an instance of an `nn.Module`
    subclass, a lazy module among them, or of one of the exact types asked for, not of their
    subclasses), in gc's order; it looks at each type once instead (about 0.2 s of CPU less an
    FSDP2 optimizer's construction in a rank), asking no object for its `__class__`."""
    import gc
    import warnings

    from canzona.runtime.param_gather import live_modules

    class Record:
        pass

    class Derived(Record):
        pass

    alive = [nn.Sequential(nn.Linear(2, 2)), nn.LazyLinear(3), Record(), Derived()]
    gc.disable()  # no collection between the two walks: gc's order stays
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # lazy modules and deprecated proxies warn when asked for __class__
            got = live_modules(Record)
        want = [o for o in gc.get_objects() if issubclass(type(o), nn.Module) or type(o) is Record]
    finally:
        gc.enable()
    assert [id(o) for o in got] == [id(o) for o in want]
    assert {id(o) for o in (*alive[:3], *alive[0])} <= {id(o) for o in got} and id(alive[3]) not in map(id, got)
