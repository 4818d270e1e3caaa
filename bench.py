"""
KV-cached decoding throughput: RMSNorm baseline vs TaperNorm unfused vs folded (SPEC §5, §6).

    python bench.py                                   # 9M, batch 1, eager and compiled
    python bench.py --size=30M --batch_size=8 --compile=compiled
    python bench.py --ckpt=internal-folded.pt         # also time a real checkpoint
    python bench.py --mode=last_token                 # the paper's v1 microbenchmark (no cache)
    python bench.py --profile=True                    # + a torch.profiler table of one decode step

Variants, one architecture, the same random weights, no training:
    baseline           RMSNorm everywhere, torch's fused F.rms_norm
    internal_unfused   Internal-Taper at g = 0: ln_1, ln_2 are one multiply by c·γ̃; real final RMSNorm
    internal_folded    the same model folded by fold.py's code: no ln_1, ln_2 at all; final RMSNorm
    all_folded         All-Taper folded: no norm anywhere, LM head untied (the upper bound)
The tapered variants come from TaperNorm models calibrated on random tokens, set to the linear
phase, with γ̃ spread around 1, so the benchmark times the artifact a user gets.

Correctness gate, before any timing, in fp32: internal_unfused and internal_folded, All-Taper
and all_folded, and a --ckpt raw checkpoint and its unfused form agree on teacher-forced logits
within GATE_RTOL of the largest logit and on the first GATE_TOKENS greedy tokens; compiled, every
timed variant's greedy tokens equal its eager ones. Otherwise no speed is reported.

Decode: --prompt_len tokens are prefilled (time to first token, TTFT), then --new_tokens one-token
decode steps. tokens/s = batch_size · new_tokens / decode time; ms/step = decode time / new_tokens.
The median over --trials trials after two warm-up trials (compile time, the first one's extra
time, is reported apart), the variants interleaved (A B C D A B C D ...) so that machine drift
hits all alike. GB/s is the bytes one decode step must read (weights, the LM head once,
batch_size embedding rows, and the whole static KV cache, which attention reads through the
mask) divided by the step time. Memory: analytic weight and KV-cache bytes; on CUDA, peak MB adds
the most a trial allocated on top of them. fp32 means fp32: TF32 matmuls are left off.
The last line printed is one JSON object with the configuration and every result.
"""

import copy
import json
import os
import statistics
import sys
import time
import types
from typing import Callable, NamedTuple, Optional

import torch

from fold import fold_state_dict
from model import GPT, LADDER, GPTConfig, TaperScale
from train import ConfigError, parse_args, resolve_device

# -----------------------------------------------------------------------------
size = '9M'             # a row of the SPEC §6 ladder: 1M | 3M | 9M | 30M ('' : give the shape below)
n_layer = 0             # any of these four, when > 0, overrides the size's value
n_head = 0
n_embd = 0
vocab_size = 10000
block_size = 512
batch_size = 1
prompt_len = 128
new_tokens = 256
mode = 'decode'         # 'decode' (KV cache) | 'last_token' (full forward, last logits, no cache)
compile = 'both'        # 'both' | 'eager' | 'compiled'
device = 'auto'         # 'auto' (cuda if available, else cpu) | 'cpu' | 'cuda' ...
dtype = 'auto'          # 'auto' (bfloat16 on CUDA where supported, else float32) | 'float32' | 'bfloat16'
trials = 5
seed = 1337
ckpt = ''               # also time this checkpoint (raw or folded) next to a baseline of its shape
profile = False         # print a torch.profiler table of one decode step of baseline and internal_folded
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith('_') and isinstance(v, (bool, int, float, str))}

VARIANTS = ('baseline', 'internal_unfused', 'internal_folded', 'all_folded')
GATE_RTOL = 1e-4   # teacher-forced logits: max |Δ| <= GATE_RTOL · max |logit|
GATE_TOKENS = 16   # greedy tokens that must be identical


class GateError(RuntimeError):
    """The folded and unfused models disagree: the benchmark refuses to time them."""


# ---- building the variants --------------------------------------------------------------

@torch.no_grad()
def linear_phase_model(arch, taper, seed):
    """A GPT with the given taper, brought to the linear phase through the real path:
    calibration statistics from random tokens, calibrate() (c, γ̃ ← γ), then γ̃ spread
    around 1 as if trained, and g = 0. Same seed, same matrices as the baseline."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**arch, taper=taper))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, arch['vocab_size'], (4, min(64, arch['block_size'])), generator=gen)
    model.set_collect('calibration')
    model(x, x)  # the calibration statistics of one batch
    model.set_collect(None)
    model.calibrate('end')
    for _, m in model.tapernorms():
        m.weight_tilde.mul_(torch.exp(0.3 * torch.randn(m.weight_tilde.shape, generator=gen)))
    model.set_phase('linear')
    model.set_gate(0.0)
    return model.eval()


def folded_model(model):
    """The model rewritten by fold.py's fold_state_dict, as a GPT with folded=True."""
    return GPT.from_state_dict(*fold_state_dict(model.state_dict(), vars(model.config)))


def build_variants(arch, seed):
    """{name: fp32 CPU model} for VARIANTS, plus the unfolded All-Taper model for the gate."""
    torch.manual_seed(seed)
    baseline = GPT(GPTConfig(**arch)).eval()
    internal = linear_phase_model(arch, 'internal', seed)
    all_taper = linear_phase_model(arch, 'all', seed)
    for name, p in baseline.named_parameters():  # the same weights everywhere they exist
        if not torch.equal(p, internal.get_parameter(name)):
            raise RuntimeError(f"baseline and Internal-Taper models differ in {name}: same seed, same init expected")
    return {'baseline': baseline,
            'internal_unfused': copy.deepcopy(internal).unfused(),
            'internal_folded': folded_model(internal),
            'all_folded': folded_model(all_taper)}, all_taper


class CheckpointRun(NamedTuple):
    name: str                # 'ckpt:FILE'
    model: GPT               # as timed
    raw: Optional[GPT]       # its TaperNorm form, for the gate, when timed unfused
    baseline: GPT            # random weights, the checkpoint's shape
    about: str               # one line: taper, norm, folded, phase, g


def checkpoint_variants(path, seed):
    """For --ckpt: a CheckpointRun. A raw linear-phase checkpoint is timed unfused (each tapered
    norm one multiply); its TaperNorm form is kept for the correctness gate."""
    model, ck = GPT.from_checkpoint(path, 'cpu')
    c, raw = model.config, None
    about = f"{path}: taper={c.taper} norm={c.norm} folded={c.folded} phase={model.phase} g={model.gate.item():.4g}"
    if model.phase == 'linear' and not c.folded:
        raw = copy.deepcopy(model)
        model.unfused()
        about += " (timed unfused)"
    elif model.phase in ('warmup', 'taper'):
        about += " (not an inference artifact: the normalizing branch still runs; fold a finished run)"
    arch = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                block_size=c.block_size, bias=c.bias, norm=c.norm, norm_eps=c.norm_eps)
    torch.manual_seed(seed)
    return CheckpointRun(f'ckpt:{os.path.basename(path)}', model, raw, GPT(GPTConfig(**arch)).eval(), about)


# ---- one variant's step functions -------------------------------------------------------

class Steps(NamedTuple):
    prefill: Callable        # (idx (B, P), input_pos (P,)) -> next token (B, 1)
    decode: Callable         # (tok (B, 1), input_pos (1,)) -> next token (B, 1)
    forward_last: Callable   # (idx (B, P)) -> next token (B, 1), no cache (--mode=last_token)


def make_steps(model, compiled, device_type):
    """Steps(prefill, decode, forward_last) for one model: prefill(idx (B, P), input_pos (P,)) and
    decode(tok (B, 1), input_pos (1,)) return the greedy next token (B, 1); forward_last(idx)
    runs the full sequence without a cache (--mode=last_token). Compiled as gpt-fast does:
    fullgraph, static shapes; on CUDA "reduce-overhead" (CUDA graphs: no per-kernel launch
    cost, no host sync)."""
    def step(idx, input_pos):
        with torch.no_grad():  # else the in-place cache writes would make the caches require grad
            logits, _ = model(idx, input_pos=input_pos)
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    def forward_last(idx, input_pos=None):
        with torch.no_grad():
            logits, _ = model(idx)
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    if not compiled:
        return Steps(step, step, forward_last)
    mode = 'reduce-overhead' if device_type == 'cuda' else None
    step = torch.compile(own_code(step), fullgraph=True, dynamic=False, mode=mode)  # one graph per shape
    return Steps(step, step, torch.compile(own_code(forward_last), fullgraph=True, dynamic=False, mode=mode))


def own_code(fn):
    """fn with a code object of its own. Dynamo keeps compiled graphs per code object, so every
    variant's steps would otherwise share one cache, and each call would check the guards of
    the other variants' graphs first."""
    code = fn.__code__.replace()  # an equal but distinct code object
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def sync(device_type):
    if device_type == 'cuda':
        torch.cuda.synchronize()


def run_decode(steps, prompt, new, device_type):
    """Prefill, then `new` decode steps. Returns (ttft_s, decode_s, tokens (B, new + 1))."""
    prefill, decode = steps.prefill, steps.decode
    P = prompt.size(1)
    prefill_pos = torch.arange(P, device=prompt.device)
    pos = torch.tensor([P], device=prompt.device)  # advanced in place: one tensor, no new shapes
    sync(device_type)
    t0 = time.perf_counter()
    tok = prefill(prompt, prefill_pos).clone()  # clone: CUDA graphs reuse their output memory
    sync(device_type)
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(new):
        tok = decode(tok, pos).clone()
        pos += 1
        out.append(tok)
    sync(device_type)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(out, dim=1)


def run_last_token(steps, prompt, new, device_type):
    """`new` full forwards of the prompt, last position only. Returns (None, seconds, tokens)."""
    forward_last = steps.forward_last
    sync(device_type)
    t0 = time.perf_counter()
    out = [forward_last(prompt).clone() for _ in range(new)]
    sync(device_type)
    return None, time.perf_counter() - t0, torch.cat(out, dim=1)


# ---- what a decode step reads ------------------------------------------------------------

def weight_bytes(model):
    """Bytes of every parameter and TaperScale buffer (the tied embedding/head once)."""
    tensors = list(model.parameters()) + [b for m in model.modules() if isinstance(m, TaperScale)
                                          for b in m.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def step_bytes(model, batch_size, seq_len, mode):
    """Bytes one step must read: the weights, with the LM head once and only batch_size rows of
    the token and position embeddings (batch_size · seq_len in last_token mode), plus the whole
    static KV cache of seq_len positions (decode mode)."""
    c, e = model.config, model.transformer.wte.weight.element_size()
    total = weight_bytes(model) - model.transformer.wpe.weight.numel() * e  # wpe: B rows only
    if c.untied_head():  # the embedding is its own table: B rows read, not V
        total -= model.transformer.wte.weight.numel() * e
    rows = batch_size * (1 if mode == 'decode' else seq_len)
    total += 2 * rows * c.n_embd * e  # token + position embedding rows
    if mode == 'decode':
        total += kv_bytes(model, batch_size, seq_len)
    return total


def kv_bytes(model, batch_size, cache_len):
    c = model.config
    return 2 * c.n_layer * batch_size * cache_len * c.n_embd * model.transformer.wte.weight.element_size()


# ---- the correctness gate -----------------------------------------------------------------

@torch.no_grad()
def check_logits(name_a, a, name_b, b, seed):
    """Teacher-forced fp32 logits of two models of one shape on one fixed random sequence;
    returns max |Δ| / max |logit|. Raises GateError above GATE_RTOL."""
    T, V = min(a.config.block_size, 128), a.config.vocab_size
    seq = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed + 2))
    seq = seq.to(a.transformer.wte.weight.device)
    la, lb = a(seq, seq)[0].float(), b(seq, seq)[0].float()
    diff, scale = (la - lb).abs().max().item(), la.abs().max().item()
    if not diff <= GATE_RTOL * scale:
        raise GateError(f"{name_a} vs {name_b}: teacher-forced logits differ by {diff:.3e} "
                        f"(max |logit| {scale:.3e}, tolerance {GATE_RTOL:g} of it)")
    return diff / scale


def assert_same_tokens(name_a, tokens_a, name_b, tokens_b, how):
    """Raise GateError, naming the first position that differs, unless two (B, n) greedy
    token tensors are equal."""
    if not torch.equal(tokens_a, tokens_b):
        first = (tokens_a != tokens_b).any(dim=0).nonzero()[0].item()
        raise GateError(f"{name_a} vs {name_b} ({how}): greedy tokens differ from token {first} on")


# ---- main ----------------------------------------------------------------------------------

def resolve(cfg):
    """Check the settings; returns (arch dict, device, torch dtype, list of compile flags)."""
    if cfg['size'] and cfg['size'] not in LADDER:
        raise SystemExit(f"--size={cfg['size']}: choose one of {list(LADDER)} or '' with explicit "
                         "--n_layer/--n_embd/--n_head")
    arch = dict(LADDER[cfg['size']]) if cfg['size'] else {}
    for key in ('n_layer', 'n_head', 'n_embd'):
        if cfg[key] > 0:
            arch[key] = cfg[key]
        elif key not in arch:
            raise SystemExit(f"--size='' needs --{key}")
    arch.update(vocab_size=cfg['vocab_size'], block_size=cfg['block_size'])
    if arch['n_embd'] % arch['n_head']:
        raise SystemExit(f"n_embd={arch['n_embd']} is not divisible by n_head={arch['n_head']}")
    for key in ('batch_size', 'prompt_len', 'new_tokens', 'trials', 'vocab_size'):
        if cfg[key] < 1:
            raise SystemExit(f"--{key}={cfg[key]} must be >= 1")
    if cfg['mode'] not in ('decode', 'last_token'):
        raise SystemExit(f"--mode={cfg['mode']!r}: choose 'decode' or 'last_token'")
    if cfg['compile'] not in ('both', 'eager', 'compiled'):
        raise SystemExit(f"--compile={cfg['compile']!r}: choose 'both', 'eager' or 'compiled'")
    if cfg['mode'] == 'decode' and cfg['prompt_len'] + cfg['new_tokens'] > cfg['block_size']:
        raise SystemExit(f"prompt_len + new_tokens = {cfg['prompt_len'] + cfg['new_tokens']} exceeds "
                         f"block_size {cfg['block_size']}: lower --prompt_len or --new_tokens")
    if cfg['prompt_len'] > cfg['block_size']:
        raise SystemExit(f"prompt_len={cfg['prompt_len']} exceeds block_size {cfg['block_size']}")
    try:
        dev, dt = resolve_device(cfg['device'], cfg['dtype'])
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    flags = {'both': [False, True], 'eager': [False], 'compiled': [True]}[cfg['compile']]
    return arch, dev, getattr(torch, dt), flags


def main(argv):
    """Run the benchmark; returns the JSON record printed on the last line."""
    try:
        cfg = parse_args(argv, DEFAULTS)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    arch, dev, dtype, flags = resolve(cfg)
    device_type = torch.device(dev).type
    B, P, N = cfg['batch_size'], cfg['prompt_len'], cfg['new_tokens']
    cache_len = P + N
    if device_type == 'cuda':
        torch.cuda.set_device(dev)  # sync and memory statistics then refer to this device

    extra = None
    if cfg['ckpt']:
        try:
            extra = checkpoint_variants(cfg['ckpt'], cfg['seed'])
        except FileNotFoundError as e:
            raise SystemExit(str(e))
        limit = extra.model.config.block_size
        if (P + N if cfg['mode'] == 'decode' else P) > limit:
            raise SystemExit(f"the checkpoint's context is {limit} tokens: lower --prompt_len and "
                             f"--new_tokens (e.g. --prompt_len={limit // 4} --new_tokens={limit // 2})")
    models, all_taper = build_variants(arch, cfg['seed'])
    reference = {name: 'baseline' for name in models}
    gate_models = dict(models, all_taper=all_taper)  # fp32, for the correctness gate
    gate_pairs = [('internal_unfused', 'internal_folded'), ('all_taper', 'all_folded')]
    if extra is not None:
        name, model, raw, base, _ = extra
        models.update({'ckpt_baseline': base, name: model})
        reference.update({'ckpt_baseline': 'ckpt_baseline', name: 'ckpt_baseline'})
        gate_models.update({'ckpt_baseline': base, name: model})
        if raw is not None:
            gate_models[f'{name} (TaperNorm)'] = raw
            gate_pairs.append((f'{name} (TaperNorm)', name))
    names = list(models)

    print(f"bench: {cfg['size'] or 'custom'} {arch} | {', '.join(names)}")
    print(f"  device={dev} dtype={str(dtype).removeprefix('torch.')} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} | mode={cfg['mode']} batch_size={B} prompt_len={P} "
          f"new_tokens={N} | trials={cfg['trials']} (+2 warm-up) | "
          f"{' and '.join('compiled' if f else 'eager' for f in flags)}")
    if cfg['trials'] < 5:
        print(f"  note: {cfg['trials']} trials; medians of fewer than 5 are noisy")
    if extra is not None:
        print(f"  ckpt {extra.about}")

    # Greedy tokens for the gate come from a prompt short enough for GATE_TOKENS − 1 decode
    # steps; in decode mode that is the timed prompt, and the caches are the timed caches.
    gate_tokens = min(GATE_TOKENS, N + 1) if cfg['mode'] == 'decode' else GATE_TOKENS
    gen = torch.Generator().manual_seed(cfg['seed'] + 3)
    prompt = torch.randint(0, arch['vocab_size'], (B, P), generator=gen).to(dev)
    prompts = {n: prompt % m.config.vocab_size for n, m in gate_models.items()}  # a checkpoint's vocabulary may be smaller
    gate_prompts = {n: prompts[n][:, :min(P, m.config.block_size - gate_tokens + 1)]
                    for n, m in gate_models.items()}
    for n, m in gate_models.items():
        m.to(dev)
        m.setup_caches(B, P + N if cfg['mode'] == 'decode' else gate_prompts[n].size(1) + gate_tokens - 1)

    # the gate, in fp32, before anything is timed
    t0 = time.perf_counter()
    try:
        gate = {f'{a} vs {b}': check_logits(a, gate_models[a], b, gate_models[b], cfg['seed'])
                for a, b in gate_pairs}
        eager_tokens = {n: run_decode(make_steps(m, False, device_type), gate_prompts[n], gate_tokens - 1,
                                      device_type)[2] for n, m in gate_models.items()}
        for a, b in gate_pairs:
            assert_same_tokens(a, eager_tokens[a], b, eager_tokens[b], 'eager')
    except GateError as e:
        raise SystemExit(f"correctness gate failed, no speed reported: {e}")
    print("  gate (fp32, eager): " + ', '.join(f"{k}: max|Δ logit|/max|logit| {v:.1e}" for k, v in gate.items())
          + f"; first {gate_tokens} greedy tokens identical ({time.perf_counter() - t0:.1f} s)")
    del gate_models, all_taper

    for m in models.values():
        m.to(dtype=dtype)  # weights and KV caches
    run = run_decode if cfg['mode'] == 'decode' else run_last_token

    results = []
    for compiled in flags:
        steps = {n: make_steps(m, compiled, device_type) for n, m in models.items()}
        compile_s = {}
        for n in names:  # two warm-up trials: compilation (CUDA graphs record on a second call), allocator
            t0 = time.perf_counter()
            run(steps[n], prompts[n], N, device_type)
            t1 = time.perf_counter()
            run(steps[n], prompts[n], N, device_type)
            compile_s[n] = (t1 - t0) - (time.perf_counter() - t1)  # the first trial's extra time
            if compiled:
                print(f"  compiled {n} in {compile_s[n]:.1f} s")
        if compiled and dtype == torch.float32:  # the compiled steps that will be timed pass the gate too
            try:
                for n in names:
                    if cfg['mode'] == 'decode':
                        tokens = run_decode(steps[n], gate_prompts[n], gate_tokens - 1, device_type)[2]
                    else:  # a full forward gives the first greedy token
                        tokens = steps[n].forward_last(gate_prompts[n])
                    assert_same_tokens(f'{n} compiled', tokens, f'{n} eager', eager_tokens[n][:, :tokens.size(1)], 'fp32')
            except GateError as e:
                raise SystemExit(f"correctness gate failed, no speed reported: {e}")
            print("  gate (fp32, compiled): every variant's greedy tokens equal its eager ones")
        elif compiled:  # rounding in 16 bits may flip a near-tie of random logits: no reliable check
            print(f"  gate (compiled): not run in {dtype}; --dtype=float32 runs it")
        times = {n: [] for n in names}
        transient = {}  # CUDA: the most a trial allocates on top of what is resident
        for _ in range(cfg['trials']):
            for n in names:  # interleaved: A B C D A B C D ...
                if device_type == 'cuda':
                    torch.cuda.reset_peak_memory_stats()
                    resident = torch.cuda.memory_allocated()
                times[n].append(run(steps[n], prompts[n], N, device_type)[:2])
                if device_type == 'cuda':
                    transient[n] = max(transient.get(n, 0), torch.cuda.max_memory_allocated() - resident)
        for n in names:
            ttft = statistics.median(t[0] for t in times[n]) if cfg['mode'] == 'decode' else None
            step_s = statistics.median(t[1] for t in times[n]) / N
            kv = kv_bytes(models[n], B, cache_len) if cfg['mode'] == 'decode' else 0
            results.append(dict(
                variant=n, compiled=compiled, tokens_per_s=B / step_s, ms_per_token=1000 * step_s,
                ttft_ms=None if ttft is None else 1000 * ttft,
                gbps=step_bytes(models[n], B, cache_len if cfg['mode'] == 'decode' else P, cfg['mode']) / step_s / 1e9,
                weight_mb=weight_bytes(models[n]) / 1e6,
                kv_mb=kv / 1e6,
                peak_mb=(weight_bytes(models[n]) + kv + transient[n]) / 1e6 if n in transient else None,
                compile_s=compile_s[n] if compiled else None))
        by_name = {r['variant']: r for r in results if r['compiled'] == compiled}
        for r in by_name.values():
            r['speedup_vs_baseline'] = r['tokens_per_s'] / by_name[reference[r['variant']]]['tokens_per_s']

    print_table(results)
    if cfg['profile'] and cfg['mode'] != 'decode':
        print("--profile: profiles a decode step, so it needs --mode=decode")
    elif cfg['profile']:
        profile_step(models, steps if flags[-1] else None, prompt, B, cache_len, device_type, cfg['mode'])
    record = {'device': torch.cuda.get_device_name(dev) if device_type == 'cuda' else f'cpu ({os.cpu_count()} cores)',
              'torch': torch.__version__,
              'config': dict(size=cfg['size'], **{k: arch[k] for k in ('n_layer', 'n_head', 'n_embd', 'vocab_size',
                                                                       'block_size')},
                             batch_size=B, prompt_len=P, new_tokens=N, dtype=str(dtype).removeprefix('torch.'),
                             trials=cfg['trials'], seed=cfg['seed'], mode=cfg['mode'], compile=cfg['compile'],
                             ckpt=cfg['ckpt']),
              'gate': gate, 'results': results}
    print(json.dumps(record))
    return record


def print_table(results):
    def fmt(v, spec):
        return '-' if v is None else format(v, spec)
    print(f"\n{'variant':<22} {'compiled':>8} {'tokens/s':>10} {'ms/step':>9} {'TTFT ms':>8} "
          f"{'speed-up':>8} {'GB/s':>7} {'weights MB':>10} {'KV MB':>7} {'peak MB':>8}")
    for r in results:
        print(f"{r['variant']:<22} {str(r['compiled']):>8} {r['tokens_per_s']:>10,.1f} {r['ms_per_token']:>9.3f} "
              f"{fmt(r['ttft_ms'], '8.2f'):>8} {r['speedup_vs_baseline']:>7.3f}× {r['gbps']:>7.2f} "
              f"{r['weight_mb']:>10.2f} {r['kv_mb']:>7.2f} {fmt(r['peak_mb'], '8.1f'):>8}")
    print()


def profile_step(models, compiled_steps, prompt, B, cache_len, device_type, mode):
    """torch.profiler of one decode step (compiled when timed compiled) of baseline and
    internal_folded, after a prefill; prints the operators by self time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == 'cuda' else [])
    for n in ('baseline', 'internal_folded'):
        eager = make_steps(models[n], False, device_type)
        for how, steps in [('eager', eager)] + ([('compiled', compiled_steps[n])] if compiled_steps else []):
            P = prompt.size(1)
            tok = steps.prefill(prompt, torch.arange(P, device=prompt.device)).clone()
            pos = torch.tensor([P], device=prompt.device)
            for _ in range(3):
                steps.decode(tok, pos)
            sync(device_type)
            with torch_profile(activities=activities) as prof:
                steps.decode(tok, pos)
                sync(device_type)
            key = 'self_device_time_total' if device_type == 'cuda' else 'self_cpu_time_total'
            print(f"---- profile: one decode step of {n} ({how}) ----")
            print(prof.key_averages().table(sort_by=key, row_limit=14))


if __name__ == '__main__':
    main(sys.argv[1:])
