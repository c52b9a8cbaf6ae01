"""torchtitan's selective layer activation checkpointing, `--recompute selective-layer` with
`--selective-ac-option K` (canzona.recompute, canzona.memory, sim.model_work, sim.fsdp): every K-th
TransformerBlock in a checkpoint wrapper (only its input stored, its forward run again before its
backward), the others storing everything; under --fsdp only."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import (
    LayerDims,
    MemorySetup,
    activation_breakdown,
    activation_bytes,
    layer_activation_bytes,
)
from canzona.models import resolve_model
from canzona.recompute import (
    FULL,
    RECOMPUTE_MODES,
    SELECTIVE_AC_DEFAULT,
    SELECTIVE_LAYER,
    SELECTIVE_OP,
    check_selective_ac_option,
    inside_layers,
    recompute_label,
    selective_layers,
)
from sim.model_work import micro_batch_work
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

LLAMA3_8B = LayerDims(32, 4096, 32, 14336, 128256, 8, 128, gated_mlp=True, dropout=False, qk_norm=False)
BASE = SimConfig(model="canzona/data/models/llama3-8b.json", gpus=8, tp=1, optimizer="adamw", fsdp=True,
                 workload=Workload(seq_len=2048, global_batch=8, micro_batch=1))


def _torchtitan_counter(k: int, layers: int) -> set[int]:
    """torchtitan's rule written as its code runs it (`_apply_ac_to_transformer_block`): a counter
    on the wrapper, from 0, incremented once per block in `model.layers` order; the block is
    wrapped when the counter is a multiple of k."""
    count, wrapped = 0, set()
    for layer in range(layers):
        count += 1
        if count % k == 0:
            wrapped.add(layer)
    return wrapped


def _run(mode: str, k: int | None = None, cfg: SimConfig = BASE):
    return simulate(replace(cfg, options=RunOptions(recompute=mode, selective_ac_option=k)))


def test_the_checkpointed_layers_are_torchtitans():
    """Every K-th block from the K-th on (0-based K - 1, 2K - 1, ...): k = 2 the odd layers, the
    counter running on over a rank's model chunks, none past the layers."""
    assert selective_layers(2, [range(8)]) == {1, 3, 5, 7}
    assert selective_layers(None, [range(8)]) == {1, 3, 5, 7} and SELECTIVE_AC_DEFAULT == 2
    assert selective_layers(3, [range(0, 4), range(8, 12)]) == {2, 9}  # the counter does not restart per chunk
    assert selective_layers(1, [range(5)]) == set(range(5))
    assert selective_layers(6, [range(5)]) == set()
    for k in (1, 2, 3, 5, 7, 32, 33):
        assert selective_layers(k, [range(32)]) == _torchtitan_counter(k, 32)
    assert inside_layers(SELECTIVE_LAYER, None, None, 4, [range(8)]) == {3, 7}
    assert inside_layers(FULL, None, None, None, [range(8)]) is None
    assert inside_layers(SELECTIVE_OP, None, None, None, [range(8)]) is None


def test_k_one_is_full_and_k_past_the_layers_is_none():
    """K = 1 wraps every block (full recompute); K past Llama 3 8B's 32 layers wraps none (no
    recompute): the same time and the same activations."""
    full, none = _run(FULL), _run("none")
    one, past = _run(SELECTIVE_LAYER, 1), _run(SELECTIVE_LAYER, 33)
    assert one.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert one.memory.worst.activations == full.memory.worst.activations
    assert past.iteration_time_s == pytest.approx(none.iteration_time_s, rel=1e-12)
    assert past.memory.worst.activations == none.memory.worst.activations


def test_every_other_layer_lies_strictly_between_none_and_full():
    none, two, full = _run("none"), _run(SELECTIVE_LAYER), _run(FULL)
    assert none.iteration_time_s < two.iteration_time_s < full.iteration_time_s
    assert none.memory.worst.activations > two.memory.worst.activations > full.memory.worst.activations
    # half the layers re-run: about half of full recompute's extra time (the same forwards, each once)
    extra = (two.iteration_time_s - none.iteration_time_s) / (full.iteration_time_s - none.iteration_time_s)
    assert 0.4 < extra < 0.6


def test_memory_by_hand():
    """K = 2 over 32 layers: 16 layers whole, 16 inputs, and while the last layer (the 32nd, a
    checkpointed one) is recomputed its whole activations beside its input; K = 3: 10
    checkpointed (the 3rd, ..., the 30th), 22 whole, and the 31st and 32nd, stored whole, freed
    by the backward before the 30th's re-run: no working set beyond the held layers."""
    setup = MemorySetup(seq_len=8192, recompute=SELECTIVE_LAYER)
    none = layer_activation_bytes(LLAMA3_8B, setup, 1, "none")
    kept = layer_activation_bytes(LLAMA3_8B, setup, 1, FULL)
    parts = activation_breakdown(LLAMA3_8B, setup, 1)
    assert parts["layers"] == pytest.approx(16 * none + 16 * kept)
    assert parts["recompute_working_set"] == pytest.approx(none - kept)
    three = activation_breakdown(LLAMA3_8B, replace(setup, selective_ac_option=3), 1)
    assert three["layers"] == pytest.approx(22 * none + 10 * kept)
    assert three["recompute_working_set"] == 0
    past = activation_breakdown(LLAMA3_8B, replace(setup, selective_ac_option=40), 1)
    assert past["layers"] == pytest.approx(32 * none) and past["recompute_working_set"] == 0
    with pytest.raises(SpecError, match="by its position"):
        layer_activation_bytes(LLAMA3_8B, setup, 1)


@pytest.mark.parametrize("tp", [1, 8])
def test_the_modes_order_the_search_relies_on(tp):
    """selective-layer last in RECOMPUTE_MODES: at any K > 1 it stores more than full; at TP 1 its
    default stores more than selective-op too (under TP less: selective-op keeps its row-parallel
    outputs whole). No place in a static list orders it by memory, which is why the search orders a
    layout's settings by their time floors instead (`sim.search.search`'s rounds)."""
    assert RECOMPUTE_MODES[-2:] == (FULL, SELECTIVE_LAYER)
    setup = MemorySetup(seq_len=8192, micro_batch=1)
    full = activation_bytes(LLAMA3_8B, replace(setup, recompute=FULL), tp)
    op = activation_bytes(LLAMA3_8B, replace(setup, recompute=SELECTIVE_OP), tp)
    for k in (2, 3, 8, 31, 32):
        assert activation_bytes(LLAMA3_8B, replace(setup, recompute=SELECTIVE_LAYER, selective_ac_option=k), tp) > full
    two = activation_bytes(LLAMA3_8B, replace(setup, recompute=SELECTIVE_LAYER), tp)
    assert (two > op) == (tp == 1)


def test_checkpointed_layers_rerun_their_forward():
    """A checkpointed layer's backward is the uncheckpointed one's plus its forward again."""
    spec, arch = resolve_model("canzona/data/models/llama3-8b.json")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, 1, 2048, 2048, arch.q_dim, arch.hidden, arch.vocab, rate)
    inside = selective_layers(2, [range(arch.layers)])
    work = micro_batch_work(*args, recompute=SELECTIVE_LAYER, checkpointed=inside, kv_dim=arch.kv_dim)
    plain = micro_batch_work(*args, kv_dim=arch.kv_dim)
    assert work.uncheckpointed == frozenset(range(0, 32, 2))
    for k in range(arch.layers):
        fwd = sum(b.seconds for b in plain.forward[k])
        bwd, base = sum(b.seconds for b in work.backward[k]), sum(b.seconds for b in plain.backward[k])
        assert bwd == pytest.approx(base + fwd if k % 2 else base, rel=1e-12)
        assert not work.no_grad(k, SELECTIVE_LAYER)  # torch's non-reentrant wrapper keeps grad on
    with pytest.raises(SpecError, match="needs the checkpointed layers"):
        micro_batch_work(*args, recompute=SELECTIVE_LAYER, kv_dim=arch.kv_dim)


@pytest.mark.parametrize("mode, k, fsdp, needle", [
    (SELECTIVE_LAYER, 0, True, "must be a whole number >= 1"),
    (SELECTIVE_LAYER, -2, True, "must be a whole number >= 1"),
    (SELECTIVE_LAYER, True, True, "must be a whole number >= 1"),
    (SELECTIVE_LAYER, 2.0, True, "must be a whole number >= 1"),
    ("none", 2, True, "is for --recompute selective-layer"),
    (FULL, 2, True, "is for --recompute selective-layer"),
    (SELECTIVE_LAYER, None, False, "simulated under --fsdp"),
])
def test_option_errors_are_one_line(mode, k, fsdp, needle):
    with pytest.raises(SpecError, match=needle) as e:
        check_selective_ac_option(mode, k, fsdp)
    assert "\n" not in str(e.value)
    if k is None or isinstance(k, int) and not isinstance(k, bool):
        with pytest.raises(SpecError, match=needle):
            replace(BASE, fsdp=fsdp, options=RunOptions(recompute=mode, selective_ac_option=k)).check()


def test_label():
    assert recompute_label(SELECTIVE_LAYER) == "selective-layer (every 2)"
    assert recompute_label(SELECTIVE_LAYER, every=4) == "selective-layer (every 4)"


ARGS = ["--model", "canzona/data/models/llama3-8b.json", "--gpus", "8", "--tp", "1", "--optimizer", "adamw",
        "--seq-len", "1024", "--global-batch", "8"]


def test_cli_round_trip_and_errors():
    result = invoke("simulate", *ARGS, "--fsdp", "--recompute", "selective-layer", "--selective-ac-option", "4",
                    "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert (d["options"]["recompute"], d["options"]["selective_ac_option"]) == ("selective-layer", 4)
    table = invoke("simulate", *ARGS, "--fsdp", "--recompute", "selective-layer")
    assert table.exit_code == 0 and "recompute selective-layer (every 2)" in " ".join(table.stdout.split())
    error_line(invoke("simulate", *ARGS, "--fsdp", "--recompute", "selective-layer", "--selective-ac-option", "0"),
               "--selective-ac-option must be a whole number >= 1")
    error_line(invoke("simulate", *ARGS, "--fsdp", "--selective-ac-option", "2"), "is for --recompute selective-layer")
    error_line(invoke("simulate", *ARGS, "--recompute", "selective-layer"), "simulated under --fsdp")
