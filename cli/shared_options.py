"""Options several commands share, declared once: a frozen dataclass whose fields are typed with the
commands' `Annotated[..., typer.Option(...)]` aliases and carry their defaults, and a decorator that
appends those fields to a command's parameters and hands the command one instance of the dataclass.

Why: `canzona simulate` and `canzona compare` simulate the same layouts; when each spelt out some
sixty options by hand they drifted (compare lacked a dozen that change what is simulated). With the
options one dataclass, a field added there is an option of every command that takes it, with the
same name, default and help.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields, is_dataclass


def _option_parameters(cls: type, omit: frozenset[str]) -> list[inspect.Parameter]:
    """`cls`'s fields as keyword parameters, in field order, each typed with its resolved
    `Annotated` alias (what typer reads its option from) and defaulting to the field's default."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in fields(cls):
        if f.name in omit:
            continue
        if f.default is MISSING:  # every shared option has a default: the command line may omit it
            raise TypeError(f"{cls.__name__}.{f.name} needs a default to be a command-line option")
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=hints[f.name]))
    return out


def takes_options(cls: type, *, omit: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Decorate a command that has one parameter annotated `cls` (a dataclass of shared options):
    the command's signature becomes `cls`'s fields (less `omit`, which keep the field's default)
    followed by the command's own parameters, and the command receives the shared values as one
    `cls` in that parameter. `omit` names the options a command deliberately lacks (compare varies
    the policy: no --policy)."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    omitted = frozenset(omit)
    unknown = omitted - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    shared = _option_parameters(cls, omitted)
    names = [p.name for p in shared]

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        holders = [p.name for p in signature.parameters.values() if p.annotation is cls]
        if len(holders) != 1:
            raise TypeError(f"{command.__name__} needs exactly one parameter annotated {cls.__name__}")
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
               if p.name != holders[0]]
        clash = set(names) & {p.name for p in own}
        if clash:
            raise TypeError(f"{command.__name__} declares shared options again: {sorted(clash)}")

        @functools.wraps(command)
        def run(**kwargs):
            values = cls(**{name: kwargs.pop(name) for name in names})
            return command(**kwargs, **{holders[0]: values})

        params = [*shared, *own]
        # typer reads the signature and the resolved annotations; neither may point back at the
        # undecorated command, whose signature holds the dataclass instead of the options
        del run.__wrapped__
        run.__signature__ = signature.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
