"""torch.optim.Optimizer's state-dict hooks around canzona's own `state_dict()` / `load_state_dict()`.

torch runs these hooks inside `Optimizer.state_dict` / `Optimizer.load_state_dict`, which canzona's
optimizers replace (their state lives in their own structures, gathered and scattered by
collectives); without this, `register_state_dict_*_hook` and `register_load_state_dict_*_hook`
would register hooks that never fire. The step hooks need nothing here: torch wraps every
subclass's `step()` in its hook runner (`Optimizer._patch_step_function`). torch's own order and
return-value rules are kept: a state-dict post hook's non-None result replaces the state dict, a
load pre hook's replaces what loads (given a shallow copy, as torch gives it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def state_dict_with_hooks(opt: torch.optim.Optimizer, take: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`take()`'s state dict, with `opt`'s state-dict pre hooks run before it and post hooks after."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    state_dict = take()
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_with_hooks(opt: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                    load: Callable[[Mapping[str, Any]], None]) -> None:
    """`load(state_dict)`, with `opt`'s load pre hooks run before it (on a shallow copy, as torch's
    `load_state_dict` runs them) and its load post hooks after."""
    state_dict = dict(state_dict)
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
