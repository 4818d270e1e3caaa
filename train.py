"""
Train a GPT whose norms taper away: one script for all four phases (docs/method.md §2).

    python train.py config/tinystories_all_taper.py                        # GPU, TinyStories
    python train.py config/tinystories_internal_taper.py config/cpu.py     # 2-core CPU, austen
    python train.py config/tinystories_internal_taper.py config/cpu.py --init_from=resume
    torchrun --standalone --nproc_per_node=2 train.py config/...           # DDP (nccl / gloo)
    python train.py config/finetune_gpt2_internal_taper.py                 # GPT-2 fine-tuning (init_from='gpt2')
    python train.py -h                                                     # every key

Configuration (configurator.py): the defaults below, then each config file (plain Python,
executed in order), then --key=value overrides; an unknown key or a wrong type is an error.

The schedule, with 0-based iterations, W = gate_warmup_iters and T = taper_iters:

    warmup      it < W          g = 1 (calibration='ema': the statistics' EMAs accumulate)
    calibrate   after the optimizer step of it = W − 1: c, s_tgt measured and frozen, γ̃ ← γ
    taper       W ≤ it < W + T  g = ½ (1 + cos(π (it − W) / T))
    linear      it ≥ W + T      g = 0; the normalizing branch is skipped

taper='none' is the RMSNorm/LayerNorm baseline; its phase is logged as 'baseline'.
norm_removal='fakeln' is the FakeLN baseline (docs/method.md §7): before iteration
k · fakeln_interval (k = 1 .. 4) it removes ln_2, then ln_1, then ln_f, then the first position's
own scalar; each event is logged.

init_from='gpt2' (or gpt2-medium, -large, -xl, or a folder holding a transformers GPT-2 checkpoint)
starts from GPT-2's weights (gpt2.from_pretrained): the model shape comes from its config,
except keys set explicitly, which must agree with it.
"""

import functools
import math
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

from baselines import FAKELN_EVENTS, NORM_FREE, fakeln_step, final_dyt_saturated, remove_norms, saturation_warning
from configurator import (ConfigError, assigned_keys, changed_keys, check_at_least, check_compiler, config_files,
                          configure, defaults_of, keys_set, overlay_rank, run_command)
from gpt2 import GPT2_MODELS, PRETRAINED_SHAPE, PretrainedError, from_pretrained, pretrained_args
from model import GPT, GPTConfig, branch_mismatch
from runs import (DIVERGED, Run, Stopped, batch_rng, check_same_data, compile_model, end_processes, final_losses,
                  final_record, find_dataset, load_weights, model_from_state_dict, resume_command, resume_config,
                  setup, sync, tokens, windows, wrap_ddp)

# -----------------------------------------------------------------------------
# data
dataset = 'tinystories'     # reads data_dir/dataset/{train.bin,val.bin,meta.json}
data_dir = 'data'           # datasets live in data_dir/NAME (relative paths: to the repository)
out_dir = 'out'             # checkpoint and log.jsonl; may name other keys: 'out-{dataset}-{taper}'
init_from = 'scratch'       # 'scratch' | 'resume': continue out_dir/ckpt.pt with the configuration stored in it | 'gpt2' | 'gpt2-medium' | 'gpt2-large' | 'gpt2-xl' | a folder holding a transformers GPT-2 checkpoint (needs transformers; the model keys not set explicitly come from its config)
overwrite = False           # a new run into an out_dir that holds a run: True deletes its ckpt.pt and log.jsonl
# system
device = 'auto'             # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'              # 'auto' (bfloat16 autocast where supported, else float32) | 'float32' | 'bfloat16'
compile = 'auto'            # 'auto' (on for CUDA, off for CPU) | True | False
backend = 'auto'            # DDP backend: 'auto' ('nccl' on CUDA, else 'gloo') | 'nccl' | 'gloo'
seed = 1337                 # initial weights, batches, dropout: a run is a function of its config
sampler = 'random'          # training windows: 'random' (random starts, drawn with replacement) | 'epoch' (a seeded permutation of train.bin's non-overlapping windows, each read at most once; a run that needs more than one pass is refused)
# model
n_layer = 8                 # the 9M row of the model ladder (docs/method.md §6)
n_head = 4
n_embd = 256
block_size = 512            # context length
dropout = 0.0
bias = True                 # biases in Linear layers and LayerNorm β (GPT-2 style)
norm = 'rmsnorm'            # 'rmsnorm' | 'layernorm' | 'dyt' (DyT, Zhu et al. 2025: γ ⊙ tanh(α·h) + β everywhere; baselines.py) | 'derf' (Derf, Chen et al. 2025: γ ⊙ erf(α·h + s) + β everywhere)
norm_eps = 1e-5             # ε of every norm, r(h) and s(h)
activation = 'gelu'         # the MLP's GELU: 'gelu' (exact) | 'gelu_tanh' (GPT-2's gelu_new)
taper = 'none'              # 'none' | 'internal' | 'all'
aux_weight = 0.0            # λ of the scale-anchor loss L_aux
aux_form = 'absolute'       # 'absolute': λ·mean (s(h) − s_tgt)², the paper's | 'relative': λ·mean (s(h)/s_tgt − 1)², beyond the paper
norm_removal = 'none'       # 'none' | 'fakeln': the FakeLN baseline (with taper='none'; docs/method.md §7)
dyt_embed_scale = True      # norm='dyt' or 'derf': a learnable scalar (√n_embd at init) after the embedding, the DyT paper's LLM recipe (the Derf authors' GPT-2 code's too)
dyt_alpha0_scale = 1.0      # norm='dyt' or 'derf': multiplies the DyT paper's α₀ (0.8 before attention, 0.2 elsewhere; Derf's too, baselines.Derf); it suggests larger for narrower models
fakeln_interval = 30        # FakeLN: steps between its events (ln_2, ln_1, ln_f, first position at 1, 2, 3, 4 ×); 30: the gaps of Baroni et al.'s GPT-2 small schedule (all norms gone by step ~104 of 300), one kind at a time
# batch: tokens per optimizer step = batch_size * block_size * gradient_accumulation_steps * world
batch_size = 32             # sequences per micro-batch, per process
gradient_accumulation_steps = 4  # per process
# optimizer: AdamW, cosine learning rate with linear warmup
learning_rate = 1e-3        # peak learning rate
min_lr = 1e-4               # reached at lr_decay_iters, then held
warmup_iters = 500          # linear learning-rate warmup
lr_decay_iters = 5000       # end of the cosine decay (usually max_iters; above it, the run stops before min_lr)
weight_decay = 0.1          # on matrices and embeddings only, never on gains and biases
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0             # 0 disables clipping (the norm is still logged)
# TaperNorm schedule
max_iters = 5000            # optimizer steps
schedule_scale = 1.0        # multiplies every step count (max_iters, lr_decay_iters, warmup_iters, gate_warmup_iters, taper_iters, eval_interval, fakeln_interval) when the configuration is read: the run stores and prints the scaled counts, with schedule_scale = 1.0
gate_warmup_iters = 500     # W
taper_iters = 2500          # T
calibration = 'ema'         # how c and s_tgt are measured: 'ema' (the paper's EMA over the warmup) | 'end' (on the model at the calibrate event)
calib_batches = 8           # forward passes (batch_size × block_size tokens each, per process) at the calibrate event: 'end' measures c and s_tgt on them, both modes the branch mismatch
# evaluation and logging
eval_interval = 500         # validation loss and a checkpoint every this many steps
eval_iters = 50             # batches per validation estimate
log_interval = 10           # a log.jsonl record every this many steps
# -----------------------------------------------------------------------------

# ---- configuration ----------------------------------------------------------------------

CHOICES = dict(compile=('auto', True, False), calibration=('end', 'ema'), sampler=('random', 'epoch'),
               dtype=('auto', 'float32', 'bfloat16'), backend=('auto', 'nccl', 'gloo'))
# keys a resumed run may change: they cannot change its result (where it runs, how often it logs)
RESUME_FREE = ('init_from', 'overwrite', 'out_dir', 'data_dir', 'device', 'compile', 'backend', 'eval_interval',
               'log_interval')
MODEL_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'norm', 'norm_eps', 'activation',
              'taper', 'aux_weight', 'aux_form', 'norm_removal', 'dyt_embed_scale',
              'dyt_alpha0_scale')  # GPTConfig's fields set here (vocab_size comes from the dataset)
SHAPE_KEYS = tuple(k for k in MODEL_KEYS if k in PRETRAINED_SHAPE or k == 'block_size')  # init_from=gpt2 sets them


# the step counts schedule_scale multiplies: the run's length and its schedule, in proportion
SCALED_KEYS = ('max_iters', 'lr_decay_iters', 'warmup_iters', 'gate_warmup_iters', 'taper_iters', 'eval_interval',
               'fakeln_interval')


def scale_schedule(cfg):
    """Resolve schedule_scale in the dict cfg, in place: each of SCALED_KEYS times it, rounded
    (a count above 0 to at least 1, warmup_iters excepted; one of 0 or less stays as given, for
    validate to refuse as typed), then schedule_scale = 1.0, so the resolved configuration
    (the one a checkpoint stores and a resume compares with) holds the real step counts.
    Raises ConfigError for schedule_scale <= 0."""
    scale = cfg['schedule_scale']
    if not 0 < scale < math.inf:
        raise ConfigError(f"schedule_scale={scale} must be a finite number > 0 (0.1: a tenth of every step count)")
    if scale != 1:
        for key in SCALED_KEYS:
            n = cfg[key]
            cfg[key] = round(n * scale) if key == 'warmup_iters' else max(1, round(n * scale)) if n > 0 else n
        cfg['schedule_scale'] = 1.0


def validate(cfg):
    """Resolve schedule_scale (scale_schedule), then raise ConfigError for values the schedule or
    training cannot run with (docs/method.md §2); the model's own keys are GPTConfig's to check.
    A step count that schedule_scale changed is quoted with the value it was scaled from."""
    given = dict(cfg)  # the step counts as the files and overrides set them

    def counts(*keys):  # (the text after their values, the keys the message quotes)
        if given['schedule_scale'] == 1:
            return '', keys
        return (f" (schedule_scale={given['schedule_scale']:g} scaled "
                + ', '.join(f"{k} {given[k]} → {cfg[k]}" for k in keys) + ")"), (*keys, 'schedule_scale')

    scale_schedule(cfg)
    try:
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg['init_from'] not in ('scratch', 'resume', *GPT2_MODELS) and not os.path.isdir(cfg['init_from']):
        raise ConfigError(f"init_from={cfg['init_from']!r}: choose 'scratch', 'resume', one of {', '.join(GPT2_MODELS)} "
                          "or a folder holding a transformers GPT-2 checkpoint (config.json + weights)")
    if not str(cfg['out_dir']).strip():  # '--out_dir=': check_writable said "cannot write in  (No such file ...)"
        raise ConfigError("out_dir is empty: name the run's folder, e.g. --out_dir=out-mine", ('out_dir',))
    check_at_least(cfg, 1, ('batch_size', 'block_size', 'gradient_accumulation_steps', 'max_iters',
                            'eval_interval', 'eval_iters', 'log_interval', 'calib_batches'))
    if not 0 < cfg['learning_rate'] < math.inf:
        raise ConfigError(f"learning_rate={cfg['learning_rate']} must be a finite number > 0")
    check_at_least(cfg, 0, ('min_lr', 'weight_decay', 'warmup_iters'))
    check_at_least(cfg, 0, ('grad_clip',), finite=False)  # inf clips nothing, as 0 does: a run may hold it
    if cfg['min_lr'] > cfg['learning_rate']:  # e.g. --learning_rate lowered under a config's min_lr
        raise ConfigError(f"min_lr={cfg['min_lr']:g} exceeds learning_rate={cfg['learning_rate']:g}: the cosine "
                          "decay would rise to it; set --min_lr at or below learning_rate (the configs use a tenth)",
                          ('min_lr', 'learning_rate'))
    for key in ('beta1', 'beta2'):  # AdamW's own check was a ValueError traceback
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be in [0, 1)", (key,))
    if cfg['lr_decay_iters'] <= cfg['warmup_iters']:  # above max_iters is allowed: a run cut short of its decay
        text, keys = counts('lr_decay_iters', 'warmup_iters')
        raise ConfigError(f"lr_decay_iters={cfg['lr_decay_iters']} must exceed warmup_iters={cfg['warmup_iters']}"
                          f"{text}: the cosine decay runs from warmup_iters to lr_decay_iters (usually max_iters)",
                          keys)
    if cfg['taper'] != 'none':
        W, T = cfg['gate_warmup_iters'], cfg['taper_iters']
        if W < 1:
            raise ConfigError(f"gate_warmup_iters={W} must be >= 1: calibration needs warmup steps")
        if T < 1:
            raise ConfigError(f"taper_iters={T} must be >= 1")
        if W + T > cfg['max_iters']:
            text, keys = counts('gate_warmup_iters', 'taper_iters', 'max_iters')
            raise ConfigError(f"gate_warmup_iters + taper_iters = {W + T} exceeds max_iters={cfg['max_iters']}{text}: "
                              f"the gate must reach 0 before training ends (lower them, or raise max_iters)", keys)
    if cfg['norm_removal'] == 'fakeln':
        events = len(FAKELN_EVENTS) * cfg['fakeln_interval']
        if cfg['fakeln_interval'] < 1 or events > cfg['max_iters']:
            text, keys = counts('fakeln_interval', 'max_iters')
            raise ConfigError(f"fakeln_interval={cfg['fakeln_interval']}: its {len(FAKELN_EVENTS)} events need "
                              f"1 <= {len(FAKELN_EVENTS)} × fakeln_interval <= max_iters={cfg['max_iters']}{text}",
                              keys)


def load_config(argv):
    """train.py's configuration as a SimpleNamespace; SystemExit with one line when it is bad."""
    return configure(argv, globals(), CHOICES, validate)


def pretrained_config(argv, cfg):
    """For init_from=<GPT-2 name or folder>: cfg with SHAPE_KEYS taken from the pretrained config
    (gpt2.pretrained_args), except the keys argv sets explicitly, which must agree with it
    (block_size may be smaller). SystemExit with one line naming both values otherwise."""
    given = keys_set(argv, defaults_of(globals()), SHAPE_KEYS, CHOICES)
    overrides = {k: getattr(cfg, k) for k in MODEL_KEYS if k in given or k not in SHAPE_KEYS}
    try:
        args = pretrained_args(cfg.init_from, overrides)
    except PretrainedError as e:
        raise SystemExit(f"init_from={cfg.init_from}: {e}") from None
    return SimpleNamespace(**{**vars(cfg), **{k: args[k] for k in MODEL_KEYS}})


def run_config(argv):
    """(configuration, checkpoint or None) of the run argv asks for: a new one (load_config), a
    resumed one (resume_config) or one from GPT-2's weights (pretrained_config)."""
    cfg = load_config(argv)
    if cfg.init_from == 'resume':
        # a resume that gives schedule_scale again starts from the stored shape and free keys, but for
        # the step counts: stored scaled, they would be scaled twice
        kept = SHAPE_KEYS + tuple(k for k in RESUME_FREE if k not in SCALED_KEYS)
        return resume_config(argv, cfg.out_dir, defaults_of(globals()), CHOICES, validate, RESUME_FREE, kept)
    return (cfg if cfg.init_from == 'scratch' else pretrained_config(argv, cfg)), None


# ---- batches: windows of train.bin, each a function of (seed, stream) -------------------------


@functools.lru_cache(maxsize=2)
def epoch_order(n_tokens, block_size, seed):
    """sampler='epoch': a seeded permutation of the (n_tokens − 1) // block_size non-overlapping
    windows of a split (window i starts at token i · block_size), int64 array."""
    return batch_rng(seed, 4).permutation((n_tokens - 1) // block_size)


def windows_per_step(cfg, env):
    """Training windows one optimizer step reads, over every micro-batch and rank."""
    return cfg.batch_size * cfg.gradient_accumulation_steps * env.world


def check_one_pass(folder, cfg, env):
    """sampler='epoch': SystemExit unless max_iters steps fit in one pass of train.bin."""
    n = os.path.getsize(os.path.join(folder, 'train.bin')) // 2
    have, per_step = (n - 1) // cfg.block_size, windows_per_step(cfg, env)
    if cfg.max_iters * per_step > have:
        raise SystemExit(f"sampler='epoch': max_iters={cfg.max_iters} steps × {per_step} windows of "
                         f"{cfg.block_size} tokens need {cfg.max_iters * per_step:,} windows, but one pass "
                         f"of {folder}/train.bin holds {have:,}: use max_iters <= {have // per_step}, "
                         "or sampler='random' (windows drawn with replacement)")


class Batches:
    """train_batch(folder, cfg, env, it, micro), with one micro-batch built ahead (`prefetch`) while
    the device still works on the step before. A batch is a function of (it, micro) alone, so
    building it early changes nothing."""

    def __init__(self, folder, cfg, env):
        self.args, self.ahead = (folder, cfg, env), {}

    def prefetch(self, it, micro):
        self.ahead = {(it, micro): train_batch(*self.args, it, micro)}

    def get(self, it, micro):
        batch = self.ahead.pop((it, micro), None)
        return batch if batch is not None else train_batch(*self.args, it, micro)


def check_same_world(ckpt, cfg, env):
    """--init_from=resume: SystemExit unless the run resumes on the number of processes it was
    trained on (a step's tokens and the windows each rank reads depend on it); checkpoints from
    before the 'world' key pass."""
    was = ckpt.get('world', env.world) if ckpt is not None else env.world
    if was != env.world:
        raise SystemExit(f"--init_from=resume: {cfg.out_dir} was trained on {was} process(es), this run has "
                         f"{env.world}: the tokens of a step (batch_size × block_size × gradient_accumulation_steps"
                         f" × processes) and the windows each rank reads would change; resume it on {was} "
                         f"({resume_command(cfg.out_dir, was)})")


def train_batch(folder, cfg, env, it, micro):
    """Micro-batch `micro` of iteration it on this rank: x, y (batch_size, block_size). 'random':
    random windows from the (seed, 0, it, rank, micro) stream; 'epoch': entries
    j = ((it · world + rank) · gradient_accumulation_steps + micro) · batch_size + b of
    epoch_order, so no window is read twice and resume and DDP see the same windows."""
    if cfg.sampler == 'random':
        return get_batch(folder, 'train', batch_rng(cfg.seed, 0, it, env.rank, micro), cfg.batch_size,
                         cfg.block_size, env.dev)
    data = tokens(folder, 'train')
    first = ((it * env.world + env.rank) * cfg.gradient_accumulation_steps + micro) * cfg.batch_size
    order = epoch_order(len(data), cfg.block_size, cfg.seed)
    return windows(data, order[first:first + cfg.batch_size] * cfg.block_size, cfg.block_size, env.dev)


def get_batch(folder, split, rng, batch_size, block_size, device):
    """Random windows of one split: x, y of shape (B, T), y shifted by one token."""
    data = tokens(folder, split)
    return windows(data, rng.integers(len(data) - block_size, size=batch_size), block_size, device)


# ---- the model, a training step, evaluation ----------------------------------------------

def configure_optimizer(model, weight_decay, learning_rate, betas, device_type):
    """AdamW; matrices and embeddings decay, gains and biases (γ, β, γ̃, β̃) do not."""
    params = [p for p in model.parameters()]  # all, including those frozen in this phase
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{'params': decay, 'weight_decay': weight_decay},
              {'params': no_decay, 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')


def build_model(cfg, model_args, ckpt, env):
    """(model on env.dev, its AdamW): random weights (scratch; seeded), the checkpoint's weights and
    optimizer state (resume), or a pretrained GPT-2's (init_from=NAME|FOLDER, model_args on top);
    SystemExit with one line if GPT-2 fails to load."""
    torch.manual_seed(cfg.seed)  # the initial weights
    if cfg.init_from in ('scratch', 'resume'):
        model = GPT(GPTConfig(**model_args))
        if ckpt is not None:
            load_weights(model, ckpt['model'], os.path.join(cfg.out_dir, 'ckpt.pt'))
    else:
        try:
            model = from_pretrained(cfg.init_from, model_args)
        except PretrainedError as e:
            raise SystemExit(f"init_from={cfg.init_from}: {e}") from None
    model.to(env.dev)
    optimizer = configure_optimizer(model, cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                    env.device_type)
    if ckpt is not None:  # the saved state, with this device's kernels: load_state_dict would take the
        # saver's flags, so a run resumed on another device kept a fused AdamW on the CPU or lost it on CUDA
        impl = [{k: g[k] for k in ('fused', 'foreach', 'capturable') if k in g} for g in optimizer.param_groups]
        saved = ckpt['optimizer']
        optimizer.load_state_dict({**saved, 'param_groups': [s | i for s, i in zip(saved['param_groups'], impl,
                                                                                      strict=True)]})
    return model, optimizer


STEP_METRICS = ('loss', 'ce', 'aux', 'hidden_rms', 'logit_rms', 'radial_cos')  # a step's means, logged


def train_step(train_model, raw_model, optimizer, batches, cfg, env, it, stop=None):
    """One optimizer step over gradient_accumulation_steps micro-batches. Returns the step's
    means over micro-batches and ranks {loss, ce, aux, hidden_rms, logit_rms, radial_cos},
    grad_norm (before clipping), dyt_saturated (baselines.final_dyt_saturated) and stop: whether
    stop() (runs.Run.stop_asked: has this process received a signal?) was true on any rank when its
    gradients were complete (it rides on the same all-reduce, so every rank stops at the same
    step), all read from the device in one .tolist(), the step's only host sync. In the 'ema'
    warmup (raw_model collecting 'calibration') it also runs raw_model.calibration_step(), before
    that sync. Stopped (runs.DIVERGED) on a non-finite loss or gradient norm, before the optimizer
    step. batches: a Batches (the next step's first micro-batch is built before that sync)."""
    torch.manual_seed(int(np.random.SeedSequence([cfg.seed, it, env.rank]).generate_state(1)[0]))  # dropout
    sums = torch.zeros(9, device=env.dev)
    for micro in range(cfg.gradient_accumulation_steps):
        if env.ddp:  # all-reduce gradients on the last micro-step only
            train_model.require_backward_grad_sync = micro == cfg.gradient_accumulation_steps - 1
        x, y = batches.get(it, micro)
        with env.autocast:
            _, loss = train_model(x, y)
        (loss / cfg.gradient_accumulation_steps).backward()
        m, sink = raw_model.last_metrics, raw_model.radial_sink  # sink.grad: radial_cos (model.RadialCos)
        sums[:6] += torch.stack([loss.detach(), m.ce, m.aux, m.hidden_rms, m.logit_rms, sink.grad]).float()
        sink.grad = None
    if raw_model.collect == 'calibration':  # the 'ema' warmup: this step's statistics into the EMAs of c and s_tgt
        raw_model.calibration_step()  # before the host read below, so its host work overlaps the device's backward
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in raw_model.parameters() if p.grad is not None],
        cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
    sums /= cfg.gradient_accumulation_steps
    sums[6] = float(stop is not None and stop())  # read as late as it can be
    if env.ddp:
        torch.distributed.all_reduce(sums)  # SUM: gloo has no AVG
        sums /= env.world
    sums[7] = grad_norm  # after the all-reduce: the gradients (and so their norm) are the same on every rank
    sums[8] = final_dyt_saturated(raw_model)  # so are they here
    if it + 1 < cfg.max_iters:
        batches.prefetch(it + 1, 0)  # the next step's first micro-batch, built while the device works
    stats = dict(zip((*STEP_METRICS, 'stop', 'grad_norm', 'dyt_saturated'), sums.tolist()))  # the step's one host sync
    stats['stop'], stats['dyt_saturated'] = stats['stop'] > 0, stats['dyt_saturated'] > 0
    if not (math.isfinite(stats['loss']) and math.isfinite(stats['grad_norm'])):
        raise Stopped(f"{DIVERGED} at iteration {it} (loss {stats['loss']}, grad norm {stats['grad_norm']}); "
                      f"stopping without saving: {os.path.join(cfg.out_dir, 'ckpt.pt')} keeps the last good state")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


@torch.no_grad()
def estimate_val_loss(fwd_model, raw_model, folder, cfg, env, first_batch=None):
    """Mean cross-entropy over eval_iters fixed random val batches (the same batches every time);
    a tqdm bar on a terminal. first_batch(seconds): called with the time of one batch, the first
    (the second when compiled: the first compiles the evaluation's graph; none if there is only one)."""
    collect = raw_model.collect
    raw_model.set_collect(None)  # evaluation never touches the calibration statistics
    fwd_model.eval()
    losses, timed = [], 1 if env.compile else 0
    try:
        for k in tqdm(range(cfg.eval_iters), desc='val loss', leave=False, disable=None if env.master else True):
            t0 = time.perf_counter()
            x, y = get_batch(folder, 'val', batch_rng(cfg.seed, 1, k), cfg.batch_size, cfg.block_size, env.dev)
            with env.autocast:
                fwd_model(x, y)
            losses.append(raw_model.last_metrics.ce)
            if k == timed and first_batch is not None:
                sync(env.device_type)  # CUDA, MPS: the forward is only queued until then
                first_batch(time.perf_counter() - t0)
    finally:  # also when a signal ends the evaluation early (runs.Run.evaluate)
        fwd_model.train()
        raw_model.set_collect(collect)
    return torch.stack(losses).mean().item()


# ---- the four phases: the schedule (pure functions of the iteration), the calibrate event, and ---
# ---- the loop that runs them in main (docs/method.md §2) -----------------------------------------

def get_phase(it, taper, gate_warmup_iters, taper_iters):
    """'baseline' for taper='none', else 'warmup' | 'taper' | 'linear' at iteration it."""
    if taper == 'none':
        return 'baseline'
    if it < gate_warmup_iters:
        return 'warmup'
    return 'taper' if it < gate_warmup_iters + taper_iters else 'linear'


PHASE_LINES = {'warmup': 'the gate warmup (not the learning rate\'s warmup_iters): g = 1, every norm normalizes',
               'taper': 'g falls from 1 to 0 on a half cosine: each tapered norm is g · N(h) + (1 − g) · L(h)',
               'linear': "g = 0: each tapered norm is its fixed linear map L(h) = c · h ⊙ γ̃, what fold.py folds"}


def phase_line(it, cfg):
    """The line train.py prints where a phase begins (or a run resumes in it): 'phase taper,
    iterations 15-89: g falls ...' (docs/method.md §2); None for a baseline run (one phase)."""
    phase = get_phase(it, cfg.taper, cfg.gate_warmup_iters, cfg.taper_iters)
    if phase == 'baseline':
        return None
    end = {'warmup': cfg.gate_warmup_iters, 'taper': cfg.gate_warmup_iters + cfg.taper_iters}.get(phase, cfg.max_iters)
    return f"phase {phase}, iterations {it}-{end - 1}: {PHASE_LINES[phase]}"


def get_gate(it, taper, gate_warmup_iters, taper_iters):
    """g(it): 1 in warmup (and baseline), ½(1 + cos(π(it − W)/T)) in taper, 0 in linear."""
    phase = get_phase(it, taper, gate_warmup_iters, taper_iters)
    if phase == 'taper':
        return 0.5 * (1.0 + math.cos(math.pi * (it - gate_warmup_iters) / taper_iters))
    return 0.0 if phase == 'linear' else 1.0


def get_fakeln_stage(it, norm_removal, fakeln_interval):
    """FakeLN's events done before iteration it (0 .. len(FAKELN_EVENTS)); 0 for norm_removal='none'."""
    return 0 if norm_removal == 'none' else min(it // fakeln_interval, len(FAKELN_EVENTS))


def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup over warmup_iters, cosine decay to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def calibrate_event(fwd_model, raw_model, folder, cfg, env):
    """docs/method.md §3: c and s_tgt from the model as it is ('end': calib_batches forwards of
    training windows from their own seeded stream, so the training batches stay as they were)
    or from the warmup's EMAs ('ema'); then the branch mismatch ‖L − N‖/‖N‖ per layer on the
    same batches. Returns the calibrate record's fields."""
    def forwards():
        for k in range(cfg.calib_batches):
            x, y = get_batch(folder, 'train', batch_rng(cfg.seed, 2, env.rank, k), cfg.batch_size,
                             cfg.block_size, env.dev)
            with env.autocast:
                fwd_model(x, y)

    fwd_model.eval()
    if cfg.calibration == 'end':
        raw_model.set_collect('calibration')
        forwards()
    event = raw_model.calibrate(cfg.calibration)
    raw_model.set_collect('mismatch')
    forwards()
    event['mismatch'] = branch_mismatch(raw_model)
    raw_model.set_collect(None)
    fwd_model.train()
    return event


def fakeln_events(raw_model, it, run):
    """FakeLN (docs/method.md §7): the removal events due before iteration it, each logged (in
    run, a runs.Run) as happening after the optimizer step of it − 1. A compiled model recompiles
    once per event."""
    while int(getattr(raw_model, 'fakeln_stage', 0)) < get_fakeln_stage(it, run.cfg.norm_removal,
                                                                         run.cfg.fakeln_interval):
        run.log({'event': 'fakeln', 'iter': it - 1, **remove_norms(raw_model)})


# ---- main -------------------------------------------------------------------------------

def cpu_hint(argv, download_failed=False):
    """For runs.Progress, when a run is long on a CPU: argv with config/cpu.py (the variant at CPU
    size) and config/smoke.py (every phase in 150 steps) where they are missing, in the order they
    apply, as the rest of its line; '' when both are given. argv's --key=value overrides are kept,
    but for out_dir (the run's own folder: the command would be refused) and the keys an added
    overlay sets. download_failed: for a failed TinyStories download (runs.find_dataset), only the
    variant at CPU size, on Jane Austen's novels, which need no download (--dataset, --data_dir dropped)."""
    files = config_files(argv)
    given = {os.path.realpath(f) for f in files}
    cpu, smoke = (os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config', name))
                  for name in ('cpu.py', 'smoke.py'))

    def command(*overlays):
        added = [f for f in overlays if os.path.realpath(f) not in given]
        dropped = {'out_dir', *(k for f in added for k in assigned_keys(f))}
        if smoke in added:  # its 150 steps: a typed step count would be scaled, not replaced (max_iters=20000 → 2000)
            dropped |= set(SCALED_KEYS)
        if download_failed:
            dropped |= {'dataset', 'data_dir'}
        kept = [a for a in argv if a not in files and a.lstrip('-').split('=', 1)[0] not in dropped]
        return ' '.join(['python train.py', *sorted(files + added, key=overlay_rank), *kept])

    austen = "the 1M model on Jane Austen's novels, prepared by python data/text/prepare.py --name=austen"
    if download_failed:
        return f": the same variant at CPU size needs no download ({austen}): {command(cpu)}"
    if os.path.realpath(cpu) not in given:
        return (f": its configuration is sized for a GPU. The same variant at CPU size ({austen}): {command(cpu)}; "
                f"every phase in 150 steps: {command(cpu, smoke)}")
    return f"; every phase in 150 steps: {command(smoke)}" if os.path.realpath(smoke) not in given else ''


HEADER_KEYS = ('taper', 'norm', 'aux_weight', 'device', 'dtype', 'compile', 'out_dir')  # what the header line shows
# keys that act only in some runs: config_line leaves them out of the others, where a changed value
# (a config's, or schedule_scale's) would read as if it changed the run
ACTS_WHEN = {
    'gate_warmup_iters': lambda c: c.taper != 'none', 'taper_iters': lambda c: c.taper != 'none',
    'calibration': lambda c: c.taper != 'none', 'calib_batches': lambda c: c.taper != 'none',
    'aux_form': lambda c: c.aux_weight > 0, 'fakeln_interval': lambda c: c.norm_removal == 'fakeln',
    'dyt_embed_scale': lambda c: c.norm in NORM_FREE, 'dyt_alpha0_scale': lambda c: c.norm in NORM_FREE,
    'overwrite': lambda c: c.init_from != 'resume',
}


def idle_keys(cfg):
    """The keys that do not act in the run configured by cfg (a SimpleNamespace): ACTS_WHEN's."""
    return tuple(k for k, acts in ACTS_WHEN.items() if not acts(cfg))


def config_line(argv, cfg):
    """The line under the run's header: every key that acts in this run (ACTS_WHEN) and whose value
    differs from train.py's defaults (configurator.changed_keys; the header's own HEADER_KEYS aside),
    so that a reader sees what the run changed. For overlays given without a base config (python
    train.py config/cpu.py), it first says which base they changed: train.py's defaults, the
    TinyStories baseline."""
    files = config_files(argv)
    changed = changed_keys(vars(cfg), defaults_of(globals()), HEADER_KEYS + idle_keys(cfg))
    base = ''
    if cfg.init_from != 'resume' and files and all(overlay_rank(f) > 0 for f in files):
        base = (f"no base config before {files[0]}: it changes train.py's defaults, the TinyStories baseline's "
                "(config/tinystories_baseline.py, taper='none'; give a base config first for a TaperNorm variant); ")
    return f"{base}changed from train.py's defaults beyond the header: {changed or 'nothing'}"


def finished_run(cfg, env, ckpt):
    """A run resumed after its end (its log holds the final record): one line, nothing redone;
    returns its model."""
    if env.master:
        print(f"{cfg.out_dir} is a finished run ({ckpt['iter_num']} of {cfg.max_iters} steps, final_val_loss "
              f"{final_record(cfg.out_dir)['final_val_loss']:.4f}): nothing to train or evaluate; a longer run "
              "is a new run")
    end_processes(env)
    return model_from_state_dict(ckpt['model'], ckpt['model_args'], os.path.join(cfg.out_dir, 'ckpt.pt'))


def main(argv):
    """Train with the configuration given by argv (see load_config); returns the trained model."""
    cfg, ckpt = run_config(argv)
    env = setup(cfg)
    if env.compile:
        check_compiler(env.dev)
    tokens_per_iter = windows_per_step(cfg, env) * cfg.block_size
    folder, meta = find_dataset(cfg, may_prepare=not env.ddp,
                                cpu_hint=cpu_hint(argv, download_failed=True) if env.device_type == 'cpu' else '')
    if cfg.sampler == 'epoch':
        check_one_pass(folder, cfg, env)
    model_args = {**{k: getattr(cfg, k) for k in MODEL_KEYS}, 'vocab_size': meta['vocab_size']}
    if ckpt is not None and GPTConfig(**ckpt['model_args']) != GPTConfig(**model_args):  # older ones lack new keys
        raise SystemExit(f"--init_from=resume: the dataset {folder} has vocab_size {meta['vocab_size']}, "
                         f"the checkpoint's model {ckpt['model_args']['vocab_size']}: resume on the run's data")
    check_same_data(ckpt, folder, meta)  # a resume on other data at the same vocab_size: refused
    iter_num = ckpt['iter_num'] if ckpt is not None else 0
    if iter_num >= cfg.max_iters and final_record(cfg.out_dir) is not None:
        return finished_run(cfg, env, ckpt)
    check_same_world(ckpt, cfg, env)
    raw_model, optimizer = build_model(cfg, model_args, ckpt, env)
    state = lambda: {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'model_args': model_args,
                     'meta': meta}
    run = Run(cfg, env, folder, iter_num, state, cpu_hint(argv) if cfg.init_from == 'scratch' else '')
    if ckpt is not None and env.master:
        print(f"resuming {run.ckpt_path} at iteration {iter_num}")
    del ckpt
    fwd_model = compile_model(raw_model) if env.compile else raw_model
    if env.master:
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters | taper={cfg.taper} norm={cfg.norm} "
              f"λ={cfg.aux_weight} | device={env.dev} dtype={env.dtype} tf32={env.tf32} compile={env.compile} "
              f"world={env.world} | {tokens_per_iter:,} tokens/iter | writing {run.ckpt_path} and log.jsonl")
        print(config_line(argv, cfg))

    # ---- the training loop: the four phases (docs/method.md §2) ----
    schedule = (cfg.taper, cfg.gate_warmup_iters, cfg.taper_iters)
    batches, train_model = Batches(folder, cfg, env), None
    estimate = functools.partial(estimate_val_loss, fwd_model, raw_model, folder, cfg, env)
    fwd_model.train()
    with run:  # from here a signal stops the run where its contract says (runs.Run)
        while run.iter_num < cfg.max_iters:
            it = run.iter_num
            phase, gate = get_phase(it, *schedule), get_gate(it, *schedule)
            lr = get_lr(it, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
            if train_model is None or phase != raw_model.phase:
                if env.master and (line := phase_line(it, cfg)):
                    print(line)
                raw_model.set_phase(phase)  # the compiled model recompiles once, here
                raw_model.set_collect('calibration' if phase == 'warmup' and cfg.calibration == 'ema' else None)
                train_model = wrap_ddp(fwd_model, env)  # DDP must see the parameters this phase trains
            try:
                raw_model.set_gate(gate)  # in place: no recompile
            except ValueError as e:  # a schedule edited wrong: stop where it leaves [0, 1]
                raise SystemExit(f"iteration {it}: {e}") from None
            fakeln_events(raw_model, it, run)  # FakeLN: a removal recompiles once, here
            for group in optimizer.param_groups:
                group['lr'] = lr
            record = run.evaluate(it, estimate)  # when due: {'val_loss': ...} and a checkpoint

            t0 = time.perf_counter()
            stats = train_step(train_model, raw_model, optimizer, batches, cfg, env, it, run.stop_asked)
            if cfg.norm_removal == 'fakeln':
                fakeln_step(raw_model)  # σ(h) of the norms not yet removed, into their windows
            logged = it % cfg.log_interval == 0 or bool(record)
            dt_s = run.step_took(it, t0, synchronize=logged)  # logged: step_ms includes the optimizer step
            if logged:
                scale = raw_model.last_metrics.final_scale_rms
                run.log(dict(iter=it, phase=phase, gate=gate, lr=lr, **{k: stats[k] for k in STEP_METRICS}, **record,
                             **({'final_scale_rms': scale.item()} if scale is not None else {}),
                             grad_norm=stats['grad_norm'], step_ms=1000 * dt_s, tokens_per_s=tokens_per_iter / dt_s))
            if stats['dyt_saturated']:  # said once: it may recover
                run.say_once('dyt_saturated', saturation_warning(raw_model, it))
            if phase == 'warmup' and it == cfg.gate_warmup_iters - 1:  # c, s_tgt frozen; γ̃ ← γ
                with run.during(f'the calibrate event after iteration {it}'):
                    event = calibrate_event(fwd_model, raw_model, folder, cfg, env)
                run.log({'event': 'calibrate', 'iter': it, **event})
            run.end_iteration(it, stats['stop'])  # a signal stops the run here, every finished step saved

        # the state after the last step belongs to iteration max_iters: linear, g = 0 when tapering
        raw_model.set_phase(get_phase(run.iter_num, *schedule))
        raw_model.set_gate(get_gate(run.iter_num, *schedule))
        fakeln_events(raw_model, run.iter_num, run)
        run.finish(raw_model.phase, functools.partial(final_losses, raw_model, folder, cfg, env))
    return raw_model  # leaving `with run`, DDP's ranks ended together (runs.end_processes)


if __name__ == '__main__':
    run_command(main)
