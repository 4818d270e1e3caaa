"""
The plain pre-norms and the per-token statistics that model.py (TaperNorm, the GPT) and
baselines.py (FakeLN's FakeNorm) both build on; the bottom floor of the house: it imports
nothing of the repository's, so model.py can build the baselines' norms without a circle.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

if not hasattr(F, 'rms_norm'):  # the oldest torch this file runs on; newer APIs are guarded where used
    raise ImportError(f"tapernorm needs torch >= 2.4 (F.rms_norm); this is torch {torch.__version__}")


def norm_input(h, kind):
    """The vector a norm of this kind scales: h (RMS kind) or P h = h − mean(h) (LN kind)."""
    return h - h.mean(-1, keepdim=True) if kind == 'layernorm' else h


def norm_scale(h, kind, eps):
    """r(h) = sqrt(mean_i h_i² + ε) (RMS kind) or σ(h), the same of P h (LN kind).

    h: (..., d) -> (..., 1). This is also s(h), the scale L_aux anchors (docs/method.md §4).
    """
    x = norm_input(h, kind)
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Norm(nn.Module):
    """A plain pre-norm, RMSNorm or LayerNorm, through torch's fused ops.

    The baseline uses it everywhere and Internal-Taper keeps it as the final norm, so every
    speed comparison is against a fused norm. h: (..., d) -> (..., d).
    """

    def __init__(self, d, kind, bias, eps):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(d))                                       # γ
        self.bias = nn.Parameter(torch.zeros(d)) if kind == 'layernorm' and bias else None  # β

    def normalize(self, h):
        if self.kind == 'rmsnorm':
            return F.rms_norm(h, (h.size(-1),), self.weight, self.eps)
        return F.layer_norm(h, (h.size(-1),), self.weight, self.bias, self.eps)

    def forward(self, h, gate=None, pos=None):
        return self.normalize(h)


def all_reduce_flat(sums):
    """Statistics collected on each rank (a list of tensors) as one flat tensor, all-reduced over
    ranks under torch.distributed (one call, so every rank gets the same values from every rank's
    data); the sums themselves are zeroed. Returns (Σ numel,) in the order of `sums`."""
    flat = torch.cat([t.view(-1) for t in sums])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flat)
    torch._foreach_zero_(sums)  # one launch for every buffer (foreach: a fused kernel on CUDA)
    return flat


def all_reduce_sums(sums):
    """all_reduce_flat(sums) as a list of tensors shaped like `sums`."""
    flat = all_reduce_flat(sums)
    return [t.view_as(s) for t, s in zip(flat.split([s.numel() for s in sums]), sums)]
