"""Pipeline stages (1F1B, Megatron's default schedule, and its interleaved schedule, the virtual
pipeline): which layers and parameters each stage holds, and the order it runs its micro-batches in.

Shared by the memory model and the simulator. Ranks are ordered TP fastest, then DP, then the
pipeline stage (Megatron's default order puts PP outermost).

Interleaved (`vp` = V > 1 model chunks per rank, Megatron's `virtual_pipeline_model_parallel_size`;
Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2): the model is cut into `pp * V` chunks of
`layers / (pp * V)` layers, and chunk `c` of rank `r` is the model's chunk `c * pp + r` (its
virtual stage), so a micro-batch crosses every rank V times. Megatron's rules, checked here:
`pp > 1`, the layers divisible by `pp * V`, the micro-batches divisible by `pp`.
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


def check_vp(vp: int, pp: int, layers: int | None = None, micro_batches: int | None = None) -> None:
    """Megatron's rules for the interleaved schedule (one `SpecError` line each): V >= 1; V > 1
    needs `pp > 1`, `layers` divisible by `pp * V` (equal chunks) and `micro_batches` divisible by
    `pp` (Megatron's `num_microbatches % pipeline_parallel_size == 0`)."""
    if not (isinstance(vp, int) and vp >= 1):
        raise SpecError(f"vp must be a whole number >= 1, got {vp!r}")
    if vp == 1:
        return
    if pp <= 1:
        raise SpecError(f"vp {vp} (the interleaved pipeline schedule) needs pipeline parallelism: pp > 1, got pp {pp}")
    if layers is not None and layers % (pp * vp):
        raise SpecError(f"vp {vp}: the {layers} layers are not divisible by pp x vp = {pp} x {vp} (Megatron's "
                        "interleaved schedule needs equal model chunks)")
    if micro_batches is not None and micro_batches % pp:
        raise SpecError(f"vp {vp}: the {micro_batches} micro-batches per DP rank are not divisible by pp {pp} "
                        "(Megatron's interleaved schedule needs num_microbatches % pipeline_parallel_size == 0)")


def chunk_layers(layers: int, pp: int, stage: int, chunk: int, vp: int) -> range:
    """The layer indices of model chunk `chunk` of pipeline rank `stage` under the interleaved
    schedule: the model's chunk `chunk * pp + stage` of `pp * vp` equal ones (Megatron's layer
    offset). At `vp` 1 the stage's layers (`stage_layers`)."""
    if vp == 1 and chunk == 0:
        return stage_layers(layers, pp, stage)
    check_vp(vp, pp, layers)
    if not 0 <= stage < pp:
        raise SpecError(f"stage {stage} is outside 0..{pp - 1}")
    if not 0 <= chunk < vp:
        raise SpecError(f"chunk {chunk} is outside 0..{vp - 1}")
    size = layers // (pp * vp)
    start = (chunk * pp + stage) * size
    return range(start, start + size)


def rank_layers(layers: int, pp: int, stage: int, vp: int = 1) -> tuple[int, ...]:
    """Every layer pipeline rank `stage` holds: its chunks' (at `vp` 1, its stage's), ascending."""
    return tuple(i for c in range(vp) for i in chunk_layers(layers, pp, stage, c, vp))


def stage_spec(spec: ModelSpec, pp: int, stage: int, layers: int | None = None, vp: int = 1) -> ModelSpec:
    """The parameters pipeline stage `stage` holds: its layers (under the interleaved schedule,
    those of its `vp` chunks: `rank_layers`); the embedding on the first stage (its first chunk);
    the parameters outside any layer (final norm, head) on the last (its last chunk). With tied
    embeddings (no head) the last stage also holds a copy of the embedding, as Megatron does for
    its output layer."""
    indices = [p.layer for p in spec.params if p.layer is not None]
    count = layers if layers is not None else (max(indices) + 1 if indices else 0)
    if pp == 1 and stage == 0 and vp == 1:
        return spec
    mine = set(rank_layers(count, pp, stage, vp))
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


Slot = tuple[str, int, int]  # ("F" or "B", micro-batch, model chunk)


def interleaved_warmup(stage: int, pp: int, vp: int, micro_batches: int) -> int:
    """The forwards (micro-batch-chunks) rank `stage` runs before its first backward under the
    interleaved schedule: `(pp - stage - 1) * 2 + (vp - 1) * pp`, capped by all `micro_batches *
    vp` of them (Megatron's `get_pp_rank_microbatches`)."""
    return min((pp - stage - 1) * 2 + (vp - 1) * pp, micro_batches * vp)


def interleaved_one_f_one_b(stage: int, pp: int, micro_batches: int, vp: int) -> list[Slot]:
    """The order rank `stage` runs its forwards ("F", i, c) and backwards ("B", i, c) of
    micro-batch i on model chunk c under Megatron's interleaved 1F1B
    (`forward_backward_pipelining_with_interleaving`): the k-th forward is micro-batch
    `(k // (pp * vp)) * pp + k % pp` on chunk `(k // pp) % vp` (groups of `pp` micro-batches run
    through chunk 0, then chunk 1, ...); the k-th backward is the same micro-batch on chunk
    `vp - 1 - (k // pp) % vp`; warm-up forwards (`interleaved_warmup`), then one forward and one
    backward in turn, then the remaining backwards. `micro_batches` must be divisible by `pp`."""
    check_vp(vp, pp, micro_batches=micro_batches)
    total = micro_batches * vp

    def slot(kind: str, k: int) -> Slot:
        group, within = divmod(k, pp * vp)
        chunk = within // pp
        return kind, group * pp + within % pp, chunk if kind == "F" else vp - 1 - chunk

    warm = interleaved_warmup(stage, pp, vp, micro_batches)
    order = [slot("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [slot("F", warm + k), slot("B", k)]
    order += [slot("B", k) for k in range(total - warm, total)]
    return order


def pipeline_order(stage: int, pp: int, micro_batches: int, vp: int = 1) -> list[Slot]:
    """The order of stage `stage`'s forwards and backwards, (kind, micro-batch, chunk): 1F1B
    (`one_f_one_b`, chunk 0) at `vp` 1, the interleaved schedule above it."""
    if vp == 1:
        return [(kind, i, 0) for kind, i in one_f_one_b(stage, pp, micro_batches)]
    return interleaved_one_f_one_b(stage, pp, micro_batches, vp)


def peak_in_flight(stage: int, pp: int, micro_batches: int | None = None, vp: int = 1,
                   chunk: int | None = None) -> int:
    """The most micro-batch-chunks (of `chunk`, or of any) whose forward stage `stage` has run and
    whose backward it has not, over `pipeline_order`: what its activations are held for. 1F1B:
    `min(pp - stage, micro_batches)`. Interleaved: the warm-up plus one, which on stage 0 is
    `pp * vp + pp - 1` chunks of `layers / (pp * vp)` layers, `layers * (1 + (pp - 1) / (pp * vp))`
    layers' worth (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.3). Without
    `micro_batches` (unknown), as many as the schedule can hold."""
    if micro_batches is None:
        micro_batches = pp * (pp + 1)  # divisible by pp, and more than any warm-up
        if vp == 1:
            return pp - stage
    held = peak = 0
    for kind, _, c in pipeline_order(stage, pp, micro_batches, vp):
        if chunk is None or c == chunk:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
    return peak
