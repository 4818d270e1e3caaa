"""TaperNorm, calibration, L_aux and the compiled model (docs/method.md §1, §3, §4)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

import train
from model import CALIB_DECAY, GPT, LADDER, GPTConfig, TaperNorm, aux_loss, branch_mismatch
from norms import Norm, norm_scale

KINDS = ['rmsnorm', 'layernorm']


def tiny(kind='rmsnorm', taper='all', bias=True, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                         norm=kind, taper=taper, bias=bias, **kw))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_logit_rms_is_the_logits_rms_in_fp32_without_a_copy_of_them(dtype):
    """The logged logit_rms is sqrt(mean z²) over every position and vocabulary entry (float64 reference
    here), reduced in fp32 under bf16 autocast too, and made without an elementwise op on the logits:
    .float().pow(2) made two fp32 copies of them, 3.3 GB each at GPT-2's 16 × 1024 × 50,257, for a
    logged number (transformers#30860)."""
    model = tiny(taper='internal').to(torch.float64 if dtype == torch.float64 else torch.float32)  # fold.py's check
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    sizes = []

    class Outputs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, '__name__', '') in ('pow', 'square', 'mul', 'float', 'to', 'abs'):
                sizes.append(out.numel() if isinstance(out, torch.Tensor) else 0)
            return out

    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), Outputs():
        logits, _ = model(x, x)
    reference = logits.double().pow(2).mean().sqrt()
    assert model.last_metrics.logit_rms.dtype == torch.float32 and logits.dtype == dtype
    assert model.last_metrics.logit_rms.double().item() == pytest.approx(reference.item(), rel=1e-6)
    assert logits.numel() not in sizes


def randomize_gains(model, spread=1.0):
    """Gains far from 1, so that skipping γ̃ ← γ (or using the wrong γ) is visible."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Norm):
                m.weight.copy_(torch.exp(spread * torch.randn_like(m.weight)))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))


def tapernorm(kind, d=16):
    torch.manual_seed(1)
    m = TaperNorm(d, kind, bias=True, eps=1e-5)
    with torch.no_grad():
        m.weight.copy_(torch.randn(d))
        m.weight_tilde.copy_(torch.randn(d))
        if m.bias is not None:
            m.bias.copy_(torch.randn(d))
            m.bias_tilde.copy_(torch.randn(d))
        m.c.fill_(0.37)
    return m


def linear_map(m, h):
    """c·h⊙γ̃ (RMS) or c·(P h)⊙γ̃ + β̃ (LN), written out from docs/method.md §1."""
    x = h - h.mean(-1, keepdim=True) if m.kind == 'layernorm' else h
    y = m.c * x * m.weight_tilde
    return y + m.bias_tilde if m.bias_tilde is not None else y


def reference_norm(m, h):
    if m.kind == 'rmsnorm':
        return F.rms_norm(h, (h.size(-1),), m.weight, eps=1e-5)
    return F.layer_norm(h, (h.size(-1),), m.weight, m.bias, eps=1e-5)


@pytest.mark.parametrize('kind', KINDS)
def test_gate_one_is_the_fused_norm(kind):
    m, h = tapernorm(kind), 3 * torch.randn(4, 7, 16)
    ref = reference_norm(m, h)
    m.phase = 'warmup'
    assert_close(m(h, torch.tensor(1.0)), ref, rtol=0, atol=0)
    m.phase = 'taper'
    assert_close(m(h, torch.tensor(1.0)), ref, rtol=0, atol=0)


class RecordCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, '__name__', str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('kind', KINDS)
def test_gate_zero_is_the_linear_map_without_r(kind):
    m, h = tapernorm(kind), 3 * torch.randn(4, 7, 16)
    m.phase = 'linear'
    with RecordCalls() as rec:
        out = m(h, torch.tensor(0.0))
    assert_close(out, linear_map(m, h))
    assert not {'rms_norm', 'layer_norm', 'sqrt', 'rsqrt', 'var', 'std'} & set(rec.names), rec.names
    m.phase = 'taper'  # the mixed path at g = 0 agrees
    assert_close(m(h, torch.tensor(0.0)), out)


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('g', [0.1, 0.5, 0.9])
def test_taper_is_the_convex_combination(kind, g):
    m, h = tapernorm(kind), 3 * torch.randn(4, 7, 16)
    m.phase = 'taper'
    expected = g * reference_norm(m, h) + (1 - g) * linear_map(m, h)
    assert_close(m(h, torch.tensor(g)), expected)


def calibrate_on(model, x):
    """calibration='end' on one batch: collect, then calibrate."""
    model.set_collect('calibration')
    model(x, x)
    model.set_collect(None)
    return model.calibrate('end')


def reference_r(h, kind, eps=1e-5):
    """r(h) or σ(h) of docs/method.md (its symbols) in plain torch, (..., d) -> (...)."""
    x = h - h.mean(-1, keepdim=True) if kind == 'layernorm' else h
    return (x.pow(2).sum(-1) / h.size(-1) + eps).sqrt()


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('mode', ['end', 'ema'])
def test_calibration_on_a_fixed_batch_is_the_closed_form(kind, mode):
    """'end' on one batch, or 'ema' fed one batch repeatedly (the bias correction cancels):
    c and s_tgt are exactly the least-squares closed form of docs/method.md §3 on that batch."""
    model = tiny(kind, taper='all')
    randomize_gains(model)
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0].detach()))
             for n, m in model.tapernorms()]
    x = torch.randint(0, 64, (4, 16))
    model.train()
    model.set_collect('calibration')
    for _ in range(5 if mode == 'ema' else 1):
        model(x, x)
        if mode == 'ema':
            model.calibration_step()
    model.set_collect(None)
    for h in hooks:
        h.remove()
    randomize_gains(model)  # γ moves during warmup: c must use the γ being copied, not an old one
    gammas = {n: m.weight.detach().clone() for n, m in model.tapernorms()}
    event = model.calibrate(mode)
    for name, m in model.tapernorms():
        h = inputs[name].reshape(-1, 32).double()
        hg = (h - h.mean(-1, keepdim=True) if kind == 'layernorm' else h) * gammas[name].double()
        c_star = (hg.pow(2).sum(-1) / reference_r(h, kind)).mean() / hg.pow(2).sum(-1).mean()  # docs/method.md §3
        assert event['c'][name] == pytest.approx(c_star.item(), rel=1e-5)
        assert_close(m.weight_tilde, m.weight, rtol=0, atol=0)
        if m.bias is not None:
            assert_close(m.bias_tilde, m.bias, rtol=0, atol=0)
    s = reference_r(inputs['ln_f'].double(), kind).mean()
    assert event['s_tgt'] == pytest.approx(s.item(), rel=1e-5)
    assert int(model.calib_steps) == (5 if mode == 'ema' else 0) and bool(model.calibrated)
    with pytest.raises(RuntimeError, match='already calibrated'):
        model.calibrate(mode)


def test_end_calibration_weights_every_batch_equally_and_ignores_the_warmup():
    """'end' over two batches = the closed form over their union; earlier statistics that were
    taken (an EMA run) do not enter it."""
    model = tiny(taper='internal')
    x1, x2 = torch.randint(0, 64, (2, 4, 16))
    ln = model.transformer.h[1].ln_2
    seen = []
    ln.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    model.set_collect('calibration')
    model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    model.calibration_step()  # an EMA step: not part of 'end'
    model.eval()
    model(x1, x1)
    model(x2, x2)
    event = model.calibrate('end')
    h = torch.cat(seen[1:]).reshape(-1, 32).double()
    g2 = ln.weight.detach().double().pow(2)
    c = (g2 * (h.pow(2) / reference_r(h, 'rmsnorm')[:, None]).mean(0)).sum() / (g2 * h.pow(2).mean(0)).sum()
    assert event['c']['h.1.ln_2'] == pytest.approx(c.item(), rel=1e-6)


def test_calibration_statistics_average_micro_batches_and_decay_per_step():
    model = tiny(taper='internal')
    x1, x2 = torch.randint(0, 64, (2, 4, 16))
    ln = model.transformer.h[0].ln_1
    seen = []
    ln.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    model.train()
    model.set_collect('calibration')
    model(x1, x1)
    model(x2, x2)  # two micro-batches, one optimizer step
    model.calibration_step()
    # D_i after one step from zero = (1 − ρ) · mean over micro-batches of the token mean of h_i²
    expected = (1 - CALIB_DECAY) * (seen[0].reshape(-1, 32).pow(2).mean(0) + seen[1].reshape(-1, 32).pow(2).mean(0)) / 2
    assert_close(ln.calib_den, expected)
    model(x1, x1)
    model.calibration_step()  # a second step decays the first by ρ
    step2 = seen[2].reshape(-1, 32).pow(2).mean(0)
    assert_close(ln.calib_den, CALIB_DECAY * expected + (1 - CALIB_DECAY) * step2)
    model.set_collect(None)
    model(x1, x1)  # a forward that does not collect never touches the statistics
    with pytest.raises(RuntimeError, match='without a forward'):
        model.calibration_step()
    with pytest.raises(ValueError, match='collect'):
        model.set_collect('both')


@pytest.mark.parametrize('kind', KINDS)
def test_ema_calibration_over_steps_of_two_micro_batches_is_the_formula_worked_by_hand(kind):
    """Three 'ema' steps of two micro-batches each, on different batches: c and s_tgt equal, to 1e-6,
    the formula of docs/method.md §3-4 computed here in float64 from the norms' inputs: per step the
    mean over micro-batches of the token means N_i = E[x_i²/r], D_i = E[x_i²] and of mean s(h), their
    EMAs (ρ = CALIB_DECAY, from 0), c = Σ γ_i² N_i / Σ γ_i² D_i, s_tgt = EMA / (1 − ρ³)."""
    model = tiny(kind, taper='all')
    randomize_gains(model)
    inputs = {n: [] for n, _ in model.tapernorms()}
    for n, m in model.tapernorms():
        m.register_forward_pre_hook(lambda mod, args, n=n: inputs[n].append(args[0].detach().double()))
    batches = torch.randint(0, 64, (3, 2, 4, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    model.set_collect('calibration')
    for step in batches:
        for x in step:
            model(x, x)
        model.calibration_step()
    gammas = {n: m.weight.detach().double() for n, m in model.tapernorms()}
    event = model.calibrate('ema')
    rho = CALIB_DECAY
    for name, hs in inputs.items():
        ema_n = ema_d = 0
        for k in range(3):
            xs = [h.reshape(-1, 32) for h in hs[2 * k:2 * k + 2]]
            xs = [x - x.mean(-1, keepdim=True) if kind == 'layernorm' else x for x in xs]
            n = sum((x.pow(2) / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).mean(0) for x in xs) / 2
            d = sum(x.pow(2).mean(0) for x in xs) / 2
            ema_n, ema_d = rho * ema_n + (1 - rho) * n, rho * ema_d + (1 - rho) * d
        g2 = gammas[name].pow(2)
        assert event['c'][name] == pytest.approx(((g2 * ema_n).sum() / (g2 * ema_d).sum()).item(), rel=1e-6), name
    ema_s = 0
    for k in range(3):
        s = sum(reference_r(h, kind).mean() for h in inputs['ln_f'][2 * k:2 * k + 2]) / 2
        ema_s = rho * ema_s + (1 - rho) * s
    assert event['s_tgt'] == pytest.approx((ema_s / (1 - rho ** 3)).item(), rel=1e-6)


def test_calibration_step_follows_the_buffers_a_move_replaces():
    """calibration_step keeps its lists of buffers between steps; .to() / .double() replace every
    buffer, so the lists must be rebuilt: the next step's statistics land in the model's own EMAs."""
    model = tiny(taper='internal')
    x = torch.randint(0, 64, (4, 16))
    model.set_collect('calibration')
    model(x, x)
    model.calibration_step()
    model.double()
    ln = model.transformer.h[1].ln_2
    before, s_before = ln.calib_den.clone(), model.hidden_rms_ema.clone()
    model(x, x)
    model.calibration_step()
    assert ln.calib_den.dtype == torch.float64 and torch.all(ln.calib_den > before)  # ρ·D + (1 − ρ)·D > ρ·D
    assert model.hidden_rms_ema > s_before and int(model.calib_steps) == 2


def count_ops(fn):
    """{op name: calls} of the ATen ops fn() runs (views included), and fn's result."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    ops = Counter()
    with Count():
        out = fn()
    return ops, out


@pytest.mark.parametrize('kind, per_norm', [
    # x², its row mean, + ε, rsqrt (1/r), [1/r, 1] (a pad), one product for both token sums; two views
    # (h as (tokens, d), [1/r, 1]ᵀ)
    ('rmsnorm', dict(pow=1, mean=1, add=1, rsqrt=1, constant_pad_nd=1, addmm_=1, view=1, t=1)),
    ('layernorm', dict(pow=1, mean=2, add=1, rsqrt=1, constant_pad_nd=1, addmm_=1, view=1, t=1, sub=1)),  # + P h
])
def test_collecting_the_warmup_statistics_adds_six_ops_per_norm(kind, per_norm):
    """A warmup forward under set_collect('calibration') against the same forward without: the ops
    collection adds, counted by hand: per TaperNorm as listed (6 that compute for the RMS kind, where
    the first version ran 10), per model three counters (Σ s(h), micro-batches, tokens); no other op."""
    from collections import Counter
    model = tiny(kind, taper='all')
    x = torch.randint(0, 64, (4, 16))
    plain, _ = count_ops(lambda: model(x, x))
    model.set_collect('calibration')
    collecting, _ = count_ops(lambda: model(x, x))
    n_norms = len(model.tapernorms())
    added = collecting.copy()
    added.subtract(plain)
    want = Counter({op: n * n_norms for op, n in per_norm.items()}) + Counter(add_=3)
    assert {op: n for op, n in added.items() if n} == dict(want)


@pytest.mark.parametrize('mode', ['calibration', 'mismatch'])
def test_a_forward_without_targets_under_collect_is_refused_and_records_nothing(mode):
    """Without targets the final norm sees only the last position and no tokens are counted, so the
    statistics it recorded would not be those of the batch."""
    model = tiny('rmsnorm', taper='all')
    model.set_collect(mode)
    with pytest.raises(ValueError, match=f"without targets under set_collect\\('{mode}'\\)"):
        model(torch.randint(0, 64, (2, 8)))
    assert all(not m.step_sums.any() and not m.mismatch_sums.any() for _, m in model.tapernorms())


def test_the_warmup_statistics_never_read_the_device_from_the_host():
    """A collecting forward and calibration_step on the 'meta' device (no values anywhere), under a
    dispatch mode that fails on every op that reads a value to the host: on a GPU none of them may
    stall the host each warmup step (the check that a forward collected runs on the device)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    syncs = {'_local_scalar_dense', 'item', 'nonzero', 'equal', 'is_nonzero'}

    class FailOnSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func.overloadpacket.__name__ not in syncs, f'{func} reads the device from the host'
            return func(*args, **(kwargs or {}))

    model = tiny(taper='all').to('meta')
    x = torch.zeros(4, 16, dtype=torch.long, device='meta')
    model.train()
    model.set_collect('calibration')
    with FailOnSync():
        model(x, x)
        model.calibration_step()
    assert model.transformer.h[0].ln_1.calib_num.device.type == 'meta'


@pytest.mark.parametrize('kind', KINDS)
def test_branch_mismatch_is_the_relative_distance_of_the_two_branches(kind):
    model = tiny(kind, taper='all')
    randomize_gains(model)
    x = torch.randint(0, 64, (4, 16))
    calibrate_on(model, x)
    inputs = {}
    for n, m in model.tapernorms():
        m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0].detach()))
    model.set_collect('mismatch')
    model(x, x)
    mismatch = branch_mismatch(model)
    for name, m in model.tapernorms():
        h = inputs[name].double()
        N = reference_norm(m.double(), h)
        L = linear_map(m, h)
        m.float()
        assert mismatch[name] == pytest.approx(((L - N).norm() / N.norm()).item(), rel=1e-4)
    with pytest.raises(RuntimeError, match='before any forward'):
        branch_mismatch(model)


@pytest.mark.parametrize('taper', ['internal', 'all'])
def test_radial_cos_is_the_cosine_of_the_cross_entropy_gradient_with_h(taper):
    """Hand computation: ∂CE/∂h at the residual stream before ln_f by autograd on a copy of the
    head, its cosine with h averaged over tokens; L_aux's (radial) gradient must not enter."""
    model = tiny(taper=taper, aux_weight=10.0)
    randomize_gains(model)
    x = torch.randint(0, 64, (3, 16))
    calibrate_on(model, x)
    model.set_phase('linear')
    model.set_gate(0.0)
    h_in = {}
    model.transformer.ln_f.register_forward_pre_hook(lambda mod, args: h_in.__setitem__('h', args[0]))
    _, loss = model(x, x)
    loss.backward()
    h = h_in['h'].detach().requires_grad_()
    ce = F.cross_entropy(model.lm_head(model.transformer.ln_f(h, model.gate)).view(-1, 64), x.view(-1))
    g, = torch.autograd.grad(ce, h)
    expected = (g * h).sum(-1) / (g.norm(dim=-1) * h.norm(dim=-1))
    assert model.radial_sink.grad.item() == pytest.approx(expected.mean().item(), rel=1e-4, abs=1e-6)
    if taper == 'internal':  # a final RMSNorm leaves (almost) no radial component
        assert abs(model.radial_sink.grad.item()) < 1e-2  # ε keeps it from exactly 0
    else:
        assert abs(model.radial_sink.grad.item()) > 1e-2


@pytest.mark.parametrize('kind', KINDS)
def test_aux_loss_is_zero_on_target_and_its_gradient_is_radial(kind):
    torch.manual_seed(0)
    h = torch.randn(3, 5, 32, dtype=torch.float64)
    target = torch.tensor(2.5, dtype=torch.float64)
    L = lambda h, eps=0.0: aux_loss(norm_scale(h, kind, eps), target, 0.1)
    h_on = h * (target / reference_r(h, kind, 0.0))[..., None]  # every token exactly at s(h) = s_tgt
    assert L(h_on).item() == pytest.approx(0.0, abs=1e-20)
    assert L(1.2 * h_on).item() == pytest.approx(0.1 * (0.2 * 2.5) ** 2, rel=1e-9)  # λ (s − s_tgt)²
    # per token, not of the mean scale: tokens at 0.5 and 1.5 × s_tgt average to s_tgt, yet each is
    # 0.5 · 2.5 away: λ · mean (s − s_tgt)² = 0.1 · 1.25²
    spread = torch.ones(3, 5, 1, dtype=torch.float64)
    spread[:, ::2], spread[:, 1::2] = 0.5, 1.5
    spread = torch.cat([spread[:, :4], spread[:, :4]], dim=1)  # 8 tokens a row: four at 0.5, four at 1.5
    h8 = torch.cat([h_on[:, :4], h_on[:, :4]], dim=1) * spread
    assert L(h8).item() == pytest.approx(0.1 * 1.25 ** 2, rel=1e-9)
    h = h.requires_grad_()
    L(h, 1e-5).backward()
    x = h - h.mean(-1, keepdim=True) if kind == 'layernorm' else h
    cos = F.cosine_similarity(h.grad, x.detach(), dim=-1).abs()
    assert_close(cos, torch.ones_like(cos))


def test_relative_aux_loss_is_the_anchor_in_units_of_s_tgt():
    # beyond the paper: λ · mean_tokens (s/s_tgt − 1)², worked by hand on s = (1, 3, 6), s_tgt = 2:
    # ((−½)² + (½)² + 2²) / 3 = 4.5 / 3 = 1.5, times λ = 0.1
    s, target = torch.tensor([1.0, 3.0, 6.0]).view(1, 3, 1), torch.tensor(2.0)
    assert aux_loss(s, target, 0.1, 'relative').item() == pytest.approx(0.15)
    assert aux_loss(s, target, 0.1).item() == pytest.approx(0.1 * (1 + 1 + 16) / 3)  # the paper's, absolute
    # the same relative spread at ten times the scale: the same relative loss, 100 × the absolute one
    assert aux_loss(10 * s, 10 * target, 0.1, 'relative').item() == pytest.approx(0.15)
    assert aux_loss(10 * s, 10 * target, 0.1).item() == pytest.approx(100 * 0.1 * 18 / 3)


def test_the_model_applies_the_aux_form_it_is_given():
    losses = {}
    for form in ('absolute', 'relative'):
        model = tiny('rmsnorm', taper='internal', aux_weight=0.5, aux_form=form)
        with torch.no_grad():
            model.s_tgt.fill_(3.0)
            model.calibrated.fill_(True)  # c = 1, γ̃ = 1: the linear branch is h itself
        model.set_phase('linear')
        x = torch.randint(0, 64, (2, 16))
        model(x, x)
        losses[form] = model.last_metrics.aux.item()
    with torch.no_grad():
        h = model.transformer.drop(model.transformer.wte(x) + model.transformer.wpe(torch.arange(16)))
        for block in model.transformer.h:
            h = block(h, model.gate)
        r = h.pow(2).mean(-1).add(1e-5).sqrt()  # s(h) per token, computed here
    assert losses['relative'] == pytest.approx(0.5 * (r / 3.0 - 1).pow(2).mean().item(), rel=1e-5)
    assert losses['absolute'] == pytest.approx(0.5 * (r - 3.0).pow(2).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"aux_form='squared': choose one of \('absolute', 'relative'\)"):
        GPTConfig(aux_form='squared')


def test_every_model_key_added_since_the_first_release_says_what_its_absence_meant():
    """GPTConfig's fields at the first release (7f2aebc); every later one is in ABSENT_MEANS, so a
    checkpoint from before it loads as it ran (tests/test_runs.py loads, samples and resumes one)."""
    from dataclasses import fields
    from model import ABSENT_MEANS
    first = {'block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'dropout', 'bias', 'norm', 'taper',
             'aux_weight', 'norm_eps'}
    assert set(ABSENT_MEANS) == {f.name for f in fields(GPTConfig)} - first
    assert ABSENT_MEANS['dyt_embed_scale'] is False  # DyT had no embedding scalar before 9b3e8c9


@pytest.mark.parametrize('kind', ['dyt', 'derf'])
def test_dyt_alpha0_scale_multiplies_the_papers_alpha0_at_every_position(kind):
    """Part 4's block 6 runs DyT at twice the paper's α₀ (it asks larger ones of narrower models);
    Derf takes DyT's α₀ and the same key (baselines.Derf)."""
    alphas = {n.rsplit('.', 1)[-1]: m.alpha.item() for n, m in tiny(kind, taper='none', dyt_alpha0_scale=2.0)
              .named_modules() if n.endswith(('ln_1', 'ln_2', 'ln_f'))}
    assert alphas == {'ln_1': pytest.approx(1.6), 'ln_2': pytest.approx(0.4), 'ln_f': pytest.approx(0.4)}  # 2 × (0.8, 0.2, 0.2)
    with pytest.raises(ValueError, match=r"dyt_alpha0_scale=0.0 must be > 0"):
        GPTConfig(norm=kind, dyt_alpha0_scale=0.0)


def test_dyt_is_gamma_tanh_alpha_h_plus_beta():
    from baselines import DyT
    torch.manual_seed(0)
    m = DyT(8, alpha0=0.7)
    assert m.alpha.item() == pytest.approx(0.7) and m.alpha.dim() == 0  # one scalar α per module
    m.double()
    with torch.no_grad():
        m.weight.copy_(torch.randn(8))
        m.bias.copy_(torch.randn(8))
        m.alpha.fill_(1.3)
    h = 3 * torch.randn(2, 5, 8, dtype=torch.float64)
    gamma, beta = m.weight.detach().double().numpy(), m.bias.detach().double().numpy()
    want = gamma * np.tanh(1.3 * h.numpy()) + beta  # numpy reference, elementwise
    assert np.allclose(m(h).detach().numpy(), want, rtol=0, atol=1e-12)


def derf_with(alpha, shift, gamma, beta):
    """A float64 Derf with these parameters (gamma, beta: lists of d floats)."""
    from baselines import Derf
    m = Derf(len(gamma), alpha0=0.5).double()
    with torch.no_grad():  # filled in float64: α = 0.9 in float32 is 0.8999999762
        m.alpha.fill_(alpha)
        m.shift.fill_(shift)
        m.weight.copy_(torch.tensor(gamma, dtype=torch.float64))
        m.bias.copy_(torch.tensor(beta, dtype=torch.float64))
    return m


def test_derf_is_gamma_erf_alpha_h_plus_s_plus_beta_by_hand():
    """arXiv 2512.10938's Derf(h) = γ ⊙ erf(α·h + s) + β against Python's math.erf, entry by entry,
    with s ≠ 0 and entries on both sides of erf's knee; and its initialization (baselines.Derf)."""
    from baselines import Derf
    m = Derf(4, alpha0=0.7)
    assert (m.alpha.dim(), m.shift.dim()) == (0, 0)  # one scalar α and one scalar s per module
    assert m.alpha.item() == pytest.approx(0.7) and m.shift.item() == 0.0  # s₀ = 0, the authors' code's
    assert torch.equal(m.weight, torch.ones(4)) and torch.equal(m.bias, torch.zeros(4))
    alpha, s, gamma, beta = 1.3, -0.4, [0.5, -2.0, 1.5, 3.0], [0.1, 0.0, -0.7, 2.0]
    m = derf_with(alpha, s, gamma, beta)
    h = [[-3.0, -0.25, 0.0, 0.6], [0.31, 2.0, -1.1, 5.0]]  # (2 tokens, d = 4)
    want = [[gamma[i] * math.erf(alpha * x + s) + beta[i] for i, x in enumerate(row)] for row in h]
    got = m(torch.tensor(h, dtype=torch.float64)).tolist()
    assert np.allclose(got, want, rtol=0, atol=1e-14), (got, want)


def test_derf_gradients_reach_alpha_s_gamma_and_beta_as_the_chain_rule_says():
    """L = Σ w ⊙ Derf(h): ∂L/∂α = Σ w γ erf'(z) h, ∂L/∂s = Σ w γ erf'(z), ∂L/∂γ = Σ_tokens w erf(z),
    ∂L/∂β = Σ_tokens w, with z = α·h + s and erf'(z) = 2/√π exp(−z²), written out by hand."""
    alpha, s, gamma, beta = 0.9, 0.3, [0.5, -2.0, 1.5], [0.1, 0.0, -0.7]
    m = derf_with(alpha, s, gamma, beta)
    h = [[-1.5, 0.2, 0.7], [0.4, -0.1, 2.5]]
    w = [[1.0, -0.5, 2.0], [0.3, 1.2, -1.0]]
    (m(torch.tensor(h, dtype=torch.float64)) * torch.tensor(w, dtype=torch.float64)).sum().backward()
    cells = [(t, i) for t in range(2) for i in range(3)]
    z = {(t, i): alpha * h[t][i] + s for t, i in cells}
    d_erf = {c: 2 / math.sqrt(math.pi) * math.exp(-z[c] ** 2) for c in cells}
    assert m.alpha.grad.item() == pytest.approx(sum(w[t][i] * gamma[i] * d_erf[t, i] * h[t][i] for t, i in cells), rel=1e-12)
    assert m.shift.grad.item() == pytest.approx(sum(w[t][i] * gamma[i] * d_erf[t, i] for t, i in cells), rel=1e-12)
    assert m.weight.grad.tolist() == pytest.approx([sum(w[t][i] * math.erf(z[t, i]) for t in range(2)) for i in range(3)], rel=1e-12)
    assert m.bias.grad.tolist() == pytest.approx([w[0][i] + w[1][i] for i in range(3)], rel=1e-12)
    assert all(g != 0 for g in (m.alpha.grad, m.shift.grad)) and m.weight.grad.abs().min() > 0


@pytest.mark.parametrize('kind', ['dyt', 'derf'])
def test_a_norm_free_model_scales_its_embeddings_by_a_learnable_sqrt_d_as_the_dyt_paper_does_for_llms(kind):
    x = torch.randint(0, 64, (2, 16))
    seen = {}
    for scaled in (True, False):
        model = tiny(kind, taper='none', dyt_embed_scale=scaled)
        model.transformer.h[0].ln_1.register_forward_hook(lambda m, args, out: seen.update({scaled: args[0]}))
        model(x, x)
        tr = model.transformer
        emb = tr.wte.weight[x] + tr.wpe.weight[:16]  # (B, T, C), indexed by hand
        assert torch.allclose(seen[scaled], emb * (32 ** 0.5 if scaled else 1.0), atol=1e-6)  # n_embd = 32
        assert ('embed_scale' in model.state_dict()) == scaled
    # RMSNorm models are untouched by the key
    assert tiny('rmsnorm', taper='none').embed_scale is None


@pytest.mark.parametrize('kind', ['dyt', 'derf'])
def test_a_norm_free_model_has_its_map_at_every_norm_with_the_dyt_papers_alpha0(kind):
    from baselines import NORM_FREE
    model = tiny(kind, taper='none')
    norms = {n: m for n, m in model.named_modules() if n.endswith(('ln_1', 'ln_2', 'ln_f'))}
    assert len(norms) == 2 * 2 + 1 and all(type(m) is NORM_FREE[kind] for m in norms.values())
    assert {n.rsplit('.', 1)[-1]: m.alpha.item() for n, m in norms.items()} == \
        {'ln_1': pytest.approx(0.8), 'ln_2': pytest.approx(0.2), 'ln_f': pytest.approx(0.2)}
    assert kind == 'dyt' or all(m.shift.item() == 0 for m in norms.values())  # Derf's s₀
    assert not any(isinstance(m, (Norm, TaperNorm)) for m in model.modules())
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert all(m.alpha.grad is not None and m.alpha.grad.abs() > 0 for m in norms.values())  # α learns
    assert kind == 'dyt' or all(m.shift.grad.abs() > 0 for m in norms.values())  # so does Derf's s
    assert model.embed_scale.grad.abs() > 0  # so does the embedding scalar
    # α, s, γ, β and the embedding scalar are gains and biases: no weight decay
    opt = train.configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), 'cpu')
    no_decay = {id(p) for g in opt.param_groups if g['weight_decay'] == 0 for p in g['params']}
    assert all(id(p) in no_decay for m in norms.values() for p in m.parameters())
    assert id(model.embed_scale) in no_decay
    for bad in (dict(taper='internal'), dict(taper='all'), dict(norm_removal='fakeln')):
        with pytest.raises(ValueError, match=f"norm='{kind}' is a baseline of its own \\(every norm a "
                                             f"{NORM_FREE[kind].__name__}, none tapered or removed\\)"):
            GPTConfig(norm=kind, **bad)


def test_a_saturated_final_derf_is_told_and_stops_every_gradient_to_the_blocks():
    """baselines.final_dyt_saturated covers Derf: with s = 20 at ln_f, every |α·h + s| is past
    erf's float32 range (exp(−z²) underflows past ≈ 10.2), α gets an exactly-zero gradient and so
    does every tensor of the blocks; at s₀ = 0 nothing is saturated. train.py's line names Derf."""
    from baselines import final_dyt_saturated, saturation_warning
    x = torch.randint(0, 64, (2, 16))
    model = tiny('derf', taper='none')
    model(x, x)[1].backward()
    assert not final_dyt_saturated(model)
    model.zero_grad()
    with torch.no_grad():
        model.transformer.ln_f.shift.fill_(20.0)
    model(x, x)[1].backward()
    assert final_dyt_saturated(model) and model.transformer.ln_f.shift.grad == 0
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if n.startswith('transformer.h.'))
    line = saturation_warning(model, 7)
    assert line.startswith("warning: iteration 7: the final Derf saturated (|α·h + s| past float32's erf' range")
    assert 'tanh' not in line.split(':')[2]
    assert final_dyt_saturated(tiny('rmsnorm', taper='none')).item() is False


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('taper', ['internal', 'all'])
def test_calibrated_taper_start_moves_logits_at_most_proportionally(kind, taper):
    """At the first taper steps ‖z(g) − z(1)‖ ≤ 0.35 (1 − g) ‖z(1)‖; without γ̃ ← γ it is not."""
    model = tiny(kind, taper=taper)
    randomize_gains(model, spread=1.0)
    x = torch.randint(0, 64, (8, 16))
    calibrate_on(model, x)
    model.eval()
    model.set_phase('taper')

    def ratios():
        model.set_gate(1.0)
        z1 = model(x, x)[0]
        out = []
        for it in range(11, 16):  # W = 10, T = 100
            g = train.get_gate(it, taper, 10, 100)
            model.set_gate(g)
            out.append(((model(x, x)[0] - z1).norm() / ((1 - g) * z1.norm())).item())
        return out

    calibrated = ratios()
    assert max(calibrated) <= 0.35, calibrated
    assert max(calibrated) == pytest.approx(min(calibrated), rel=0.05)  # proportional to 1 − g
    with torch.no_grad():
        for _, m in model.tapernorms():
            m.weight_tilde.fill_(1.0)  # as if γ̃ had not been set to γ
    assert min(ratios()) > 0.35


def test_phase_paths_and_trainable_gains():
    model = tiny(taper='internal')
    ln = model.transformer.h[0].ln_1
    assert not ln.weight_tilde.requires_grad and ln.weight.requires_grad  # warmup
    with pytest.raises(RuntimeError, match='calibrated'):
        model.set_phase('taper')
    calibrate_on(model, torch.randint(0, 64, (2, 16)))
    model.set_phase('taper')
    model.set_gate(0.5)
    assert ln.weight.requires_grad and ln.weight_tilde.requires_grad  # 0 < g < 1: both branches train
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    assert ln.weight.grad.abs().sum() > 0 and ln.weight_tilde.grad.abs().sum() > 0
    model.set_phase('linear')
    assert ln.weight_tilde.requires_grad and not ln.weight.requires_grad
    assert model.transformer.ln_f.weight.requires_grad  # Internal-Taper keeps a real final norm
    with pytest.raises(ValueError, match='phase'):
        model.set_phase('baseline')


def test_norm_scale_is_the_root_of_mean_square_plus_eps_by_hand():
    h = torch.tensor([[3.0, 4.0, 0.0, 0.0]])  # mean h² = 25/4; centred: mean 7/4, (P h)² = 25/16·…
    assert norm_scale(h, 'rmsnorm', 0.75).item() == pytest.approx(math.sqrt(25 / 4 + 0.75))
    x = h - 1.75  # [1.25, 2.25, -1.75, -1.75]
    assert norm_scale(h, 'layernorm', 0.75).item() == pytest.approx(math.sqrt((x ** 2).mean().item() + 0.75))


def test_gains_and_biases_get_no_weight_decay():
    """docs/method.md §1: γ, β, γ̃, β̃ (and every Linear bias) are excluded; matrices and embeddings decay."""
    model = tiny('layernorm', taper='all')
    opt = train.configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), 'cpu')
    decay = {id(p): g['weight_decay'] for g in opt.param_groups for p in g['params']}
    for name, p in model.named_parameters():
        gain_or_bias = name.endswith(('weight_tilde', 'bias_tilde', '.bias')) or '.ln_' in name
        assert decay[id(p)] == (0.0 if gain_or_bias else 0.1), name


def test_the_ladder_parameter_counts():
    """docs/method.md §6: 8 layers, 10k vocabulary, context 512, tied, GPT-2 biases; config/ uses its rows."""
    millions = {'0.4M': 0.44, '1M': 1.07, '3M': 2.93, '9M': 9.01, '30M': 30.6}
    for size, row in LADDER.items():
        m = GPT(GPTConfig(block_size=512, vocab_size=10000, **row))
        assert round(m.num_params() / 1e6, 2 if millions[size] < 10 else 1) == millions[size]
    for config_files, size in [(['config/tinystories_baseline.py'], '9M'),
                               (['config/tinystories_all_taper.py', 'config/cpu.py'], '1M')]:
        cfg = vars(train.load_config(config_files))
        assert {k: cfg[k] for k in LADDER[size]} == LADDER[size]
    import study  # the study's model sizes are the ladder's rows
    for size, overrides in study.SIZES.items():
        cfg = study.cell_config(['config/cpu.py', *overrides])
        assert {k: cfg[k] for k in LADDER[size or '1M']} == LADDER[size or '1M'], size


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match='taper'):
        GPTConfig(taper='final')
    with pytest.raises(ValueError, match='aux_weight'):
        GPTConfig(taper='none', aux_weight=0.1)
    with pytest.raises(ValueError, match='block_size'):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def test_compiled_model_recompiles_only_at_phase_boundaries():
    """The gate changes every taper step without recompiling; each phase compiles once."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model = tiny(taper='all', aux_weight=0.1)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16))
    frames = []
    for it in range(12):  # W = 3, T = 6
        phase = train.get_phase(it, 'all', 3, 6)
        if phase != model.phase:
            model.set_phase(phase)
        model.set_gate(train.get_gate(it, 'all', 3, 6))
        _, loss = compiled(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if it == 2:
            calibrate_on(model, x)
        frames.append(counter.frame_count)
    # warmup 0-2, taper 3-8, linear 9-11: one compile at the start of each phase
    assert frames == [1] * 3 + [2] * 6 + [3] * 3
    torch._dynamo.reset()
