"""Single-device numerical references: Muon, SOAP, Shampoo, NorMuon, AdamW (docs/design.md §3), each a
`torch.optim.Optimizer` taking its defaults from `canzona.optimizers`, and `CombinedOptimizer`
(matrix optimizer + AdamW, routed by the model spec). The distributed runtime is verified against
these. (A tiny Qwen3-style model is added separately.)
"""

from reference.adamw import AdamW
from reference.combined import CombinedOptimizer
from reference.muon import Muon
from reference.normuon import NorMuon
from reference.shampoo import Shampoo
from reference.soap import SOAP

__all__ = ["AdamW", "CombinedOptimizer", "Muon", "NorMuon", "SOAP", "Shampoo"]
