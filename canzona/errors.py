"""Error types that carry a one-line message meant for the user, not a traceback."""

from __future__ import annotations


class CanzonaError(ValueError):
    """Bad input the user can fix: the CLI prints the message on one line and exits with code 2."""


class SpecError(CanzonaError):
    """A model, layout or hyper-parameter that cannot be used (unknown model, TP not dividing heads, ...)."""


class PlanError(CanzonaError):
    """A plan file that cannot be read, is malformed, or does not match the model it is used with."""


class CheckpointError(CanzonaError):
    """A checkpoint that is incomplete, damaged, mixed from several saves, not the one expected, or
    that cannot be written: refused before anything in it is unpickled or loaded."""
