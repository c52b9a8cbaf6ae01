"""Fused attention's achieved throughput by shape, from published measurements (docs/design.md §9.3).

`canzona/data/attention_throughput.json` holds the bf16 TFLOP/s the FlashAttention-3 paper
(arXiv 2407.08608, Figures 5 and 6) measured on an H100 SXM5 for cuDNN's fused attention and for
FlashAttention-3, by sequence length (512 to 16k), head dimension (64, 128, 256), causal mask or
not, forward and backward. Megatron / NeMo bf16 recipes run Transformer Engine's fused attention,
whose Hopper backend is cuDNN's (when both can run, TE's `get_attention_backend` disables
flash-attention "to give FusedAttention preference on Hopper+": NVIDIA/TransformerEngine,
transformer_engine/pytorch/attention/dot_product_attention/utils.py), so the cuDNN series is the
proxy for what those runs' attention reaches. A run that chose Transformer Engine's FlashAttention
backend instead (Megatron's `--attention-backend flash`, or TE's `NVTE_FUSED_ATTN=0`, as NeMo
24.07's launcher did) ran the flash-attn 2 package under Transformer Engine 1.x: the same paper's
FlashAttention-2 series (`ATTENTION_BACKENDS`; head dim 128 only, held at other head dims).

`efficiency(pass, causal, seq, head_dim)` is that throughput as a fraction of the H100's dense
bf16 peak (989 TFLOP/s), interpolated linearly in log2(seq) and in log2(head_dim) between the
measured points and held at the table's ends. Callers multiply it by their device's bf16 peak: the
table's fraction stands for every profile (the H200 has the H100's GH100 compute; on other
devices this is an assumption, labelled in design.md §9.3).

Each figure is the mean of a short benchmark loop started on a cool GPU (the table's `protocol`:
FlashAttention-3's benchmark sleeps 1 s "to avoid residual power throttling", then times 30 calls
after 2 untimed ones), so it ran largely at the boost clock, where a training step's attention runs
among seconds of GEMMs at the power-limited clock. `efficiency(..., clock=, window_s=)` converts
each measured point to that clock as the GEMM model's rows are priced (`canzona.gemm_model`:
boost for the power controller's `window_s` of load, then `clock` x boost; an attention call's time
scales as 1 / clock, a tensor-core-bound kernel's: an assumption, as is that attention runs at the
clock the GEMMs sustain), before interpolating; `clock` 1 (the default) keeps the table's figures.
The conversion is the measuring GPU's (the protocol's `profiles`: H100 SXM, and H200 on the same
die and power limit, `measured_on`); on another device (A100) the fractions are a proxy, checked
against its own power-limited measurements (`canzona.attention_checks`), and used as they are.

The paper publishes no causal backward panel. The causal backward is taken as the non-causal
backward scaled by the ratio the causal mask costs the forward at the same sequence and head
dimension (`causal forward / non-causal forward`): an assumption, that the masked diagonal tiles
and the uneven work per query tile cost both passes alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources

from canzona.errors import SpecError
from canzona.fileio import parse_json
from canzona.gemm_model import sustained_seconds
from canzona.hardware import efficiency_on

SCHEMA = "canzona.attention_throughput"
# the H100 SXM's dense bf16 peak, the denominator of the table's fractions (NVIDIA H100 datasheet;
# the same figure as profiles/h100-sxm.json's gpu.peak_flops.bf16)
TABLE_PEAK_FLOPS = 989e12
IMPLEMENTATION = "cudnn"  # Transformer Engine's fused attention on Hopper: the module docstring
# Megatron's `--attention-backend` (its AttnBackend names) -> the table's series. "fused": TE's
# FusedAttention, cuDNN's kernels (what "auto" resolves to on Hopper: the module docstring);
# "flash": TE's FlashAttention backend, the flash-attn 2 package under Transformer Engine 1.x
# (NeMo 24.07's launcher chose it with NVTE_FUSED_ATTN=0), the paper's FlashAttention-2 series
ATTENTION_BACKENDS = {"fused": IMPLEMENTATION, "flash": "fa2"}
DEFAULT_ATTENTION_BACKEND = "fused"
PASSES = ("forward", "backward")
# A flash-attention backward pass does 2.5x the forward's FLOPs (five matmuls against two: Dao
# 2023, arXiv 2307.08691, section 3.1; the FLOP count of the throughput table's backward figures)
ATTENTION_BACKWARD = 2.5


@dataclass(frozen=True, kw_only=True)
class BenchLoop:
    """How the table's figures were measured: each call over `tokens` tokens (batch x seqlen) of a
    `hidden`-wide attention, `warmup` untimed then `iters` timed calls from a cool GPU."""

    tokens: int
    hidden: int
    warmup: int
    iters: int
    # the hardware profiles whose GPU ran the loop (or shares its die): their clock converts it
    profiles: tuple[str, ...] = ()

    def call_flops(self, pass_: str, causal: bool, seq: float) -> float:
        """FLOPs of one measured call at sequence length `seq` (the table's convention)."""
        forward = 4.0 * self.tokens * seq * self.hidden * (0.5 if causal else 1.0)
        return forward * (ATTENTION_BACKWARD if pass_ == "backward" else 1.0)


@dataclass(frozen=True, kw_only=True)
class AttentionTable:
    """Measured TFLOP/s by (implementation, pass, causal, head_dim): one value per `seqlens` entry;
    `protocol`: the benchmark loop they come from (None: not known, the figures taken as sustained)."""

    seqlens: tuple[int, ...]
    series: dict[tuple[str, str, bool, int], tuple[float, ...]]
    protocol: BenchLoop | None = None
    # series converted to a sustained clock, by (series key, clock, window): filled on use
    _sustained: dict[tuple, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)

    def measured(self, implementation: str, pass_: str, causal: bool, head_dim: int) -> tuple[float, ...] | None:
        return self.series.get((implementation, pass_, causal, head_dim))

    def head_dims(self, implementation: str, pass_: str, causal: bool) -> list[int]:
        return sorted(h for (i, p, c, h) in self.series if (i, p, c) == (implementation, pass_, causal))


def table_from_dict(data: object, where: str = "attention table") -> AttentionTable:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecError(f"{where}: not a {SCHEMA} file")
    seqlens = data.get("seqlens")
    if not (isinstance(seqlens, list) and seqlens and all(isinstance(s, int) and s > 0 for s in seqlens)
            and seqlens == sorted(set(seqlens))):
        raise SpecError(f"{where}: seqlens must be increasing positive whole numbers")
    series = {}
    for i, row in enumerate(data.get("series") or []):
        ok = (isinstance(row, dict) and row.get("pass") in PASSES and isinstance(row.get("causal"), bool)
              and isinstance(row.get("head_dim"), int) and isinstance(row.get("implementation"), str)
              and isinstance(row.get("tflops"), list) and len(row["tflops"]) == len(seqlens)
              and all(isinstance(x, (int, float)) and 0 < x < TABLE_PEAK_FLOPS / 1e12 for x in row["tflops"]))
        if not ok:
            raise SpecError(f"{where}: series {i} must give implementation, pass, causal, head_dim and one "
                            f"TFLOP/s below the peak per seqlen")
        series[(row["implementation"], row["pass"], row["causal"], row["head_dim"])] = tuple(
            float(x) for x in row["tflops"])
    raw = data.get("protocol")
    protocol = None
    if raw is not None:
        keys = ("tokens", "hidden", "warmup", "iters")
        if not (isinstance(raw, dict) and all(isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool)
                                              for k in keys)
                and raw["tokens"] > 0 and raw["hidden"] > 0 and raw["warmup"] >= 0 and raw["iters"] > 0):
            raise SpecError(f"{where}: protocol must give tokens, hidden and iters (positive) and warmup (>= 0) "
                            "as whole numbers")
        profiles = raw.get("profiles", [])
        if not (isinstance(profiles, list) and all(isinstance(p, str) and p for p in profiles)):
            raise SpecError(f"{where}: protocol.profiles must be a list of hardware profile names")
        protocol = BenchLoop(**{k: raw[k] for k in keys}, profiles=tuple(profiles))
    return AttentionTable(seqlens=tuple(seqlens), series=series, protocol=protocol)


@functools.cache
def default_table() -> AttentionTable:
    text = (resources.files("canzona") / "data" / "attention_throughput.json").read_text()
    return table_from_dict(parse_json(text, "attention_throughput.json", SpecError), "attention_throughput.json")


def check_attention_backend(backend: str) -> str:
    """The table's implementation of a Megatron attention backend (`ATTENTION_BACKENDS`)."""
    if backend not in ATTENTION_BACKENDS:
        raise SpecError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    return ATTENTION_BACKENDS[backend]


def measured_on(profile: str, table: AttentionTable | None = None) -> bool:
    """Whether `profile`'s GPU ran the table's loops (or shares their die): there the measured
    loops are converted to the profile's power-limited clock; elsewhere the fractions are a proxy
    taken as they are (the module docstring)."""
    loop = (table or default_table()).protocol
    return loop is not None and profile in loop.profiles


def _sustained(table: AttentionTable, key: tuple[str, str, bool, int], clock: float,
               window_s: float) -> tuple[float, ...]:
    """A series' TFLOP/s at the power-limited clock `clock` x boost (the module docstring); the
    table's own figures without a protocol or a clock below 1."""
    measured = table.series[key]
    loop = table.protocol
    if loop is None or clock >= 1.0:
        return measured
    cached = table._sustained.get((key, clock, window_s))
    if cached is None:
        _, pass_, causal, _ = key
        out = []
        for seq, tflops in zip(table.seqlens, measured):
            flops = loop.call_flops(pass_, causal, seq)
            seconds = sustained_seconds(flops / (tflops * 1e12), clock, window_s, loop.warmup, loop.iters)
            out.append(flops / seconds / 1e12)
        cached = table._sustained[(key, clock, window_s)] = tuple(out)
    return cached


def _tflops(table: AttentionTable, implementation: str, pass_: str, causal: bool, seq: float,
            head_dim: int, clock: float, window_s: float) -> float | None:
    dims = table.head_dims(implementation, pass_, causal)
    if not dims:
        return None
    by_dim = [(float(h), efficiency_on(tuple(zip(table.seqlens, _sustained(
        table, (implementation, pass_, causal, h), clock, window_s))), seq)) for h in dims]
    return efficiency_on(tuple(by_dim), head_dim)


def efficiency(pass_: str, causal: bool, seq: float, head_dim: int, *, implementation: str = IMPLEMENTATION,
               table: AttentionTable | None = None, clock: float = 1.0, window_s: float = 0.0) -> float:
    """Fraction of the dense bf16 peak one fused attention call reaches: `seq` the keys each query
    attends over (the sequence, or a CP ring step's block), `head_dim` the head dimension;
    `clock` < 1: under sustained load at that fraction of the boost clock, the measured loops
    converted with the power controller's boost window `window_s` (the module docstring)."""
    if pass_ not in PASSES:
        raise SpecError(f"attention pass must be one of {', '.join(PASSES)}, got {pass_!r}")
    if seq <= 0 or head_dim <= 0:
        raise SpecError(f"attention needs a positive sequence and head dimension, got {seq} and {head_dim}")
    if not 0.0 < clock <= 1.0 or window_s < 0.0:
        raise SpecError(f"attention clock must be in (0, 1] and its boost window >= 0 s, got {clock} and {window_s}")
    table = table or default_table()
    measured = _tflops(table, implementation, pass_, causal, seq, head_dim, clock, window_s)
    if measured is None and pass_ == "backward" and causal:  # derived: the module docstring
        full = _tflops(table, implementation, "backward", False, seq, head_dim, clock, window_s)
        fwd_causal = _tflops(table, implementation, "forward", True, seq, head_dim, clock, window_s)
        fwd_full = _tflops(table, implementation, "forward", False, seq, head_dim, clock, window_s)
        if None not in (full, fwd_causal, fwd_full):
            measured = full * fwd_causal / fwd_full  # type: ignore[operator]
    if measured is None:
        raise SpecError(f"no published {implementation} attention throughput for the {pass_} pass "
                        f"({'causal' if causal else 'no mask'})")
    return measured * 1e12 / TABLE_PEAK_FLOPS
