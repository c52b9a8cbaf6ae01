"""CPU time of `DistributedOptimizer`'s construction at a model of many modules, and of its walk of
the garbage collector's objects (`param_gather.param_holders`, which also gives
`enclosing_modules` the modules' parents: one walk), in one process (a one-rank gloo group).

The model: `blocks` blocks of LayerNorm(8) + Linear(8, 8) (3 modules each: 3,001 at the default
1,000). Also the ZeRO-1 step's check of the links down to the parameters' holders
(`param_gather.ModuleLinks`): their construction, a step's check (a walk only after a module was
registered), and a walk. CPU time (`time.process_time`), as the machine may be shared: the least of `--repeat`.

`--never-grad N`: instead, a model of N blocks (each a LayerNorm and a Linear in a Sequential) beside
a module the forward never calls (its parameters, kept in the optimizer, never get a gradient): a
step's links check (`ModuleLinks.changed`) as it is, against the rule before (walk whenever a
parameter got no gradient: `_as_walked` always False), interleaved round by round, and a whole ZeRO-1
step (zero_grad, forward, backward, step) under each rule, interleaved too.

    PYTHONPATH=. python3 benchmarks/bench_construction_walk.py [--blocks 1000] [--repeat 5]
    PYTHONPATH=. python3 benchmarks/bench_construction_walk.py --never-grad 80 [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from canzona.runtime import DistributedOptimizer, param_gather
from canzona.runtime.modules import named_parameters, spec_from_module


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)


def least_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
        gc.collect()  # an optimizer's parts refer to each other
    return min(times) * 1e3


class Spare(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(blocks)))
        self.spare = nn.Linear(8, 8)  # never called: no gradient, ever

    def forward(self, x):
        return self.blocks(x)


class WalkWhenMissed(param_gather.ModuleLinks):
    """The rule before: a walk at every step where some parameter got no gradient."""

    __slots__ = ()

    def _as_walked(self, gone) -> bool:
        return False


def never_grad(blocks: int, repeat: int) -> None:
    import torch

    torch.set_num_threads(1)  # CPU time of one thread: the check's share of a step, not the pool's

    model = Spare(blocks)
    params = dict(named_parameters(model))
    missed = [n for n in params if n.startswith("spare.")]
    parents: param_gather.Parents = {}
    holders = param_gather.param_holders(params, parents)
    now, before = (cls(param_gather.module_links(holders, parents), params) for cls in
                   (param_gather.ModuleLinks, WalkWhenMissed))
    fed = {n: 0 for n in params if n not in missed}  # as ZeRO-1's: the gradients' states by name
    gone = lambda: params.keys() - fed.keys() if len(fed) < len(params) else ()  # noqa: E731
    for links in (now, before):
        assert links.changed(params, gone) is None
    steps = 200
    rounds = []
    for _ in range(repeat):  # interleaved: before, now, before, now...
        b = least_ms(lambda: [before.changed(params, gone) for _ in range(steps)], 1) / steps * 1e3
        a = least_ms(lambda: [now.changed(params, gone) for _ in range(steps)], 1) / steps * 1e3
        rounds.append((b, a))
    print(f"never-gradient model, {blocks} blocks, {len(now.links)} links, {len(missed)} parameters never "
          f"get a gradient: a step's links check, before (walk) / now, per round (us): "
          + ", ".join(f"{b:.1f} / {a:.2f} ({b / a:.0f}x)" for b, a in rounds)
          + f"; least {min(b for b, _ in rounds):.1f} / {min(a for _, a in rounds):.2f} us")
    opt = DistributedOptimizer(list(params.items()), spec_from_module(model), "adamw")
    x = torch.randn(4, 8)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    rule = param_gather.ModuleLinks._as_walked
    whole = []
    for _ in range(repeat):
        times = []
        for as_walked in (WalkWhenMissed._as_walked, rule):
            param_gather.ModuleLinks._as_walked = as_walked
            try:
                step()  # the rule's first step (a walk after the switch) left out
                times.append(least_ms(lambda: [step() for _ in range(50)], 1) / 50)
            finally:
                param_gather.ModuleLinks._as_walked = rule
        whole.append(tuple(times))
    print("a whole ZeRO-1 step (one rank), before / now, per round (ms): "
          + ", ".join(f"{b:.3f} / {a:.3f} ({b / a:.2f}x)" for b, a in whole)
          + f"; least {min(b for b, _ in whole):.3f} / {min(a for _, a in whole):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--never-grad", type=int, default=0, metavar="N")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if args.never_grad:
            never_grad(args.never_grad, args.repeat)
            return
        model = nn.Sequential(*(Block() for _ in range(args.blocks)))
        params = dict(named_parameters(model))
        spec = spec_from_module(model)

        def walk() -> None:
            parents: param_gather.Parents = {}
            holders = param_gather.param_holders(params, parents)
            param_gather.enclosing_modules(param_gather.modules_holding(params, holders), parents)

        def construct() -> None:
            opt = DistributedOptimizer(list(params.items()), spec, "adamw")
            assert opt.overlap_param_gather

        print(f"modules {sum(1 for _ in model.modules())}, gc objects {len(gc.get_objects())}: "
              f"walk {least_ms(walk, args.repeat):.1f} ms, construction {least_ms(construct, args.repeat):.1f} ms "
              "(CPU, least)")
        parents = {}
        holders = param_gather.param_holders(params, parents)
        links = param_gather.ModuleLinks(param_gather.module_links(holders, parents), params)
        links.changed(params)
        steps = 100
        print(f"module links {len(links.links)}: built in "
              f"{least_ms(lambda: param_gather.module_links(holders, parents), args.repeat):.1f} ms; a step's check "
              f"{least_ms(lambda: [links.changed(params) for _ in range(steps)], args.repeat) / steps * 1e3:.2f} us "
              f"(walked: {least_ms(lambda: param_gather.links_changed(links.links, params), args.repeat) * 1e3:.0f} "
              "us, only after a module was registered or a parameter missed its gradient); the construction "
              f"roots found in {least_ms(lambda: param_gather.construction_roots(links.links, params), args.repeat):.1f}"
              " ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
