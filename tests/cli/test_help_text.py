"""Help text that names what the code has: the matrix optimizers of the registry, the axes the
search walks."""

from __future__ import annotations

from canzona.optimizers import MATRIX_REGISTRY
from tests.cli_helpers import help_text


def test_top_help_names_every_matrix_optimizer() -> None:
    text = help_text()
    titles = [e.title for e in MATRIX_REGISTRY.values() if not e.elementwise]
    assert len(titles) >= 4
    assert f"matrix optimizers ({', '.join(titles)})" in text, text


def test_search_help_names_context_parallelism() -> None:
    assert "(TP, PP, VP, CP, EP, DP," in help_text("search")
