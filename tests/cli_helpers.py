"""Running the CLI in-process and checking how it fails: every bad input ends in one `error:` line
on stderr, nothing on stdout, no traceback, and exit code 2 (1 for a failed run)."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app


def _runner() -> CliRunner:
    """Separate stdout and stderr: click < 8.2 needs mix_stderr=False, click >= 8.2 always separates
    (and has no such argument)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def invoke(*args: object, **kwargs):
    return _runner().invoke(app, [str(a) for a in args], **kwargs)


def help_text(*command: str) -> str:
    """`--help` of a command on one line, wide enough that rich does not elide anything."""
    return " ".join(invoke(*command, "--help", env={"COLUMNS": "300"}).stdout.split())


def error_line(result, *needles: str, code: int = 2) -> str:
    """The one `error:` line of a failed command, checked to contain every needle."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert result.stdout == "", result.stdout
    for text in (result.stdout, result.stderr, result.output):
        assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
