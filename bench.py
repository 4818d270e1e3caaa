"""
KV-cached decoding throughput: RMSNorm baseline vs TaperNorm unfused vs folded (docs/method.md §5);
with --mode=train, what TaperNorm costs in training, per phase and over a whole run (bench_train.py).

    python bench.py                                   # 9M, batch 1, eager and compiled
    python bench.py --size=30M --batch_size=8 --compile=compiled
    python bench.py --ckpt=internal-folded.pt         # also time a real checkpoint
    python bench.py --profile=True                    # + a torch.profiler table of one decode step per variant
    python bench.py --mode=train --size=1M --trials=3 # one optimizer step per variant and phase
    python bench.py --mode=train --batch_size=4 --block_size=256 --schedule=config/tinystories_all_taper.py

Variants, one architecture, the same random weights (tapered: calibrated on random tokens, g = 0):
    baseline           RMSNorm everywhere, torch's fused F.rms_norm
    internal_unfused   Internal-Taper at g = 0: ln_1, ln_2 are one multiply by c·γ̃; real final RMSNorm
    internal_folded    the same model folded by fold.py: no ln_1, ln_2 at all; final RMSNorm
    all_folded         All-Taper folded: no norm anywhere, LM head untied (the upper bound)

Gate, before any timing, in IEEE fp32: internal_unfused and internal_folded, All-Taper and
all_folded, a raw --ckpt and its unfused form agree on teacher-forced logits (fold.py's check,
max_logit_error) and the first GATE_TOKENS greedy tokens; compiled, each variant against itself
eager in the dtype timed (fp32: greedy tokens equal; bf16: prefill logits within BF16_RTOL, tokens
equal up to a near-tie). TF32 is on only for bf16 (configurator.set_tf32; the JSON's config.tf32).

Timing (model.py's decode path, as in GPT.generate): a prefill of --prompt_len tokens (time to first
token, TTFT), then --new_tokens decode steps; medians of --trials trials (default 15 on CUDA, 5
elsewhere) after two warm-up trials (the first one's extra time is the compile time), the variants
interleaved in rounds, each in a fresh seeded order (benchkit.round_orders). A decode step decodes one token of every sequence:
ms/step = decode time / new_tokens, tokens/s = batch_size · new_tokens / decode time (aggregate),
tokens/s/seq = tokens/s / batch_size. Each row keeps its trials (ms_per_step_trials, ms_range = their
[min, max]); speed-up is the ratio of medians, and speedup_interval a 95 % interval (sign test,
benchkit.median_ratio_interval; below 6 trials [min, max], coverage in speedup_coverage) of the
per-round paired ratio, the baseline's decode time over the variant's in the same round: a machine's
drift hits both, so the pair's ratio is steadier than either time. GB/s: the bytes a decode
step reads (weights, the LM head once, batch_size embedding rows, the whole KV cache) / step time.
peak MB (CUDA): weights + KV cache + the most a trial allocated on top. The last line printed is one
JSON object with the configuration and every result.

Conditions, in the header and the JSON's `conditions`: torch's thread count, the CPU model, the ISA
torch's CPU kernels dispatch to, and the 1, 5, 15-minute load averages when the run starts. When the
1-minute load average exceeds half a core per thread in use (load₁ > 0.5 · threads), one line says
that the machine is busy and its ratios are unreliable (benchkit.py's busy rule).
"""

import copy
import json
import os
import statistics
import time
import types
from functools import partial

import torch

from baselines import NORM_FREE
from benchkit import (calibrated_model, conditions, default_trials, device_name, interleaved, median_ratio_interval,
                      print_conditions, print_profile, profiled, random_tokens, with_peak)
from configurator import (ConfigError, check_at_least, check_compiler, configure, defaults_of, keys_set,
                          resolve_device, run_command, set_tf32, uses_tf32)
from fold import CheckError, fold_model, max_logit_error, tensor_bytes
from model import GPT, LADDER, GPTConfig, TaperScale, decode_n_tokens, decode_one_token, prefill, unfused
from runs import load_model, out_of_memory, sync

# -----------------------------------------------------------------------------
mode = 'decode'         # 'decode': KV-cached decoding | 'train': an optimizer step per variant and phase
size = '9M'             # a row of the ladder (docs/method.md §6): 1M | 3M | 9M | 30M ('': give the shape below)
n_layer = 0             # blocks; this, n_head and n_embd, when > 0, override the size's value
n_head = 0              # attention heads
n_embd = 0              # width d
vocab_size = 10000      # vocabulary of the random-weight variants
block_size = 512        # their context: prompt_len + new_tokens must fit; train: the sequence, 128 unless given
batch_size = 1          # sequences decoded together (B); train: a step's, 16 unless given (config/cpu.py's)
prompt_len = 128        # prompt tokens, prefilled (TTFT)
new_tokens = 256        # decode steps timed
compile = 'both'        # 'both' | 'eager' | 'compiled'
device = 'auto'         # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:N' | 'mps'
dtype = 'auto'          # 'auto' (bfloat16 on CUDA where supported, else float32) | 'float32' | 'bfloat16'
trials = 0              # timed trials per variant (the median is reported), after two warm-up trials (train: 3); 0: 15 on CUDA, else 5
seed = 1337             # weights, calibration tokens, prompt and gate sequence
ckpt = ''               # also time this checkpoint (raw or folded) next to a baseline of its shape; every variant then takes its shape (--size is not used)
profile = False         # torch.profiler tables of one step of every variant (train: every row), each with its totals
schedule = 'config/tinystories_all_taper.py'  # train: the run projected: train.py config files, comma-separated
gate_warmup_iters = 0   # train: W of that run; 0: the schedule's (likewise the next two)
taper_iters = 0         # train: T of that run
max_iters = 0           # train: its optimizer steps
# -----------------------------------------------------------------------------
CHOICES = {'mode': ('decode', 'train'), 'size': ('', *LADDER), 'compile': ('both', 'eager', 'compiled')}
VARIANTS = ('baseline', 'internal_unfused', 'internal_folded', 'all_folded')
SHAPE = ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size')  # the architecture in the JSON record
GATE_TOKENS = 16   # greedy tokens that must be identical
# the bf16 gate's tolerance, relative to max |logit|: bf16 keeps 8 significant bits (one rounding
# 2^-8 ≈ 0.4 %), and a forward rounds many times over; compiled and eager kernels round differently
BF16_RTOL = 2e-2


def architecture(cfg):
    """configure()'s check of the settings (ConfigError names the key and the fix), and the model
    shape they give: the size's ladder row, n_layer / n_head / n_embd overriding where > 0,
    vocab_size and block_size (a dict)."""
    check_at_least(cfg, 1, ('batch_size', 'prompt_len', 'new_tokens'))
    if cfg['trials'] < 0:
        raise ConfigError(f"--trials={cfg['trials']} must be >= 1, or 0 for the default (15 on CUDA, else 5)")
    if cfg['mode'] == 'train' and cfg['ckpt']:
        raise ConfigError("--ckpt times a checkpoint's decoding: drop it with --mode=train, which times "
                          "random-weight models of --size")
    keys = ('n_layer', 'n_head', 'n_embd')
    check_at_least(cfg, 0, keys)  # 0: the size's value; a negative one was taken as 0, silently
    arch = dict(LADDER.get(cfg['size'], {}), **{k: cfg[k] for k in keys if cfg[k] > 0})
    if missing := [k for k in keys if k not in arch]:
        raise ConfigError(f"--size='' needs --{', --'.join(missing)}")
    arch.update(vocab_size=cfg['vocab_size'], block_size=cfg['block_size'])
    try:
        GPTConfig(**arch)  # sizes >= 1, n_embd divisible by n_head
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # --ckpt: the checkpoint's context bounds them (checkpoint_variants), not --block_size
    if cfg['mode'] == 'decode' and not cfg['ckpt'] and cfg['prompt_len'] + cfg['new_tokens'] > cfg['block_size']:
        raise ConfigError(f"prompt_len + new_tokens = {cfg['prompt_len'] + cfg['new_tokens']} exceeds "
                          f"block_size {cfg['block_size']}: lower --prompt_len or --new_tokens")
    return arch


# ---- building the variants --------------------------------------------------------------

@torch.no_grad()
def linear_phase_model(arch, taper, seed):
    """A GPT with the given taper, brought to the linear phase through the real path:
    calibration statistics from random tokens, calibrate() (c, γ̃ ← γ; benchkit.calibrated_model),
    then γ̃ spread around 1 as if trained, and g = 0. Same seed, same matrices as the baseline."""
    model = calibrated_model(dict(arch, taper=taper), seed)
    gen = torch.Generator().manual_seed(seed + 4)  # seed + 1 .. 3: calibration, gate and prompt tokens
    for _, m in model.tapernorms():
        m.weight_tilde.mul_(torch.exp(0.3 * torch.randn(m.weight_tilde.shape, generator=gen)))
    model.set_phase('linear')
    model.set_gate(0.0)
    return model.eval()


def build_variants(arch, seed):
    """({name: fp32 CPU model} for VARIANTS, the unfolded All-Taper model for the gate)."""
    torch.manual_seed(seed)
    baseline = GPT(GPTConfig(**arch)).eval()
    internal = linear_phase_model(arch, 'internal', seed)
    all_taper = linear_phase_model(arch, 'all', seed)  # same seed: the baseline's weights where they exist
    return {'baseline': baseline, 'internal_unfused': unfused(copy.deepcopy(internal)),
            'internal_folded': fold_model(internal), 'all_folded': fold_model(all_taper)}, all_taper


def checkpoint_variants(cfg):
    """For --ckpt: ({'ckpt_baseline': random weights of the checkpoint's shape, 'ckpt:FILE': the
    checkpoint}, {name: model} and [(name, timed name)] of its TaperNorm form for the gate, one
    line about it, the checkpoint's architecture (SHAPE), which the built-in variants take too).
    A raw linear-phase checkpoint is timed unfused (each tapered norm one multiply), named
    'ckpt:FILE unfused', and gated against 'ckpt:FILE as trained' (its TaperNorm layers at g = 0)."""
    model, _ = load_model(cfg.ckpt, 'cpu')
    c, name, raw = model.config, f'ckpt:{os.path.basename(cfg.ckpt)}', {}
    if c.norm in NORM_FREE:
        kind = NORM_FREE[c.norm]
        raise SystemExit(f"{cfg.ckpt} is a {kind.__name__} model (norm={c.norm!r}): bench.py times TaperNorm's "
                         f"folded and unfused forms against a fused norm, and {kind.MAP} does not fold into a linear layer")
    about = f"{cfg.ckpt}: taper={c.taper} norm={c.norm} folded={c.folded} phase={model.phase} g={model.gate.item():.4g}"
    if cfg.prompt_len + cfg.new_tokens > c.block_size:
        raise SystemExit(f"the checkpoint's context is {c.block_size} tokens: lower --prompt_len and --new_tokens "
                         f"(e.g. --prompt_len={c.block_size // 4} --new_tokens={c.block_size // 2})")
    if model.phase == 'linear' and not c.folded:
        raw[f'{name} as trained'] = copy.deepcopy(model)  # its TaperNorm layers at g = 0: the gate's reference
        model, name, about = unfused(model), name + ' unfused', about + " (timed unfused)"
    elif model.phase in ('warmup', 'taper'):
        about += " (not an inference artifact: the normalizing branch still runs; fold a finished run)"
    torch.manual_seed(cfg.seed)
    shape = {k: getattr(c, k) for k in SHAPE + ('bias', 'norm', 'norm_eps', 'activation')}  # GPT-2: gelu_tanh
    return ({'ckpt_baseline': GPT(GPTConfig(**shape)).eval(), name: model}, raw, [(r, name) for r in raw], about,
            {k: shape[k] for k in SHAPE})


# ---- timing ----------------------------------------------------------------------------

def make_steps(compiled, device_type, functions=(prefill, decode_one_token)):
    """(prefill, decode step) for one variant: model.py's, or compiled as gpt-fast does: fullgraph,
    static shapes, on CUDA "reduce-overhead" (CUDA graphs). Each compiled copy has a code object of
    its own: dynamo keeps graphs per code object, and would check other variants' guards first."""
    if not compiled:
        return functions
    mode = 'reduce-overhead' if device_type == 'cuda' else None
    return tuple(torch.compile(types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__),
                               fullgraph=True, dynamic=False, mode=mode) for f in functions)


def run_decode(model, steps, prompt, new, device_type):
    """Prefill, then `new` decode steps (decode_n_tokens). Returns (ttft_s, decode_s, tokens (B, new + 1))."""
    prefill_pos = torch.arange(prompt.size(1), device=prompt.device)
    sync(device_type)
    t0 = time.perf_counter()
    tok = steps[0](model, prompt, prefill_pos).clone()  # clone: CUDA graphs reuse their output memory
    sync(device_type)
    t1 = time.perf_counter()
    rest = decode_n_tokens(model, tok, prefill_pos[-1:] + 1, new, step=steps[1])
    sync(device_type)
    return t1 - t0, time.perf_counter() - t1, torch.cat([tok, *rest], dim=1)


def time_variants(models, steps, prompts, new, trials, device_type, after_warm_up=None):
    """Two warm-up trials per variant (CUDA graphs record on a second call), after_warm_up(compile_s),
    then `trials` trials, the variants interleaved (benchkit.interleaved). Returns (compile_s {name: the
    first trial's extra seconds}, {name: [(ttft_s, decode_s)]}, {name: most a trial allocated over the
    resident, CUDA})."""
    def trial(n):
        return with_peak(lambda: run_decode(models[n], steps[n], prompts[n], new, device_type)[:2], device_type)

    runs = {n: trial(n) for n in models}
    compile_s = {}

    def warmed_up(warm):
        compile_s.update({n: sum(w[0][0]) - sum(w[1][0]) for n, w in warm.items()})
        if after_warm_up is not None:
            after_warm_up(compile_s)

    _, timed = interleaved(runs, trials, 2, warmed_up)
    transient = {n: max(t[1] for t in ts) for n, ts in timed.items()} if device_type == 'cuda' else {}
    return compile_s, {n: [t[0] for t in ts] for n, ts in timed.items()}, transient


def memory_bytes(model, batch_size, cache_len):
    """(weights, KV cache, what one decode step reads), in bytes. Weights: every parameter and
    TaperScale buffer, a tied embedding/head once; KV: 2 · n_layer · B · cache_len · d elements. A
    step reads the weights (of the embeddings B rows each) and the whole KV cache, through the mask."""
    c, wte, wpe = model.config, model.transformer.wte.weight, model.transformer.wpe.weight
    e = wte.element_size()
    scales = [b for m in model.modules() if isinstance(m, TaperScale) for b in m.buffers()]
    weights, kv = tensor_bytes(list(model.parameters()) + scales), 2 * c.n_layer * batch_size * cache_len * c.n_embd * e
    tables = wpe.numel() + (wte.numel() if c.untied_head() else 0)  # a tied wte is the head, read whole
    return weights, kv, weights - tables * e + 2 * batch_size * c.n_embd * e + kv


def result_rows(models, reference, times, transient, compile_s, compiled, cfg):
    """One result dict per timed variant: the medians of its trials, the trials themselves, and for
    every variant but a reference its speed-up with the interval of the paired ratio (module docstring)."""
    rows, B, cache_len = {}, cfg.batch_size, cfg.prompt_len + cfg.new_tokens
    for n, m in models.items():
        trials_ms = [1000 * t[1] / cfg.new_tokens for t in times[n]]
        step_s = statistics.median(trials_ms) / 1000
        weights, kv, step = memory_bytes(m, B, cache_len)
        rows[n] = dict(variant=n, compiled=compiled, ms_per_step=1000 * step_s, ms_range=[min(trials_ms), max(trials_ms)],
                       ms_per_step_trials=trials_ms, tokens_per_s=B / step_s,
                       tokens_per_s_per_seq=1 / step_s, ttft_ms=1000 * statistics.median(t[0] for t in times[n]),
                       gbps=step / step_s / 1e9, weight_mb=weights / 1e6, kv_mb=kv / 1e6,
                       peak_mb=(weights + kv + transient[n]) / 1e6 if n in transient else None,
                       compile_s=compile_s[n] if compiled else None)
    for r in rows.values():
        ref = rows[reference[r['variant']]]
        r['speedup_vs_baseline'] = r['tokens_per_s'] / ref['tokens_per_s']
        if r is not ref:  # the reference's decode time over this variant's, round by round
            lo, hi, coverage = median_ratio_interval(ref['ms_per_step_trials'], r['ms_per_step_trials'])
            r['speedup_interval'], r['speedup_coverage'] = [lo, hi], coverage
    return list(rows.values())


# ---- the correctness gate -----------------------------------------------------------------

def gate_eager(models, pairs, prompts, n_tokens, seed, device_type):
    """Every pair's teacher-forced logits on one random sequence agree (fold.max_logit_error, fold.py's
    own check), then its first n_tokens greedy tokens. Returns {'a vs b': max |Δ| / max |logit|};
    SystemExit when a check fails: no speed is reported."""
    errors, steps = {}, make_steps(False, device_type)
    for a, b in pairs:
        c = models[a].config
        seq = random_tokens(c.vocab_size, (2, min(c.block_size, 128)), seed + 2).to(prompts[a].device)
        try:
            diff, scale = max_logit_error(models[a], models[b], seq, f'{a} vs {b}')
        except CheckError as e:
            raise SystemExit(f"correctness gate failed, no speed reported: {e}")
        errors[f'{a} vs {b}'] = diff / scale
        tokens = [run_decode(models[n], steps, prompts[n], n_tokens - 1, device_type)[2] for n in (a, b)]
        same_tokens_up_to_a_near_tie(f'{a} vs {b} (eager)', None, None, tokens[1], tokens[0], 0)
    return errors


def same_tokens_up_to_a_near_tie(name, model, prompt, got, want, rtol):
    """SystemExit unless got == want (B, n) up to the first token where they differ, and there the
    eager model's top-2 logit margin is below rtol · max |logit| in every row that differs (rounding
    may flip such a tie; rtol = 0: no flip allowed, model unused). Returns a note on where a tie was
    met ('' when none)."""
    if torch.equal(got, want):
        return ''
    j = (got != want).any(dim=0).nonzero()[0].item()
    fail = f"correctness gate failed, no speed reported: {name}: greedy tokens differ from token {j} on"
    if not rtol:
        raise SystemExit(fail)
    seq = torch.cat([prompt, want[:, :j]], dim=1)  # the context in which token j was chosen
    with torch.no_grad():
        logits = model(seq, seq)[0][:, -1].float()
    top2, rows = logits.topk(2, dim=-1).values, (got[:, j] != want[:, j])
    margin, tol = (top2[:, 0] - top2[:, 1])[rows].max().item(), rtol * logits.abs().max().item()
    if not margin < tol:
        raise SystemExit(f"{fail}, where the eager top-2 margin {margin:.3g} is no near-tie (< {tol:.3g})")
    return f"{name}: a near-tie at token {j} (margin {margin:.2g} < {tol:.2g})"


def gate_compiled(models, steps, prompts, n_new, dt, device_type, compile_s):
    """After the compiled warm-up: print the compile times, then check every compiled variant
    against the same variant eager, in the dtype timed (SystemExit otherwise). fp32: greedy tokens
    equal. bf16: a compiled prefill's logits within BF16_RTOL · max |logit| of the eager ones, and
    greedy tokens equal up to the first near-tie (same_tokens_up_to_a_near_tie)."""
    rtol, eager, notes, worst = (0 if dt == 'float32' else BF16_RTOL), make_steps(False, device_type), [], 0.0
    for n, m in models.items():
        print(f"  compiled {n} in {compile_s[n]:.1f} s")
        if rtol:  # a prefill's logits (B, 1, V) through the KV caches, eager and compiled (a graph per variant)
            pos = torch.arange(prompts[n].size(1), device=prompts[n].device)
            forwards = (GPT.forward, *make_steps(True, device_type, (GPT.forward,)))
            with torch.no_grad():
                a, b = (f(m, prompts[n], None, pos)[0].float() for f in forwards)
            worst = max(worst, (a - b).abs().max().item() / a.abs().max().item())
            if not worst <= BF16_RTOL:
                raise SystemExit(f"correctness gate failed, no speed reported: {n} compiled vs eager ({dt}): prefill "
                                 f"logits differ by {worst:.2e} of max |logit| (tolerance {BF16_RTOL:g})")
        got, want = (run_decode(m, s, prompts[n], n_new, device_type)[2] for s in (steps[n], eager))
        notes.append(same_tokens_up_to_a_near_tie(f'{n} compiled vs eager', m, prompts[n], got, want, rtol))
    within = f"prefill logits within {worst:.1e} of max|logit| (tolerance {BF16_RTOL:g}); " if rtol else ''
    print(f"  gate ({dt}, compiled): {within}"
          + ('; '.join(x for x in notes if x) or "every variant's greedy tokens equal its eager ones"))


# ---- main ----------------------------------------------------------------------------------

def main(argv):
    """Run the benchmark; returns the JSON record printed on the last line."""
    cfg = configure(argv, globals(), choices=CHOICES, validate=architecture)
    flags = {'both': [False, True], 'eager': [False], 'compiled': [True]}[cfg.compile]
    if cfg.mode == 'train':  # its own batch and context unless given: a decode's batch of 1 trains nothing typical
        import bench_train  # here: decoding, an inference script's job, never loads train.py (test_inference.py)
        given = keys_set(argv, defaults_of(globals()), ('batch_size', 'block_size'), CHOICES)
        vars(cfg).update({k: v for k, v in bench_train.train_shape().items() if k not in given})
        return bench_train.main(cfg, architecture(vars(cfg)), flags)
    arch, (dev, dt) = architecture(vars(cfg)), resolve_device(cfg.device, cfg.dtype)
    device_type = torch.device(dev).type
    if device_type == 'cuda':
        torch.cuda.set_device(dev)  # sync and memory statistics then refer to this device
    if True in flags:
        check_compiler(dev, '--compile=eager')  # before the eager rows
    cfg.trials = default_trials(cfg.trials, device_type)
    set_tf32(dev, 'float32')  # the gate's forwards: IEEE fp32, whatever ran before in the process
    B, P, N = cfg.batch_size, cfg.prompt_len, cfg.new_tokens
    # with --ckpt, every variant takes the checkpoint's shape, whatever --size says
    extra, raw, pairs, about, arch = checkpoint_variants(cfg) if cfg.ckpt else ({}, {}, [], '', arch)
    models, all_taper = build_variants(arch, cfg.seed)
    reference = {**dict.fromkeys(models, 'baseline'), **dict.fromkeys(extra, 'ckpt_baseline')}
    models.update(extra)
    gated = {**models, 'all_taper': all_taper, **raw}  # fp32, for the correctness gate
    pairs = [('internal_unfused', 'internal_folded'), ('all_taper', 'all_folded')] + pairs

    print(f"bench: {'the checkpoint' if cfg.ckpt else cfg.size or 'custom'}'s shape {arch} | {', '.join(models)}")
    print(f"  device={dev} dtype={dt} tf32={uses_tf32(dev, dt)} torch={torch.__version__} | mode=decode "
          f"batch_size={B} prompt_len={P} new_tokens={N} | trials={cfg.trials} (+2 warm-up) | "
          f"{' and '.join('compiled' if f else 'eager' for f in flags)}")
    print_conditions(machine := conditions())
    if cfg.trials < 5:
        print(f"  note: {cfg.trials} trial{'s' * (cfg.trials != 1)}; medians of fewer than 5 are noisy")
    if about:
        print(f"  ckpt {about}")

    # the gate's greedy tokens come from the timed prompt and caches: GATE_TOKENS − 1 decode steps at most
    gate_tokens = min(GATE_TOKENS, N + 1)
    prompt = random_tokens(arch['vocab_size'], (B, P), cfg.seed + 3).to(dev)
    prompts = {n: prompt % m.config.vocab_size for n, m in gated.items()}  # a checkpoint's vocabulary may be smaller
    try:
        for m in gated.values():
            m.to(dev).setup_caches(B, P + N)
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        raise SystemExit(f"the {len(gated)} models and their KV caches (batch_size {B} × {P + N} positions each) do "
                         f"not fit in {dev}'s memory: lower --batch_size (or --prompt_len + --new_tokens, or --size)") from None
    t0 = time.perf_counter()
    errors = gate_eager(gated, pairs, prompts, gate_tokens, cfg.seed, device_type)
    print("  gate (fp32, eager): " + ', '.join(f"{k}: max|Δ logit|/max|logit| {v:.1e}" for k, v in errors.items())
          + f"; first {gate_tokens} greedy tokens identical ({time.perf_counter() - t0:.1f} s)")
    del gated, all_taper, raw  # the unfolded forms are not timed

    for m in models.values():
        m.to(dtype=getattr(torch, dt))  # weights and KV caches
    tf32, results = set_tf32(dev, dt), []
    for compiled in flags:
        steps = {n: make_steps(compiled, device_type) for n in models}
        gate = partial(gate_compiled, models, steps, prompts, gate_tokens - 1, dt, device_type) if compiled else None
        compile_s, times, transient = time_variants(models, steps, prompts, N, cfg.trials, device_type, gate)
        results += result_rows(models, reference, times, transient, compile_s, compiled, cfg)

    print_table(results)
    record = {'device': device_name(dev),
              'torch': torch.__version__, 'conditions': machine, 'mode': 'decode',
              'config': dict(size='' if cfg.ckpt else cfg.size, **{k: arch[k] for k in SHAPE},  # --ckpt: its shape
                             batch_size=B, prompt_len=P, new_tokens=N, dtype=dt, tf32=tf32, trials=cfg.trials,
                             seed=cfg.seed, mode='decode', compile=cfg.compile, ckpt=cfg.ckpt),
              'gate': errors, 'results': results}
    print(json.dumps(record))  # before the profiles: a run cut short there (a time limit) keeps its figures
    if cfg.profile:
        profile_step(models, steps if flags[-1] else None, prompts, device_type)
        print(json.dumps(record))  # again, as the last line, where readers look for it
    return record


def print_table(results):
    """The results, one line per row; the speed-up with its paired-ratio interval (module docstring)."""
    coverage = {r['speedup_coverage'] for r in results if 'speedup_interval' in r}
    print(f"\n{'variant':<22} {'compiled':>8} {'ms/step':>9} {'ms range':>15} {'tokens/s':>10} {'tokens/s/seq':>12} "
          f"{'TTFT ms':>8} {'speed-up [interval]':>22} {'GB/s':>7} {'weights MB':>10} {'KV MB':>7} {'peak MB':>8}")
    for r in results:
        peak = '-' if r['peak_mb'] is None else f"{r['peak_mb']:8.1f}"
        interval = '[{:.3f}, {:.3f}]'.format(*r['speedup_interval']) if 'speedup_interval' in r else ''
        print(f"{r['variant']:<22} {str(r['compiled']):>8} {r['ms_per_step']:>9.3f} "
              f"{'{:.3f}–{:.3f}'.format(*r['ms_range']):>15} {r['tokens_per_s']:>10,.1f} "
              f"{r['tokens_per_s_per_seq']:>12,.1f} {r['ttft_ms']:>8.2f} "
              f"{r['speedup_vs_baseline']:>6.3f}× {interval:>15} {r['gbps']:>7.2f} "
              f"{r['weight_mb']:>10.2f} {r['kv_mb']:>7.2f} {peak:>8}")
    if coverage:
        print(f"speed-up: the ratio of median tokens/s; [interval]: of the per-round paired ratio, coverage "
              f"{', '.join(f'{c:.1%}' for c in sorted(coverage))} (sign test; below 6 trials [min, max])")
    print()


def profile_step(models, compiled_steps, prompts, device_type):
    """torch.profiler of one decode step of every variant after a prefill, eager and (when timed
    compiled) compiled; prints the operators by self time, then the step's totals (operator calls,
    host ms; on CUDA kernels and device ms: a step whose host time exceeds its device time is
    launch-bound, and there a kernel less saves its launch)."""
    hows = ('eager', 'compiled') if compiled_steps else ('eager',)
    for n, how in [(n, how) for n in models for how in hows]:
        first, step = compiled_steps[n] if how == 'compiled' else make_steps(False, device_type)
        P = prompts[n].size(1)
        tok = first(models[n], prompts[n], torch.arange(P, device=prompts[n].device)).clone()
        pos = torch.tensor([P], device=prompts[n].device)
        for _ in range(3):
            step(models[n], tok, pos)
        sync(device_type)  # the warm-up's kernels end outside the profile
        prof = profiled(lambda: (step(models[n], tok, pos), sync(device_type)), device_type)
        print_profile(prof, f"one decode step of {n} ({how})", device_type, row_limit=14)


if __name__ == '__main__':
    run_command(main)
