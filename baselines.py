"""
Norm-removal baselines beside TaperNorm: FakeLN's norms (norm_removal='fakeln', docs/method.md §7)
and the norm-free DyT (norm='dyt') and Derf (norm='derf'). model.GPT builds their norms from its
config; this file stands on norms.py alone, below model.py (the floors: norms.py < baselines.py <
model.py).

FakeLN removes the norms of a trained model one kind at a time, each replaced by fixed scalars;
a removed norm is linear and folds like a linear-phase TaperNorm (fold.py).

DyT (Zhu, Chen, He, LeCun & Liu, "Transformers without Normalization", CVPR 2025,
arXiv 2503.10622) and Derf (Chen, Lu, Zhu, Sun & Liu, "Stronger Normalization-Free Transformers",
arXiv 2512.10938, by DyT's group) replace every norm, the final one too, by an elementwise
squashing map with no per-token statistics (NORM_FREE). Unlike a linear-phase TaperNorm neither is
linear, so neither folds into the next layer (fold.py and bench.py refuse such a checkpoint).
"""

import torch
import torch.nn as nn

from norms import Norm, all_reduce_sums, norm_input, norm_scale

# what FakeLN's removal events remove, in order (docs/method.md §7): event k is due at k · fakeln_interval
FAKELN_EVENTS = ('ln_2', 'ln_1', 'ln_f', 'first_position')

# α₀ by position: the DyT paper's initialization for its language models (LLaMA-2 7B, its
# narrowest LLM: 0.8 before attention, 0.2 before the MLP and at the final norm). The paper finds
# the best α₀ set mostly by width, larger for narrower models; this repository's models are far
# narrower than 7B, so these values are the paper's recipe, not a tuned optimum. On the quick start
# neither 5× nor 0.25× these keeps the final DyT from saturating (docs/results.md).
DYT_ALPHA0 = {'ln_1': 0.8, 'ln_2': 0.2, 'ln_f': 0.2}


class DyT(nn.Module):
    """DyT(h) = γ ⊙ tanh(α · h) + β   (arXiv 2503.10622, eq. 1).

    α: one learnable scalar per module, initialized to alpha0; γ (`weight`), β (`bias`): learnable
    per-channel vectors, initialized to ones and zeros (β is always there, as in the paper, whatever
    config.bias says). α, γ and β are not weight-decayed (train.configure_optimizer decays only
    tensors of two or more dimensions).

    A DyT model also gets the DyT paper's recipe for language models (its §"Large Language
    Models"): a learnable scalar multiplies the embeddings before the first block, √d at init
    (GPT.embed_scale; GPTConfig.dyt_embed_scale=False leaves it out). Without it the first DyT's
    input is the embeddings' sum, RMS near 0.03 (wte and wpe of std 0.02), about 30× below the
    unit RMS that RMSNorm's output has, and the paper reports that training "struggles to
    progress"; here, without it, DyT stalled early and ended 5-31 % above the baseline
    (docs/results.md, part 3, block 5). The scalar is not weight-decayed either. It takes the same (h, gate, pos) as the other norms and ignores the
    last two. h: (..., d) -> (..., d).
    """

    MAP = 'tanh(α·h)'  # in fold.py's and bench.py's refusals
    SATURATES = "|α·h| past float32's tanh' range, about 9"  # tanh' = 1 − tanh² is exactly 0 once tanh rounds to ±1

    def __init__(self, d, alpha0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((), float(alpha0)))  # α
        self.weight = nn.Parameter(torch.ones(d))                 # γ
        self.bias = nn.Parameter(torch.zeros(d))                  # β

    def forward(self, h, gate=None, pos=None):
        return torch.tanh(self.alpha * h) * self.weight + self.bias


# s₀: Derf's shift at init, 0 in every model family of the authors' code (see Derf)
DERF_SHIFT0 = 0.0


class Derf(nn.Module):
    """Derf(h) = γ ⊙ erf(α · h + s) + β   (arXiv 2512.10938, "Dynamic erf"; eq. 10 in a summary's
    numbering, erf(αx + s) in the paper's own figure and abstract). erf is the standard error
    function, 2/√π ∫₀ᶻ exp(−t²) dt (torch.erf), the rescaled Gaussian CDF the paper names.

    Where each constant comes from:
    - α and s (`shift`): one learnable scalar each per module, s initialized to 0 (DERF_SHIFT0),
      as in the authors' code (github.com/zlab-princeton/Derf: every model family's Dynamic_erf
      has an α and a shift of one element, shift_init_value=0.0). Scalars, not per-channel vectors.
    - α₀: the Derf paper's values for its GPT-2 runs were not found in the text this repository
      could read. The authors' GPT-2 code takes three α₀, before attention, before the MLP and at
      the final norm, from the command line (placeholder defaults 1.0; 0.5 in its other models), the
      split of DyT's LLM recipe. This repository's choice: DyT's LLM α₀ by position (DYT_ALPHA0,
      times GPTConfig.dyt_alpha0_scale), so that DyT and Derf models here differ in the map and
      the shift only. At the same α, erf'(0) = 2/√π ≈ 1.13: Derf is 13 % steeper at 0 than DyT.
    - γ (`weight`), β (`bias`): learnable per-channel vectors, ones and zeros (β always there, as in
      the authors' code, whatever config.bias says).
    - the embedding scalar: the authors' GPT-2 code multiplies the embeddings by one learnable
      scalar, √d at init, for Derf as for DyT (its `shared_scale`): here it is DyT's, GPT.embed_scale
      (dyt_embed_scale; GPTConfig.dyt_embed_scale=False leaves it out).

    What this repository does differently: α₀ (DyT's, above, not a value the Derf paper tuned for
    GPT-2); α and s are 0-dim tensors (the authors' have shape (1,): the same values and updates).
    α, s, γ, β and the embedding scalar are not weight-decayed (as DyT's).

    Saturation, as DyT's: erf rounds to ±1 in float32 from |α·h + s| ≈ 3.9, but its gradient
    2/√π · exp(−(α·h + s)²) is computed from the input and becomes exactly 0 only past ≈ 10.2, where
    exp underflows; past it at every entry of ln_f no gradient reaches the residual stream
    (final_dyt_saturated covers Derf). Same (h, gate, pos) as the other norms, the last two
    ignored. h: (..., d) -> (..., d).
    """

    MAP = 'erf(α·h + s)'
    SATURATES = "|α·h + s| past float32's erf' range, about 10.2"  # exp(−z²) underflows to exactly 0

    def __init__(self, d, alpha0, shift0=DERF_SHIFT0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((), float(alpha0)))  # α
        self.shift = nn.Parameter(torch.full((), float(shift0)))  # s
        self.weight = nn.Parameter(torch.ones(d))                 # γ
        self.bias = nn.Parameter(torch.zeros(d))                  # β

    def forward(self, h, gate=None, pos=None):
        return torch.erf(self.alpha * h + self.shift) * self.weight + self.bias


# GPTConfig.norm of the norm-free baselines -> the class of every norm in such a model (model.GPT)
NORM_FREE = {'dyt': DyT, 'derf': Derf}

# train.py's one line, the first time final_dyt_saturated is true (saturation_warning fills it in)
SATURATED = ("warning: iteration {it}: the final {name} saturated ({how} at every entry of ln_f): no "
             "gradient reaches the blocks or the embeddings until it desaturates. On the quick start DyT "
             "with its paper's recipe never recovered, nor trained at a 4x lower rate (docs/results.md, "
             "\"DyT on the quick start\"); compare against norm='rmsnorm'")


def saturation_warning(model, it):
    """SATURATED for this model's final norm (a DyT or a Derf) at iteration it."""
    ln_f = model.transformer.ln_f
    return SATURATED.format(it=it, name=type(ln_f).__name__, how=ln_f.SATURATES)


def dyt_embed_scale(config):
    """GPT.embed_scale of a model with this GPTConfig: the DyT paper's learnable scalar on the
    embeddings, √n_embd at init (0-dim nn.Parameter; see DyT), which the Derf authors' GPT-2 code
    uses too (see Derf), or None (not a norm-free model, or config.dyt_embed_scale=False)."""
    wanted = config.norm in NORM_FREE and config.dyt_embed_scale
    return nn.Parameter(torch.full((), config.n_embd ** 0.5)) if wanted else None


def final_dyt_saturated(model):
    """A 0-dim bool tensor, read after backward and before the optimizer step, without a host sync:
    True when the final DyT's (or Derf's) α got an exactly-zero gradient. With z = α·h (DyT) or
    α·h + s (Derf), ∂L/∂α = Σ f'(z) h ⊙ γ ⊙ ∂L/∂y is exactly 0 when every entry of every token has
    |z| past float32's range of f' (the class's SATURATES: about 9 for tanh, 10.2 for erf): then no
    gradient reaches the residual stream, so none reaches the blocks or the embeddings
    (docs/results.md, "DyT on the quick start"). A false tensor for a model without such a final norm."""
    ln_f = model.transformer.ln_f
    if not isinstance(ln_f, tuple(NORM_FREE.values())) or ln_f.alpha.grad is None:
        return torch.zeros((), dtype=torch.bool, device=model.gate.device)
    return ln_f.alpha.grad == 0


class FakeNorm(Norm):
    """FakeLN (Heimersheim 2024; Baroni et al. 2025, arXiv 2507.02559), the norm-removal baseline
    (docs/method.md §7): once removed, the norm divides by fixed scalars instead of σ(h):

        before removal:  N(h) = (P h / σ(h)) ⊙ γ + β       (the ordinary norm; RMS kind: h, r(h), no β)
        after:           F(h) = (P h / s) ⊙ γ + β          s = `std`; at position 0, s0 = `std_first`

    s and s0 are the token means of σ(h) at positions ≥ 1 and at position 0 over the training
    forwards since the previous removal, measured on the model's own activations (`remove_norms`).
    F is a fixed linear map at every position ≥ 1, so it folds like a linear-phase TaperNorm with
    c = 1/s, γ̃ = γ, β̃ = β; at position 0 it is s/s0 times that map, which no weight matrix (the
    same at every position) holds: the last FakeLN event sets s0 = s (docs/method.md §7).

    `removed` and `first_position` are Python attributes set by sync_fakeln (as TaperNorm.phase):
    a compiled model recompiles at a removal event, never per step. Buffers: std, std_first (scalars),
    window (Σ σ at positions ≥ 1, their count, Σ σ at position 0, its count, since the previous
    removal: identical on every rank), step_sums (the same for this optimizer step, this rank's,
    not saved). A training-mode forward before removal adds to step_sums.
    h: (B, T, d) -> (B, T, d); pos: (T,) positions of h, None for 0 .. T−1.
    """

    def __init__(self, d, kind, bias, eps):
        super().__init__(d, kind, bias, eps)
        self.register_buffer('std', torch.ones(()))
        self.register_buffer('std_first', torch.ones(()))
        self.register_buffer('window', torch.zeros(4))
        self.register_buffer('step_sums', torch.zeros(4), persistent=False)
        self.removed = False
        self.first_position = True

    @torch.no_grad()
    def observe(self, h):
        """Add this forward's sums of σ(h) (fp32) at positions ≥ 1 and at position 0 to step_sums."""
        s = norm_scale(h.float(), self.kind, self.eps)[..., 0]  # (B, T)
        first = s[:, 0]
        self.step_sums += torch.stack([s.sum() - first.sum(), s.new_full((), s.numel() - first.numel()),
                                       first.sum(), s.new_full((), first.numel())])

    def forward(self, h, gate=None, pos=None):
        if not self.removed:
            if self.training:
                self.observe(h)
            return self.normalize(h)
        s = self.std
        if self.first_position:
            pos = torch.arange(h.size(-2), device=h.device) if pos is None else pos
            s = torch.where(pos[:, None] == 0, self.std_first, self.std)  # (T, 1)
        y = norm_input(h, self.kind) / s * self.weight
        return y if self.bias is None else y + self.bias


# ---- FakeLN's removal events on a GPT with norm_removal='fakeln' (docs/method.md §7) -------------

def fakenorms(model, kind=None):
    """(name, FakeNorm) pairs, e.g. ('h.0.ln_2', ...), in forward order; kind: 'ln_1', 'ln_2',
    'ln_f' or None for all."""
    return [(n.removeprefix('transformer.'), m) for n, m in model.named_modules()
            if isinstance(m, FakeNorm) and kind in (None, n.rpartition('.')[2])]

def sync_fakeln(model):
    """Set every FakeNorm's code path from the model's buffer fakeln_stage (after loading a checkpoint too)."""
    stage = int(model.fakeln_stage)
    for name, m in fakenorms(model):
        m.removed = FAKELN_EVENTS.index(name.rpartition('.')[2]) < stage
        m.first_position = stage < len(FAKELN_EVENTS)

@torch.no_grad()
def fakeln_step(model):
    """After every optimizer step: add the step's σ sums of every norm not yet removed,
    all-reduced over ranks (so every rank holds the same window), to its window."""
    live = [m for _, m in fakenorms(model) if not m.removed]
    if live:
        for m, total in zip(live, all_reduce_sums([m.step_sums for m in live])):
            m.window += total

@torch.no_grad()
def remove_norms(model):
    """FakeLN's next removal event (docs/method.md §7), FAKELN_EVENTS[fakeln_stage]:
    'ln_2' / 'ln_1' / 'ln_f': in every block (or the final norm), s ← the mean σ(h) at positions
      ≥ 1 and s0 ← the mean σ(h) at position 0 over the window since the previous event, and
      the norm divides by them from now on;
    'first_position': s0 ← s in every norm, so position 0 is no longer special and the model folds.
    Every window restarts. Returns {'removed': what, 'std': {name: s}, 'std_first': {name: s0}}.
    Raises RuntimeError after the last event, or when a norm measured nothing in its window.
    """
    stage = int(model.fakeln_stage)
    if stage >= len(FAKELN_EVENTS):
        raise RuntimeError("every FakeLN removal event has happened already")
    what = FAKELN_EVENTS[stage]
    norms = fakenorms(model, None if what == 'first_position' else what)
    for name, m in norms:
        if what == 'first_position':
            m.std_first.copy_(m.std)
            continue
        total, n, first, n_first = m.window.tolist()
        if n_first == 0:
            raise RuntimeError(f"{name}: no training-mode forward measured σ(h) since the previous "
                               "FakeLN event (call fakeln_step(model) after each optimizer step)")
        m.std.fill_(total / n if n else first / n_first)  # a context of 1 has position 0 only
        m.std_first.fill_(first / n_first)
    for _, m in fakenorms(model):
        m.window.zero_()
    model.fakeln_stage += 1
    sync_fakeln(model)
    return {'removed': what, 'std': {n: m.std.item() for n, m in norms},
            'std_first': {n: m.std_first.item() for n, m in norms}}
