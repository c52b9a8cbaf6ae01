"""CPU time of `DistributedOptimizer`'s construction at a model of many modules, and of its walk of
the garbage collector's objects (`param_gather.param_holders`, which also gives
`enclosing_modules` the modules' parents: one walk), in one process (a one-rank gloo group).

The model: `blocks` blocks of LayerNorm(8) + Linear(8, 8) (3 modules each: 3,001 at the default
1,000). Also the ZeRO-1 step's check of the links down to the parameters' holders
(`param_gather.ModuleLinks`): their construction, a step's check (a walk only after a module was
registered), and a walk. CPU time (`time.process_time`), as the machine may be shared: the least of `--repeat`.

    PYTHONPATH=. python3 benchmarks/bench_construction_walk.py [--blocks 1000] [--repeat 5]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
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
