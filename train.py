"""
Train a GPT whose norms taper away: one script for all four phases of SPEC §2.

    python train.py config/tinystories_all_taper.py                        # GPU, TinyStories
    python train.py config/tinystories_internal_taper.py config/cpu.py     # 2-core CPU, austen
    python train.py config/tinystories_baseline.py config/cpu.py --max_iters=200
    python train.py config/tinystories_internal_taper.py config/cpu.py --init_from=resume
    torchrun --standalone --nproc_per_node=2 train.py config/...           # DDP (nccl / gloo)

Configuration as in nanoGPT: the defaults below, then each config file (plain Python,
executed in order), then --key=value overrides; an unknown key or a wrong type is an error.

The schedule, with 0-based iterations, W = gate_warmup_iters and T = taper_iters:

    warmup      it < W          g = 1 (calibration='ema': the statistics' EMAs accumulate)
    calibrate   after the optimizer step of it = W − 1: c, s_tgt measured and frozen, γ̃ ← γ
    taper       W ≤ it < W + T  g = ½ (1 + cos(π (it − W) / T))
    linear      it ≥ W + T      g = 0; the normalizing branch is skipped

taper='none' is the RMSNorm/LayerNorm baseline; its phase is logged as 'baseline'.
"""

import ast
import builtins
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from types import ModuleType, SimpleNamespace

import numpy as np
import torch

from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# default config values: the TinyStories baseline, 9M model (SPEC §6 ladder)
# data
dataset = 'tinystories'     # reads data_dir/dataset/{train.bin,val.bin,meta.json}
data_dir = 'data'
out_dir = 'out'
init_from = 'scratch'       # 'scratch' | 'resume' (out_dir/ckpt.pt)
# system
device = 'auto'             # 'auto' (cuda if available, else cpu) | 'cpu' | 'cuda' | 'cuda:1' ...
dtype = 'auto'              # 'auto' (bfloat16 autocast where supported, else float32) | 'float32' | 'bfloat16'
compile = 'auto'            # 'auto' (on for CUDA, off for CPU) | True | False
backend = 'auto'            # DDP backend: 'auto' ('nccl' on CUDA, else 'gloo') | 'nccl' | 'gloo'
seed = 1337
# model
n_layer = 8
n_head = 4
n_embd = 256
block_size = 512
dropout = 0.0
bias = True
norm = 'rmsnorm'            # 'rmsnorm' | 'layernorm'
norm_eps = 1e-5
taper = 'none'              # 'none' | 'internal' | 'all'
aux_weight = 0.0            # λ of the scale-anchor loss L_aux
# batch: tokens per optimizer step = batch_size * block_size * gradient_accumulation_steps * world
batch_size = 32
gradient_accumulation_steps = 4  # per process
# optimizer: AdamW, cosine learning rate with linear warmup
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 500
lr_decay_iters = 5000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0             # 0 disables clipping (the norm is still logged)
# TaperNorm schedule
max_iters = 5000
gate_warmup_iters = 500     # W
taper_iters = 2500          # T
calibration = 'end'         # how c and s_tgt are measured: 'end' (on the model at the calibrate event) | 'ema' (the paper's EMA over the warmup)
calib_batches = 8           # 'end': forward passes (batch_size × block_size tokens each, per process) at the calibrate event
# evaluation and logging
eval_interval = 500
eval_iters = 50
log_interval = 10
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or an invalid combination."""


def check_type(defaults, key, value, where):
    """Return value if it has the type of defaults[key] (an int passes for a float), else raise ConfigError."""
    default = defaults[key]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                          f"expected {type(default).__name__} like the default {default!r}")
    return value


def _check_train_type(defaults, key, value, where):
    if key == 'compile':  # the one key with two types
        if value == 'auto' or isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: compile={value!r}: use 'auto', True or False")
    return check_type(defaults, key, value, where)


def parse_args(args, defaults, check=check_type):
    """nanoGPT-style configuration shared by every script: defaults, then config files and
    --key=value overrides in the order given. Returns a new dict.

    args: e.g. ['config/tinystories_all_taper.py', 'config/cpu.py', '--max_iters=200'].
    A config file is executed with the current values as its namespace (so an overlay can
    derive values from earlier ones) and `__file__` set. A value is read as a Python literal,
    or else as a bare string (--dataset=austen); a key whose default is a string keeps the text
    when the literal does not fit it (--start=1984). Raises ConfigError naming the key for an
    unknown key, a wrong type (check(defaults, key, value, where)) or a missing file.
    """
    cfg = dict(defaults)
    for arg in args:
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise ConfigError(f"{arg}: overrides are written --key=value")
            if key not in cfg:
                raise ConfigError(f"unknown config key {key!r} in {arg}")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare word is a string: --dataset=austen
            try:
                cfg[key] = check(defaults, key, value, arg)
            except ConfigError:
                if value is text or not isinstance(defaults[key], str):
                    raise
                cfg[key] = check(defaults, key, text, arg)  # a string key keeps its text: --start=1984
        else:
            if not os.path.isfile(arg):
                hint = f"; did you mean --{arg}?" if '=' in arg else " (run from the repository root)"
                raise ConfigError(f"config file {arg!r} not found{hint}")
            namespace = dict(cfg, __file__=os.path.abspath(arg))
            with open(arg) as f:
                exec(builtins.compile(f.read(), arg, 'exec'), namespace)
            for key, value in namespace.items():
                if key.startswith('_') or isinstance(value, ModuleType) or callable(value):
                    continue
                if key not in cfg:
                    raise ConfigError(f"unknown config key {key!r} set in {arg}")
                cfg[key] = check(defaults, key, value, arg)
    return cfg


def load_config(args):
    """train.py's configuration: parse_args over the defaults above, then out_dir's {key}
    placeholders are filled and the combination is validated. Returns a SimpleNamespace.
    Raises ConfigError naming the key (see parse_args and validate_config).
    """
    cfg = parse_args(args, DEFAULTS, _check_train_type)
    try:  # out_dir may name other keys, resolved after every override: 'out-{dataset}-{taper}'
        cfg['out_dir'] = cfg['out_dir'].format(**cfg)
    except (KeyError, ValueError, IndexError) as e:
        raise ConfigError(f"out_dir={cfg['out_dir']!r}: placeholders must be config keys, like "
                          f"{{taper}} ({type(e).__name__}: {e})")
    validate_config(cfg)
    return SimpleNamespace(**cfg)


def validate_config(cfg):
    """Raise ConfigError for combinations that cannot run (SPEC §2)."""
    choices = dict(norm=('rmsnorm', 'layernorm'), taper=('none', 'internal', 'all'), calibration=('end', 'ema'),
                   init_from=('scratch', 'resume'), dtype=('auto', 'float32', 'bfloat16'),
                   backend=('auto', 'nccl', 'gloo'))
    for key, allowed in choices.items():
        if cfg[key] not in allowed:
            raise ConfigError(f"{key}={cfg[key]!r}: choose one of {allowed}")
    for key in ('batch_size', 'block_size', 'gradient_accumulation_steps', 'max_iters',
                'eval_interval', 'eval_iters', 'log_interval', 'n_layer', 'n_head', 'n_embd', 'calib_batches'):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be >= 1")
    for key in ('learning_rate',):
        if not cfg[key] > 0:
            raise ConfigError(f"{key}={cfg[key]} must be > 0")
    for key in ('min_lr', 'weight_decay', 'grad_clip', 'warmup_iters', 'norm_eps'):
        if cfg[key] < 0:
            raise ConfigError(f"{key}={cfg[key]} must be >= 0")
    if not 0 <= cfg['dropout'] < 1:
        raise ConfigError(f"dropout={cfg['dropout']} must be in [0, 1)")
    if cfg['lr_decay_iters'] < cfg['warmup_iters']:
        raise ConfigError(f"lr_decay_iters={cfg['lr_decay_iters']} is below warmup_iters={cfg['warmup_iters']}")
    if cfg['n_embd'] % cfg['n_head']:
        raise ConfigError(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    if cfg['taper'] == 'none':
        if cfg['aux_weight'] > 0:
            raise ConfigError("aux_weight > 0 needs taper='internal' or 'all'; "
                              "set --aux_weight=0 for the baseline")
    else:
        W, T = cfg['gate_warmup_iters'], cfg['taper_iters']
        if W < 1:
            raise ConfigError(f"gate_warmup_iters={W} must be >= 1: calibration needs warmup steps")
        if T < 1:
            raise ConfigError(f"taper_iters={T} must be >= 1")
        if W + T > cfg['max_iters']:
            raise ConfigError(f"gate_warmup_iters + taper_iters = {W + T} exceeds max_iters="
                              f"{cfg['max_iters']}: the gate must reach 0 before training ends")
    if cfg['aux_weight'] < 0:
        raise ConfigError(f"aux_weight={cfg['aux_weight']} must be >= 0")


def resolve_device(device, dtype):
    """Resolve the device and dtype settings shared by the scripts: returns (device, dtype name).

    device 'auto' is cuda when available, else cpu; dtype 'auto' is bfloat16 on a CUDA device
    that supports it, else float32. Raises ConfigError for a dtype other than auto, float32,
    bfloat16 or float16, or a CUDA device on a machine without one.
    """
    dev = ('cuda' if torch.cuda.is_available() else 'cpu') if device == 'auto' else device
    if dev.startswith('cuda') and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: this machine has no CUDA device; use --device=cpu")
    if dtype == 'auto':
        dtype = 'bfloat16' if dev.startswith('cuda') and torch.cuda.is_bf16_supported() else 'float32'
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise ConfigError(f"dtype={dtype!r}: choose 'auto', 'float32', 'bfloat16' or 'float16'")
    return dev, dtype


# -----------------------------------------------------------------------------
# the schedule: pure functions of the iteration (SPEC §2)

def get_phase(it, taper, gate_warmup_iters, taper_iters):
    """'baseline' for taper='none', else 'warmup' | 'taper' | 'linear' at iteration it."""
    if taper == 'none':
        return 'baseline'
    if it < gate_warmup_iters:
        return 'warmup'
    return 'taper' if it < gate_warmup_iters + taper_iters else 'linear'


def get_gate(it, taper, gate_warmup_iters, taper_iters):
    """g(it): 1 in warmup (and baseline), ½(1 + cos(π(it − W)/T)) in taper, 0 in linear."""
    phase = get_phase(it, taper, gate_warmup_iters, taper_iters)
    if phase == 'taper':
        return 0.5 * (1.0 + math.cos(math.pi * (it - gate_warmup_iters) / taper_iters))
    return 0.0 if phase == 'linear' else 1.0


def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup over warmup_iters, cosine decay to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -----------------------------------------------------------------------------
# data

def prepare_command(dataset):
    """The command that prepares `dataset`, for error messages."""
    if dataset == 'tinystories':
        return 'python data/tinystories/prepare.py'
    corpus = os.path.join('..', 'shared', 'corpora', f'{dataset}.txt')
    source = corpus if os.path.exists(corpus) else f'PATH/TO/{dataset}.txt'
    return f'python data/text/prepare.py --name={dataset} --input={source}'


def find_dataset(cfg, may_prepare):
    """Return (dataset folder, meta dict); prepare TinyStories when it is missing.

    Raises SystemExit with the exact prepare command when the data is missing.
    """
    folder = os.path.join(cfg.data_dir, cfg.dataset)
    if not os.path.exists(os.path.join(folder, 'train.bin')) and cfg.dataset == 'tinystories' and may_prepare:
        from data.tinystories import prepare as tinystories  # downloads; offline it says how to pass files
        print(f"{folder}/train.bin not found: preparing TinyStories first")
        tinystories.main([f'--out_dir={folder}'])
    for name in ('train.bin', 'val.bin', 'meta.json'):
        if not os.path.exists(os.path.join(folder, name)):
            raise SystemExit(f"{os.path.join(folder, name)} not found. Prepare the dataset first:\n"
                             f"    {prepare_command(cfg.dataset)}")
    with open(os.path.join(folder, 'meta.json')) as f:
        return folder, json.load(f)


def batch_rng(seed, *stream):
    """A numpy Generator determined by (seed, *stream): batches depend on nothing else."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def get_batch(folder, split, rng, batch_size, block_size, device):
    """Random windows of one split: x, y of shape (B, T), y shifted by one token."""
    # re-open the memmap per batch: a long-lived np.memmap grows the resident memory
    data = np.memmap(os.path.join(folder, f'{split}.bin'), dtype=np.uint16, mode='r')
    if len(data) <= block_size:
        raise SystemExit(f"{folder}/{split}.bin has {len(data)} tokens, fewer than block_size+1 "
                         f"= {block_size + 1}; use a smaller --block_size or more data")
    ix = rng.integers(len(data) - block_size, size=batch_size)
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
    if device.startswith('cuda'):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# checkpoints

def save_checkpoint(obj, path):
    """torch.save to a temp file, fsync, then rename: a crash or Ctrl-C mid-save keeps the old file."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# -----------------------------------------------------------------------------

def main(argv):
    """Train with the configuration given by argv (see load_config); returns the trained model."""
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")

    # ---- devices and processes ----
    ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun
    try:
        dev, dt = resolve_device(cfg.device, cfg.dtype)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    if ddp:
        rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
        if dev.startswith('cuda'):
            dev = f'cuda:{local_rank}'
            torch.cuda.set_device(dev)
        be = ('nccl' if dev.startswith('cuda') else 'gloo') if cfg.backend == 'auto' else cfg.backend
        torch.distributed.init_process_group(backend=be)
    else:
        rank, local_rank, world = 0, 0, 1
    master = rank == 0
    device_type = 'cuda' if dev.startswith('cuda') else 'cpu'
    use_compile = device_type == 'cuda' if cfg.compile == 'auto' else cfg.compile
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = (nullcontext() if dt == 'float32'
                else torch.autocast(device_type=device_type, dtype=torch.bfloat16))
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps * world

    folder, meta = find_dataset(cfg, may_prepare=not ddp)
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')

    # ---- model and optimizer ----
    model_keys = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'norm', 'norm_eps',
                  'taper', 'aux_weight')
    model_args = {k: getattr(cfg, k) for k in model_keys}
    model_args['vocab_size'] = meta['vocab_size']
    ckpt = None
    if cfg.init_from == 'resume':
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"--init_from=resume: {ckpt_path} not found; train from scratch first "
                             "or point --out_dir at the run to continue")
        ckpt = torch.load(ckpt_path, map_location=dev, weights_only=True)
        for key in model_keys + ('vocab_size',):
            if ckpt['model_args'][key] != model_args[key]:
                raise SystemExit(f"--init_from=resume: {key}={model_args[key]!r} differs from the "
                                 f"checkpoint's {ckpt['model_args'][key]!r}; use the run's config")
        for key in ('gate_warmup_iters', 'taper_iters', 'seed'):
            if ckpt['config'][key] != getattr(cfg, key):
                raise SystemExit(f"--init_from=resume: {key}={getattr(cfg, key)!r} differs from the "
                                 f"checkpoint's {ckpt['config'][key]!r}; the schedule must not change")
    torch.manual_seed(cfg.seed)  # the initial weights
    model = GPT(GPTConfig(**model_args))
    if ckpt is not None:
        model.load_state_dict(ckpt['model'])
    model.to(dev)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           device_type)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt['optimizer'])
    iter_num = ckpt['iter_num'] if ckpt is not None else 0
    if ckpt is not None and master:
        print(f"resuming {ckpt_path} at iteration {iter_num}")
    del ckpt
    raw_model = model
    fwd_model = torch.compile(model) if use_compile else model

    def wrap(m):
        # broadcast_buffers=False: each rank accumulates its own calibration statistics, and
        # calibration_step() all-reduces them; a broadcast from rank 0 would overwrite them
        return (torch.nn.parallel.DistributedDataParallel(
                    m, device_ids=[local_rank] if device_type == 'cuda' else None, broadcast_buffers=False)
                if ddp else m)

    if master:
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters | taper={cfg.taper} norm={cfg.norm} "
              f"λ={cfg.aux_weight} | device={dev} dtype={dt} compile={use_compile} world={world} | "
              f"{tokens_per_iter:,} tokens/iter")

    def log(record):
        if master:
            with open(os.path.join(cfg.out_dir, 'log.jsonl'), 'a') as f:
                f.write(json.dumps(record) + '\n')

    def checkpoint(it):
        if master:
            save_checkpoint({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                             'model_args': model_args, 'iter_num': it, 'config': vars(cfg),
                             'meta': meta}, ckpt_path)

    @torch.no_grad()
    def estimate_val_loss():
        """Mean cross-entropy over eval_iters fixed random val batches (same batches every time)."""
        collect = raw_model.collect
        raw_model.set_collect(None)  # evaluation never touches the calibration statistics
        fwd_model.eval()
        losses = []
        for k in range(cfg.eval_iters):
            x, y = get_batch(folder, 'val', batch_rng(cfg.seed, 1, k), cfg.batch_size, cfg.block_size, dev)
            with autocast:
                fwd_model(x, y)
            losses.append(raw_model.last_metrics.ce)
        fwd_model.train()
        raw_model.set_collect(collect)
        return torch.stack(losses).mean().item()

    def calibration_forwards():
        """calib_batches forwards of training windows from their own seeded stream (the
        training batches stay as they were), in eval mode, without gradients."""
        for k in range(cfg.calib_batches):
            x, y = get_batch(folder, 'train', batch_rng(cfg.seed, 2, rank, k), cfg.batch_size, cfg.block_size, dev)
            with autocast:
                fwd_model(x, y)

    @torch.no_grad()
    def calibrate_event():
        """SPEC §2–§4: c and s_tgt from the model as it is ('end') or from the warmup's EMAs
        ('ema'), then the branch mismatch ‖L − N‖/‖N‖ per layer on the calibration batches."""
        fwd_model.eval()
        if cfg.calibration == 'end':
            raw_model.set_collect('calibration')
            calibration_forwards()
        event = raw_model.calibrate(cfg.calibration)
        raw_model.set_collect('mismatch')
        calibration_forwards()
        event['mismatch'] = raw_model.branch_mismatch()
        raw_model.set_collect(None)
        fwd_model.train()
        return event

    # ---- training loop ----
    schedule = (cfg.taper, cfg.gate_warmup_iters, cfg.taper_iters)
    train_model = None
    fwd_model.train()
    while iter_num < cfg.max_iters:
        it = iter_num
        phase, gate = get_phase(it, *schedule), get_gate(it, *schedule)
        lr = get_lr(it, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
        if train_model is None or phase != raw_model.phase:
            raw_model.set_phase(phase)   # the compiled model recompiles once, here
            raw_model.set_collect('calibration' if phase == 'warmup' and cfg.calibration == 'ema' else None)
            train_model = wrap(fwd_model)  # DDP must see the parameters this phase trains
        raw_model.set_gate(gate)  # in place: no recompile
        for group in optimizer.param_groups:
            group['lr'] = lr

        record = {}
        if it % cfg.eval_interval == 0 and master:
            record['val_loss'] = estimate_val_loss()
            checkpoint(it)

        # ---- one optimizer step ----
        t0 = time.perf_counter()
        torch.manual_seed(int(np.random.SeedSequence([cfg.seed, it, rank]).generate_state(1)[0]))  # dropout
        sums = torch.zeros(6, device=dev)  # loss, ce, aux, hidden_rms, logit_rms, radial_cos
        for micro in range(cfg.gradient_accumulation_steps):
            if ddp:  # all-reduce gradients on the last micro-step only
                train_model.require_backward_grad_sync = micro == cfg.gradient_accumulation_steps - 1
            x, y = get_batch(folder, 'train', batch_rng(cfg.seed, 0, it, rank, micro),
                             cfg.batch_size, cfg.block_size, dev)
            with autocast:
                _, loss = train_model(x, y)
            m = raw_model.last_metrics
            (loss / cfg.gradient_accumulation_steps).backward()
            sink = raw_model.radial_sink
            sums += torch.stack([loss.detach(), m.ce, m.aux, m.hidden_rms, m.logit_rms, sink.grad]).float()
            sink.grad = None
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in raw_model.parameters() if p.grad is not None],
            cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
        sums /= cfg.gradient_accumulation_steps
        if ddp:
            torch.distributed.all_reduce(sums)  # SUM: gloo has no AVG
            sums /= world
        loss_v, ce_v, aux_v, hidden_v, logit_v, radial_v = sums.tolist()  # the step's one host sync
        if not (math.isfinite(loss_v) and math.isfinite(grad_norm.item())):
            raise SystemExit(f"non-finite loss {loss_v} (grad norm {grad_norm.item()}) at iteration {it}; "
                             f"stopping without saving: {ckpt_path} keeps the last good state")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if phase == 'warmup' and cfg.calibration == 'ema':
            raw_model.calibration_step()
        if device_type == 'cuda':
            torch.cuda.synchronize()
        dt_s = time.perf_counter() - t0

        if it % cfg.log_interval == 0 or record:
            record = dict(iter=it, phase=phase, gate=gate, lr=lr, loss=loss_v, ce=ce_v, aux=aux_v,
                          hidden_rms=hidden_v, logit_rms=logit_v, radial_cos=radial_v, **record)
            if m.final_scale_rms is not None:
                record['final_scale_rms'] = m.final_scale_rms.item()
            record.update(grad_norm=grad_norm.item(), step_ms=1000 * dt_s, tokens_per_s=tokens_per_iter / dt_s)
            log(record)
            if master:
                val = f" | val {record['val_loss']:.4f}" if 'val_loss' in record else ''
                print(f"iter {it:6d} {phase:>8s} g={gate:.4f} | loss {loss_v:.4f} (ce {ce_v:.4f} "
                      f"aux {aux_v:.2e}) | hidden_rms {hidden_v:.3f} logit_rms {logit_v:.3f} | "
                      f"lr {lr:.2e} | {1000 * dt_s:.0f} ms {tokens_per_iter / dt_s:,.0f} tok/s{val}")

        if phase == 'warmup' and it == cfg.gate_warmup_iters - 1:
            event = calibrate_event()
            log({'event': 'calibrate', 'iter': it, **event})
            if master:
                cs, mm = list(event['c'].values()), list(event['mismatch'].values())
                print(f"calibrate ({cfg.calibration}) after iter {it}: c in [{min(cs):.4f}, {max(cs):.4f}], "
                      f"s_tgt {event['s_tgt']:.4f}, branch mismatch ‖L−N‖/‖N‖ in [{min(mm):.3f}, {max(mm):.3f}]")
        iter_num += 1

    # the state after the last step belongs to iteration max_iters: linear, g = 0 when tapering
    raw_model.set_phase(get_phase(iter_num, *schedule))
    raw_model.set_gate(get_gate(iter_num, *schedule))
    checkpoint(iter_num)
    final, final_train = final_losses(raw_model, folder, cfg.seed, cfg.batch_size, cfg.block_size, dev,
                                      autocast, rank, world)
    log({'iter': iter_num, 'phase': raw_model.phase, 'final_val_loss': final, 'final_train_loss': final_train})
    if master:
        print(f"final_val_loss {final:.4f} (whole val split, non-overlapping windows of {cfg.block_size}), "
              f"final_train_loss {final_train:.4f} (as many train windows)")
    if ddp:
        # free the DDP wrapper (its reducer holds the process group) before the group goes, with
        # every rank done: gloo aborted at exit now and then when one rank tore down first
        del train_model
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return raw_model


@torch.no_grad()
def final_losses(model, folder, seed, batch_size, block_size, device, autocast, rank=0, world=1):
    """(final_val_loss, final_train_loss): cross-entropy in nats/token over windows of block_size.

    val: the whole val split in non-overlapping windows, window i covering tokens [i·T, (i+1)·T)
    with targets shifted by one (a tail shorter than a window is dropped). train: as many
    windows as val has, at fixed random starts in the train split (seeded), so the two are
    comparable: train below val is fitting the training text more than the language.
    Under DDP the windows are split over ranks and the sums all-reduced.
    """
    val = np.memmap(os.path.join(folder, 'val.bin'), dtype=np.uint16, mode='r')
    train = np.memmap(os.path.join(folder, 'train.bin'), dtype=np.uint16, mode='r')
    n_windows = (len(val) - 1) // block_size
    train_starts = batch_rng(seed, 3).integers(len(train) - block_size, size=n_windows)
    return (split_loss(model, val, [i * block_size for i in range(n_windows)], batch_size, block_size,
                       device, autocast, rank, world),
            split_loss(model, train, train_starts, batch_size, block_size, device, autocast, rank, world))


def split_loss(model, data, starts, batch_size, block_size, device, autocast, rank, world):
    """Mean cross-entropy of the windows data[s : s + T] → data[s + 1 : s + T + 1], s in starts."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # sum of CE over tokens, tokens
    mine = list(starts[rank::world])
    for k in range(0, len(mine), batch_size):
        ix = mine[k:k + batch_size]
        x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
        with autocast:
            model(x.to(device), y.to(device))
        total += torch.stack([model.last_metrics.ce.double() * y.numel(),
                              torch.tensor(y.numel(), device=device, dtype=torch.float64)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


if __name__ == '__main__':
    main(sys.argv[1:])
