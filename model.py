"""
A GPT-2-shaped pre-norm transformer whose normalization layers can taper away.

TaperNorm (docs/method.md §1) mixes a normalizing branch and a sample-independent linear branch
with one global gate g ∈ [0, 1]:

    TaperNorm(h; g) = g · (h / r(h)) ⊙ γ  +  (1 − g) · c · h ⊙ γ̃,     r(h) = sqrt(mean_i h_i² + ε)

Training moves g from 1 to 0 (train.py holds the schedule); at g = 0 every tapered layer is
the fixed map h ↦ c·h⊙γ̃, which can be merged into the next linear layer (docs/method.md §5).

Everything the method adds lives here, each in one place:
- `TaperNorm`                   the layer, RMS and LayerNorm kinds          (docs/method.md §1)
- `GPT.set_collect`, `GPT.calibrate`
                                the calibrate event: c, s_tgt, γ̃ ← γ          (docs/method.md §2–§4)
- `GPT.calibration_step`        calibration='ema': per-step EMA of the statistics (docs/method.md §3)
- `branch_mismatch`             ‖L − N‖/‖N‖ where the taper starts              (docs/method.md §3)
- `aux_loss`                    the scale-anchor loss L_aux on h before ln_f  (docs/method.md §4)
- `RadialCos`                   cos(∂CE/∂h, h) at the pre-logit state: logit chasing's signature (§4)
- `TaperScale`, `unfused`       g = 0 kept as one precomputed multiply         (docs/method.md §5)
- `GPTConfig.folded`            a model whose tapered norms fold.py merged away (docs/method.md §5;
                                the arithmetic is fold.py's `fold_state_dict`)

The norm-removal baselines (FakeLN's `FakeNorm` and removal events, the norm-free DyT and Derf)
are baselines.py's; a GPT builds their norms from its config (docs/method.md §7).

Inference has one decode path, as in gpt-fast: a static, preallocated KV cache per layer
(`KVCache`, `GPT.setup_caches`), `prefill` of the prompt, then `decode_one_token` steps
(`decode_n_tokens`) whose tensor shapes never change, the position a tensor advanced in place,
so a compiled decode step never recompiles. `GPT.generate`, sample.py and bench.py all use it.

Module names follow GPT-2 (transformer.wte/wpe/h.N.ln_1/attn.c_attn/...), so gpt2.py can load
GPT-2's released weights into a GPT (`gpt2.from_pretrained`) and write them back, through Hugging
Face transformers, an optional dependency imported only there.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from baselines import DYT_ALPHA0, NORM_FREE, FakeNorm, dyt_embed_scale, sync_fakeln
from norms import Norm, all_reduce_flat, all_reduce_sums, norm_input, norm_scale

NORMS = ('rmsnorm', 'layernorm', *NORM_FREE)  # 'dyt', 'derf': the norm-free baselines (baselines.py), no per-token statistics
TAPERS = ('none', 'internal', 'all')
PHASES = ('warmup', 'taper', 'linear')  # 'baseline' is the phase of a model with taper='none'
ACTIVATIONS = ('gelu', 'gelu_tanh')  # the MLP's GELU: exact (erf) | tanh approximation (GPT-2's gelu_new)
NORM_REMOVALS = ('none', 'fakeln')
AUX_FORMS = ('absolute', 'relative')  # L_aux: the paper's λ·(s − s_tgt)², or λ·(s/s_tgt − 1)² (beyond the paper)
# the model ladder of docs/method.md §6 (vocabulary 10k, context 512, tied head), shared by config/ and bench.py
LADDER = {'0.4M': dict(n_layer=8, n_embd=32, n_head=1),
          '1M': dict(n_layer=8, n_embd=64, n_head=2), '3M': dict(n_layer=8, n_embd=128, n_head=4),
          '9M': dict(n_layer=8, n_embd=256, n_head=4), '30M': dict(n_layer=8, n_embd=512, n_head=8)}
CALIB_DECAY = 0.99  # ρ: EMA decay per optimizer step of the calibration statistics (docs/method.md §3)


def aux_loss(s, s_tgt, aux_weight, form='absolute'):
    """L_aux = λ · mean_tokens (s(h) − s_tgt)², the explicit scale anchor (docs/method.md §4).

    form='relative' (beyond the paper) is λ · mean_tokens (s(h)/s_tgt − 1)²: the same anchor in
    units of s_tgt, so its pull on a token does not grow with the scale the model calibrated to.
    s: (B, T, 1) = norm_scale(h) of the residual stream h before the final norm; s_tgt: 0-dim
    tensor (> 0 for 'relative'); returns a 0-dim tensor. Its gradient with respect to each token's
    h is radial (along h, or P h for the LN kind), so it fixes the scale of h without steering its
    direction.
    """
    if form == 'relative':
        return aux_weight * (s / s_tgt - 1).pow(2).mean()
    return aux_weight * (s - s_tgt).pow(2).mean()


class TaperNorm(Norm):
    """TaperNorm(h; g) = g · N(h) + (1 − g) · L(h)   (docs/method.md §1).

    N(h) = (h / r(h)) ⊙ γ                   (RMS kind; LN kind: LayerNorm with γ, β)
    L(h) = c · h ⊙ γ̃                         (RMS kind; LN kind: c · (P h) ⊙ γ̃ + β̃)

    `phase` is a plain Python attribute that selects the code path: 'warmup' runs N only,
    'taper' mixes both with the gate tensor, 'linear' runs L only and never computes r(h).
    The gate is a tensor so that changing it every step does not recompile a compiled model;
    the phase changes twice a run.

    `collect` (set by `GPT.set_collect`) makes a warmup forward also record statistics of its
    input: 'calibration' adds the token sums of x_i²/r(h) and x_i² (x = h or P h) for c
    (docs/method.md §3; the GPT divides by its token count once per step); 'mismatch' adds
    ‖L(h) − N(h)‖² and ‖N(h)‖² over tokens.
    Buffers: c (scalar, set by calibration, never trained), calib_num / calib_den (the 'ema'
    mode's EMAs of N_i = E[x_i²/r] and D_i = E[x_i²], fp32, (d,)), and non-persistent sums
    (step_sums, (2, d): Σ_tokens x_i²/r and Σ_tokens x_i²).
    h: (..., d) -> (..., d); gate: 0-dim tensor.
    """

    def __init__(self, d, kind, bias, eps):
        super().__init__(d, kind, bias, eps)
        self.weight_tilde = nn.Parameter(torch.ones(d))                                   # γ̃
        self.bias_tilde = nn.Parameter(torch.zeros(d)) if self.bias is not None else None  # β̃
        self.register_buffer('c', torch.ones(()))
        self.register_buffer('calib_num', torch.zeros(d))
        self.register_buffer('calib_den', torch.zeros(d))
        self.register_buffer('step_sums', torch.zeros(2, d), persistent=False)  # Σ_tokens x_i²/r, Σ_tokens x_i²
        self.register_buffer('mismatch_sums', torch.zeros(2), persistent=False)  # ‖L − N‖², ‖N‖²
        self.phase = 'warmup'
        self.collect = None

    def linear(self, h):
        # c·γ̃ is a d-vector: one multiply on the (B, T, d) tensor, the op folding removes
        y = norm_input(h, self.kind) * (self.c * self.weight_tilde)
        return y if self.bias_tilde is None else y + self.bias_tilde

    @torch.no_grad()
    def observe(self, h, y):
        """Record this forward's statistics of h (and of y = N(h)) for `collect`, in fp32 (in the
        buffers' dtype: fp32 unless the model was cast)."""
        if self.collect == 'mismatch':
            y = y.float()
            self.mismatch_sums += torch.stack([(self.linear(h.float()) - y).pow(2).sum(), y.pow(2).sum()])
            return
        # c's least-squares fit needs, per channel i, N_i = Σ x_i²/r and D_i = Σ x_i² over tokens, without γ:
        # γ keeps training until the calibrate event, which weights the sums by the γ² of that moment.
        # every warmup forward runs this once per norm: 6 ops (RMS kind; LN's centring adds 2), one pass
        # over x² for r and for both sums. 1/r = rsqrt(mean x² + ε) is r(h) of the RMS kind, and σ(h)
        # of the LN kind since x = P h is centred; [1/r, 1]ᵀ x² is (2, d): Σ x_i²/r and Σ x_i² in one product
        x = norm_input(h.to(self.step_sums.dtype), self.kind).flatten(0, -2)  # (tokens, d), fp32 in training
        x2 = x.pow(2)
        inv_r = (x2.mean(-1, keepdim=True) + self.eps).rsqrt()  # (tokens, 1)
        # in place, so autocast leaves it in fp32 (it casts only out-of-place matmuls); a CUDA bf16 run
        # allows TF32 here, whose rounding averages out over the tokens of a sum
        self.step_sums.addmm_(F.pad(inv_r, (0, 1), value=1.0).t(), x2)

    def forward(self, h, gate, pos=None):
        if self.phase == 'warmup':
            y = self.normalize(h)
            if self.collect is not None:
                self.observe(h, y)
            return y
        if self.phase == 'linear':
            return self.linear(h)
        return gate * self.normalize(h) + (1 - gate) * self.linear(h)


class TaperScale(nn.Module):
    """A TaperNorm at g = 0 kept as an explicit op: "unfused" inference (docs/method.md §5).

    x ↦ x ⊙ a with a = c·γ̃ precomputed once, one elementwise multiply per token (LN kind:
    (x − mean x) ⊙ a + β̃). Built by `unfused(model)` for inference; it does not train.
    h: (..., d) -> (..., d).
    """

    def __init__(self, taper_norm):
        super().__init__()
        self.kind = taper_norm.kind
        with torch.no_grad():
            self.register_buffer('scale', taper_norm.c * taper_norm.weight_tilde)  # c·γ̃, (d,)
            bias = taper_norm.bias_tilde
            self.register_buffer('bias', None if bias is None else bias.detach().clone())  # β̃

    def forward(self, h, gate=None, pos=None):
        y = norm_input(h, self.kind) * self.scale
        return y if self.bias is None else y + self.bias


class RadialCos(torch.autograd.Function):
    """Identity on h (B, T, d) whose backward also returns, as the gradient of `sink` (a 0-dim
    leaf), the mean over tokens of cos(∂ℓ/∂h, h): the radial share of the gradient reaching h.

    The diagnostic of logit chasing (docs/method.md §4): a final norm makes ∂CE/∂h orthogonal to h, so
    it is ≈ 0 with one and not without. Part of the graph, so no second backward and no
    recompile; gradients accumulate in sink.grad like any other (sum over micro-batches).
    """

    @staticmethod
    def forward(ctx, h, sink):
        ctx.save_for_backward(h)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        h, = ctx.saved_tensors
        return grad, F.cosine_similarity(grad.float(), h.float(), dim=-1).mean()


# GPTConfig fields added after the first release (7f2aebc), each with what a checkpoint written
# before it meant: the behaviour before the field existed, which need not be today's default (a DyT
# model of then had no embedding scalar). runs.load_checkpoint fills them in for every script.
ABSENT_MEANS = dict(activation='gelu', norm_removal='none', folded=False, aux_form='absolute',
                    dyt_embed_scale=False, dyt_alpha0_scale=1.0)


@dataclass
class GPTConfig:
    block_size: int = 512       # context length T
    vocab_size: int = 10000     # from the dataset's meta.json (compact GPT-2 vocabulary)
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True           # biases in Linear layers and LayerNorm β (GPT-2 style)
    norm: str = 'rmsnorm'       # 'rmsnorm' | 'layernorm' (TaperLN, for GPT-2) | 'dyt' | 'derf' (the DyT, Derf baselines, taper='none')
    taper: str = 'none'         # 'none' (baseline) | 'internal' (ln_1, ln_2) | 'all' (+ ln_f)
    aux_weight: float = 0.0     # λ of L_aux (docs/method.md §4); 0 disables it
    aux_form: str = 'absolute'  # 'absolute': the paper's L_aux | 'relative': (s/s_tgt − 1)², beyond the paper (aux_loss)
    norm_eps: float = 1e-5      # ε, passed explicitly to every norm
    activation: str = 'gelu'    # the MLP's GELU: 'gelu' (exact) | 'gelu_tanh' (GPT-2's gelu_new)
    norm_removal: str = 'none'  # 'none' | 'fakeln': the FakeLN baseline (docs/method.md §7), taper='none'
    dyt_embed_scale: bool = True  # norm='dyt' or 'derf' only: a learnable scalar, √n_embd at init, scales the embeddings (baselines.py)
    dyt_alpha0_scale: float = 1.0  # norm='dyt' or 'derf' only: multiplies every α₀ of baselines.DYT_ALPHA0 (the DyT paper's, Derf's here)
    folded: bool = False        # the tapered (or FakeLN) norms were folded into the next linear layers (fold.py)

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r}: choose one of {NORMS}")
        if self.taper not in TAPERS:
            raise ValueError(f"taper={self.taper!r}: choose one of {TAPERS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: choose one of {ACTIVATIONS}")
        if self.norm_removal not in NORM_REMOVALS:
            raise ValueError(f"norm_removal={self.norm_removal!r}: choose one of {NORM_REMOVALS}")
        if self.aux_form not in AUX_FORMS:
            raise ValueError(f"aux_form={self.aux_form!r}: choose one of {AUX_FORMS}")
        if self.norm in NORM_FREE and (self.taper != 'none' or self.norm_removal != 'none'):
            raise ValueError(f"norm={self.norm!r} is a baseline of its own (every norm a "
                             f"{NORM_FREE[self.norm].__name__}, none tapered or removed): it needs taper='none' "
                             f"and norm_removal='none' (got taper={self.taper!r}, norm_removal={self.norm_removal!r})")
        if self.norm_removal != 'none' and self.taper != 'none':
            raise ValueError(f"norm_removal={self.norm_removal!r} is a baseline of its own: it needs "
                             f"taper='none' (got taper={self.taper!r})")
        for key in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd'):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.dyt_alpha0_scale <= 0:
            raise ValueError(f"dyt_alpha0_scale={self.dyt_alpha0_scale} must be > 0 (it multiplies DyT's and Derf's α₀)")
        if not 0 <= self.norm_eps < math.inf:  # inf made every norm's output 0: a run that learned nothing, silently
            raise ValueError(f"norm_eps={self.norm_eps} must be a finite number >= 0")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight={self.aux_weight} must be >= 0")
        if self.aux_weight > 0 and self.taper == 'none':
            raise ValueError("aux_weight > 0 needs taper='internal' or 'all': the baseline's "
                             "final norm already anchors the scale; set aux_weight=0")
        if self.folded and self.taper == 'none' and self.norm_removal == 'none':
            raise ValueError("folded=True needs taper='internal' or 'all' (or norm_removal='fakeln'): "
                             "only tapered or removed norms fold")

    def removable(self, final):
        """True for a norm that becomes a fixed linear map (a TaperNorm or a FakeNorm), which fold.py
        can merge into the next linear layer; final: ln_f rather than a block's ln_1 / ln_2."""
        return (self.norm_removal == 'fakeln' or self.taper == 'all'
                or (self.taper == 'internal' and not final))

    def untied_head(self):
        """True when ln_f was folded into the LM head, which then has its own weight (docs/method.md §5)."""
        return self.folded and self.removable(final=True)


@dataclass
class ForwardMetrics:
    """Detached scalars from the last forward with targets, kept in `GPT.last_metrics`.

    ce:              cross-entropy, nats/token
    aux:             L_aux with λ included (0 when inactive)
    hidden_rms:      mean over tokens of s(h), h the residual stream before the final norm
    logit_rms:       sqrt(mean z²) over all positions and vocabulary entries, fp32
    final_scale_rms: RMS of c·γ̃ of the final norm, or None when the final norm does not taper
                     (through the gate warmup c and γ̃ keep their initial 1: it reads 1.0 until the
                     calibrate event sets them)
    """
    ce: torch.Tensor
    aux: torch.Tensor
    hidden_rms: torch.Tensor
    logit_rms: torch.Tensor
    final_scale_rms: Optional[torch.Tensor]


def rms(t):
    """sqrt(mean t²) over every entry of t, a 0-d fp32 tensor: reduced at fp32 or wider without a
    copy of t (.float().pow(2) made two, 3.3 GB each for GPT-2's 16 × 1024 × 50,257 logits)."""
    return torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)).float() / t.numel() ** 0.5


def apply_norm(norm, x, gate, pos=None):
    """norm(x, gate, pos), or x itself where fold.py merged the norm into the next linear layer."""
    return x if norm is None else norm(x, gate, pos)


class KVCache(nn.Module):
    """Static, preallocated keys and values of one attention layer (as in gpt-fast).

    k_cache, v_cache: (B, n_head, T_max, head_dim), allocated once; `update` writes the new
    positions in place, so every decode step sees tensors of the same shapes. Non-persistent:
    never part of a checkpoint.
    """

    def __init__(self, batch_size, n_head, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_head, max_seq_len, head_dim)
        self.register_buffer('k_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer('v_cache', torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        """input_pos: (T,) positions; k, v: (B, n_head, T, head_dim), stored in the cache's dtype
        (attention_dtype: the same as theirs when the caches were set up under this forward's autocast
        state). Returns the whole caches."""
        self.k_cache.index_copy_(2, input_pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, input_pos, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


# ---- decoding: the one path of GPT.generate, sample.py and bench.py (as in gpt-fast) ------------

FP32_MAX = torch.finfo(torch.float32).max  # logits / temperature is computed in fp32


def attention_dtype(weight):
    """The dtype the KV caches and the causal mask are kept in: torch.autocast's where it is on for
    weight's device (else it would cast the whole caches and the mask, every layer, every step:
    torchtune#398), else weight's. The forwards must run under the same autocast state as this call."""
    kind = weight.device.type
    try:
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    except RuntimeError:  # a device type without autocast in this torch (MPS before 2.5)
        return weight.dtype


def check_sampling(temperature, top_k):
    """Raise ValueError unless 0 <= temperature <= FP32_MAX and top_k is None (every token) or >= 1."""
    # NaN fails too; past FP32_MAX the fp32 temperature is inf, every logit / T is 0 and top_k would keep every token
    if not 0 <= temperature <= FP32_MAX:
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0: greedy) and at most "
                         f"{FP32_MAX:.4g}, the largest float32")
    if top_k is not None and not top_k >= 1:
        raise ValueError(f"top_k={top_k} must be >= 1, or None to keep every token")


def check_generate(T0, max_new_tokens, limit, temperature, top_k):
    """GPT.generate's arguments: ValueError for an empty prompt (T0 = 0), max_new_tokens < 0,
    T0 + max_new_tokens > limit (block_size; the message gives the most that fits), or bad
    sampling settings (check_sampling)."""
    check_sampling(temperature, top_k)
    total = T0 + max_new_tokens
    if T0 == 0:  # prefill's last position would be -1
        raise ValueError("an empty prompt (T0 = 0): give at least one token, e.g. <|endoftext|>")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if total > limit:
        if T0 < limit:
            fix = f"ask for at most {limit - T0} new tokens or shorten the prompt"
        elif max_new_tokens < limit:  # no count of new tokens fits after this prompt
            fix = f"shorten the prompt to at most {limit - max(max_new_tokens, 1)} tokens"
        else:
            fix = f"ask for at most {limit - 1} new tokens and shorten the prompt to fit"
        raise ValueError(f"a prompt of {T0} tokens + {max_new_tokens} new tokens = {total} positions "
                         f"exceeds the model's context of {limit}; {fix}")


def sample_next(logits, temperature=1.0, top_k=None, generator=None):
    """The next token (B, 1) from logits (B, V): argmax when temperature is 0, else a sample of
    softmax(logits / temperature) in fp32 over the top_k largest (None: all). A row whose
    logits / temperature overflows (a temperature like 1e-40) takes its argmax, the limit T → 0.
    Raises ValueError for temperature < 0 or top_k < 1 (check_sampling)."""
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits.float() / temperature
    if top_k is not None:
        # by index, not by the k-th value: a threshold keeps every token tied with the k-th (bf16 logits
        # tie often), so top_k=1 would not be greedy (vllm-project/tpu-inference#3590)
        top = torch.topk(scaled, min(top_k, scaled.size(-1))).indices
        kept = torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, top, True)
        scaled = scaled.masked_fill(~kept, float('-inf'))
    probs = F.softmax(scaled, dim=-1)
    overflow = ~torch.isfinite(scaled.amax(dim=-1, keepdim=True))  # (B, 1): softmax gave NaN there
    # one-hot of the argmax by scatter: F.one_hot reads its indices' range back to the host
    greedy = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.where(overflow, greedy, probs)
    # the exponential race, torch.multinomial's own for one sample (and gpt-fast's): with q_i ~ Exp(1),
    # argmax p_i / q_i is i with probability p_i, and nothing is read back to the host. Here q has a
    # floor: where exponential_ gives 0 or -0.0 (on MPS, pytorch#192577), 0 / q is NaN, which argmax
    # would pick, a token outside top_k
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / q).argmax(dim=-1, keepdim=True)


def prefill(model, idx, input_pos, temperature=0.0, top_k=None, generator=None):
    """Run idx (B, T) at positions input_pos (T,) through the KV caches (after setup_caches) and
    choose the next token (B, 1) from the last position's logits with sample_next (0: greedy)."""
    with torch.no_grad():  # in-place cache writes under autograd would make the caches require grad
        logits, _ = model(idx, input_pos=input_pos)
    return sample_next(logits[:, -1], temperature, top_k, generator)


def decode_one_token(model, tok, input_pos, temperature=0.0, top_k=None, generator=None):
    """One decode step: tok (B, 1) at position input_pos (1,) -> the next token (B, 1). The
    shapes never change, so compiled (a function of its own: its own graph) it never recompiles."""
    return prefill(model, tok, input_pos, temperature, top_k, generator)


def decode_n_tokens(model, tok, input_pos, n, temperature=0.0, top_k=None, generator=None,
                    step=decode_one_token):
    """n decode steps after tok (B, 1), the first at input_pos (1,), which is advanced in place
    (one tensor: no new shapes). step: decode_one_token or a compiled copy of it. Returns the n
    new tokens, a list of (B, 1), as gpt-fast does (torch.cat them when needed)."""
    out = []
    for _ in range(n):
        tok = step(model, tok, input_pos, temperature, top_k, generator).clone()  # CUDA graphs reuse their output
        input_pos += 1
        out.append(tok)
    return out


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.kv_cache = None  # a KVCache, set by GPT.setup_caches

    def forward(self, x, input_pos=None, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if input_pos is None:  # training / full forward: the sequence attends to itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # prefill or decode: attend to every cached position the mask (1, 1, T, T_max) allows
            k, v = self.kv_cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = 'tanh' if config.activation == 'gelu_tanh' else 'none'  # F.gelu's names

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):

    def __init__(self, config, make_norm):
        super().__init__()
        self.ln_1 = make_norm('ln_1')
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm('ln_2')
        self.mlp = MLP(config)

    def forward(self, x, gate, input_pos=None, mask=None, pos=None):
        x = x + self.attn(apply_norm(self.ln_1, x, gate, pos), input_pos, mask)
        x = x + self.mlp(apply_norm(self.ln_2, x, gate, pos))
        return x


class GPT(nn.Module):
    """Pre-norm GPT with tied token embedding / LM head and optional TaperNorm layers.

    taper='internal' tapers ln_1 and ln_2 of every block; 'all' tapers ln_f too (docs/method.md §4).
    The model owns the one global gate g (buffer `gate`), the scale target s_tgt and its EMA.
    With config.folded the tapered norms are absent (None: no op runs in their place), and
    under All-Taper the LM head is untied from the token embedding (LN kind with config.bias: with a bias).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        kind, eps = config.norm, config.norm_eps

        def make_norm(where):  # 'ln_1' | 'ln_2' | 'ln_f'
            if kind in NORM_FREE:  # DyT or Derf, both with DyT's α₀ by position (baselines.Derf says why)
                return NORM_FREE[kind](config.n_embd, config.dyt_alpha0_scale * DYT_ALPHA0[where])
            if not config.removable(final=where == 'ln_f'):
                return Norm(config.n_embd, kind, config.bias, eps)
            if config.folded:
                return None  # merged into the next linear layer by fold.py
            if config.norm_removal == 'fakeln':
                return FakeNorm(config.n_embd, kind, config.bias, eps)
            return TaperNorm(config.n_embd, kind, config.bias, eps)

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, make_norm) for _ in range(config.n_layer)]),
            ln_f=make_norm('ln_f'),
        ))
        # a folded LayerNorm's β̃ reaches the logits as W β̃: the folded head carries it as a bias (docs/method.md §5)
        head_bias = config.untied_head() and config.norm == 'layernorm' and config.bias
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=head_bias)
        if not config.untied_head():  # folding ln_f gives the head its own weight W' (docs/method.md §5)
            self.transformer.wte.weight = self.lm_head.weight

        self.embed_scale = dyt_embed_scale(config)  # None but in a DyT or Derf model: DyT's LLM recipe (baselines.DyT)
        self.register_buffer('gate', torch.ones(()))  # g, used only in the taper phase
        if config.taper != 'none':
            self.register_buffer('calibrated', torch.zeros((), dtype=torch.bool))
            self.register_buffer('calib_steps', torch.zeros((), dtype=torch.long))
            self.register_buffer('hidden_rms_ema', torch.zeros(()))  # EMA of mean s(h)
            self.register_buffer('s_tgt', torch.zeros(()))
            self.register_buffer('step_hidden_rms', torch.zeros(()), persistent=False)  # Σ_tokens s(h)
            self.register_buffer('step_micro', torch.zeros(()), persistent=False)       # collecting forwards
            self.register_buffer('step_tokens', torch.zeros(()), persistent=False)      # their tokens
        if config.norm_removal == 'fakeln':  # FakeLN's removal events so far (docs/method.md §7)
            self.register_buffer('fakeln_stage', torch.zeros((), dtype=torch.long))
            self.register_load_state_dict_post_hook(lambda module, keys: sync_fakeln(module))
        self.last_metrics = None
        self.collect = None  # see set_collect
        self._calibration = None  # calibration_buffers' lists, built on first use, dropped by _apply
        self.register_buffer('radial_sink', torch.zeros((), requires_grad=True), persistent=False)
        self.register_buffer('causal_mask', None, persistent=False)  # (T_max, T_max) additive, by setup_caches
        self.set_phase('baseline' if config.taper == 'none' else 'warmup')

        self.apply(init_weights)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):  # GPT-2: scale residual projections by 1/sqrt(2L)
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self._calibration = None  # .to() / .float() replace the buffers it lists
        # .to(device) returns a non-leaf copy of a requires_grad buffer: make the sink a leaf again
        self.radial_sink = self.radial_sink.detach().requires_grad_()
        return self

    def num_params(self):
        """Parameters, a shared tensor once (the tied embedding and head), γ̃ and β̃ left out (they replace γ, β)."""
        return sum(p.numel() for n, p in self.named_parameters() if '_tilde' not in n)

    def tapernorms(self):
        """(name, TaperNorm) pairs, e.g. ('h.0.ln_1', ...), in forward order."""
        return [(n.removeprefix('transformer.'), m) for n, m in self.named_modules()
                if isinstance(m, TaperNorm)]

    # ---- schedule -----------------------------------------------------------------------

    def set_phase(self, phase):
        """Select the code path of every TaperNorm (docs/method.md §1) and which gains train.

        γ, β of tapered layers are unused in 'linear', γ̃, β̃ unused in 'warmup' (the 'mismatch'
        statistics read them without gradient): they get requires_grad=False so DDP (which needs
        every trainable parameter used) does not fail.
        Raises ValueError for a phase this model cannot be in, RuntimeError for taper or
        linear before calibrate().
        """
        allowed = ('baseline',) if self.config.taper == 'none' else PHASES
        if phase not in allowed:
            raise ValueError(f"phase={phase!r} is not one of {allowed} for taper={self.config.taper!r}")
        if phase != 'warmup' and self.config.taper != 'none' and not self.calibrated:
            raise RuntimeError(f"phase {phase!r} needs a calibrated model: call calibrate() "
                               "at the end of the gate warmup")
        self.phase = phase
        for _, m in self.tapernorms():
            m.phase = phase
            for p in (m.weight, m.bias):
                if p is not None:
                    p.requires_grad_(phase != 'linear')
            for p in (m.weight_tilde, m.bias_tilde):
                if p is not None:
                    p.requires_grad_(phase != 'warmup')

    @torch.no_grad()
    def set_gate(self, g):
        """Set the global gate g in place (a Python float; the buffer keeps its identity). ValueError for
        g outside [0, 1], NaN included: beyond them the mix g·N + (1 − g)·L extrapolates (docs/method.md §1)."""
        if not 0.0 <= g <= 1.0:
            raise ValueError(f"gate g = {g:.6g} is outside [0, 1]: the gate schedule (train.get_gate) must "
                             "run from 1 to 0")
        self.gate.fill_(g)

    # ---- calibration (docs/method.md §3, §4) ------------------------------------------------------

    def set_collect(self, mode):
        """Make warmup forwards record statistics (see TaperNorm): None (off), 'calibration'
        (N, D per channel and mean s(h): what c and s_tgt need) or 'mismatch' (‖L − N‖, ‖N‖).
        Raises ValueError for another mode."""
        if mode not in (None, 'calibration', 'mismatch'):
            raise ValueError(f"collect={mode!r}: choose None, 'calibration' or 'mismatch'")
        self.collect = mode
        for _, m in self.tapernorms():
            m.collect = mode

    @torch.no_grad()
    def calibration_step(self):
        """calibration='ema' only: fold this optimizer step's statistics into the EMAs (ρ = CALIB_DECAY).

        Call once after every optimizer step of the gate warmup, whose forwards ran under
        set_collect('calibration'). The step's statistics are the mean over its micro-batches
        and ranks. If no collecting forward ran since the last call: on the CPU and MPS a
        RuntimeError here; on CUDA a device-side assert (no host sync each step), which surfaces at
        the next synchronization and leaves the CUDA context unusable.
        """
        means, n_micro = step_statistics(self)
        message = "calibration_step() without a forward under set_collect('calibration')"
        if n_micro.device.type in ('cpu', 'mps'):  # MPS: older torch releases lack its _assert_async kernel
            if n_micro.item() == 0:
                raise RuntimeError(message)
        else:  # checked on the device: .item() would stop the host every warmup step
            torch._assert_async(n_micro > 0, message)
        # ema ← ρ·ema + (1 − ρ)·mean for every statistic in one foreach op, not one per buffer: on a
        # GPU each op is a kernel launch, and All-Taper has 2·(2·n_layer + 1) + 1 of them
        emas = calibration_buffers(self)[1]
        torch._foreach_lerp_(emas, means.split([t.numel() for t in emas]), 1 - CALIB_DECAY)
        self.calib_steps += 1

    @torch.no_grad()
    def calibrate(self, mode):
        """The calibrate event (docs/method.md §2–§4): freeze c per layer and s_tgt, set γ̃ ← γ, β̃ ← β.

        c = Σ_i γ_i² N_i / Σ_i γ_i² D_i with the γ being copied (docs/method.md §3), from (mode has
        no default here: train.py's `calibration` chooses, 'ema' unless told otherwise)
        mode='end': the statistics collected since the last reset (the forwards run under
          set_collect('calibration') on the model as it is now; s_tgt = their mean s(h));
        mode='ema': the EMAs of calibration_step (their bias correction cancels in c; s_tgt is
          the bias-corrected EMA of mean s(h)).
        Returns {'c': {layer name: float}, 's_tgt': float}. Raises RuntimeError if already
        calibrated or nothing was collected, ValueError for another mode.
        """
        if self.config.taper == 'none':
            raise RuntimeError("calibrate() on a baseline model (taper='none')")
        if self.calibrated:
            raise RuntimeError("the model is already calibrated; the calibrate event runs once")
        norms = self.tapernorms()
        if mode == 'end':
            means, n_micro = step_statistics(self)  # N, D per layer, then mean s(h)
            if n_micro.item() == 0:
                raise RuntimeError("calibrate('end') before any forward under set_collect('calibration')")
            stats, s_tgt = means[:-1].view(2 * len(norms), -1).unbind(0), means[-1]
        elif mode == 'ema':
            steps = int(self.calib_steps)
            if steps == 0:
                raise RuntimeError("calibrate('ema') before any calibration_step(): run the gate warmup first")
            stats = [t for _, m in norms for t in (m.calib_num, m.calib_den)]
            s_tgt = self.hidden_rms_ema / (1 - CALIB_DECAY ** steps)
        else:
            raise ValueError(f"calibrate(mode={mode!r}): choose 'end' or 'ema'")
        cs = {}
        # stats alternates per norm: N_i, D_i (Σ_tokens x_i²/r and Σ_tokens x_i², as means or EMAs)
        for (name, m), num, den in zip(norms, stats[0::2], stats[1::2], strict=True):
            gamma2 = m.weight.float().pow(2)  # γ², the weights of the least-squares fit of c
            m.c.fill_((gamma2 * num).sum() / (gamma2 * den).sum())
            m.weight_tilde.copy_(m.weight)
            if m.bias is not None:
                m.bias_tilde.copy_(m.bias)
            cs[name] = m.c.item()
        self.s_tgt.copy_(s_tgt)
        self.calibrated.fill_(True)
        return {'c': cs, 's_tgt': self.s_tgt.item()}

    def forward(self, idx, targets=None, input_pos=None):
        """idx: (B, T) token ids, T <= block_size; targets: (B, T) ids or None (-1 = ignore).

        With targets: returns (logits (B, T, V), loss) where loss = cross-entropy + L_aux, and
        stores the detached parts in `self.last_metrics` (a ForwardMetrics).
        Without: returns (logits of the last position (B, 1, V), None); so a prefill returns
        only the logits that choose the next token.
        L_aux = λ · mean_tokens (s(h) − s_tgt)² (or config.aux_form's 'relative' form, see aux_loss)
        on the residual stream h before the final norm (docs/method.md §4), active in the taper and
        linear phases when λ > 0.
        input_pos: None for the ordinary causal forward, or the (T,) positions of idx to write
        into and attend over the KV caches (prefill: 0..T−1; decode: one position), after
        `setup_caches`. Positions are not range-checked here (that would sync with the host);
        `generate` checks them.
        Raises ValueError if T > block_size, or for a forward without targets under set_collect
        (the final norm would see only the last position, and no tokens are counted), RuntimeError
        for input_pos without setup_caches().
        """
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if targets is None and self.collect is not None:
            raise ValueError(f"a forward without targets under set_collect({self.collect!r}) would skew the "
                             "statistics (ln_f sees only the last position): pass targets, or set_collect(None)")
        if input_pos is None:
            pos, mask = torch.arange(T, dtype=torch.long, device=idx.device), None
        else:
            if self.causal_mask is None:
                raise RuntimeError("forward(input_pos=...) needs KV caches: call setup_caches() first")
            pos, mask = input_pos, self.causal_mask[None, None, input_pos]  # (1, 1, T, T_max)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, self.gate, input_pos, mask, pos)

        if targets is None:  # generation: no loss, no statistics, only the last position
            # a slice, not x[:, [-1]]: a list index becomes a device tensor by a blocking copy
            return self.lm_head(apply_norm(self.transformer.ln_f, x[:, -1:, :], self.gate, pos[-1:])), None

        tapering = self.config.taper != 'none'
        aux_on = tapering and self.config.aux_weight > 0 and self.phase in ('taper', 'linear')
        s = norm_scale((x if aux_on else x.detach()).float(), self.config.norm, self.config.norm_eps)  # (B, T, 1)
        hidden_rms = s.detach().mean()
        if tapering and self.phase == 'warmup' and self.collect == 'calibration':
            with torch.no_grad():  # s_tgt's statistic, once per micro-batch
                self.step_hidden_rms.add_(hidden_rms, alpha=B * T)  # a token sum, as the norms' sums are
                self.step_micro += 1
                self.step_tokens += B * T
        aux = aux_loss(s, self.s_tgt, self.config.aux_weight, self.config.aux_form) if aux_on else None

        if torch.is_grad_enabled():  # backward leaves mean cos(∂CE/∂h, h) in radial_sink.grad
            x = RadialCos.apply(x, self.radial_sink)  # below this point only CE depends on x
        logits = self.lm_head(apply_norm(self.transformer.ln_f, x, self.gate, pos))  # (B, T, V)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        ln_f = self.transformer.ln_f
        self.last_metrics = ForwardMetrics(
            ce=ce.detach(), aux=aux.detach() if aux_on else ce.new_zeros(()), hidden_rms=hidden_rms,
            logit_rms=rms(logits.detach()),
            final_scale_rms=rms((ln_f.c * ln_f.weight_tilde).detach()) if isinstance(ln_f, TaperNorm) else None)
        # no `ce + 0` when L_aux is off: with inductor (torch 2.13) that loss came back without grad_fn
        return logits, ce + aux if aux_on else ce

    # ---- inference ----------------------------------------------------------------------

    def setup_caches(self, batch_size, max_seq_len):
        """Allocate a static KV cache per layer, (batch_size, n_head, max_seq_len, head_dim), and the
        (max_seq_len, max_seq_len) causal mask, additive (0 / −inf): SDPA adds it as it is, where a bool
        mask costs every layer a `where` and two `scalar_tensor`s a step. Both on the weights' device,
        in attention_dtype. ValueError if max_seq_len > block_size (wpe ends there)."""
        cfg = self.config
        if not 1 <= max_seq_len <= cfg.block_size:
            raise ValueError(f"a KV cache of {max_seq_len} positions: the model's context "
                             f"(block_size) allows 1 to {cfg.block_size}")
        w = self.transformer.wte.weight
        dtype = attention_dtype(w)
        for block in self.transformer.h:
            block.attn.kv_cache = KVCache(batch_size, cfg.n_head, max_seq_len, cfg.n_embd // cfg.n_head,
                                          dtype, w.device)
        self.causal_mask = torch.full((max_seq_len, max_seq_len), float('-inf'), dtype=dtype, device=w.device).triu(1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Continue idx (B, T0) by max_new_tokens tokens: returns (B, T0 + max_new_tokens) ids.

        The prompt is prefilled into a static KV cache of T0 + max_new_tokens positions, then one
        token is decoded per step (prefill, decode_n_tokens). temperature, top_k: see sample_next
        (0: greedy). Runs in eval mode, then restores the mode (GPT() is in train mode, where dropout
        made greedy decoding random: nanoGPT#749). ValueError for bad arguments (check_generate).
        """
        B, T0 = idx.shape
        check_generate(T0, max_new_tokens, self.config.block_size, temperature, top_k)
        if max_new_tokens == 0:
            return idx
        was_training = self.training
        self.eval()
        try:
            self.setup_caches(B, T0 + max_new_tokens)
            sampling = (temperature, top_k, generator)
            tok = prefill(self, idx, torch.arange(T0, device=idx.device), *sampling)
            rest = decode_n_tokens(self, tok, torch.tensor([T0], device=idx.device), max_new_tokens - 1, *sampling)
        finally:
            self.train(was_training)
        return torch.cat([idx, tok, *rest], dim=1)


# ---- the GPT's plumbing: weights at init, the warmup statistics' buffers ---------------------

def init_weights(module):  # GPT-2's: weights N(0, 0.02²), biases 0
    if isinstance(module, (nn.Linear, nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def calibration_buffers(model):
    """(sums, emas): the buffers GPT.calibration_step reads and updates, in matching order. sums: each
    TaperNorm's step_sums (2, d), then step_hidden_rms, step_micro, step_tokens; emas: each
    TaperNorm's calib_num, calib_den (d,), then hidden_rms_ema as a (1,) view. Built once and kept
    (a walk of the modules costs ~0.1 ms of host time, every warmup step), until GPT._apply replaces
    the buffers."""
    if model._calibration is None:
        norms = [m for _, m in model.tapernorms()]
        model._calibration = ([m.step_sums for m in norms] + [model.step_hidden_rms, model.step_micro, model.step_tokens],
                             [t for m in norms for t in (m.calib_num, m.calib_den)] + [model.hidden_rms_ema.view(1)])
    return model._calibration


@torch.no_grad()
def step_statistics(model):
    """The statistics collected since the last call, summed over ranks, as (means, micro-batches):
    means (2 · n_norms · d + 1,) = each TaperNorm's N, then D, then mean s(h), each Σ_tokens / tokens
    (laid out as calibration_buffers' emas); micro-batches: the collecting forwards (0-dim). The
    sums are zeroed."""
    flat = all_reduce_flat(calibration_buffers(model)[0])
    return flat[:-2] / flat[-1], flat[-2]


def branch_mismatch(model):
    """{layer name: ‖L(h) − N(h)‖ / ‖N(h)‖}, pooled: the sums of squares over every token of the
    forwards run under set_collect('mismatch'), all-reduced over ranks, then one ratio. How far the
    linear branch the taper starts from is from the normalizing branch it replaces (docs/method.md
    §3). The sums are reset.
    Raises RuntimeError if nothing was collected."""
    norms = model.tapernorms()
    sums = all_reduce_sums([m.mismatch_sums for _, m in norms])
    if any(ref.item() == 0 for _, ref in sums):
        raise RuntimeError("branch_mismatch() before any forward under set_collect('mismatch')")
    return {name: (err / ref).sqrt().item() for (name, _), (err, ref) in zip(norms, sums)}


@torch.no_grad()
def implied_phase(model):
    """The phase the buffers imply, for a loaded checkpoint: 'baseline' (taper='none'),
    'warmup' (not calibrated), 'taper' (g > 0) or 'linear' (g = 0; the taper phase never
    has g = 0, docs/method.md §2)."""
    if model.config.taper == 'none':
        return 'baseline'
    if not model.calibrated:
        return 'warmup'
    return 'taper' if model.gate.item() > 0 else 'linear'


def unfused(model):
    """Replace every TaperNorm by a TaperScale holding c·γ̃: "unfused" inference (docs/method.md §5).

    For inference only, in place; returns the model. Raises RuntimeError unless the model is in
    the linear phase (g = 0), where a TaperNorm is exactly that map.
    """
    if model.phase != 'linear':
        raise RuntimeError(f"unfused() needs the linear phase (g = 0); this model is in phase "
                           f"{model.phase!r} with g = {model.gate.item():.4g}")
    for name, m in model.tapernorms():
        parent = model.transformer.get_submodule(name.rpartition('.')[0]) if '.' in name else model.transformer
        setattr(parent, name.rpartition('.')[2], TaperScale(m))
    return model
