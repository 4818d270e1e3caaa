"""
`python bench.py --mode=train`: what TaperNorm costs in training, one optimizer step per phase, and
what that makes of a whole run. bench.py reads the configuration and calls `main`.

Variants, one architecture (bench.py's --size or shape keys); every other model key (taper, λ,
norm, ...) is the shipped config's, read by train.py's own load_config:
    baseline   RMSNorm                          config/tinystories_baseline.py
    internal   Internal-Taper, that config's λ  config/tinystories_internal_taper.py
    all        All-Taper + L_aux                config/tinystories_all_taper.py
    dyt        DyT (norm='dyt'): point-wise, no per-token statistic; the baseline config with --norm=dyt
    control    the baseline again, on a model and optimizer of its own with the baseline's initial
               weights (an A/A row): its × baseline is how far two identical rows differ here, the
               resolution every other ratio has
baseline, dyt and control have one phase ('baseline'); internal and all have three, each timed on a model of
its own put into it as train.main does (set_phase, set_collect, set_gate): warmup at g = 1 with the
config's calibration ('ema': statistics collected in the forward, and raw_model.calibration_step()
inside train_step, before its host read, all inside the timing), taper at g = 0.5 and linear at g = 0, after the calibrate event
(benchkit.calibrated_model: the model's own calibrate path on random tokens).

A timed step is train.py's own train_step (forward, backward, gradient clipping, AdamW from
train.configure_optimizer, fused on CUDA) on one micro-batch of batch_size × block_size random
tokens preallocated on the device (data loading, the same for every variant, is left out), under
train.py's autocast (runs.setup: bf16 on CUDA by default); compiled, the model is runs.compile_model's,
as in train.main. A sync before and after each step; WARM_UPS steps per row absorb compilation, then
--trials steps with the rows interleaved (benchkit.interleaved). ms/step: the median; × baseline:
its ratio to the baseline's median in the same mode; peak MB (CUDA): the row's parameters, buffers
and optimizer state plus the most a step allocated on top (torch.cuda.max_memory_allocated).

Projection: a run of the schedule (W warmup, T taper, max_iters − W − T linear steps) costs variant
v Σ_phase steps(phase) · ms(v, phase), the baseline max_iters · ms(baseline); projected_run is their
ratio per variant and mode. Left out, as nearly the same for every variant: the calibrate event (a
few forwards, once), evaluations, checkpoints and data loading.
"""

import itertools
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

import train
from benchkit import (calibrated_model, conditions, default_trials, device_name, interleaved, median_ratio_interval,
                      print_conditions, print_profile, profiled, random_tokens, with_peak)
from configurator import check_compiler
from fold import tensor_bytes
from model import GPT, PHASES, GPTConfig
from runs import compile_model, out_of_memory, setup, sync

ROOT = os.path.dirname(os.path.abspath(__file__))
VARIANT_CONFIGS = {'baseline': ['config/tinystories_baseline.py'], 'internal': ['config/tinystories_internal_taper.py'],
                   'all': ['config/tinystories_all_taper.py'], 'dyt': ['config/tinystories_baseline.py', '--norm=dyt'],
                   'control': ['config/tinystories_baseline.py']}
NAMES = {'baseline': 'the baseline', 'internal': 'Internal-Taper', 'all': 'All-Taper', 'dyt': 'DyT',
         'control': 'the control (the baseline again)'}
DATASETS = {'tinystories': 'TinyStories'}  # how the projection line names a config's dataset
GATES = {'baseline': 1.0, 'warmup': 1.0, 'taper': 0.5, 'linear': 0.0}  # g of each phase's timed steps
# untimed steps per row and mode: the first compiles the forward and the backward (in the tests
# nothing compiles after it) and builds AdamW's state; the others run each of RandomBatches' two
# micro-batches once more, so that the allocator's cache and the BLAS handles have settled on every
# step the trials repeat: 1 + 2
WARM_UPS = 3
SCHEDULE_KEYS = ('gate_warmup_iters', 'taper_iters', 'max_iters')
# the timed steps' learning rate: AdamW does all its work whatever the rate, but at a config's peak
# rate, with no LR warmup, steps repeated on two random batches diverged on a GPU (the TinyStories
# shape in bf16: a non-finite loss at a row's 14th step); at 0 the weights stay where they started
TIMED_LR = 0.0


def train_config(files):
    """train.py's configuration (a SimpleNamespace) of config files named relative to the repository
    (or --key=value overrides), read and validated by train.load_config."""
    return train.load_config([os.path.join(ROOT, f) if f.endswith('.py') else f for f in files])


def train_shape():
    """config/cpu.py's micro-batch, train mode's default: {'batch_size': 16, 'block_size': 128}."""
    c = train_config(['config/tinystories_baseline.py', 'config/cpu.py'])
    return dict(batch_size=c.batch_size, block_size=c.block_size)


def schedule(cfg):
    """The projected run's schedule: {files, gate_warmup_iters (W), taper_iters (T), max_iters, dataset}
    from --schedule's train.py config files (comma-separated, here or in the repository; '': train.py's
    defaults), each of --gate_warmup_iters, --taper_iters, --max_iters > 0 overriding its value. train.py's
    validation checks them as a tapered run's. SystemExit with one line for a file not found or a
    schedule train.py refuses (W < 1, T < 1, W + T > max_iters)."""
    files = []
    for f in filter(None, cfg.schedule.split(',')):
        if not os.path.isfile(f) and not os.path.isfile(os.path.join(ROOT, f)):
            raise SystemExit(f"config error: --schedule={cfg.schedule}: no file {f} here or in {ROOT}; give train.py "
                             "config files (config/tinystories_all_taper.py,config/cpu.py) or --schedule='' with "
                             "--gate_warmup_iters, --taper_iters and --max_iters")
        files.append(f if os.path.isfile(f) else os.path.join(ROOT, f))
    overrides = [f'--{k}={getattr(cfg, k)}' for k in SCHEDULE_KEYS if getattr(cfg, k) > 0]
    c = train.load_config(files + ['--taper=all'] + overrides)  # taper: so train.py validates W and T
    return dict(files=cfg.schedule, **{k: getattr(c, k) for k in SCHEDULE_KEYS}, dataset=c.dataset)


class RandomBatches:
    """train.Batches' interface (get, prefetch) over two preallocated micro-batches of random tokens on
    the device, x and y = x shifted by one, (batch_size, block_size) each; micro-batch it % 2 at step it."""

    def __init__(self, vocab_size, batch_size, block_size, device, seed):
        tokens = random_tokens(vocab_size, (2, batch_size, block_size + 1), seed).to(device)
        self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

    def get(self, it, micro):
        return self.batches[it % len(self.batches)]

    def prefetch(self, it, micro):
        pass  # nothing to build: the batches are on the device already


def phase_model(args, phase, seed, calibration):
    """GPT(GPTConfig(**args)) (weights from seed) put into `phase` as train.main does at a phase change:
    set_phase, set_collect ('calibration' in the warmup with calibration='ema'), then set_gate(GATES[phase]);
    taper and linear after the calibrate event (benchkit.calibrated_model). In train mode."""
    if phase in ('baseline', 'warmup'):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(**args))
    else:
        model = calibrated_model(args, seed)
    model.set_phase(phase)
    model.set_collect('calibration' if phase == 'warmup' and calibration == 'ema' else None)
    model.set_gate(GATES[phase])
    return model.train()


def build_rows(arch, seed, env):
    """One row per variant and phase: SimpleNamespace(variant, phase, model (on env.dev), optimizer
    (train.configure_optimizer with the variant config's hyperparameters, at TIMED_LR), cfg (the variant's
    train.py configuration, one micro-batch a step), its (a step counter))."""
    rows = []
    for variant, files in VARIANT_CONFIGS.items():
        c = train_config(files)
        args = {**{k: getattr(c, k) for k in train.MODEL_KEYS}, **arch}
        step_cfg = SimpleNamespace(**{**vars(c), 'gradient_accumulation_steps': 1, 'max_iters': 2 ** 62})
        for phase in PHASES if c.taper != 'none' else ('baseline',):
            model = phase_model(args, phase, seed, c.calibration).to(env.dev)
            optimizer = train.configure_optimizer(model, c.weight_decay, TIMED_LR, (c.beta1, c.beta2), env.device_type)
            rows.append(SimpleNamespace(variant=variant, phase=phase, model=model, optimizer=optimizer, cfg=step_cfg,
                                        its=itertools.count()))
    return rows


def step_run(row, train_model, batches, env):
    """A call of one timed optimizer step of row, as train.main runs it: train.train_step (in the
    warmup with calibration='ema' it runs raw_model.calibration_step()); returns (seconds from a sync
    before to a sync after, CUDA: bytes the step allocated on top of the resident, else None)."""
    def run():
        it = next(row.its)
        sync(env.device_type)
        t0 = time.perf_counter()
        train.train_step(train_model, row.model, row.optimizer, batches, row.cfg, env, it)
        sync(env.device_type)
        return time.perf_counter() - t0
    return with_peak(run, env.device_type)


def resident_bytes(row):
    """Bytes a row holds between steps: parameters, buffers and optimizer state, each storage once."""
    state = [t for s in row.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return tensor_bytes(list(row.model.parameters()) + list(row.model.buffers()) + state)


class StepProgress:
    """Progress over the steps of one mode's rows, on stderr (the minutes of a large model or a
    compile would pass in silence): a tqdm bar where stderr is a terminal, else one short line each
    time a row's worth of steps (WARM_UPS + trials) is done. counted(runs) wraps each run to count
    its calls; close() ends the bar."""

    def __init__(self, rows, per_row, mode):
        self.rows, self.per_row, self.mode, self.done, self.start = rows, per_row, mode, 0, time.perf_counter()
        self.bar = (tqdm(total=rows * per_row, desc=f'{mode} steps', unit='step', leave=False, file=sys.stderr)
                    if sys.stderr.isatty() else None)

    def counted(self, runs):
        def count(run):
            def call():
                result = run()
                self.done += 1
                if self.bar is not None:
                    self.bar.update()
                elif self.done % self.per_row == 0:
                    print(f"  {self.mode}: {self.done}/{self.rows * self.per_row} steps, "
                          f"{time.perf_counter() - self.start:.0f} s", file=sys.stderr, flush=True)
                return result
            return call
        return {name: count(run) for name, run in runs.items()}

    def close(self):
        if self.bar is not None:
            self.bar.close()


def time_rows(rows, compiled, batches, env, trials, tokens):
    """Time every row in one mode (module docstring); returns (one result dict per row, in rows' order,
    {(variant, phase): its step's call} for profile_steps)."""
    runs = {(r.variant, r.phase): step_run(r, compile_model(r.model) if compiled else r.model, batches, env)
            for r in rows}
    progress = StepProgress(len(runs), WARM_UPS + trials, 'compiled' if compiled else 'eager')
    try:
        warm, timed = interleaved(progress.counted(runs), trials, WARM_UPS)
    finally:
        progress.close()
    results = []
    for r in rows:
        seconds = [t for t, _ in timed[(r.variant, r.phase)]]
        step_s, transient = statistics.median(seconds), [b for _, b in timed[(r.variant, r.phase)]]
        results.append(dict(variant=r.variant, phase=r.phase, gate=GATES[r.phase], compiled=compiled,
                            ms_per_step=1000 * step_s, ms_range=[1000 * min(seconds), 1000 * max(seconds)],
                            ms_per_step_trials=[1000 * t for t in seconds],  # in round order: pairs by round
                            tokens_per_s=tokens / step_s,
                            peak_mb=(resident_bytes(r) + max(transient)) / 1e6 if env.device_type == 'cuda' else None,
                            # the first step's time above the median: never below 0, which a row that
                            # reuses a graph compiled for another (the control, the baseline's) would get from noise
                            compile_s=max(0.0, warm[(r.variant, r.phase)][0][0] - step_s) if compiled else None))
    base = next(x for x in results if x['variant'] == 'baseline')
    for x in results:
        x['vs_baseline'] = x['ms_per_step'] / base['ms_per_step']
        if x is not base:  # the paired ratio's interval, as bench.py's decode rows (median_ratio_interval)
            lo, hi, coverage = median_ratio_interval(x['ms_per_step_trials'], base['ms_per_step_trials'])
            x['vs_baseline_interval'], x['vs_baseline_coverage'] = [lo, hi], coverage
    return results, runs


def projected_run(results, sched):
    """{variant: {'eager' | 'compiled': whole-run wall time ÷ the baseline's}} for the modes in results:
    Σ_phase steps(phase) · ms_per_step(variant, phase) over max_iters · ms_per_step(baseline), with W
    warmup, T taper and max_iters − W − T linear steps; one phase ('baseline') runs all max_iters."""
    W, T, M = (sched[k] for k in SCHEDULE_KEYS)
    steps = {'baseline': M, 'warmup': W, 'taper': T, 'linear': M - W - T}
    out = {}
    for compiled in sorted({x['compiled'] for x in results}):
        total = {}
        for x in results:
            if x['compiled'] == compiled:
                total[x['variant']] = total.get(x['variant'], 0.0) + steps[x['phase']] * x['ms_per_step']
        for variant, ms in total.items():
            out.setdefault(variant, {})['compiled' if compiled else 'eager'] = ms / total['baseline']
    return out


def profile_steps(runs, compiled, device_type):
    """A torch.profiler table of one training step of each row, operators by self time, then the
    step's totals (profile_totals): whether a row's extra time is work on the device or launches."""
    for (variant, phase), run in runs.items():
        prof = profiled(run, device_type)
        print_profile(prof, f"one training step of {variant}, phase {phase} ({'compiled' if compiled else 'eager'})",
                      device_type, row_limit=12)


def print_table(results, sched, projection):
    """The table of results, then one line per mode: what a run of the schedule costs All-Taper."""
    print(f"\n{'variant':<9} {'phase':<9} {'g':>4} {'mode':<9} {'ms/step':>9} {'tokens/s':>10} "
          f"{'× baseline [interval]':>26} {'peak MB':>8}")
    for x in results:
        peak = '-' if x['peak_mb'] is None else f"{x['peak_mb']:.1f}"
        interval = '[{:.3f}, {:.3f}]'.format(*x['vs_baseline_interval']) if 'vs_baseline_interval' in x else ''
        print(f"{x['variant']:<9} {x['phase']:<9} {x['gate']:>4g} {'compiled' if x['compiled'] else 'eager':<9} "
              f"{x['ms_per_step']:>9.2f} {x['tokens_per_s']:>10,.0f} {x['vs_baseline']:>9.3f}× {interval:>16} {peak:>8}")
    coverage = {x['vs_baseline_coverage'] for x in results if 'vs_baseline_coverage' in x}
    print(f"× baseline: the ratio of median step times; [interval]: of the per-round paired ratio, coverage "
          f"{', '.join(f'{c:.1%}' for c in sorted(coverage))} (sign test; below 6 trials [min, max])")
    if results[0]['peak_mb'] is None:
        print("peak MB: not measured (torch keeps no peak-memory statistic off CUDA)")
    W, T, M = (sched[k] for k in SCHEDULE_KEYS)
    for mode in projection['all']:
        others = ', '.join(f"{NAMES[v]} {r[mode]:.3f}×" for v, r in projection.items() if v not in ('baseline', 'all'))
        print(f"a {DATASETS.get(sched['dataset'], sched['dataset'])} run of All-Taper costs "
              f"{projection['all'][mode]:.3f} × the baseline's training time ({mode}; W={W}, T={T}, max_iters={M}, "
              f"steps timed at this shape; {others})")


def main(cfg, arch, flags):
    """bench.py --mode=train with bench.py's configuration cfg, its model shape arch and compile flags
    ([False], [True] or both); returns the JSON record printed on the last line."""
    if cfg.dtype == 'float16':  # setup's autocast is bf16 for any 16-bit dtype: the rows would say float16
        raise SystemExit("config error: --mode=train times train.py's steps, in bfloat16 or float32 (float16 "
                         "would need a GradScaler, which train.py does not use): choose --dtype=bfloat16 or float32")
    sched = schedule(cfg)
    env = setup(SimpleNamespace(device=cfg.device, dtype=cfg.dtype, backend='auto', compile=False))
    cfg.trials = default_trials(cfg.trials, env.device_type)
    if True in flags:
        check_compiler(env.dev, '--compile=eager')
    B, T = cfg.batch_size, cfg.block_size
    print(f"bench: {cfg.size or 'custom'}'s shape {arch} | mode=train | {', '.join(VARIANT_CONFIGS)}")
    print(f"  device={env.dev} dtype={env.dtype} tf32={env.tf32} torch={torch.__version__} | batch_size={B} "
          f"block_size={T} ({B * T:,} tokens a step) | trials={cfg.trials} (+{WARM_UPS} warm-up steps) | "
          f"{' and '.join('compiled' if f else 'eager' for f in flags)}")
    print_conditions(machine := conditions())
    source = sched['files'] or "train.py's defaults"
    print(f"  schedule: W={sched['gate_warmup_iters']} T={sched['taper_iters']} max_iters={sched['max_iters']} "
          f"({source}; dataset {sched['dataset']})")
    if cfg.trials < 5:
        print(f"  note: {cfg.trials} trial{'s' * (cfg.trials != 1)}; medians of fewer than 5 are noisy")
    try:
        rows = build_rows(arch, cfg.seed, env)
        batches = RandomBatches(arch['vocab_size'], B, T, env.dev, cfg.seed + 3)
        timed = [time_rows(rows, compiled, batches, env, cfg.trials, B * T) for compiled in flags]
        results = [x for rows_of_mode, _ in timed for x in rows_of_mode]
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        raise SystemExit(f"the {len(VARIANT_CONFIGS)} variants' models (one a phase, each with its AdamW state) and a "
                         f"training step of batch_size {B} × block_size {T} do not fit in {env.dev}'s memory: lower "
                         "--batch_size (or --block_size, or --size)") from None
    projection = projected_run(results, sched)
    print_table(results, sched, projection)
    device = device_name(env.dev)
    record = {'device': device, 'torch': torch.__version__, 'conditions': machine, 'mode': 'train',
              'config': dict(size=cfg.size, **arch, batch_size=B, dtype=env.dtype, tf32=env.tf32, trials=cfg.trials,
                             warm_ups=WARM_UPS, seed=cfg.seed, mode='train', compile=cfg.compile, schedule=sched),
              'train': results, 'projected_run': projection}
    print(json.dumps(record))  # before the profiles: a run cut short there (a time limit) keeps its figures
    if cfg.profile:
        for compiled, (_, runs) in zip(flags, timed):
            profile_steps(runs, compiled, env.device_type)
        print(json.dumps(record))  # again, as the last line, where readers look for it
    return record
