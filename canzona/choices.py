"""One check for an option that takes one of a fixed set of names (a policy, a mode, an
implementation): the project's single wording of the error, "unknown X 'y'; choose one of a, b, c",
so every option says it the same way and no module keeps its own copy. Torch-free."""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

from canzona.errors import CanzonaError, SpecError

T = TypeVar("T")


def check_choice(value: T, choices: Collection[str], what: str, *, error: type[CanzonaError] = SpecError,
                 where: str = "", note: str = "") -> T:
    """`value` unchanged if it is one of `choices` (a tuple of names, or a dict: its keys, in order);
    otherwise raise `error` saying "unknown {what} {value!r}; choose one of {choices}", prefixed
    with "{where}: " when given and followed by `note` (e.g. " or all", " (help)") as it is."""
    if value not in choices:
        prefix = f"{where}: " if where else ""
        raise error(f"{prefix}unknown {what} {value!r}; choose one of {', '.join(choices)}{note}")
    return value


__all__ = ["check_choice"]
