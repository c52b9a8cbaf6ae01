"""Pipeline stages (1F1B, Megatron's default schedule, and its interleaved schedule, the virtual
pipeline): which layers and parameters each stage holds, and the order it runs its micro-batches in.

Shared by the memory model and the simulator. Ranks are ordered TP fastest, then DP, then the
pipeline stage (Megatron's default order puts PP outermost).

Interleaved (`vp` = V > 1 model chunks per rank, Megatron's `virtual_pipeline_model_parallel_size`;
Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2): the model is cut into `pp * V` chunks of
`layers / (pp * V)` layers, and chunk `c` of rank `r` is the model's chunk `c * pp + r` (its
virtual stage), so a micro-batch crosses every rank V times. Megatron's rules, checked here:
`pp > 1`, the layers divisible by `pp * V`, the micro-batches divisible by `pp`.

Uneven splits (`PipelineSplit`, Megatron's options of the same names; docs/design.md §9.3): the
embedding and / or the loss counted as one layer each when the layers are cut into the `pp * V`
chunks (`account_for_embedding_in_pipeline_split`, `account_for_loss_in_pipeline_split`: the first
chunk holds one decoder layer fewer, the last one fewer), or the first and / or last stage given
its own layer count (`num_layers_in_first_pipeline_stage` / `..._last_...`, Megatron's
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`), the other stages
splitting the rest evenly. The rules are Megatron-LM's (megatron/core/transformer/
transformer_config.py `TransformerConfig.__post_init__`'s checks, transformer_block.py
`get_num_layers_to_build`, transformer_layer.py `get_transformer_layer_offset`), checked by
`check_split`. canzona's runtime has no pipeline parallelism: these are the simulator's only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from canzona.errors import SpecError
from canzona.spec import ModelSpec, Role


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """How the decoder layers are cut over the pipeline's `pp * vp` model chunks, beyond the even
    split (Megatron's `TransformerConfig` options, named as there; every default Megatron's)."""

    # the embedding counts as one layer: (layers + 1 [+ 1]) / (pp * vp) a chunk, the first one a layer short
    account_for_embedding_in_pipeline_split: bool = False
    # the output layer and loss count as one layer: the last chunk a layer short
    account_for_loss_in_pipeline_split: bool = False
    # the first (last) stage's decoder layers, over its vp chunks; the middle stages split the rest
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None

    @property
    def even(self) -> bool:
        """Megatron's default: every chunk `layers / (pp * vp)` layers."""
        return self == EVEN_SPLIT

    @property
    def accounted(self) -> tuple[int, int]:
        """(embedding, loss): 1 for each counted as a layer, else 0."""
        return int(self.account_for_embedding_in_pipeline_split), int(self.account_for_loss_in_pipeline_split)

    @property
    def edges(self) -> bool:
        """The first or last stage's layer count is given."""
        return self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage is not None

    def describe(self) -> str:
        """The split in a few words (the simulate table's title): what is counted, what is given."""
        counted = [name for name, on in zip(("embedding", "loss"), self.accounted) if on]
        parts = [f"{' and '.join(counted)} counted as layers"] if counted else []
        if self.num_layers_in_first_pipeline_stage is not None:
            parts.append(f"first stage {self.num_layers_in_first_pipeline_stage} layers")
        if self.num_layers_in_last_pipeline_stage is not None:
            parts.append(f"last stage {self.num_layers_in_last_pipeline_stage} layers")
        return ", ".join(parts) or "even"


EVEN_SPLIT = PipelineSplit()


def check_split(split: PipelineSplit, layers: int, pp: int, vp: int = 1) -> None:
    """Megatron's rules for an uneven split (one `SpecError` line each; nothing to check for the
    even split): the options' types; the first / last stage counts not with the embedding / loss
    accounting; pp > 1 for the first / last counts; each given count >= 1 and divisible by `vp`;
    the middle stages' layers (the rest) divisible by their number, each stage's share by `vp`,
    and no layers left without a middle stage or a middle stage without layers; with the
    accounting, layers + 1 (+ 1) divisible by `pp` and each stage's share by `vp`."""
    if split.even:
        return
    check_vp(vp, pp)  # a whole vp >= 1 (and pp > 1 under it) before anything is divided by it
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if not isinstance(getattr(split, name), bool):
            raise SpecError(f"{name} must be True or False, got {getattr(split, name)!r}")
    for flag, value in (("--decoder-first-pipeline-num-layers", split.num_layers_in_first_pipeline_stage),
                        ("--decoder-last-pipeline-num-layers", split.num_layers_in_last_pipeline_stage)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise SpecError(f"{flag} must be a whole number >= 1, got {value!r} (Megatron: larger than 0)")
        if value is not None and value % vp:
            raise SpecError(f"{flag} {value} is not divisible by vp {vp} (Megatron: the first / last stage's "
                            "layers split over its vp model chunks)")
    if split.edges and any(split.accounted):
        raise SpecError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                        "--account-for-embedding/loss-in-pipeline-split (Megatron rejects both at once)")
    if split.edges:
        if pp < 2:
            raise SpecError("--decoder-first/last-pipeline-num-layers need pipeline parallelism: pp > 1, got pp 1")
        first = split.num_layers_in_first_pipeline_stage or 0
        last = split.num_layers_in_last_pipeline_stage or 0
        middle_stages = pp - (split.num_layers_in_first_pipeline_stage is not None) - \
            (split.num_layers_in_last_pipeline_stage is not None)
        rest = layers - first - last
        if rest < 0:
            raise SpecError(f"the first / last stage's {first} + {last} layers are more than the model's {layers}")
        if vp > 1 and not middle_stages:
            raise SpecError(f"--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers at pp {pp} "
                            f"with vp {vp} leave no middle stage: Megatron's layer offset under the interleaved "
                            "schedule needs a middle stage (it divides by their number)")
        if bool(rest) != bool(middle_stages):
            raise SpecError(f"the first / last stage counts leave {rest} layers for {middle_stages} middle stages "
                            f"of pp {pp} (Megatron: a mismatch; every stage needs layers, every layer a stage)")
        if middle_stages and rest % middle_stages:
            raise SpecError(f"the {rest} layers left by the first / last stage counts are not divisible by the "
                            f"{middle_stages} middle stages of pp {pp} (Megatron's uneven pipeline needs it)")
        if middle_stages and (rest // middle_stages) % vp:
            raise SpecError(f"a middle stage's {rest // middle_stages} layers are not divisible by vp {vp} (Megatron: "
                            "each middle stage's layers split over its vp model chunks)")
        return
    counted = layers + sum(split.accounted)
    if counted % pp:
        raise SpecError(f"the {layers} layers with the embedding / loss counted as layers, {counted}, are not "
                        f"divisible by pp {pp} (Megatron's account_for_*_in_pipeline_split needs it)")
    if (counted // pp) % vp:
        raise SpecError(f"a stage's {counted // pp} layers (embedding / loss counted) are not divisible by vp {vp} "
                        "(Megatron: each stage's layers split over its vp model chunks)")


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


def check_vp(vp: int, pp: int, layers: int | None = None, micro_batches: int | None = None,
             split: PipelineSplit = EVEN_SPLIT) -> None:
    """Megatron's rules for the interleaved schedule (one `SpecError` line each): V >= 1; V > 1
    needs `pp > 1`, `layers` divisible by `pp * V` (equal chunks; under an uneven `split` its own
    rules instead, `check_split`) and `micro_batches` divisible by `pp` (Megatron's
    `num_microbatches % pipeline_parallel_size == 0`)."""
    if not (isinstance(vp, int) and vp >= 1):
        raise SpecError(f"vp must be a whole number >= 1, got {vp!r}")
    if vp == 1:
        return
    if pp <= 1:
        raise SpecError(f"vp {vp} (the interleaved pipeline schedule) needs pipeline parallelism: pp > 1, got pp {pp}")
    if layers is not None and split.even and layers % (pp * vp):
        raise SpecError(f"vp {vp}: the {layers} layers are not divisible by pp x vp = {pp} x {vp} (Megatron's "
                        "interleaved schedule needs equal model chunks; its --account-for-embedding-in-pipeline-"
                        "split / --account-for-loss-in-pipeline-split or --decoder-first/last-pipeline-num-layers "
                        "cut them otherwise)")
    if layers is not None and not split.even:
        check_split(split, layers, pp, vp)
    if micro_batches is not None and micro_batches % pp:
        raise SpecError(f"vp {vp}: the {micro_batches} micro-batches per DP rank are not divisible by pp {pp} "
                        "(Megatron's interleaved schedule needs num_microbatches % pipeline_parallel_size == 0)")


def chunk_layers(layers: int, pp: int, stage: int, chunk: int, vp: int,
                 split: PipelineSplit = EVEN_SPLIT) -> range:
    """The layer indices of model chunk `chunk` of pipeline rank `stage` under the interleaved
    schedule: the model's chunk `chunk * pp + stage` of `pp * vp` equal ones (Megatron's layer
    offset). At `vp` 1 the stage's layers (`stage_layers`). An uneven `split`: `split_chunk`."""
    if not split.even:
        return split_chunk(layers, pp, stage, chunk, vp, split)
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


def split_chunk(layers: int, pp: int, stage: int, chunk: int, vp: int, split: PipelineSplit) -> range:
    """The layers of chunk `chunk` of rank `stage` under an uneven `split` (checked: `check_split`),
    as Megatron's `get_num_layers_to_build` and `get_transformer_layer_offset` place them. Each
    round of chunks (`chunk` = c on every rank) holds `layers / vp` consecutive layers.
    - First / last stage counts: in each round the first stage takes its count / vp layers, each
      middle stage the rest / (middle stages x vp), the last stage its count / vp.
    - Embedding / loss counted: the model is `layers + e + l` slots (slot 0 the embedding, the last
      the loss), each chunk `(layers + e + l) / (pp * vp)` consecutive slots: the first chunk of the
      first stage one decoder layer short (it may hold none), the last chunk of the last stage too."""
    check_split(split, layers, pp, vp)
    if not 0 <= stage < pp:
        raise SpecError(f"stage {stage} is outside 0..{pp - 1}")
    if not 0 <= chunk < vp:
        raise SpecError(f"chunk {chunk} is outside 0..{vp - 1}")
    if split.edges:
        first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
        middle_stages = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        middle = rest // (middle_stages * vp) if middle_stages else 0
        head = 0 if first is None else first // vp  # the first stage's layers in one round
        if stage == 0 and first is not None:
            start, size = 0, head
        else:
            start = head + (stage - (first is not None)) * middle
            size = last // vp if stage == pp - 1 and last is not None else middle
        start += chunk * (layers // vp)
        return range(start, start + size)
    embedding, loss = split.accounted
    size = (layers + embedding + loss) // (pp * vp)
    slot = (chunk * pp + stage) * size
    begin = max(slot - embedding, 0)
    end = min(slot + size - embedding, layers)
    return range(begin, end)


def rank_layers(layers: int, pp: int, stage: int, vp: int = 1, split: PipelineSplit = EVEN_SPLIT) -> tuple[int, ...]:
    """Every layer pipeline rank `stage` holds: its chunks' (at `vp` 1, its stage's), ascending."""
    return tuple(i for c in range(vp) for i in chunk_layers(layers, pp, stage, c, vp, split))


def stage_spec(spec: ModelSpec, pp: int, stage: int, layers: int | None = None, vp: int = 1,
               split: PipelineSplit = EVEN_SPLIT) -> ModelSpec:
    """The parameters pipeline stage `stage` holds: its layers (under the interleaved schedule,
    those of its `vp` chunks: `rank_layers`, cut by `split`); the embedding on the first stage (its
    first chunk); the parameters outside any layer (final norm, head) on the last (its last
    chunk). With tied embeddings (no head) the last stage also holds a copy of the embedding, as
    Megatron does for its output layer."""
    count = _layer_count(spec, layers)
    if pp == 1 and stage == 0 and vp == 1:
        return spec
    return _holding(spec, set(rank_layers(count, pp, stage, vp, split)), first=stage == 0, last=stage == pp - 1,
                    name=f"{spec.name}[stage {stage}/{pp}]")


def chunk_spec(spec: ModelSpec, pp: int, stage: int, chunk: int, layers: int | None = None, vp: int = 1,
               split: PipelineSplit = EVEN_SPLIT) -> ModelSpec:
    """The parameters model chunk `chunk` of pipeline stage `stage` holds (`chunk_layers`): what a
    micro-batch crosses on that rank before it moves on. The embedding is the first stage's first
    chunk's, the parameters outside any layer (and a tied embedding's copy) the last stage's last
    chunk's (`stage_spec`)."""
    count = _layer_count(spec, layers)
    return _holding(spec, set(chunk_layers(count, pp, stage, chunk, vp, split)),
                    first=stage == 0 and chunk == 0, last=stage == pp - 1 and chunk == vp - 1,
                    name=f"{spec.name}[stage {stage}/{pp} chunk {chunk}/{vp}]")


def _layer_count(spec: ModelSpec, layers: int | None) -> int:
    indices = [p.layer for p in spec.params if p.layer is not None]
    return layers if layers is not None else (max(indices) + 1 if indices else 0)


def _holding(spec: ModelSpec, mine: set[int], *, first: bool, last: bool, name: str) -> ModelSpec:
    """`spec`'s parameters of the layers `mine`, the embedding where `first`, and where `last`
    the parameters outside any layer and, tied (no head), the embedding's copy."""
    tied = not any(p.role == Role.HEAD for p in spec.params)
    out = []
    for p in spec.params:
        if p.layer is not None:
            keep = p.layer in mine
        elif p.role == Role.EMBEDDING:
            keep = first or (tied and last)
        else:
            keep = last
        if keep:
            out.append(p)
    return ModelSpec(name, tuple(out))


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
    warm = interleaved_warmup(stage, pp, vp, micro_batches)
    order = [_slot("F", k, pp, vp) for k in range(warm)]
    for k in range(total - warm):
        order += [_slot("F", warm + k, pp, vp), _slot("B", k, pp, vp)]
    order += [_slot("B", k, pp, vp) for k in range(total - warm, total)]
    return order


def _slot(kind: str, k: int, pp: int, vp: int) -> Slot:
    """The k-th forward (backward) of the interleaved schedule: micro-batch `(k // (pp * vp)) * pp
    + k % pp` on chunk `(k // pp) % vp` (backward: counted from the last chunk). At pp = vp = 1
    the k-th micro-batch on chunk 0."""
    group, within = divmod(k, pp * vp)
    chunk = within // pp
    return kind, group * pp + within % pp, chunk if kind == "F" else vp - 1 - chunk


Step = tuple[Slot | None, Slot | None]  # (forward, backward) run together; None: that pass idle


def combined_order(stage: int, pp: int, micro_batches: int, vp: int = 1) -> list[Step]:
    """The steps of Megatron's combined 1F1B schedule (`overlap_moe_expert_parallel_comm`,
    sim.ep_overlap) on rank `stage`: one forward micro-batch-chunk beside one backward one
    (megatron/core/pipeline_parallel/combined_1f1b.py). PP 1 (`combined_1f1b_schedule_for_no_
    pipelining`): forward 0 alone, then forward i beside backward i - 1, then the last backward
    alone. PP > 1 needs the interleaved schedule (vp > 1; schedules.py `forward_backward_pipelining_
    with_interleaving`): its order (`interleaved_one_f_one_b`) with one warm-up forward more
    (`get_pp_rank_microbatches`: "one extra micro-batch forward step before the 1f1b stages ... to
    ensure the forward and backward computations are independent"), capped by all of them; each
    steady-state forward k + warm-up runs beside backward k. Both cases are that rule: at pp = vp = 1
    the interleaved warm-up is 0, and one more is forward 0 alone."""
    if pp > 1 and vp == 1:
        raise SpecError(f"the combined 1F1B schedule at pp {pp} needs a virtual pipeline (vp > 1): Megatron "
                        "runs it only inside the interleaved schedule")
    check_vp(vp, pp, micro_batches=micro_batches)
    total = micro_batches * vp
    warm = min(interleaved_warmup(stage, pp, vp, micro_batches) + 1, total)
    steps: list[Step] = [(_slot("F", k, pp, vp), None) for k in range(warm)]
    steps += [(_slot("F", warm + k, pp, vp), _slot("B", k, pp, vp)) for k in range(total - warm)]
    steps += [(None, _slot("B", k, pp, vp)) for k in range(total - warm, total)]
    return steps


def pipeline_order(stage: int, pp: int, micro_batches: int, vp: int = 1) -> list[Slot]:
    """The order of stage `stage`'s forwards and backwards, (kind, micro-batch, chunk): 1F1B
    (`one_f_one_b`, chunk 0) at `vp` 1, the interleaved schedule above it."""
    if vp == 1:
        return [(kind, i, 0) for kind, i in one_f_one_b(stage, pp, micro_batches)]
    return interleaved_one_f_one_b(stage, pp, micro_batches, vp)


@lru_cache(maxsize=4096)  # pure, and asked again for every layout of a search (sim.search.memory_floor)
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


def peak_layers_in_flight(stage: int, pp: int, micro_batches: int | None, vp: int,
                          chunk_sizes: Sequence[float]) -> float:
    """The most layers' activations rank `stage` holds at once over `pipeline_order`: each
    micro-batch-chunk whose forward has run and whose backward has not holds its chunk's layers
    (`chunk_sizes[c]`; or any weight of a chunk, e.g. the bytes it holds). Equal chunks: a chunk's
    layers times `peak_in_flight`; an uneven split's fullest moment weighs each chunk by its own
    size. Without `micro_batches` as in `peak_in_flight`."""
    if len(chunk_sizes) != vp:
        raise SpecError(f"{len(chunk_sizes)} chunk sizes for vp {vp}")
    if vp == 1:
        return chunk_sizes[0] * peak_in_flight(stage, pp, micro_batches)
    return _peak_layers(stage, pp, micro_batches, vp, tuple(chunk_sizes))


@lru_cache(maxsize=4096)  # pure, and asked again for every layout of a search (sim.search.memory_floor)
def _peak_layers(stage: int, pp: int, micro_batches: int | None, vp: int, chunk_sizes: tuple[float, ...]) -> float:
    """`peak_layers_in_flight` under the interleaved schedule (`vp` > 1)."""
    if micro_batches is None:
        micro_batches = pp * (pp + 1)  # divisible by pp, and more than any warm-up (as peak_in_flight)
    held = peak = 0
    for kind, _, c in pipeline_order(stage, pp, micro_batches, vp):
        held += chunk_sizes[c] if kind == "F" else -chunk_sizes[c]
        peak = max(peak, held)
    return peak
