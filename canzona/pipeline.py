"""Pipeline stages (1F1B, Megatron's default schedule): which layers and parameters each stage holds.

Shared by the memory model and the simulator. Ranks are ordered TP fastest, then DP, then the
pipeline stage (Megatron's default order puts PP outermost).
"""

from __future__ import annotations

from canzona.errors import SpecError
from canzona.spec import ModelSpec, Role


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The layer indices of pipeline stage `stage` of `pp`: split evenly, the first stages taking
    one more when `pp` does not divide `layers`."""
    if not (isinstance(pp, int) and pp >= 1):
        raise SpecError(f"pp must be a whole number >= 1, got {pp!r}")
    if not 0 <= stage < pp:
        raise SpecError(f"stage {stage} is outside 0..{pp - 1}")
    if pp > layers:
        raise SpecError(f"pp={pp} is more than the {layers} layers")
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_spec(spec: ModelSpec, pp: int, stage: int, layers: int | None = None) -> ModelSpec:
    """The parameters pipeline stage `stage` holds: its layers; the embedding on the first stage;
    the parameters outside any layer (final norm, head) on the last. With tied embeddings (no head)
    the last stage also holds a copy of the embedding, as Megatron does for its output layer."""
    indices = [p.layer for p in spec.params if p.layer is not None]
    count = layers if layers is not None else (max(indices) + 1 if indices else 0)
    if pp == 1 and stage == 0:
        return spec
    mine = stage_layers(count, pp, stage)
    tied = not any(p.role == Role.HEAD for p in spec.params)
    out = []
    for p in spec.params:
        if p.layer is not None:
            keep = p.layer in mine
        elif p.role == Role.EMBEDDING:
            keep = stage == 0 or (tied and stage == pp - 1)
        else:
            keep = stage == pp - 1
        if keep:
            out.append(p)
    return ModelSpec(f"{spec.name}[stage {stage}/{pp}]", tuple(out))


def one_f_one_b(stage: int, pp: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order stage `stage` runs its forwards ("F", i) and backwards ("B", i) in 1F1B: up to
    `pp - stage - 1` warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards (Narayanan et al. 2021, arXiv 2104.04473, section 2.2)."""
    warm = min(pp - stage - 1, micro_batches)
    order = [("F", i) for i in range(warm)]
    for i in range(micro_batches - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(micro_batches - warm, micro_batches)]
    return order
