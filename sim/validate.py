"""The simulator against the runtime (`canzona validate`): predicted against measured step times.

The runtime trains one model under every step policy on spawned gloo ranks
(`canzona.harness.validate`); the simulator is given the same model, world, batch and a hardware
profile calibrated on the same machine, with the runtime's way of running: parameters all-gathered
inside `step()` (not overlapped with the next forward), no TP, fp32 model. Compared per policy:

- step: end of the backward's compute to parameters updated and gathered (the runtime's
  `optimizer.step()`: waiting for the last reduce-scatters, the update, the parameter all-gather);
- iteration: forward + backward + step.

The ranking of the policies is compared with Kendall's tau (scipy): 1 means the same order. It is
preserved when no pair measured clearly apart (more than `NOISE`) is predicted the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from canzona.decoder import Architecture
from canzona.spec import ModelSpec
from sim.options import RunOptions
from sim.simulate import SimConfig, SimResult, simulate
from sim.workload import Workload

# the runtime's parameters, gradients and activations in the validation model: fp32
RUNTIME_BYTES = 4
# Step times closer than this are ties: interleaved medians on a shared machine move by a few percent
NOISE = 0.05


@dataclass(frozen=True)
class Comparison:
    policy: str
    measured_step_s: float
    predicted_step_s: float
    measured_iteration_s: float
    predicted_iteration_s: float

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0

    @property
    def iteration_error(self) -> float:
        return self.predicted_iteration_s / self.measured_iteration_s - 1.0


@dataclass(frozen=True)
class Report:
    rows: tuple[Comparison, ...]
    step_tau: float
    iteration_tau: float

    @property
    def discordant(self) -> list[tuple[str, str]]:
        """Pairs (a, b) measured clearly faster for a (by more than `NOISE`) but predicted
        strictly slower: the ranking errors that matter. Pairs closer than the noise are ties."""
        out = []
        for a in self.rows:
            for b in self.rows:
                if a.measured_step_s * (1 + NOISE) < b.measured_step_s and a.predicted_step_s > b.predicted_step_s:
                    out.append((a.policy, b.policy))
        return out

    @property
    def ranking_preserved(self) -> bool:
        return not self.discordant

    @property
    def worst_step_error(self) -> float:
        return max(abs(r.step_error) for r in self.rows)

    def to_dict(self) -> dict:
        return {
            "rows": [{"policy": r.policy, "measured_step_s": r.measured_step_s, "predicted_step_s": r.predicted_step_s,
                      "step_error": r.step_error, "measured_iteration_s": r.measured_iteration_s,
                      "predicted_iteration_s": r.predicted_iteration_s, "iteration_error": r.iteration_error}
                     for r in self.rows],
            "step_kendall_tau": self.step_tau,
            "iteration_kendall_tau": self.iteration_tau,
            "ranking_preserved": self.ranking_preserved,
            "discordant_pairs": [list(p) for p in self.discordant],
            "worst_step_error": self.worst_step_error,
        }


def runtime_config(policy: str, dp: int, seq_len: int, batch_per_rank: int, optimizer: str, hardware: str,
                   name: str) -> SimConfig:
    """The simulated counterpart of the runtime's validation run (the runtime's defaults: the step's
    parameter all-gathers under the next forward)."""
    wl = Workload(seq_len=seq_len, global_batch=dp * batch_per_rank, micro_batch=batch_per_rank,
                  grad_bytes=RUNTIME_BYTES, param_bytes=RUNTIME_BYTES, activation_bytes=RUNTIME_BYTES,
                  dtype="fp32")
    return SimConfig(model=name, gpus=dp, tp=1, optimizer=optimizer, policy=policy, hardware=hardware, workload=wl,
                     options=RunOptions(overlap_param_gather=True, tp_comm_overlap=False, collectives="runtime"),
                     zero1_fallback=False,
                     # the runtime's ranks are the calibrated machine's own: no fleet of GPUs of one
                     # model whose slowest the job would wait for (canzona.variability)
                     gpu_variability=0.0)


def predict(policies: Sequence[str], spec: ModelSpec, arch: Architecture, dp: int, seq_len: int,
            batch_per_rank: int, optimizer: str, hardware: str) -> dict[str, SimResult]:
    return {p: simulate(runtime_config(p, dp, seq_len, batch_per_rank, optimizer, hardware, spec.name),
                        model=(spec, arch)) for p in policies}


def predicted_step_s(r: SimResult) -> float:
    """End of the backward's compute to parameters updated and gathered."""
    return r.iteration_time_s - r.forward_backward_s


def _tau(a: Sequence[float], b: Sequence[float]) -> float:
    from scipy.stats import kendalltau  # on use: scipy.stats is slow to import

    if len(a) < 2:
        return 1.0
    tau = kendalltau(a, b).statistic
    return 1.0 if tau != tau else float(tau)  # NaN: every value tied on one side


def compare(measured: Mapping[str, object], predicted: Mapping[str, SimResult]) -> Report:
    """`measured[policy]` has `step_s` and `iteration_s` (a `canzona.harness.validate.Measured`)."""
    rows = tuple(Comparison(p, m.step_s, predicted_step_s(predicted[p]), m.iteration_s,
                            predicted[p].iteration_time_s)
                 for p, m in measured.items())
    return Report(rows,
                  _tau([r.measured_step_s for r in rows], [r.predicted_step_s for r in rows]),
                  _tau([r.measured_iteration_s for r in rows], [r.predicted_iteration_s for r in rows]))
