"""The attention table's fractions checked on another device (docs/design.md §9.3):
`python -m canzona.attention_checks` prints each published measurement of
`canzona/data/attention_checks.json` beside what the simulator prices it at.

`canzona.attention_rate` holds measured throughput of one device (H100 SXM5, cuDNN) as fractions of
its dense bf16 peak and prices fused attention on every profile at that fraction of the profile's
peak. The rows here were measured on other devices (A100: FlashAttention-2; H200: cuDNN) and say
how far that proxy is from them. A forward+backward row is one forward and one backward call: its
rate is the FLOP-weighted harmonic mean of the two passes (the backward does `ATTENTION_BACKWARD`
times the forward's FLOPs). On a profile whose GPU shares the table's die (`measured_on`: H200) the
simulator converts the table's loops to the power-limited clock of a training step, and so does
`model_tflops`."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from canzona.attention_rate import ATTENTION_BACKWARD, efficiency, measured_on
from canzona.hardware import load_profile

CHECKS = "attention_checks.json"  # canzona/data


def checks() -> list[dict[str, Any]]:
    """The rows of canzona/data/attention_checks.json, each with its source's citation under `cite`."""
    data = json.loads((resources.files("canzona") / "data" / CHECKS).read_text())
    return [dict(row, cite=data["sources"][row["source"]]) for row in data["rows"]]


def model_tflops(row: dict[str, Any]) -> float:
    """TFLOP/s the simulator prices the row's call at on the row's profile (bf16 peak x the
    table's fraction, at the power-limited clock where the simulator converts the table to it, as
    `sim.model_work` does; forward+backward: both passes, FLOP-weighted)."""
    profile = load_profile(row["profile"])
    peak = profile.gpu.peak_flops["bf16"]
    power = profile.gemm_kernels()
    clock = dict(clock=power.sustained_clock, window_s=power.boost_window_s) \
        if measured_on(row["profile"]) else {}

    def rate(pass_: str) -> float:
        return peak * efficiency(pass_, row["causal"], row["seq"], row["head_dim"], **clock) / 1e12

    if row["pass"] == "forward+backward":
        return (1 + ATTENTION_BACKWARD) / (1 / rate("forward") + ATTENTION_BACKWARD / rate("backward"))
    return rate(row["pass"])


def main() -> None:
    """Print each row beside the model (`python -m canzona.attention_checks`)."""
    print(f"{'profile':9} {'impl':5} {'pass':16} {'mask':6} {'hd':>4} {'seq':>6} {'measured':>9} {'model':>7} "
          f"{'error':>7}  use")
    for row in checks():
        got = model_tflops(row)
        print(f"{row['profile']:9} {row['implementation']:5} {row['pass']:16} {'causal' if row['causal'] else 'none':6} "
              f"{row['head_dim']:4} {row['seq']:6} {row['tflops']:9.1f} {got:7.1f} {got / row['tflops'] - 1:+7.1%}  "
              f"{row['use']}")


if __name__ == "__main__":
    main()
