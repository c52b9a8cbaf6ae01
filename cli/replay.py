"""A simulator configuration back as the `canzona simulate` command line that builds it again.

Why: `canzona search` ranks layouts it builds with `sim.search.config_of`; a user re-runs the chosen
one with `canzona simulate` (for a trace, a memory breakdown, a comparison), whose flags build their
configuration with `cli.main._sim_config`. The two must give the same configuration, bit for bit.
Nothing here restates a flag: the options are `cli.main.SimOptions`'s fields, read back from the
configuration by name (`simulate_options`), and spelt as the simulate command's click parameters
declare them (`command_line`); the result is checked by building it forward again with
`_sim_config` (one definition of what each option does), so a configuration the flags cannot
express is an error naming what differs, never a command that silently simulates something else.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any

from canzona.errors import SpecError
from canzona.optimizers import matrix_config_json
from canzona.plan import PLAN_DEFAULTS
from cli.units import parse_capacity
from sim.workload import grad_bytes_for, loss_bytes_for

if TYPE_CHECKING:  # the simulator is imported when a command runs, not when the CLI starts
    from sim.simulate import SimConfig


def _value(config: SimConfig, name: str) -> Any:
    """The configuration's value of the simulate option `name`: the field of that name of the
    configuration, its workload, run options, EP dispatcher or pipeline split (the builders pass
    them by name), or the few options `_sim_config` translates."""
    if name == "policy":  # None: the optimizer's default, as SimConfig resolves it
        return None if config.policy == _default_policy(config) else config.policy
    if name == "dp_policy":  # None: canzona's default DP policy (the option refuses it beside other policies)
        return None if config.dp_policy == PLAN_DEFAULTS.dp_policy else config.dp_policy
    if name == "capacity":
        if config.capacity != parse_capacity("auto"):
            c = config.capacity
            return f"{c.value!r}{'s' if c.unit == 's' else 'B'}"
        return "auto"
    if name == "matrix_config":  # the JSON object of its fields off the defaults (SimConfig holds None for none)
        return None if config.matrix_config is None else matrix_config_json(config.optimizer, config.matrix_config)
    if name == "cost_table":  # a cost model object: no path to read back (a given one is named as differing)
        return None
    if name == "grad_reduce_in_fp32":  # None: the default of the run's master weights (`grad_bytes_for`)
        wl = config.workload
        return None if wl.grad_bytes == grad_bytes_for(None, wl.master_weights) else wl.grad_bytes == grad_bytes_for(True)
    if name == "loss_fp32_upcast":
        return config.workload.loss_bytes == loss_bytes_for(True)
    if name == "router_imbalance":
        r = config.router_imbalance
        return ",".join(repr(float(v)) for v in r) if isinstance(r, tuple) else ("1" if r == 1.0 else repr(float(r)))
    if name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        where = "first" if "first" in name else "last"
        return getattr(config.pipeline_split, f"num_layers_in_{where}_pipeline_stage")
    for holder in (config, config.workload, config.options, config.options.ep_dispatcher, config.pipeline_split):
        if name in {f.name for f in fields(holder)}:
            return getattr(holder, name)
    raise SpecError(f"simulate's option --{name.replace('_', '-')} is not a field of the simulator's configuration")


def _default_policy(config: SimConfig) -> str:
    """The step policy SimConfig resolves none to, for this configuration's optimizer (and FSDP)."""
    return type(config)(optimizer=config.optimizer, fsdp=config.fsdp, policy=None).policy


# the options a command line always gives, at their defaults too: what is simulated where (the line
# reads whole, and stays the same run should a default change)
ALWAYS = ("model", "gpus", "tp")


@dataclass(frozen=True, kw_only=True)
class Replay:
    """`canzona simulate`'s options class (`cli.main.SimOptions`), their builder (`cli.main._sim_config`)
    and the Typer app that declares their flags: handed in by `cli.main`, so this module imports no
    command (the CLI imports it, not the other way round)."""

    options: type
    build: Callable[..., SimConfig]
    app: Any

    def simulate_options(self, config: SimConfig) -> Any:
        """`canzona simulate`'s options that build `config`, checked by building it again: a
        configuration the options cannot express (a setting no flag sets, such as a workload's
        gathered parameter bytes) raises `SpecError` naming the fields that differ."""
        options = self.options(**{f.name: _value(config, f.name) for f in fields(self.options)})
        built = self.build(shared=options)
        if built != config:
            differ = [f.name for f in fields(config) if getattr(built, f.name) != getattr(config, f.name)]
            raise SpecError(f"canzona simulate's options cannot express this configuration: {', '.join(differ)} differ")
        return options

    @cached_property
    def _params(self) -> dict[str, dict[str, Any]]:
        """The click parameters of each `canzona` command, by name: the flags as the parser reads them."""
        from typer.main import get_command

        return {name: {p.name: p for p in command.params} for name, command in get_command(self.app).commands.items()}

    def command_line(self, command: str, options: Any) -> str:
        """`canzona <command>` with a flag for every option of `options` off its default (and those of
        `ALWAYS`), in the options' order, spelt as the command declares it (a boolean's on / off flag)."""
        params = self._params[command]
        parts = ["canzona", command]
        for f in fields(self.options):
            value = getattr(options, f.name)
            if value == f.default and f.name not in ALWAYS:
                continue
            p = params[f.name]
            if p.is_flag:
                flags = p.opts if value else p.secondary_opts
                if not flags:  # an on-only flag cannot be turned off (its default is off)
                    raise SpecError(f"{p.opts[0]} has no flag for {value!r}")
                parts.append(flags[0])
            else:
                parts += [p.opts[0], shlex.quote(str(value))]
        return " ".join(parts)

    def simulate_command(self, config: SimConfig) -> str:
        """The `canzona simulate` command line that simulates `config` (every non-default option)."""
        return self.command_line("simulate", self.simulate_options(config))


__all__ = ["ALWAYS", "Replay"]
