"""
Norm-removal baselines that are not TaperNorm: the norms a GPT gets with norm='dyt'.

DyT (Zhu, Chen, He, LeCun & Liu, "Transformers without Normalization", CVPR 2025,
arXiv 2503.10622) replaces every norm, the final one too, by an elementwise squashing map with no
per-token statistics. Unlike a linear-phase TaperNorm it is not linear, so it never folds into the
next layer (fold.py and bench.py refuse a DyT checkpoint). Imported by model.GPT only when used.
"""

import torch
import torch.nn as nn

# α₀ by position: the DyT paper's initialization for its language models (LLaMA-2 7B, its
# narrowest LLM: 0.8 before attention, 0.2 before the MLP and at the final norm). The paper finds
# the best α₀ set mostly by width, larger for narrower models; this repository's models are far
# narrower than 7B, so these values are the paper's recipe, not a tuned optimum.
DYT_ALPHA0 = {'ln_1': 0.8, 'ln_2': 0.2, 'ln_f': 0.2}


class DyT(nn.Module):
    """DyT(h) = γ ⊙ tanh(α · h) + β   (arXiv 2503.10622, eq. 1).

    α: one learnable scalar per module, initialized to alpha0; γ (`weight`), β (`bias`): learnable
    per-channel vectors, initialized to ones and zeros (β is always there, as in the paper, whatever
    config.bias says). It takes the same (h, gate, pos) as the other norms and ignores the last two.
    h: (..., d) -> (..., d).
    """

    def __init__(self, d, alpha0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((), float(alpha0)))  # α
        self.weight = nn.Parameter(torch.ones(d))                 # γ
        self.bias = nn.Parameter(torch.zeros(d))                  # β

    def forward(self, h, gate=None, pos=None):
        return torch.tanh(self.alpha * h) * self.weight + self.bias
