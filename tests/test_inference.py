"""KV-cached decoding, sampling, unfused and folded inference, fold.py and sample.py (docs/method.md §5)."""

import ast
import copy
import errno
import os
import signal
import subprocess
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import bench
import configurator
import fold
import sample
import train
from model import (GPT, GPTConfig, TaperNorm, TaperScale, decode_n_tokens, decode_one_token, prefill, sample_next,
                   unfused)
from runs import load_model, save_checkpoint
from test_runs import ROOT, read_only  # noqa: F401 (a fixture)

KINDS = ['rmsnorm', 'layernorm']
TAPERS = ['internal', 'all']


def linear_phase(kind='rmsnorm', taper='internal', bias=True, seed=0, block_size=64):
    """A model in the linear phase (g = 0) with c, γ̃, β̃ far from their defaults, and weights
    large enough that greedy decoding is decisive, not a tie-break among near-equal logits."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=96, n_layer=2, n_head=2, n_embd=32,
                          norm=kind, taper=taper, bias=bias))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith('bias'):
                p.normal_(0, 0.3)
            else:  # gains γ, around 1
                p.copy_(torch.exp(0.5 * torch.randn_like(p)))
        if taper != 'none':
            for _, m in model.tapernorms():
                m.weight_tilde.copy_(torch.exp(0.5 * torch.randn_like(m.weight_tilde)))
                m.c.fill_(0.3 + torch.rand(()).item())
                if m.bias_tilde is not None:
                    m.bias_tilde.normal_(0, 0.3)
            model.calibrated.fill_(True)
            model.set_phase('linear')
            model.set_gate(0.0)
    return model.eval()


@torch.no_grad()
def greedy_full_recompute(model, idx, n):
    """The reference decode: n greedy tokens, each from a forward of the whole sequence so far
    (no KV cache): idx (B, T0) -> (B, T0 + n)."""
    for _ in range(n):
        logits, _ = model(idx)  # (B, 1, V): the last position
        idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return idx


# ---- KV cache -------------------------------------------------------------------------

@pytest.mark.parametrize('taper', ['none', 'internal', 'all'])
def test_kv_cache_greedy_decoding_equals_full_recompute(taper):
    model = linear_phase(taper=taper)
    prompt = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    full = greedy_full_recompute(model, prompt, 50)
    assert torch.equal(model.generate(prompt, 50, temperature=0), full)
    assert len(set(full[:, 7:].reshape(-1).tolist())) > 1  # not one token repeated throughout

    # teacher-forced through the cache on random tokens (greedy paths may settle on one token)
    seq = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full_logits, _ = model(seq, seq)
    tol = 1e-5 * full_logits.abs().max().item()  # All-Taper logits reach the hundreds here
    model.setup_caches(2, 40)
    with torch.no_grad():
        steps = [model(seq[:, :5], input_pos=torch.arange(5))[0]]
        steps += [model(seq[:, [t]], input_pos=torch.tensor([t]))[0] for t in range(5, 40)]
    assert_close(torch.cat(steps, dim=1), full_logits[:, 4:], rtol=1e-5, atol=tol)


def test_decoding_inside_autocast_matches_the_full_forward_under_it():
    """nanoGPT's sample.py calls generate inside torch.autocast: the bf16 keys and values go into
    the fp32 cache (an index_copy_ dtype error before), and the cached logits are the full forward's."""
    model = linear_phase(taper='internal')
    seq = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        full_logits, _ = model(seq, seq)
        model.setup_caches(2, 24)
        steps = [model(seq[:, :5], input_pos=torch.arange(5))[0]]
        steps += [model(seq[:, [t]], input_pos=torch.tensor([t]))[0] for t in range(5, 24)]
        out = model.generate(seq[:, :5], 10, temperature=0)
    tol = 2e-2 * full_logits.abs().max().item()  # bf16's rounding, on different (equal in exact math) paths
    assert_close(torch.cat(steps, dim=1).float(), full_logits[:, 4:].float(), rtol=2e-2, atol=tol)
    assert out.shape == (2, 15) and torch.equal(out[:, :5], seq[:, :5])
    # the caches and mask take autocast's dtype: fp32 ones were cast whole, every layer, every step
    assert model.causal_mask.dtype == torch.bfloat16
    assert {b.attn.kv_cache.k_cache.dtype for b in model.transformer.h} == {torch.bfloat16}
    model.setup_caches(2, 24)  # outside autocast: the weights' dtype again
    assert model.causal_mask.dtype == model.transformer.h[0].attn.kv_cache.v_cache.dtype == torch.float32


def test_a_device_without_autocast_in_this_torch_keeps_the_weights_dtype(monkeypatch):
    """torch < 2.5 has no MPS autocast, and asking about it raises: generate failed on such a Mac."""
    import model as model_module

    def no_autocast(device_type):
        raise RuntimeError(f"unsupported device type {device_type} for autocast")
    monkeypatch.setattr(torch, 'is_autocast_enabled', no_autocast)
    assert model_module.attention_dtype(torch.zeros(2, dtype=torch.float16)) == torch.float16
    prompt = torch.zeros(1, 3, dtype=torch.long)
    assert linear_phase().generate(prompt, 2, temperature=0).shape == (1, 5)


def test_generate_decodes_in_eval_mode_and_keeps_the_mode_it_found():
    """A model fresh from GPT() is in train mode (nanoGPT#749): dropout made greedy decoding random."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32, dropout=0.5))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    prompt = torch.randint(0, 96, (4, 5), generator=torch.Generator().manual_seed(1))
    outs = [model.generate(prompt, 20, temperature=0) for _ in range(3)]
    assert model.training
    assert all(torch.equal(o, greedy_full_recompute(model.eval(), prompt, 20)) for o in outs)
    assert not model.training


def test_prefill_and_decode_steps_advance_the_position_in_place():
    model = linear_phase(taper='all')
    prompt = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    model.setup_caches(3, 30)
    tok = prefill(model, prompt, torch.arange(6))
    pos = torch.tensor([6])
    rest = decode_n_tokens(model, tok, pos, 20)
    assert pos.item() == 26 and len(rest) == 20 and all(t.shape == (3, 1) for t in rest)
    assert torch.equal(torch.cat([prompt, tok, *rest], dim=1), greedy_full_recompute(model, prompt, 21))
    assert decode_n_tokens(model, tok, pos, 0) == []


def test_training_forward_ignores_the_caches():
    model = linear_phase(taper='all')
    x = torch.randint(0, 96, (2, 16))
    before, _ = model(x, x)
    model.setup_caches(2, 32)
    after, _ = model(x, x)
    assert torch.equal(before, after)
    assert 'transformer.h.0.attn.kv_cache.k_cache' not in model.state_dict()


def test_positions_beyond_the_context_are_refused_with_the_limit():
    model = linear_phase(block_size=64)
    with pytest.raises(ValueError, match='context of 64; ask for at most 54 new tokens'):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 55)
    # a prompt longer than the context: no count of new tokens fits, so none is offered; the prompt that
    # leaves room for the tokens asked for (at least one) is
    for new, fix in ((0, 'shorten the prompt to at most 63 tokens'), (1, 'shorten the prompt to at most 63 tokens'),
                     (10, 'shorten the prompt to at most 54 tokens'),
                     (64, 'ask for at most 63 new tokens and shorten the prompt to fit')):
        with pytest.raises(ValueError, match=f'{65 + new} positions exceeds the model.s context of 64; {fix}$'):
            model.generate(torch.zeros(1, 65, dtype=torch.long), new)
    with pytest.raises(ValueError, match='allows 1 to 64'):
        model.setup_caches(1, 65)
    with pytest.raises(RuntimeError, match='setup_caches'):
        GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8))(
            torch.zeros(1, 1, dtype=torch.long), input_pos=torch.zeros(1, dtype=torch.long))


def test_a_decode_step_indexes_by_slices_not_by_lists():
    # x[:, [-1]] builds an index tensor from a Python list, a blocking host-to-device copy on a
    # GPU every decode step (aten.lift_fresh); a slice (x[:, -1:]) is a view. And no op may read a
    # value back to the host (aten._local_scalar_dense: .item(), or F.one_hot's range check).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    model = linear_phase(taper='all').eval()
    model.setup_caches(2, 16)
    idx, prompt_pos, next_pos, gen = torch.randint(0, 96, (2, 5)), torch.arange(5), torch.tensor([5]), torch.Generator()
    with Ops() as ops, torch.no_grad():
        tok = prefill(model, idx, prompt_pos, temperature=1.0, top_k=5, generator=gen)
        decode_one_token(model, tok, next_pos, temperature=1.0, top_k=5, generator=gen)
        model(idx)  # the eager forward without targets
    assert 'aten.topk' in ops.seen and 'aten.slice' in ops.seen  # the mode saw the ops
    assert not ops.seen & {'aten.lift_fresh', 'aten._local_scalar_dense'}


def test_compiled_decode_step_never_recompiles():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model = linear_phase(taper='internal')
    prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    counter = CompileCounter()
    compiled = torch.compile(decode_one_token, backend=counter, fullgraph=True)
    frames = []

    def step(*args):
        tok = compiled(*args)
        frames.append(counter.frame_count)
        return tok

    model.setup_caches(1, 40)
    tok = prefill(model, prompt, torch.arange(8))
    rest = decode_n_tokens(model, tok, torch.tensor([8]), 31, step=step)
    assert frames == [1] * 31  # one graph, compiled at the first step, never again
    assert torch.equal(torch.cat([prompt, tok, *rest], dim=1), greedy_full_recompute(model, prompt, 32))
    torch._dynamo.reset()


class CountOps(TorchDispatchMode):
    """The ATen ops run inside the mode, by name: `ops` the ones that compute or write, `views` the
    ones whose result only aliases an input (their schema's return carries a read-only alias)."""

    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        (self.views if view else self.ops)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(model):
    """CountOps of one decode step (decode_one_token, greedy) after a 4-token prefill, batch 1."""
    model.setup_caches(1, 16)
    with torch.no_grad():
        tok = prefill(model, torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0)), torch.arange(4))
        with CountOps() as counted:
            decode_one_token(model, tok, torch.tensor([4]))
    return counted


def test_a_decode_step_runs_the_ops_counted_by_hand():
    """Every variant bench.py times, its decode step's ops against counts worked by hand: per layer,
    c_attn, c_proj, c_fc, c_proj (4 addmm), the K and V cache writes, SDPA, GELU and two residual
    adds, plus what the layer's two norms cost: an RMSNorm its F.rms_norm ops (counted here on a
    plain tensor), an unfused tapered norm one multiply by c·γ̃, a folded one nothing. In
    particular no layer converts the causal mask (a bool mask costs SDPA a `where` and two
    `scalar_tensor`s per layer, per step): the mask is built once, in the form SDPA adds."""
    h, gain = torch.randn(1, 1, 32), torch.ones(32)
    with CountOps() as rms:
        F.rms_norm(h, (32,), gain, 1e-5)
    assert not rms.views
    rms, layer = rms.ops, Counter(addmm=4, index_copy_=2, gelu=1, add=2)
    norms = {'baseline': rms + rms, 'internal_unfused': Counter(mul=2), 'internal_folded': Counter(),
             'all_folded': Counter()}
    counts = {}
    for n_layer in (2, 3):
        arch = dict(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=64, block_size=16)
        models, _ = bench.build_variants(arch, seed=0)
        counts[n_layer] = {name: decode_step_ops(m) for name, m in models.items()}
    for name, per_norms in norms.items():
        three, two = counts[3][name], counts[2][name]
        per_layer = three.ops - two.ops
        sdpa = [op for op in per_layer if 'scaled_dot_product' in op]
        assert len(sdpa) == 1 and per_layer.pop(sdpa[0]) == 1, (name, per_layer)
        assert per_layer == layer + per_norms, name
        assert not {'where', 'scalar_tensor', '_to_copy'} & set(three.ops), name
    folded, unfolded = counts[3]['internal_folded'], counts[3]['internal_unfused']
    assert unfolded.ops - folded.ops == Counter(mul=2 * 3) and not folded.ops - unfolded.ops
    assert unfolded.views == folded.views
    # All-Taper folded also drops the final RMSNorm; its untied head is the same one matmul
    assert folded.ops - counts[3]['all_folded'].ops == rms and not counts[3]['all_folded'].ops - folded.ops


# ---- sampling ---------------------------------------------------------------------------

def test_sampling_follows_softmax_of_logits_over_temperature_within_top_k():
    logits = torch.tensor([[0.0, 1.0, 0.5, -1.0, 0.2]])
    n = 20000
    for temperature, top_k in [(1.0, None), (0.5, None), (2.0, 3)]:
        g = torch.Generator().manual_seed(0)
        picks = sample_next(logits.repeat(n, 1), temperature=temperature, top_k=top_k, generator=g).view(-1)
        freq = torch.bincount(picks, minlength=5).float() / n
        expected = torch.exp(logits[0] / temperature)  # plain softmax, by hand
        if top_k is not None:
            expected[logits[0] < logits[0].sort(descending=True).values[top_k - 1]] = 0
        expected /= expected.sum()
        assert (freq - expected).abs().max() < 0.015, (temperature, top_k, freq, expected)


def test_sampling_respects_top_k_and_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    picks = sample_next(logits, temperature=1.0, top_k=2, generator=g)
    assert set(picks.view(-1).tolist()) == {1, 2}
    assert torch.equal(sample_next(logits, temperature=0), torch.ones(500, 1, dtype=torch.long))
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1, generator=g), torch.ones(500, 1, dtype=torch.long))
    assert set(sample_next(logits, 1.0, top_k=100, generator=g).view(-1).tolist()) <= {0, 1, 2, 3}


def test_top_k_keeps_k_tokens_when_logits_tie_at_the_kth():
    """By index, not by threshold: a threshold keeps every token tied with the k-th (bf16 logits tie
    often), and top_k=1 then drew among the tied maxima instead of being greedy."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 2.0]], dtype=torch.bfloat16).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    for top_k in (1, 2, 3):
        picks = sample_next(logits, temperature=1.0, top_k=top_k, generator=g).view(-1)
        assert len(set(picks.tolist())) == top_k and set(picks.tolist()) <= {0, 1, 2, 4}


def test_a_zero_from_the_exponential_noise_never_picks_a_token_outside_top_k(monkeypatch):
    """pytorch#192577: on MPS, exponential_ now and then gives -0.0 (and 0 is a possible draw anywhere);
    sampling divides p by it, 0 / -0.0 is NaN, and argmax takes NaN: a token of probability 0, outside
    top_k, was sampled. Here every draw of the dropped tokens' noise is 0 or -0.0."""
    real = torch.Tensor.exponential_

    def zero_where_dropped(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self[:, 0], self[:, 3] = -0.0, 0.0
        return self

    monkeypatch.setattr(torch.Tensor, 'exponential_', zero_where_dropped)
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(500, 1)
    picks = sample_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(picks.view(-1).tolist()) == {1, 2}


def test_the_largest_float32_temperature_still_keeps_top_k():
    # logits / 3.4e38 are about 1e-38, still apart in fp32 (subnormals included): top_k=1 keeps the argmax
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(100, 1)
    picks = sample_next(logits, temperature=torch.finfo(torch.float32).max, top_k=1,
                        generator=torch.Generator().manual_seed(0))
    assert picks.view(-1).tolist() == [1] * 100


@pytest.mark.parametrize('temperature', [1e-40, 1e-45, 1e-300, 5e-324])
def test_a_vanishing_temperature_is_greedy_not_a_crash(temperature):
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [-5.0, -7.0, -2.0, -3.0], [1e-3, 0.0, -1e-3, 0.0]])
    assert not torch.isfinite((logits / temperature).amax(dim=-1)).all()  # the overflow this guards against
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        picks = sample_next(logits, temperature=temperature, generator=g)
        assert picks.view(-1).tolist() == [1, 2, 0]
    assert sample_next(logits, temperature=temperature, top_k=2, generator=g).view(-1).tolist() == [1, 2, 0]


@pytest.mark.parametrize('kwargs, message', [
    (dict(temperature=-1.0), 'temperature=-1.0 must be a finite number >= 0'),
    (dict(temperature=float('nan')), 'temperature=nan must be a finite number >= 0'),
    (dict(temperature=float('inf'), top_k=1), 'temperature=inf must be a finite number >= 0'),  # top_k ignored
    # past the largest float32, logits / temperature is 0 in fp32 and top_k kept every token (a sample, not the argmax)
    (dict(temperature=1e39, top_k=1), r'temperature=1e\+39 must be .* at most 3.403e\+38, the largest float32'),
    (dict(top_k=0), 'top_k=0 must be >= 1, or None'),
    (dict(top_k=-1), 'top_k=-1 must be >= 1, or None'),
])
def test_bad_sampling_settings_raise_value_errors(kwargs, message):
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=message):
        sample_next(logits, **{'temperature': 1.0, **kwargs})
    model = linear_phase()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 0, **kwargs)  # checked even with no token to sample
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, **kwargs)


# ---- unfused and folded ---------------------------------------------------------------

@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('taper', TAPERS)
def test_unfused_and_folded_logits_equal_the_linear_phase(kind, taper):
    model = linear_phase(kind, taper)
    x = torch.randint(0, 96, (3, 64))
    with torch.no_grad():
        reference, _ = model(x, x)
        folded, _ = fold.fold_model(model)(x, x)
        unfused_logits, _ = unfused(model)(x, x)
    scale = reference.abs().max().item()
    assert scale > 2  # logits far from zero: a wrong fold would show
    assert_close(folded, reference, rtol=1e-5, atol=1e-5 * scale)
    assert_close(unfused_logits, reference, rtol=1e-5, atol=1e-5 * scale)
    assert not any(isinstance(m, TaperNorm) for m in model.modules())
    assert sum(isinstance(m, TaperScale) for m in model.modules()) == 4 + (taper == 'all')


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('kind', KINDS)
def test_a_half_precision_checkpoint_folds_into_fp32_layers_with_its_logits(kind, dtype):
    """A checkpoint cast down for size (QuaRot#8: folding into bf16 weights rounds the product): the
    folded layers stay fp32, so the folded model gives the logits of the half-precision weights it
    came from, which load into an fp32 model exactly; rounded back to bf16 they were 1e-3 off."""
    model = linear_phase(kind, 'all')
    half = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    sd, args = fold.fold_state_dict(half, vars(model.config))
    assert {sd[f'{lin}.weight'].dtype for _, lin in fold.fold_pairs(args)} == {torch.float32}
    x = torch.randint(0, 96, (3, 64))
    with torch.no_grad():
        reference, _ = fold.model_from_state_dict(half, vars(model.config))(x, x)
        folded, _ = fold.model_from_state_dict(sd, args)(x, x)
    scale = reference.abs().max().item()
    assert_close(folded, reference, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize('taper', TAPERS)
def test_folded_model_has_no_norm_where_the_tapered_ones_were(taper):
    folded = fold.fold_model(linear_phase('layernorm', taper))
    blocks = folded.transformer.h
    assert all(b.ln_1 is None and b.ln_2 is None for b in blocks)
    assert (folded.transformer.ln_f is None) == (taper == 'all')
    assert not [n for n, _ in folded.named_modules() if n.endswith(('ln_1', 'ln_2'))]


@pytest.mark.parametrize('taper', TAPERS)
def test_layernorm_fold_rows_sum_to_zero_and_bias_uses_the_original_weight(taper):
    model = linear_phase('layernorm', taper)
    sd, _ = fold.fold_state_dict(model.state_dict(), vars(model.config))
    names = ['transformer.h.0.attn.c_attn', 'transformer.h.1.mlp.c_fc'] + (['lm_head'] if taper == 'all' else [])
    for name in names:
        W = sd[f'{name}.weight']
        assert W.sum(dim=1).abs().max() < 1e-5 * W.abs().max() * W.size(1)
    ln, lin = model.transformer.h[0].ln_1, model.transformer.h[0].attn.c_attn
    with torch.no_grad():
        assert_close(sd['transformer.h.0.attn.c_attn.bias'], lin.bias + lin.weight @ ln.bias_tilde)


def test_folded_head_is_untied_and_stays_untied_through_a_checkpoint(tmp_path):
    model = linear_phase('layernorm', 'all')
    folded = fold.fold_model(model)
    wte, head = folded.transformer.wte.weight, folded.lm_head.weight
    assert wte is not head and not torch.equal(wte, head)
    assert torch.equal(wte, model.transformer.wte.weight)  # the embedding keeps its weight
    assert folded.lm_head.bias is not None  # W β̃ of the folded LN
    path = str(tmp_path / 'folded.pt')
    save_checkpoint({'model': folded.state_dict(), 'model_args': vars(folded.config)}, path)
    loaded, _ = load_model(path)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight, head) and torch.equal(loaded.transformer.wte.weight, wte)
    assert loaded.phase == 'linear'
    x = torch.randint(0, 96, (2, 64))
    with torch.no_grad():
        assert torch.equal(loaded(x, x)[0], folded(x, x)[0])


def test_fold_refuses_what_it_cannot_fold():
    baseline = linear_phase(taper='none')
    with pytest.raises(fold.FoldError, match='baseline'):
        fold.fold_state_dict(baseline.state_dict(), vars(baseline.config))
    model = linear_phase(taper='all')
    folded = fold.fold_model(model)
    with pytest.raises(fold.FoldError, match='already folded'):
        fold.fold_state_dict(folded.state_dict(), vars(folded.config))
    model.set_phase('taper')
    model.set_gate(0.25)
    with pytest.raises(fold.FoldError, match=r'taper phase \(g = 0.25\)'):
        fold.fold_state_dict(model.state_dict(), vars(model.config))
    warm = GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8, taper='internal'))
    with pytest.raises(fold.FoldError, match=r'warmup phase \(g = 1\)'):
        fold.fold_state_dict(warm.state_dict(), vars(warm.config))
    for norm, why in (('dyt', r'DyT model: tanh\(α·h\)'), ('derf', r'Derf model: erf\(α·h \+ s\)')):
        free = GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8, norm=norm))
        with pytest.raises(fold.FoldError, match=why + ' is not a linear map'):
            fold.fold_state_dict(free.state_dict(), vars(free.config))


def offset_layernorm_model(offset):
    """An All-TaperLN model in the linear phase with random c·γ̃, β̃ and `offset` added to every
    embedding entry: a large residual stream, as GPT-2's first position has."""
    model = linear_phase('layernorm', taper='all', seed=3)
    with torch.no_grad():
        model.transformer.wte.weight.add_(offset)
        model.transformer.wpe.weight.add_(offset)
    return model


def test_the_fold_check_judges_both_forms_against_fp64():
    x = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1))
    big = offset_layernorm_model(100.0)
    folded = fold.fold_model(big)
    # fp32 rounding alone puts both forms ~1e-4 of the largest logit from fp64, and from each
    # other (a check of 1e-4 between them refused this correct fold): judged against fp64, the
    # folded model is as good as the unfolded one, and the fold passes
    ref = copy.deepcopy(big).double()(x, x)[0]
    err_unfolded = (big(x, x)[0].double() - ref).abs().max().item()
    err_folded = (folded(x, x)[0].double() - ref).abs().max().item()
    assert err_unfolded > 5e-5 * ref.abs().max().item() and err_folded <= 4 * err_unfolded
    diff, scale = fold.max_logit_error(big, folded, x, 'unfolded vs folded')
    assert diff > 1e-4 * scale  # what the old check refused
    # one γ̃ entry off by 1e-3 in the folded weights is refused, at that scale too
    wrong = fold.fold_model(big)
    with torch.no_grad():
        wrong.transformer.h[0].attn.c_attn.weight[:, 5] *= 1 + 1e-3
    with pytest.raises(fold.CheckError, match='from an fp64 copy of the first'):
        fold.max_logit_error(big, wrong, x, 'unfolded vs folded')


# ---- the scripts, end to end ----------------------------------------------------------

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A real (tiny) dataset through data/text/prepare.py and a run that ends in the linear phase."""
    from data.text import prepare
    root = tmp_path_factory.mktemp('e2e')
    words = 'the cat sat on a mat and then it ran away very quickly said Emma to her sister'.split()
    rng = torch.Generator().manual_seed(0)
    lines = [' '.join(words[i] for i in torch.randint(0, len(words), (9,), generator=rng).tolist())
             for _ in range(400)]
    (root / 'corpus.txt').write_text('.\n'.join(lines))
    prepare.main([f'--input={root / "corpus.txt"}', '--vocab_size=64', f'--out_dir={root / "data" / "words"}'])
    out = root / 'run'
    train.main([f'--data_dir={root / "data"}', '--dataset=words', f'--out_dir={out}', '--device=cpu',
                '--compile=False', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32',
                '--batch_size=4', '--gradient_accumulation_steps=1', '--taper=all', '--aux_weight=0.1',
                '--max_iters=20', '--gate_warmup_iters=5', '--taper_iters=8', '--warmup_iters=2',
                '--lr_decay_iters=20', '--learning_rate=3e-3', '--eval_interval=10', '--eval_iters=1',
                '--log_interval=10'])
    return out / 'ckpt.pt'


def test_folds_check_reads_the_runs_val_tokens_and_other_data_under_its_name_is_not_read(trained, tmp_path,
                                                                                          monkeypatch):
    """nanoGPT#483's IndexError: fold.py's check fed a val.bin with ids >= vocab_size to the model
    when the dataset's name was prepared again with another vocabulary."""
    import shutil
    ck = torch.load(trained, weights_only=True)
    T, V = ck['model_args']['block_size'], ck['model_args']['vocab_size']
    folder = Path(ck['config']['data_dir']) / ck['config']['dataset']
    tokens, source = fold.check_batch(ck, 3, 0)
    assert source == str(folder / 'val.bin') and tokens.shape == (3, T)
    val = torch.from_numpy(np.fromfile(folder / 'val.bin', dtype=np.uint16).astype(np.int64))
    windows = val.unfold(0, T, 1)
    assert all((windows == row).all(1).any() for row in tokens)  # each row is a window of val.bin

    data = tmp_path / 'data'
    shutil.copytree(folder, data / 'words')
    moved = {**ck, 'config': {**ck['config'], 'data_dir': str(data)}}
    assert fold.check_batch(moved, 3, 0)[1] == str(data / 'words' / 'val.bin')  # the same data elsewhere: read
    # a relative data_dir is the repository's, as train.py reads it, wherever fold.py runs
    relative = {**ck, 'config': {**ck['config'], 'data_dir': os.path.relpath(data, ROOT)}}
    monkeypatch.chdir(tmp_path / 'data')
    assert os.path.samefile(fold.check_batch(relative, 3, 0)[1], data / 'words' / 'val.bin')
    meta = json.loads((data / 'words' / 'meta.json').read_text())
    # the name prepared again with a larger vocabulary: another meta.json, ids past the model's
    (data / 'words' / 'meta.json').write_text(json.dumps({**meta, 'vocab_size': 4 * V}))
    np.arange(V, V + 4 * T, dtype=np.uint16).tofile(data / 'words' / 'val.bin')
    tokens, source = fold.check_batch(moved, 3, 0)
    assert source.startswith('random tokens') and 'is not the data the run trained on' in source
    assert tokens.shape == (3, T) and 0 <= tokens.min() and tokens.max() < V
    # a checkpoint that records no meta: the ids themselves give it away
    bare = {k: v for k, v in moved.items() if k != 'meta'}
    tokens, source = fold.check_batch(bare, 3, 0)
    assert source.startswith('random tokens') and f'ids >= the model\'s vocab_size = {V}' in source
    assert tokens.max() < V
    for damage, why in ((lambda d: (d / 'meta.json').unlink(), 'meta.json not found'),
                        (lambda d: (d / 'val.bin').write_bytes(b'\0' * (2 * T + 1)), 'not a whole number of tokens'),
                        (lambda d: (d / 'val.bin').write_bytes(b''), 'not a whole number of tokens')):
        shutil.rmtree(data / 'words')
        shutil.copytree(folder, data / 'words')
        damage(data / 'words')  # a memmap's ValueError, or a wrong reason, before
        tokens, source = fold.check_batch(moved, 3, 0)
        assert source.startswith('random tokens') and why in source and tokens.max() < V
    path = tmp_path / 'other.pt'
    save_checkpoint(moved, str(path))
    report = fold.main([f'--ckpt={path}', f'--out={tmp_path / "folded.pt"}'])  # an IndexError before
    assert report['max_abs_logit_diff'] < 1e-4 * max(1.0, report['max_abs_logit'])


def test_fold_and_sample_scripts_end_to_end(trained, tmp_path, capsys):
    out = tmp_path / 'folded.pt'
    report = fold.main([f'--ckpt={trained}', f'--out={out}'])
    assert report['max_abs_logit_diff'] < 1e-4 * max(1.0, report['max_abs_logit'])
    assert report['params'][1] > report['params'][0]  # All-Taper: the untied head adds V·d
    assert 'untied' in capsys.readouterr().out
    saved = torch.load(out, weights_only=True)
    assert saved['model_args']['folded'] and saved['folded_norms'][-1] == 'transformer.ln_f'
    assert 'optimizer' not in saved
    args = ['--start=the cat', '--num_samples=2', '--max_new_tokens=12', '--temperature=0', '--device=cpu']
    raw = sample.main([f'--ckpt={trained}'] + args)
    folded = sample.main([f'--ckpt={out}'] + args)
    assert raw == folded and raw[0].startswith('the cat') and len(raw[0]) > len('the cat')
    assert len(raw) == 1  # greedy: one continuation, said once, not two identical ones
    assert capsys.readouterr().err.count('temperature=0 is greedy: its 2 samples would be identical') == 2
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('the mat')
    text = sample.main([f'--ckpt={out}', f'--start=FILE:{prompt}', '--num_samples=1', '--temperature=0.8',
                        '--top_k=5'])
    assert text[0].startswith('the mat') and len(text[0]) > 50  # max_new_tokens=0 fills the context
    every = sample.main([f'--ckpt={out}', '--start=the mat', '--num_samples=1', '--temperature=0.8', '--top_k=0',
                         '--max_new_tokens=4'])  # top_k 0: every token
    assert every[0].startswith('the mat') and len(every[0]) > len('the mat')
    with pytest.raises(SystemExit, match='already folded'):
        fold.main([f'--ckpt={out}', f'--out={tmp_path / "twice.pt"}'])


def test_samples_piped_into_a_reader_that_stops_early_end_quietly(trained):
    """`python sample.py ... | head -1`: a reader that closes the pipe (here before the first write, so
    the test does not race it) ends sample.py with status 1 and nothing on stderr, as Python's docs
    advise for EPIPE (configurator.run_command), not a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, 'sample.py', f'--ckpt={trained}', '--num_samples=2',
                             '--max_new_tokens=4', '--device=cpu'], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS='1'))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == ''


def test_ctrl_c_outside_a_training_run_is_one_line(trained):
    """A KeyboardInterrupt reaching configurator.run_command (here mid-sampling; a GPT-2 download too,
    huggingface_hub#3648) printed a traceback: one line now, status 130 as for SIGINT."""
    proc = subprocess.Popen([sys.executable, 'sample.py', f'--ckpt={trained}', '--num_samples=1000',
                             '--max_new_tokens=30', '--device=cpu'], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS='1'))
    proc.stdout.readline()  # sampling has begun
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.decode() == 'stopped by SIGINT (Ctrl-C)\n'


def test_sample_errors_name_the_fix(trained, tmp_path):
    with pytest.raises(SystemExit, match='not found'):
        sample.main([f'--ckpt={tmp_path / "missing.pt"}'])
    with pytest.raises(SystemExit, match='--max_new_tokens=30 or less'):
        sample.main([f'--ckpt={trained}', '--start=the cat', '--max_new_tokens=31'])
    with pytest.raises(SystemExit, match='cannot read the prompt file'):
        sample.main([f'--ckpt={trained}', f'--start=FILE:{tmp_path / "nope.txt"}'])
    with pytest.raises(SystemExit, match=r'^config error: temperature=inf must be a finite number >= 0'):
        sample.main([f'--ckpt={trained}', '--temperature=1e400', '--top_k=1'])  # a ValueError traceback before
    model = linear_phase()
    toy = str(tmp_path / 'toy.pt')  # trained on token ids without a tokenizer (tests' toy data)
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config),
                     'meta': {'vocab_size': 96, 'tokenizer': 'toy'}}, toy)
    with pytest.raises(SystemExit, match='no tokenizer table'):
        sample.main([f'--ckpt={toy}'])


def test_an_empty_prompt_is_one_line_naming_where_it_came_from(trained, tmp_path):
    with pytest.raises(SystemExit, match='^the prompt is empty: give at least one character with --start$'):
        sample.main([f'--ckpt={trained}', '--start='])
    prompt = tmp_path / 'prompt.txt'
    for content in ('', '\n'):  # a file copying the default --start='\n' is empty once its line ending goes
        prompt.write_text(content)
        with pytest.raises(SystemExit, match=f'^the prompt file {prompt} holds no text \\(its final line ending is '
                                             'dropped\\): write the prompt into it$'):
            sample.main([f'--ckpt={trained}', f'--start=FILE:{prompt}'])


def test_a_prompt_file_that_is_not_utf8_is_one_line_naming_the_conversion(tmp_path):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_bytes('Once upon a time, Zoë and Ann'.encode('latin-1'))
    with pytest.raises(SystemExit) as e:
        sample.read_prompt(f'FILE:{prompt}')
    assert str(e.value) == (f"--start=FILE:{prompt}: the prompt file is not UTF-8 text (byte 20: invalid "
                            f"continuation byte); convert it, e.g. iconv -f ITS_ENCODING -t UTF-8 {prompt} > prompt.txt")
    prompt.write_text('Once upon a time, Zoë', encoding='utf-8')
    assert sample.read_prompt(f'FILE:{prompt}') == 'Once upon a time, Zoë'
    prompt.write_bytes(b'\xef\xbb\xbf' + 'Once upon a time, Zoë'.encode())  # Notepad's BOM is not prompt text
    assert sample.read_prompt(f'FILE:{prompt}') == 'Once upon a time, Zoë'
    prompt.write_bytes(b'\xef\xbb\xbf' + 'Once upon a time, Zoë'.encode('latin-1'))
    with pytest.raises(SystemExit, match=r'byte 23: '):  # the file's byte, the mark counted
        sample.read_prompt(f'FILE:{prompt}')


@pytest.mark.parametrize('ending, kept', [(b'\n', ''), (b'\r\n', ''), (b'\r', ''), (b'\n\n', '\n'), (b'', ''),
                                          (b' \n', ' ')])
def test_a_prompt_file_loses_the_one_line_ending_an_editor_adds(tmp_path, ending, kept):
    """rustformers/llm#60 (llama.cpp drops it too): `echo 'the cat' > prompt.txt` ends the file with a
    newline, and the continuation began on a new line. One is dropped; a second is the user's."""
    prompt = tmp_path / 'prompt.txt'
    prompt.write_bytes(b'the cat\nsat' + ending)
    assert sample.read_prompt(f'FILE:{prompt}') == 'the cat\nsat' + kept
    assert sample.read_prompt('the cat\n') == 'the cat\n'  # a prompt typed as --start is taken as it is


def test_fold_refuses_an_out_folder_it_cannot_write_before_folding(tmp_path, monkeypatch, read_only):
    model = linear_phase()
    ckpt = tmp_path / 'ckpt.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(ckpt))
    folds, real_fold = [], fold.fold_state_dict
    monkeypatch.setattr(fold, 'fold_state_dict', lambda *a: folds.append(a) or real_fold(*a))
    folder = tmp_path / 'ro'
    folder.mkdir()
    read_only(folder)
    with pytest.raises(SystemExit) as e:
        fold.main([f'--ckpt={ckpt}', f'--out={folder / "folded.pt"}'])
    assert str(e.value) in (f"cannot write in {folder} ({os.strerror(n)}): choose another --out"
                            for n in (errno.EROFS, errno.EACCES))  # the stand-in's, or chmod's
    assert folds == [] and os.listdir(folder) == []  # refused before the fold was computed


def test_sample_refuses_a_prompt_that_fills_the_context_and_bad_devices(trained, tmp_path):
    prompt = tmp_path / 'long.txt'
    prompt.write_text('the cat sat on a mat ' * 20)  # well over the 32-token context
    with pytest.raises(SystemExit, match='leaves room for new tokens only after a prompt of at most 31'):
        sample.main([f'--ckpt={trained}', f'--start=FILE:{prompt}'])
    with pytest.raises(SystemExit, match="dtype='fp16'"):
        sample.main([f'--ckpt={trained}', '--dtype=fp16'])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match='no CUDA device; use --device=cpu'):
            sample.main([f'--ckpt={trained}', '--device=cuda'])


def test_fold_writes_nothing_when_its_check_fails(trained, tmp_path, monkeypatch):
    fold_properly = fold.fold_state_dict

    def off_by_a_bit(sd, args):
        sd, args = fold_properly(sd, args)
        sd['transformer.h.0.mlp.c_fc.weight'] = sd['transformer.h.0.mlp.c_fc.weight'] * 1.01
        return sd, args

    monkeypatch.setattr(fold, 'fold_state_dict', off_by_a_bit)
    out = tmp_path / 'bad.pt'
    with pytest.raises(SystemExit, match='nothing written'):
        fold.main([f'--ckpt={trained}', f'--out={out}'])
    assert not out.exists()
    with pytest.raises(SystemExit, match='folder does not exist'):
        fold.main([f'--ckpt={trained}', f'--out={tmp_path / "no" / "such.pt"}'])
    # --out replaces only an earlier fold: not a run's log (it exited 0, the log a checkpoint), nor the
    # trained checkpoint through a link to it
    log = trained.parent / 'log.jsonl'
    before = log.read_bytes()
    with pytest.raises(SystemExit, match=f'--out={log} exists and is not a folded checkpoint: fold.py replaces'):
        fold.main([f'--ckpt={trained}', f'--out={log}'])
    other_run = tmp_path / 'other_run.pt'  # a trained checkpoint, not a fold: kept too
    other_run.write_bytes(trained.read_bytes())
    with pytest.raises(SystemExit, match='exists and is not a folded checkpoint'):
        fold.main([f'--ckpt={trained}', f'--out={other_run}'])
    assert other_run.read_bytes() == trained.read_bytes()
    (tmp_path / 'link.pt').symlink_to(trained)
    with pytest.raises(SystemExit, match='--out must differ from --ckpt'):
        fold.main([f'--ckpt={tmp_path / "link.pt"}', f'--out={trained}'])
    assert log.read_bytes() == before
    monkeypatch.setattr(fold, 'fold_state_dict', fold_properly)
    again = tmp_path / 'again.pt'
    for _ in range(2):  # a fold is replaced by the next one
        fold.main([f'--ckpt={trained}', f'--out={again}'])
    for n in (0, -1):  # numpy's 'need at least one array to stack' / 'negative dimensions' before
        with pytest.raises(SystemExit, match=f'config error: batch_size={n} must be >= 1; set by --batch_size={n}'):
            fold.main([f'--ckpt={trained}', f'--out={out}', f'--batch_size={n}'])
    for folder in (str(tmp_path), f'{tmp_path / "new"}/'):  # was a traceback from os.replace, after the fold
        with pytest.raises(SystemExit) as e:
            fold.main([f'--ckpt={trained}', f'--out={folder}'])
        assert str(e.value) == (f"config error: --out={folder} names a folder: --out is the file to write, e.g. "
                                f"--out={os.path.join(folder, 'folded.pt')}")


def test_unfused_needs_the_linear_phase():
    model = linear_phase()
    model.set_phase('taper')
    model.set_gate(0.5)
    with pytest.raises(RuntimeError, match=r"phase 'taper' with g = 0.5"):
        unfused(model)


def test_generate_argument_checks():
    model = linear_phase()
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match='max_new_tokens=-1'):
        model.generate(idx, -1)
    with pytest.raises(ValueError, match=r'an empty prompt \(T0 = 0\)'):  # an IndexError deep in prefill
        model.generate(idx[:, :0], 2)
    assert torch.equal(model.generate(idx, 0), idx)
    out = model.generate(idx, 5, temperature=0.7, top_k=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and torch.equal(out[:, :3], idx)


@torch.no_grad()
def test_generate_samples_every_new_token_not_only_the_first():
    """With the head zeroed (bias too) every logit is 0: each new token is uniform over the vocabulary at
    temperature 1, where greedy decoding would give token 0 every time. 64 rows × 8 tokens from V = 96:
    about 96·(1 − e^(−512/96)) ≈ 95 distinct values expected, each decode position many."""
    model = linear_phase(taper='none', bias=False)
    model.lm_head.weight.zero_()  # tied: the token embedding is zero too, the positions still differ
    idx = torch.zeros(64, 3, dtype=torch.long)
    out = model.generate(idx, 8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out[:, 3].unique().numel() > 32  # the prefill's token
    for t in range(4, 11):  # the decode steps' tokens
        assert out[:, t].unique().numel() > 32, t


@pytest.mark.parametrize('script', [sample, fold, bench])
def test_help_prints_every_key_with_its_comment_and_exits_0(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(['--help'])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    lines = configurator.defaults_block(vars(script)).splitlines()
    keys = configurator.defaults_of(vars(script))
    assert len(lines) == len(keys) and all(' # ' in line for line in lines)
    assert all(any(line.startswith(f'{k} =') for line in out.splitlines()) for k in keys)


def test_no_script_imports_train():
    for name in ('sample.py', 'fold.py', 'bench.py'):
        tree = ast.parse((Path(__file__).resolve().parents[1] / name).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert 'train' not in modules, name


def test_sample_starts_from_end_of_text_and_warns_about_unk_prompts(trained, capsys):
    eot = sample.main([f'--ckpt={trained}', '--start=<|endoftext|>', '--num_samples=1', '--max_new_tokens=5',
                       '--temperature=0'])
    assert eot[0].startswith('<|endoftext|>') and len(eot[0]) > len('<|endoftext|>')
    assert 'warning' not in capsys.readouterr().err
    sample.main([f'--ckpt={trained}', '--start=Ünïcödé ñøñ-ÅSCII the', '--num_samples=1', '--max_new_tokens=2'])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('warning: ') and "reach the model as <unk>" in err[0]
    share = int(err[0].split('%')[0].removeprefix('warning: '))
    assert 50 <= share < 100  # most of it, but 'the' is in the vocabulary


def test_fold_of_a_stopped_run_says_how_to_finish_it(trained, tmp_path):
    """A run stopped mid-taper (Ctrl-C, a time limit) cannot fold; the message gives the command
    that finishes it. A checkpoint at its run's last step gets no such sentence."""
    ck = torch.load(trained, weights_only=False)
    ck['model']['gate'] = torch.tensor(0.5)
    for it, says in ((9, True), (20, False)):
        ck['iter_num'] = it
        path = tmp_path / f'at{it}.pt'
        save_checkpoint(ck, str(path))
        with pytest.raises(SystemExit) as e:
            fold.main([f'--ckpt={path}', f'--out={tmp_path / "folded.pt"}'])
        assert 'in the taper phase (g = 0.5)' in str(e.value.code)
        finish = (f"Its run stopped after 9 of its 20 iterations; finish it with: python train.py --init_from=resume "
                  f"--out_dir={trained.parent}")
        assert str(e.value.code).endswith(finish) if says else 'finish it' not in str(e.value.code)
