"""`canzona` CLI entry point."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from canzona.catalog import DEFAULT_MODEL, get_model
from canzona.dp import DP_POLICIES
from canzona.errors import CanzonaError
from canzona.plan import check_plan_matches, load_plan, make_plan
from canzona.tp import TP_POLICIES
from cli.render import dp_table, models_table, tp_table
from cli.units import parse_capacity

app = typer.Typer(
    help="Canzona: plan, simulate and verify distributed matrix optimizers (Muon, SOAP, Shampoo).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Wide tables when piped (CI logs, files); a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 140)


def fail(message: str) -> None:
    """One clear line on stderr and exit code 2: how every bad input ends."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code=2)


@app.command()
def models() -> None:
    """List the model catalog."""
    console.print(models_table())


@app.command()
def plan(
    model: Annotated[str, typer.Option(help="Catalog model name.")] = DEFAULT_MODEL,
    dp: Annotated[int, typer.Option(help="Data-parallel size.")] = 32,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 8,
    optimizer: Annotated[str, typer.Option(help="Matrix optimizer: muon, soap or shampoo.")] = "muon",
    dp_policy: Annotated[str, typer.Option(help=f"One of: {', '.join(DP_POLICIES)}.")] = "alpha-balanced",
    tp_policy: Annotated[str, typer.Option(help=f"One of: {', '.join(TP_POLICIES)}.")] = "greedy-rollback",
    alpha: Annotated[float, typer.Option(help="Compute (1) vs segment-size (0) balance, in [0, 1].")] = 1.0,
    bucket_size: Annotated[int | None, typer.Option(help="Gradient bucket size in elements (default: about one matrix per rank).")] = None,
    align: Annotated[int, typer.Option(help="Parameter start alignment in elements.")] = 64,
    capacity: Annotated[str, typer.Option(help="Micro-group capacity: 'auto', seconds (20ms) or bytes (4GiB).")] = "auto",
    balance_by: Annotated[str, typer.Option(help="Balance 'seconds' (ours) or 'elements' (as the authors' code does).")] = "seconds",
    out: Annotated[Path | None, typer.Option(help="Write the chosen plan as JSON to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the chosen plan's summary as one JSON object.")] = False,
) -> None:
    """Plan a layout and compare the chosen policies with the baselines."""
    try:
        spec = get_model(model, tp)
        cap = parse_capacity(capacity)

        def make(dpp: str, tpp: str, unit: str = balance_by):
            return make_plan(spec, dp, tp, optimizer, dpp, tpp, alpha, bucket_size, align, cap,
                             balance_by=unit)

        chosen = make(dp_policy, tp_policy)
        if out is not None:
            try:
                chosen.save(out)
            except OSError as e:
                fail(f"cannot write {out}: {e.strerror}")
        if as_json:
            print(json.dumps(chosen.summary()))
            return
        # every DP policy, plus the paper's policy balanced by elements as the authors' code does
        variants = [(name, "seconds") for name in DP_POLICIES]
        variants.insert(variants.index(("alpha-balanced", "seconds")) + 1, ("alpha-balanced", "elements"))
        if (dp_policy, balance_by) not in variants:
            variants.append((dp_policy, balance_by))
        dp_rows = [chosen if v == (dp_policy, balance_by) else make(v[0], tp_policy, v[1]) for v in variants]
        tp_rows = [chosen if name == tp_policy else make(dp_policy, name) for name in TP_POLICIES]
    except CanzonaError as e:
        fail(str(e))
    console.print(dp_table(dp_rows, chosen))
    console.print(tp_table(tp_rows, tp_policy))
    if out is not None:
        console.print(f"plan written to {out} (hash {chosen.hash()[:12]})")


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A plan file written by `canzona plan --out`.")],
    model: Annotated[str | None, typer.Option(help="Check the plan against this catalog model.")] = None,
    dp: Annotated[int | None, typer.Option(help="Check the plan's DP size.")] = None,
    tp: Annotated[int | None, typer.Option(help="Check the plan's TP size.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Validate a plan file (optionally against a model and layout) and summarise it."""
    try:
        loaded = load_plan(path)
        if model is not None:
            check_plan_matches(loaded, get_model(model, loaded.tp), dp, tp)
        elif dp is not None or tp is not None:
            fail("--dp and --tp are checked together with --model")
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        print(json.dumps({**loaded.summary(), "hash": loaded.hash()}))
        return
    console.print(dp_table([loaded], loaded))
    console.print(tp_table([loaded], loaded.tp_plan.policy))
    console.print(f"{path}: valid plan, hash {loaded.hash()[:12]}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
