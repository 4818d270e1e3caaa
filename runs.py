"""
The mechanics around one train.py run, kept apart so that train.py shows the method: resume
(the stored configuration and its check), the dataset's checks, the seeded streams batches are
drawn from and the final losses over whole splits, processes and devices (DDP, autocast,
torch.compile), what a long run prints about its time, the run folder (one run per out_dir, its
lock, the log on resume), stopping on a signal, the log itself, and checkpoints (written
atomically, read by one loader, a model built from one). From a user's side they are in
docs/runs.md.
"""

import atexit
import dataclasses
import datetime
import difflib
import errno
import functools
import json
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import warnings
from contextlib import ExitStack, contextmanager, nullcontext
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

try:
    import fcntl  # the out_dir lock; Unix only
except ImportError:
    fcntl = None

from configurator import ConfigError, parse_args, resolve_device, set_tf32
from data.common import compact_vocabulary, disk_full, remove_stale_scratch, replacing
from model import ABSENT_MEANS, GPT, GPTConfig, implied_phase

REPO = os.path.dirname(os.path.abspath(__file__))


# ---- resume ---------------------------------------------------------------------------------

def resume_config(argv, out_dir, defaults, choices, validate, free, kept=()):
    """For --init_from=resume: (configuration, checkpoint). The configuration is the one stored
    in out_dir/ckpt.pt (over the script's defaults, for keys it predates), with argv's config files
    and overrides applied on top and checked by validate; keys outside `free` must keep their
    stored values, else SystemExit listing every difference; SystemExit too for a stored key the
    defaults lack (unknown_keys). An argv that sets schedule_scale is
    resolved from the defaults, as its first run was (the stored step counts are scaled already), but
    for the keys `kept`, which start from their stored values as on the plain path (the model's shape:
    a run from pretrained weights took it from the weights' config, which no argument gives again; the
    free keys argv leaves out, such as device): the command that started a run resumes it."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        raise SystemExit(f"--init_from=resume: {path} not found; train from scratch first "
                         "or point --out_dir at the run to continue")
    ckpt = load_checkpoint(path, 'cpu')
    unknown_keys(path, 'config', ckpt['config'], defaults)  # a newer version's key: never guess what it meant
    absent = {k: v for k, v in CONFIG_ABSENT_MEANS.items() if k in defaults}  # what a key it lacks meant
    stored = {**defaults, **absent, **ckpt['config']}
    try:
        cfg = parse_args(argv, stored, choices)
        if cfg.get('schedule_scale', 1.0) != 1.0:  # given again: it scales the step counts of the files it
            # comes with, not the stored, already scaled ones
            cfg = parse_args(argv, {**defaults, **{k: stored[k] for k in kept}}, choices)
        validate(cfg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}")
    was = lambda k: (f"stored: {ckpt['config'][k]!r}" if k in ckpt['config'] else "not stored: the run predates "
                     "the key" + (f", so it ran as {k}={absent[k]!r}" if k in absent else ""))
    diff = [f"{k}={cfg[k]!r} ({was(k)})" for k in cfg if k not in free and cfg[k] != stored[k]]
    if diff:
        raise SystemExit(f"--init_from=resume: {', '.join(diff)} would change the run in {out_dir}; "
                         f"leave them out to continue it as it was ({resume_command(out_dir, ckpt.get('world', 1))}), "
                         "or start a new run in another --out_dir")
    return SimpleNamespace(**cfg), ckpt


# ---- the dataset ----------------------------------------------------------------------------

def prepare_command(dataset, folder=None):
    """The command that prepares `dataset` into folder, where train.py looks for it (find_dataset's;
    None: data/DATASET, the prepare scripts' default, which needs no --out_dir), for error messages."""
    name, ext = os.path.splitext(os.path.basename(dataset))
    prepared = name if ext else dataset  # --dataset=austen.txt: the folder to prepare is austen, beside it
    default = os.path.join(REPO, 'data', prepared)
    folder = os.path.normpath(os.path.join(os.path.dirname(folder), prepared)) if folder else default
    to = '' if folder == default else f' --out_dir={shlex.quote(folder)}'
    if ext:  # --dataset=austen.txt: a file where a dataset name belongs
        return (f"python data/text/prepare.py --name={name} --input={dataset}{to}   "
                f"(then --dataset={name}: --dataset names a prepared folder, not a text file)")
    if dataset == 'tinystories':
        return f'python data/tinystories/prepare.py{to}'
    if dataset in ('openwebtext', 'pile'):  # streamed from the Hugging Face hub, full GPT-2 vocabulary
        return (f'python data/{dataset}/prepare.py{to}   (offline: python data/{dataset}/prepare.py '
                f'--input=PATH/TO/{dataset}.jsonl{to})')
    from data.mix7.build_corpora import OUT_DIR, RECIPES  # the study's corpora, from package registries
    if dataset in RECIPES:  # a concatenation of the files would split val differently: the recipe
        inputs = ' '.join(f'--input={OUT_DIR}/{name}' for name in RECIPES[dataset])
        held = all(os.path.isfile(os.path.join(REPO, OUT_DIR, name)) for name in RECIPES[dataset])
        build = '' if held else 'python data/mix7/build_corpora.py && '  # it downloads them
        return f'{build}python data/text/prepare.py --name={dataset} {inputs}{to}'
    from data.text.prepare import PUBLIC_CORPORA  # names prepare.py can download
    local = f'python data/text/prepare.py --name={dataset} --input=PATH/TO/{dataset}.txt{to}'
    return (f'python data/text/prepare.py --name={dataset}{to}   (offline: {local})' if dataset in PUBLIC_CORPORA
            else local)


def find_dataset(cfg, may_prepare, cpu_hint=''):
    """Return (dataset folder, meta dict) after check_dataset; prepare TinyStories when it is
    missing. A relative data_dir is relative to the repository (where prepare.py writes), not
    to the working folder. SystemExit with the exact prepare command when the data is missing.
    cpu_hint: for a run on a CPU, the rest of a line on the command that runs it at CPU size
    (train.cpu_hint), added to a failed TinyStories download's message, which Progress never
    gets to say.
    """
    folder = os.path.join(REPO, cfg.data_dir, cfg.dataset)
    if not os.path.exists(os.path.join(folder, 'train.bin')) and cfg.dataset == 'tinystories' and may_prepare:
        from data.tinystories import prepare as tinystories  # downloads; offline it says how to pass files
        print(f"{folder}/train.bin not found: preparing TinyStories first")
        try:
            tinystories.main([f'--out_dir={folder}'])
        except SystemExit as e:
            if cpu_hint and isinstance(e.code, str):  # a 2 GB download for a run sized for a GPU
                raise SystemExit(f"{e.code}\nthis run is on a CPU{cpu_hint}") from None
            raise
    for name in ('train.bin', 'val.bin', 'meta.json'):
        if not os.path.exists(os.path.join(folder, name)):
            guess = misspelled(folder)
            prepare = "otherwise prepare it first" if guess else "Prepare the dataset first"
            raise SystemExit(f"{os.path.join(folder, name)} not found. {guess}{prepare}:\n"
                             f"    {prepare_command(cfg.dataset, folder)}")
    meta = check_dataset(folder, cfg.block_size, prepare_command(cfg.dataset, folder))
    if cfg.init_from not in ('scratch', 'resume') and compact_vocabulary(meta):
        raise SystemExit(f"init_from={cfg.init_from} reads GPT-2's own token ids, but {folder} holds a compact "
                         f"vocabulary of {meta['vocab_size']} ids: prepare it with the full GPT-2 vocabulary "
                         "(--vocab_size=0; data/openwebtext and data/pile always use it)")
    return folder, meta


def misspelled(folder):
    """For a dataset folder that does not exist: 'Did you mean --dataset=NAME (...)? ' naming the prepared
    dataset beside it (a folder with a meta.json) whose name is closest, or '' when none is close."""
    parent, name = os.path.split(os.path.normpath(folder))
    if os.path.exists(folder) or not os.path.isdir(parent):
        return ''
    prepared = [d for d in os.listdir(parent) if os.path.isfile(os.path.join(parent, d, 'meta.json'))]
    close = difflib.get_close_matches(name, prepared, n=1)
    return f"Did you mean --dataset={close[0]} (prepared in {parent})? " if close else ''


def check_dataset(folder, block_size, fix):
    """meta.json of a dataset folder after checking it and both .bin files: readable JSON with
    an integer vocab_size, a whole number of uint16 tokens, as many as meta.json's tokens[split]
    where it has them, at least block_size + 1, every id below vocab_size. SystemExit naming the
    file and the fix otherwise. The dict returned always holds tokens (each split's count, measured),
    which a hand-made meta.json may lack: a checkpoint keeps this dict, and check_same_data needs
    the counts to tell other files of the same vocabulary from the run's."""
    path = os.path.join(folder, 'meta.json')
    try:
        with open(path) as f:
            meta = json.load(f)
        vocab_size, tokens = meta['vocab_size'], meta.get('tokens') or {}  # a hand-made one may lack tokens
        assert isinstance(vocab_size, int) and vocab_size > 0
        assert isinstance(tokens, dict) and all(type(n) is int for n in tokens.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise SystemExit(f"{path} is not a readable dataset description (JSON with an integer vocab_size, and "
                         f"integer token counts if it has any); prepare the dataset again: {fix}") from None
    measured = {}
    for split in ('train', 'val'):
        path = os.path.join(folder, f'{split}.bin')
        if not os.path.isfile(path):  # a folder: np.memmap's IsADirectoryError below
            raise SystemExit(f"{path} is not a file; prepare the dataset again: {fix}")
        size = os.path.getsize(path)
        if size % 2:
            raise SystemExit(f"{path} holds {size} bytes, not a whole number of uint16 tokens (truncated?); "
                             f"prepare the dataset again: {fix}")
        counted = measured[split] = size // 2
        written = tokens.get(split)  # by data/common.py
        if written is not None and counted != written:  # e.g. the same ids rewritten as uint32: 0 between every two
            raise SystemExit(f"{path} holds {counted:,} uint16 tokens, but meta.json says {written:,} (rewritten in "
                             f"another dtype, or files from two preparations?); prepare the dataset again: {fix}")
        if counted < block_size + 1:  # one window: block_size inputs and their block_size targets
            raise SystemExit(f"{path} has {counted} tokens, fewer than block_size + 1 = {block_size + 1} (one "
                             f"window); use a smaller --block_size or more data")
        try:
            data = np.memmap(path, dtype=np.uint16, mode='r')
            top = max(int(data[i:i + (1 << 24)].max()) for i in range(0, len(data), 1 << 24))
        except OSError as e:  # no read permission, an I/O error
            raise SystemExit(f"{path} cannot be read ({e.strerror or e}); fix its permissions, or prepare the "
                             f"dataset again: {fix}") from None
        if top >= vocab_size:
            raise SystemExit(f"{path} holds token id {top}, outside meta.json's vocab_size {vocab_size} "
                             f"(files from two preparations?); prepare the dataset again: {fix}")
    return {**meta, 'tokens': measured}


def data_identity(meta):
    """A prepared dataset's meta.json (dict) less its 'sources': what makes two preparations the
    same data. The sources are the input files' paths, which say where the text was, not what it
    was, so the same corpus prepared from another folder matches."""
    return {k: v for k, v in meta.items() if k != 'sources'}


def check_same_data(ckpt, folder, meta):
    """For a resume from the checkpoint dict ckpt: SystemExit unless `meta` (folder's meta.json) is
    the checkpoint's `meta` (data_identity): another dataset at the same vocab_size would give the
    run's ids other tokens. The message names the keys that differ and the folder the run trained
    on. ckpt None (a run from scratch) or without a meta passes: there is nothing to compare with."""
    if ckpt is None or ckpt.get('meta') is None:
        return
    now, was = data_identity(meta), data_identity(ckpt['meta'])
    if 'tokens' not in was:  # a checkpoint from before check_dataset counted a hand-made meta.json's tokens
        now.pop('tokens', None)
    if now == was:
        return
    absent = object()  # a key one of the two lacks

    def short(v):
        return 'absent' if v is absent else repr(v) if len(repr(v)) <= 60 else f'a {type(v).__name__}'

    def differs(k):
        a, b = now.get(k, absent), was.get(k, absent)
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return f"{k} ({sum(x != y for x, y in zip(a, b)):,} of {len(a):,} differ)"
        return f"{k} ({short(a)} here, {short(b)} in the run's)"

    diff = '; '.join(differs(k) for k in sorted(now.keys() | was.keys()) if now.get(k, absent) != was.get(k, absent))
    run = ckpt.get('config') or {}
    trained = os.path.join(REPO, run.get('data_dir', 'data'), run.get('dataset', '?'))
    where = ('was prepared again since the run trained on it' if os.path.abspath(trained) == os.path.abspath(folder)
             else f'is not the dataset the run trained on ({trained})')
    raise SystemExit(f"--init_from=resume: {folder} {where}: its meta.json differs in {diff}; resume on the run's "
                     "data (--data_dir), or train on this dataset in a new --out_dir")


# ---- seeded streams of windows, and the final losses over whole splits ---------------------------

def batch_rng(seed, *stream):
    """A numpy Generator determined by (seed, *stream): batches depend on nothing else.
    Streams: (0, it, rank, micro) training, (1, k) evaluation, (2, rank, k) calibration,
    (3,) the final training-loss windows, (4,) the order of sampler='epoch'."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


# the split files of the runs alive in this process, by path (read_dataset): tokens() maps these
_OPEN_SPLITS = {}


@contextmanager
def read_dataset(folder):
    """Within it, tokens(folder, split) maps the train.bin and val.bin that were there when it
    began, open until it ends. prepare.py writes a new file and renames it over the old one
    (data.common), and an open file keeps the old one: a dataset prepared again while a run
    trains changes nothing the run reads, its last steps and final losses included. Run holds it
    for the whole run. OSError (FileNotFoundError) for a split that cannot be opened: find_dataset
    has checked both before."""
    files = {}
    try:
        for split in ('train', 'val'):
            path = os.path.join(folder, f'{split}.bin')
            files[path] = open(path, 'rb')
        _OPEN_SPLITS.update(files)
        yield
    finally:
        for path, f in files.items():
            if _OPEN_SPLITS.get(path) is f:
                del _OPEN_SPLITS[path]
            f.close()


def tokens(folder, split):
    """The token ids of folder/split.bin, a uint16 np.memmap (n,): of the file read_dataset opened
    while a run holds it, else of the path. Mapped anew at each call: a long-lived np.memmap grows
    the process's resident memory."""
    path = os.path.join(folder, f'{split}.bin')
    return np.memmap(_OPEN_SPLITS.get(path, path), dtype=np.uint16, mode='r')


def windows(data, starts, block_size, device):
    """x, y (len(starts), T) int64 on device: data[s : s + T] and the same shifted by one token."""
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in starts]).astype(np.int64))
    if device.startswith('cuda'):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


@torch.no_grad()
def final_losses(model, folder, cfg, env):
    """(final_val_loss, final_train_loss): cross-entropy in nats/token over windows of block_size.

    val: the whole val split in non-overlapping windows, window i covering tokens [i·T, (i+1)·T)
    with targets shifted by one (a tail shorter than a window is dropped). train: as many
    windows as val has, at fixed random starts in the train split (seeded), so the two are
    comparable: train below val is fitting the training text more than the language.
    Under DDP the windows are split over ranks and the sums all-reduced.
    """
    T = cfg.block_size
    val, train = tokens(folder, 'val'), tokens(folder, 'train')
    n_windows = (len(val) - 1) // T
    train_starts = batch_rng(cfg.seed, 3).integers(len(train) - T, size=n_windows)
    return tuple(mean_ce(model, data, starts, cfg.batch_size, T, env, f'final {split} loss')
                 for split, data, starts in (('val', val, [i * T for i in range(n_windows)]),
                                             ('train', train, train_starts)))


def mean_ce(model, data, starts, batch_size, block_size, env, desc='windows'):
    """Mean cross-entropy of the windows at `starts` (see windows), this rank's share; a tqdm bar
    named desc on a terminal."""
    was_training = model.training
    model.eval()
    mine = list(starts[env.rank::env.world])
    ces, counts = [], []  # each batch's mean CE stays on the device: one transfer at the end, no sync per batch
    try:
        for k in tqdm(range(0, len(mine), batch_size), desc=desc, leave=False, disable=None if env.master else True):
            x, y = windows(data, mine[k:k + batch_size], block_size, env.dev)
            with env.autocast:
                model(x, y)
            ces.append(model.last_metrics.ce.detach().float())
            counts.append(y.numel())
    finally:  # also when a signal cuts the work short (StopSignal.cut_short)
        model.train(was_training)
    # the sum over many batches needs float64, which MPS (Apple silicon) lacks: it is made on the host
    total = torch.zeros(2, dtype=torch.float64)  # sum of CE over tokens, tokens
    total[1] = len(mine) * block_size
    if ces:
        total[0] = torch.stack(ces).cpu().double() @ torch.tensor(counts, dtype=torch.float64)
    if env.ddp:  # NCCL reduces only device tensors (CUDA has float64); gloo, the only backend off CUDA, host ones
        # copy=True: the reduced sums are read from the device copy alone, even where dev is the host
        shared = total.to(env.dev, copy=True) if torch.distributed.get_backend() == 'nccl' else total
        torch.distributed.all_reduce(shared)
        total = shared.cpu()
    return (total[0] / total[1]).item()


# ---- progress: what a long run prints before its first log line ------------------------------

CPU_LONG_S = 3600  # a run estimated at more than this on a CPU gets one line that says so, with a shorter command


def count_multiples(a, b, n):
    """How many multiples of n lie in [a, b) (iterations with an evaluation, for n = eval_interval)."""
    return (b - 1) // n - (a - 1) // n


def duration(seconds):
    """seconds as a user reads them: '45 s', '26 min', '38 h 20 min'."""
    if seconds < 90:
        return f'{seconds:.0f} s'
    if seconds < 90 * 60:
        return f'{seconds / 60:.0f} min'
    hours, minutes = divmod(round(seconds / 60), 60)
    return f'{hours} h {minutes} min'


def clock(seconds):
    """seconds as a clock reads, for a line printed often: '0:07', '4:05', '1:02:09'."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f'{hours}:{minutes:02d}:{secs:02d}' if hours else f'{minutes}:{secs:02d}'


class Progress:
    """The time a run has left, estimated from its own timings and printed by rank 0: first from
    the first evaluation batch it times (a training step taken as STEP_FORWARDS forward batches per
    micro-batch: a backward pass costs about two forwards), a first-batch figure that its line says
    runs high (1.3-2.1x where measured), then once more after its first FIRST_STEPS training steps
    (within 5 % where measured). On a CPU, an estimate above CPU_LONG_S also prints one line that
    says so, with `hint` (a shorter command, from train.py) when there is one. Each logged step's
    line ends with status(): the share done, the time elapsed and the time left.

    folder: the dataset folder (its val split sets the final losses' batches, runs.final_losses)."""

    STEP_FORWARDS = 3
    FIRST_STEPS = 3  # the first is not used: it builds the optimizer's state (and compiles)

    def __init__(self, cfg, env, folder, hint=''):
        self.cfg, self.env, self.hint = cfg, env, hint
        windows = (os.path.getsize(os.path.join(folder, 'val.bin')) // 2 - 1) // cfg.block_size
        per_rank = -(-windows // env.world)
        self.final_batches = 2 * -(-per_rank // cfg.batch_size)  # val, and as many train windows
        self.batch_s, self.step_s, self.warned = None, [], False
        self.start, self.steps, self.later_s = time.perf_counter(), 0, 0.0  # later_s: the steps after the first

    def forward_batches_left(self, it):
        """Forward passes of one batch still ahead before iteration it runs: the evaluations from
        it on, the calibrate event if it is ahead ('end' measures on its batches, then both
        modes measure the branch mismatch), the final losses."""
        c = self.cfg
        return (count_multiples(it, c.max_iters, c.eval_interval) * c.eval_iters + self.final_batches
                + (c.calib_batches * (2 if c.calibration == 'end' else 1) if self.calibrates(it) else 0))

    def calibrates(self, it):
        """Whether the calibrate event is still ahead of iteration it (not for a resume past it)."""
        return self.cfg.taper != 'none' and it < self.cfg.gate_warmup_iters

    def evaluation_batch(self, it, seconds):
        """The first batch of the evaluation at iteration it took `seconds`: the first estimate,
        unless training steps have given one."""
        if self.batch_s is None:
            self.batch_s = seconds
            if not self.step_s:
                step_s = self.STEP_FORWARDS * self.cfg.gradient_accumulation_steps * seconds
                self.report(self.cfg.max_iters - it, step_s, self.forward_batches_left(it) - 1, seconds, it,
                            f'from the first evaluation batch alone (a first-batch figure, often high; a second '
                            f'estimate follows after {self.FIRST_STEPS} steps)')

    def step(self, it, seconds):
        """Training step it took `seconds` (evaluation excluded)."""
        self.steps += 1
        if self.steps > 1:
            self.later_s += seconds
        if self.steps <= self.FIRST_STEPS:
            self.step_s.append(seconds)
        if self.steps == self.FIRST_STEPS:
            step_s = sum(self.step_s[1:]) / (self.FIRST_STEPS - 1)
            batch_s = self.batch_s or step_s / (self.STEP_FORWARDS * self.cfg.gradient_accumulation_steps)
            self.report(self.cfg.max_iters - it - 1, step_s, self.forward_batches_left(it + 1), batch_s, it + 1,
                        f'from iterations {it + 2 - self.FIRST_STEPS}–{it}')

    def left(self, it):
        """Seconds left before iteration it runs: its steps at the mean of this process's steps after
        the first (on CUDA only the logged steps wait for the device, so the mean is right at them), its
        forward batches (forward_batches_left) at the first evaluation batch's time; each estimated from
        the other while only one is known. None before either is."""
        per_step = self.STEP_FORWARDS * self.cfg.gradient_accumulation_steps  # forward batches a step costs
        step_s = self.later_s / (self.steps - 1) if self.steps > 1 else None
        if step_s is None and self.batch_s is None:
            return None
        batch_s = self.batch_s if self.batch_s is not None else step_s / per_step
        step_s = step_s if step_s is not None else per_step * batch_s
        return (self.cfg.max_iters - it) * step_s + self.forward_batches_left(it) * batch_s

    def status(self, it):
        """After training step it, for its log line: '12% 0:41 elapsed, 6:02 left' (the iterations done of
        max_iters, rounded down: 100 % is the last step; elapsed: since this process began the run;
        left: left(it + 1), omitted while unknown)."""
        done = f"{100 * (it + 1) // self.cfg.max_iters}% {clock(time.perf_counter() - self.start)} elapsed"
        left = self.left(it + 1)
        return done if left is None else f"{done}, {clock(left)} left"

    def report(self, steps, step_s, batches, batch_s, it, source):
        """Print the estimate: steps and batches (forward_batches_left(it)) at their times."""
        if not self.env.master:
            return
        left = steps * step_s + batches * batch_s
        kinds = 'evaluations, calibration, final losses' if self.calibrates(it) else 'evaluations, final losses'
        print(f"estimate: {duration(left)} left: {steps:,} steps at {step_s:.3g} s and {batches:,} forward batches "
              f"({kinds}) at {batch_s:.3g} s, {source}", flush=True)
        if self.env.device_type == 'cpu' and left > CPU_LONG_S and not self.warned:
            self.warned = True
            print(f"this run takes about {duration(left)} on this CPU{self.hint}", flush=True)


# ---- processes and devices ------------------------------------------------------------------

# How long a DDP rank waits in a collective for the others before the run fails (NCCL's watchdog
# aborts it; gloo raises). The longest wait by design: while rank 0 alone evaluates (eval_iters
# batches, the first time after compiling the evaluation's graph) and writes the checkpoint, every
# other rank waits in the step's gradient all-reduce. At iteration 0 that is a cold compile plus an
# evaluation, which on a large model can near NCCL's default of 10 minutes; 30 minutes (gloo's
# default) leaves room, and a longer wait is a hang (a rank died or went its own way). One value
# for the whole run: torch 2.13 has no public way to change an existing group's timeout (only
# the private distributed_c10d._set_pg_timeout), so it is not lowered after the first step.
DDP_TIMEOUT = datetime.timedelta(minutes=30)


def setup(cfg):
    """Devices, DDP (when launched by torchrun; its process group waits DDP_TIMEOUT in a collective),
    TF32 and autocast: a SimpleNamespace with dev (a CUDA device with its index, made current),
    dtype, tf32 (configurator.set_tf32), device_type, ddp, rank, local_rank, world, master,
    autocast, compile."""
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp and (missing := [k for k in ('LOCAL_RANK', 'WORLD_SIZE') if k not in os.environ]):
        # a launcher (or a shell's leftover export) set RANK without torchrun's other variables
        raise SystemExit(f"RANK={os.environ['RANK']} is set but {' and '.join(missing)} not: a distributed run "
                         "starts with torchrun (which sets all three); for one process, unset RANK")
    rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
    dev, dt = resolve_device(cfg.device, cfg.dtype, local_rank if ddp else None)
    device_type = torch.device(dev).type
    if device_type == 'cuda':
        torch.cuda.set_device(dev)  # torch.cuda.synchronize() and NCCL then use this device
    if ddp:
        be = ('nccl' if device_type == 'cuda' else 'gloo') if cfg.backend == 'auto' else cfg.backend
        if be == 'nccl' and device_type != 'cuda':  # NCCL's own error: a traceback from every rank
            raise SystemExit(f"config error: backend='nccl' reduces CUDA tensors, but this run is on {dev}: "
                             "use --backend=gloo (or auto, which picks it off CUDA)")
        torch.distributed.init_process_group(backend=be, timeout=DDP_TIMEOUT)
        atexit.register(leave_gloo_group)
    tf32 = set_tf32(dev, dt)
    autocast = nullcontext() if dt == 'float32' else torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return SimpleNamespace(dev=dev, dtype=dt, tf32=tf32, device_type=device_type, ddp=ddp, rank=rank,
                           local_rank=local_rank, world=world, master=rank == 0, autocast=autocast,
                           compile=device_type == 'cuda' if cfg.compile == 'auto' else cfg.compile)


def sync(device_type):
    """Wait for the device's queued work (CUDA, MPS: both run asynchronously), so that a host clock
    read after it counts that work; a no-op on the CPU."""
    if device_type in ('cuda', 'mps'):
        getattr(torch, device_type).synchronize()


# versions of GPT.forward one run compiles: a tapered run 8 (training and evaluation in each of
# three phases, plus the calibrate event's two collect modes), FakeLN 10 (five stages, each in
# training and evaluation mode). dynamo's default limit is 8; past it a function silently runs
# uncompiled, so the limit gets room to spare.
RECOMPILE_LIMIT = 32


def compile_model(model):
    """torch.compile(model), with dynamo's recompile limit raised to RECOMPILE_LIMIT (never lowered)."""
    import torch._dynamo.config as dynamo_config
    name = 'recompile_limit' if hasattr(dynamo_config, 'recompile_limit') else 'cache_size_limit'  # torch < 2.6
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
    return torch.compile(model)


# the Work of each run's final barrier, kept to the end of the process (end_processes says why)
FINAL_BARRIERS = []


def end_processes(env):
    """Under DDP, with every rank here (a run that ended, or stopped at a point its ranks agreed
    on): a barrier, then the process group goes. A rank that exits with its process group alive,
    or before the others are done, aborts now and then at exit ("terminate called without an
    active exception", SIGABRT): gloo's threads outlive the interpreter.

    The barrier's Work is kept (FINAL_BARRIERS), not dropped when barrier() returns. It holds the
    run's last collectives, whose tensors are Python's. Dropped, its last reference could be the
    gloo worker thread's, which frees it a moment after the wait ends, holding the group's work
    lock and needing the GIL to free those tensors. If the main thread meanwhile frees the group
    (DDP's reducer holds it, and goes when train.main returns), it holds the GIL and waits for
    that lock: a deadlock, the rank hangs at its end (once in about 20 runs on 2 cores)."""
    if env.ddp:
        work = torch.distributed.barrier(async_op=True, device_ids=[env.local_rank] if env.device_type == 'cuda' else None)
        work.wait()
        FINAL_BARRIERS.append(work)
        torch.distributed.destroy_process_group()


def leave_gloo_group():
    """At exit (atexit, registered by setup under DDP): a gloo process group still alive goes, so that
    its threads do not outlive the interpreter, where they abort the rank now and then ("terminate
    called without an active exception", SIGABRT; pytorch/pytorch#190489). It is alive after a config
    error every rank raised before `with run` (check_one_pass, a vocab mismatch, check_same_world) and
    after an error raised inside it (Run ends the group only for an end its ranks agreed on). gloo's
    teardown is this rank's alone; NCCL's flushes with the other ranks (a hang if one is gone), so an
    NCCL group is left to PyTorch's own exit."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == 'gloo':
        torch.distributed.destroy_process_group()


def wrap_ddp(model, env):
    """model under DDP when launched by torchrun, else model itself. broadcast_buffers=False:
    the calibration statistics are each rank's own until the model all-reduces them.

    A compiled model goes in compiled (DDP of torch.compile(model)), the order PyTorch's "Where to
    apply torch.compile?" recommends: its forward runs inside DDP's, so dynamo's DDPOptimizer splits
    the graph at DDP's gradient buckets and each bucket's all-reduce overlaps the rest of the backward.
    torch.compile(DDP(model)) makes dynamo trace DDP's own Python, which breaks its graph (torch 2.13)."""
    if not env.ddp:
        return model
    with warnings.catch_warnings():
        # torch >= 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still syncs the
        # buffers when DDP wraps the model; this runs at every phase change, after calibration,
        # where the buffers are the model's own sums: keep broadcast_buffers=False, without the warning
        warnings.filterwarnings('ignore', message='`broadcast_buffers` is deprecated', category=FutureWarning)
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[env.local_rank] if env.device_type == 'cuda' else None, broadcast_buffers=False)


# ---- the run folder, signals, the log ---------------------------------------------------------

# the temp files a run folder's writes went through before each writer had its own (PID-N.NAME.tmp,
# data.common.temporary_name): a run killed mid-write by an older version left these
TEMP_FILES = ('ckpt.pt.tmp', 'log.jsonl.tmp')


def check_writable(folder, arg):
    """SystemExit with one line unless this process can create files in folder, made if missing
    (a read-only filesystem, another user's folder). arg: the argument that named it ('--out_dir')."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # a file with no name: nothing is left behind
            pass
    except OSError as e:
        raise SystemExit(f"cannot write in {folder} ({e.strerror}): choose another {arg}") from None


# Filesystems that keep no flock locks: Lustre mounted without -o flock (ENOSYS), NFS without its
# lock daemon (ENOLCK), some FUSE mounts (EOPNOTSUPP). A run there goes on unlocked, and says so.
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)  # the last two differ on macOS
_unlocked = set()  # the filesystems (st_dev) already warned about


def take_lock(f, wait=False):
    """Take an exclusive flock on the open file f, held until f is closed (or its process ends).
    Returns False when another process holds it (wait=False; wait=True blocks until it is free),
    else True. Where nothing can be locked (no fcntl: Windows; a filesystem in NO_LOCKS) it returns
    True, having warned on stderr, once per filesystem, that nothing keeps a second process out of f's folder.
    Other OSErrors propagate."""
    folder = os.path.dirname(os.path.abspath(f.name))
    if fcntl is None:
        what = "this system cannot lock files (no fcntl: Windows)"
    else:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in NO_LOCKS:
                raise
            what = f"{folder} is on a filesystem that cannot lock files ({e.strerror})"
    device = os.stat(folder).st_dev
    if device not in _unlocked:  # a study's cells: one warning, not one per cell
        _unlocked.add(device)
        print(f"warning: {what}: nothing keeps two processes from writing in {folder} at the same time",
              file=sys.stderr, flush=True)
    return True


def claim_out_dir(cfg, iter_num):
    """Make out_dir this process's run before anything is written to it. Returns the open lock
    file (keep it open: the lock lasts as long as this process, so a run killed with kill -9
    leaves nothing that blocks its resume); stale TEMP_FILES (a process killed mid-write) go.
    SystemExit when out_dir cannot be written (check_writable), another train.py holds it, or
    a new run (from scratch or pretrained weights) meets a used out_dir without --overwrite=True. On resume the log keeps only
    the records before iter_num, so it reads as one uninterrupted run."""
    check_writable(cfg.out_dir, '--out_dir')
    lock = open(os.path.join(cfg.out_dir, '.lock'), 'a')
    if not take_lock(lock):
        raise SystemExit(f"{cfg.out_dir} is in use by another train.py run; wait for it to end "
                         "or choose another --out_dir")
    remove_stale_scratch(cfg.out_dir)  # a process killed while writing left its temp files; the folder is ours now
    for name in TEMP_FILES:
        if os.path.exists(os.path.join(cfg.out_dir, name)):
            os.remove(os.path.join(cfg.out_dir, name))
    log_path = os.path.join(cfg.out_dir, 'log.jsonl')
    used = [p for p in (os.path.join(cfg.out_dir, 'ckpt.pt'), log_path) if os.path.exists(p)]
    if cfg.init_from != 'resume' and used:  # a fine-tune restarted by mistake would replace its checkpoint too
        if not cfg.overwrite:
            raise SystemExit(f"{cfg.out_dir} already holds a run ({', '.join(map(os.path.basename, used))}): "
                             f"continue it with --init_from=resume, choose another --out_dir, or replace "
                             f"it with --overwrite=True")
        for path in used:
            os.remove(path)
    if cfg.init_from == 'resume' and os.path.exists(log_path):
        kept = [r for r in read_log(cfg.out_dir) if r['iter'] < iter_num]  # a torn last line goes too
        try:
            with replacing(log_path) as tmp, open(tmp, 'w') as f:
                f.writelines(json.dumps(r) + '\n' for r in kept)
        except OSError as e:  # before `with run`, whose exit says this for a full disk later on
            if (full := disk_full(e)) is None:
                raise
            raise SystemExit(f"a filesystem is full ({full.strerror}): the resume could not rewrite "
                             f"{log_path}, and left the run as it was; free space there, then run the same "
                             "command") from None
    return lock


def claim_on_every_rank(cfg, env, iter_num):
    """Rank 0's claim_out_dir (the lock file; None on other ranks), agreed on by every rank: under DDP
    an all-reduce, so that when rank 0 refuses the folder every rank stops here, the others
    silently (exit 1), where they went on into DDP's first collective and failed there in a
    traceback."""
    refusal, lock = None, None
    if env.master:
        try:
            lock = claim_out_dir(cfg, iter_num)
        except BaseException as e:  # an OSError too: the other ranks wait in the all-reduce below
            refusal = e
    if env.ddp:
        flag = torch.tensor([float(refusal is not None)], device=env.dev)
        torch.distributed.all_reduce(flag)
        if flag.item():
            end_processes(env)  # together: a rank that leaves its group alone aborts now and then
            if refusal is None:
                raise SystemExit(1)  # rank 0 says why
    if refusal is not None:
        raise refusal
    return lock


def resume_command(out_dir, world):
    """The command that resumes the run in out_dir, launched as it was: python for one process,
    torchrun for `world` processes (a run resumes on the number it was trained on); quoted for a
    POSIX shell where out_dir needs it (a space)."""
    launch = 'python train.py' if world == 1 else f'torchrun --standalone --nproc_per_node={world} train.py'
    return f"{launch} --init_from=resume {shlex.quote(f'--out_dir={out_dir}')}"


# how train.py's end at a non-finite loss or gradient norm begins ("DIVERGED at iteration N (loss ...")):
# study.py reads it from a run's output to record the cell as diverged at N
DIVERGED = 'non-finite loss or gradient'


class Stopped(SystemExit):
    """An end of the run that every rank reaches at the same point: Run.stop's (a signal, exit
    128 + its number, where Run's contract says) or a non-finite loss or gradient norm (train.py,
    DIVERGED: the step's all-reduce shows it to every rank). Leaving the Run, the ranks end their
    processes together (end_processes), as at a finished run."""


class Cut(BaseException):
    """Raised inside StopSignal.cut_short's work by the first signal: the work is abandoned. A
    BaseException, as KeyboardInterrupt is: the signal can land inside library code that catches
    Exception (tqdm starting its monitor thread warns and goes on), which must not swallow it."""


def say(line):
    """line on stderr at once, from a signal handler too: os.write, so a handler that interrupts
    a print (or a tqdm bar) never meets a buffered writer in use. Lost where stderr's reader is gone."""
    try:
        os.write(2, (line + '\n').encode())
    except OSError:  # EPIPE, EIO: nobody reads it any more, and the run's stop must go on
        pass


# the signals that stop a run: Ctrl-C, kill / `timeout` / a batch scheduler, and a closed terminal or
# a dropped ssh session (SIGHUP; not where it is ignored: under nohup the run goes on)
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, 'SIGHUP', None)) if s is not None)
# the stop recorded when the reader of the run's output ends (`| head`, the tee of a closed terminal):
# Python ignores SIGPIPE itself, so the write fails (OutputGuard)
OUTPUT_CLOSED = getattr(signal, 'SIGPIPE', signal.SIGTERM)


def stop_handlers(handle):
    """Set handle for each of STOP_SIGNALS, a SIGHUP ignored on entry (nohup) left ignored; returns
    {signal: the handler it replaced}, for the caller to put back. In the main thread only, where
    Python allows handlers: elsewhere nothing is set and {} returned."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handle) for s in STOP_SIGNALS
            if s in (signal.SIGINT, signal.SIGTERM) or signal.getsignal(s) != signal.SIG_IGN}


def exit_code(signum):
    """The exit status of a run stopped by signum, the shell's 128 + N: 130 SIGINT, 143 SIGTERM,
    129 SIGHUP, 141 SIGPIPE (its output closed)."""
    return 128 + signum


class OutputGuard:
    """sys.stdout or sys.stderr inside a StopSignal. A write that finds its reader gone (EPIPE: the
    reader of a pipe ended; EIO: a terminal hung up) sends the stream's later output to os.devnull
    and calls closed(), which stops the run as a signal does, instead of raising a BrokenPipeError
    from whichever print met it and losing the steps since the last checkpoint."""

    def __init__(self, stream, closed):
        self.stream, self.closed = stream, closed

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            self.lost(e)
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError as e:
            self.lost(e)

    def lost(self, e):
        if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
            e.filename = e.filename or getattr(self.stream, 'name', None)  # a full disk under a redirect: '<stdout>'
            raise e
        try:  # the stream's buffer and the interpreter's flush at exit go nowhere, quietly
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError):  # a stream with no descriptor
            pass
        self.closed()


class StopSignal:
    """A context in which SIGINT, SIGTERM and SIGHUP (STOP_SIGNALS: Ctrl-C, `timeout`, a batch
    scheduler, a closed terminal) stop the run, and so does the end of the reader of its output
    (OUTPUT_CLOSED, recorded as SIGPIPE: OutputGuard guards sys.stdout and sys.stderr). A SIGHUP
    ignored on entry (nohup) stays ignored.

    The first signal says at once, on stderr, what will happen: work run through `cut_short`
    (an evaluation, the final losses) is abandoned on the spot; anything else (`doing`: a
    training step, the calibrate event, a checkpoint being written) finishes, then the loop saves
    and stops (a closed output cuts nothing: the work it interrupted goes on). `received` is that
    signal. A second signal ends the process at once without saving (exit_code: 130, 143, 129),
    in one line: out_dir/ckpt.pt keeps the last checkpoint written. The same signal again within
    REPEAT_S is not a second one but one event sent twice (a terminal's process group and a
    launcher that passes it on: torchrun, study.py, a tool that signals every process of a job);
    nor is a closed output (a first signal after it says its line, as first). `talk`: whether this
    process prints (rank 0 under DDP). A run's stop is built on it (Run)."""

    REPEAT_S = 1.0  # seconds within which the same signal again is the same event

    def __init__(self, talk=True, doing='the step in progress'):
        self.talk, self.received, self.previous = talk, None, {}
        self.first = self.first_at = None  # the first signal (not a closed output) and its time.monotonic()
        self.doing, self.cuttable = doing, False  # doing: text, or a function giving it when a signal lands

    def __enter__(self):
        self.previous = stop_handlers(self.handle)
        self.streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = (OutputGuard(stream, self.output_closed) for stream in self.streams)
        return self

    def output_closed(self):
        """OutputGuard's call: the reader of stdout or stderr has ended; the run stops as at a signal."""
        if self.received is None:
            self.received = OUTPUT_CLOSED
            if self.talk:
                doing = self.doing() if callable(self.doing) else self.doing
                say(f"the output's reader has ended (a broken pipe, a closed terminal): finishing {doing}, "
                    f"then saving and stopping")

    def handle(self, signum, frame):
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.first is not None:
            if signum == self.first and now - self.first_at < self.REPEAT_S:  # the first one, delivered twice
                if self.talk:
                    say(f"{name} again within {self.REPEAT_S:g} s: taken as the same one (once more stops at once)")
                return
            if self.talk:
                say(f"second {name}: stopped at once, without saving; the run folder keeps its last checkpoint")
            os._exit(exit_code(signum))  # no cleanup: nothing may delay it
        self.first, self.first_at = signum, now
        self.received = signum  # over a closed output's: the run stops for this signal now
        if self.talk:
            doing = self.doing() if callable(self.doing) else self.doing
            say(f"{name}: {'cutting ' + doing + ' short' if self.cuttable else 'finishing ' + doing}, "
                f"then saving and stopping (Ctrl-C again stops at once, without saving)")
        if self.cuttable:
            raise Cut

    def cut_short(self, doing, work, *args):
        """(work(*args), False), or (None, True) when a signal arrived before or during it: then
        the work is abandoned at once, wherever it is (it must be work whose result the run can
        do without, and that leaves the model as it found it, e.g. through try/finally). Afterwards
        `doing` is what it was before."""
        before = self.doing
        try:
            try:
                self.doing, self.cuttable = doing, True
                if self.received is None:
                    return work(*args), False
            finally:
                self.doing, self.cuttable = before, False
        except Cut:
            pass
        return None, True

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        sys.stdout, sys.stderr = self.streams


def out_of_memory(e):
    """Whether exception e is an allocator's refusal: CUDA's OutOfMemoryError, or the plain
    RuntimeError of the CPU allocator ("can't allocate memory") and of backends that say "out of
    memory" (MPS; inductor's wrappers keep the message)."""
    # torch.cuda.OutOfMemoryError: torch 2.4 has only this name; from 2.5 it is torch.OutOfMemoryError itself
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or (  # MemoryError: numpy's (a batch's array)
        isinstance(e, RuntimeError) and ('out of memory' in str(e) or 'allocate memory' in str(e)))


def log(record, cfg, env, progress=''):
    """Append one record to out_dir/log.jsonl (rank 0) and print the step records, a step's line
    ending with `progress` (Progress.status) when given."""
    if not env.master:
        return
    path = os.path.join(cfg.out_dir, 'log.jsonl')
    try:
        with open(path, 'a') as f:
            f.write(json.dumps(record) + '\n')
    except OSError as e:  # a full disk's, say: an error at close names no file (Run's exit says which)
        e.filename = e.filename or path
        raise
    r = record
    if r.get('event') == 'fakeln':
        stds = list(r['std'].values())
        print(f"fakeln after iter {r['iter']}: removed {r['removed']}, fixed std in [{min(stds):.4f}, "
              f"{max(stds):.4f}]{'' if r['removed'] == 'first_position' else ' (position 0: its own)'}")
    elif r.get('event') == 'calibrate':
        cs, mm = list(r['c'].values()), list(r['mismatch'].values())
        print(f"calibrate ({cfg.calibration}) after iter {r['iter']}: c in [{min(cs):.4f}, {max(cs):.4f}], "
              f"s_tgt {r['s_tgt']:.4f}, branch mismatch ‖L−N‖/‖N‖ in [{min(mm):.3f}, {max(mm):.3f}]")
    elif 'loss' in r:
        val = f" | val {r['val_loss']:.4f}" if 'val_loss' in r else ''
        print(f"iter {r['iter']:6d} {r['phase']:>8s} g={r['gate']:.4f} | loss {r['loss']:.4f} (ce {r['ce']:.4f} "
              f"aux {r['aux']:.2e}) | hidden_rms {r['hidden_rms']:.3f} logit_rms {r['logit_rms']:.3f} | "
              f"lr {r['lr']:.2e} | {r['step_ms']:.0f} ms {r['tokens_per_s']:,.0f} tok/s{val}"
              f"{' | ' + progress if progress else ''}")
    elif 'final_val_loss' in r:
        print(f"final_val_loss {r['final_val_loss']:.4f} (whole val split, non-overlapping windows of "
              f"{cfg.block_size}), final_train_loss {r['final_train_loss']:.4f} (as many train windows)")


CUT_SAID = set()  # (log path, line) of the cut-short lines said: a log read twice (resume does) says it once


def read_log(out_dir):
    """The records (dicts, each with 'iter') of out_dir/log.jsonl in file order, [] without one:
    the one reader of a run's log (resume, study.py, plot.py). A last line that is not a record
    is an append cut short (a full disk, a power loss): it is dropped, and stderr says so in one
    line. SystemExit naming the file and line for any other line that is not a record."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return []
    with open(path, 'rb') as f:  # bytes: a torn line may end inside a character
        lines = [(n, line) for n, line in enumerate(f.read().split(b'\n'), 1) if line.strip()]
    records = []
    for k, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or 'iter' not in record:
                raise ValueError('not a record with an iteration')
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if k == len(lines) - 1:
                if (path, n) not in CUT_SAID:
                    CUT_SAID.add((path, n))
                    say(f"{path}: its last line ({n}) is cut short (the write was interrupted: a full disk or a "
                        f"power loss); read without it")
                break
            raise SystemExit(f"{path}, line {n}: not a log record ({e}); only a last line may be cut short: "
                             f"repair or delete that line") from None
        records.append(record)
    return records


def final_record(out_dir):
    """The record with final_val_loss in out_dir/log.jsonl (the last one), or None: a run whose
    log has it is finished."""
    return next((r for r in reversed(read_log(out_dir)) if 'final_val_loss' in r), None)


# ---- checkpoints: written atomically, read by one loader -----------------------------------------

def save_checkpoint(obj, path):
    """torch.save to a temp file of this writer's own beside path (data.common.replacing), fsync, then
    rename: a crash or Ctrl-C mid-save keeps the old file, and no other file is touched (a fixed
    PATH.tmp was truncated and renamed away: fold.py --ckpt=x.pt.tmp --out=x.pt lost its input).
    SystemExit in one line, the old file kept, where path's filesystem is full."""
    try:
        with replacing(path) as tmp, open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        if (cause := disk_full(e)) is None:
            raise
        folder = os.path.dirname(os.path.abspath(path))
        raise SystemExit(f"the filesystem of {folder} is full ({cause.strerror}) writing {os.path.basename(path)}: "
                         f"an atomic save needs room for two checkpoints (the old file stays whole until the new "
                         f"one is); free space there") from None


CHECKPOINT_KEYS = ('model', 'model_args')  # what every checkpoint holds; train.py's also optimizer, iter_num, config
# train.py keys added after the first release: what a run's config without them meant (the model's
# own are model.ABSENT_MEANS; a run from before `calibration` calibrated with the warmup's EMA)
CONFIG_ABSENT_MEANS = {**ABSENT_MEANS, 'calibration': 'ema'}


def load_checkpoint(path, device='cpu'):
    """The dict that train.py or fold.py saved at path, tensors on device (weights_only: no
    code runs). The one loader every script uses: the weights' names lose the prefixes a compiled or
    DDP-wrapped model adds. SystemExit with one line that says what is wrong: no file (a run folder
    names its ckpt.pt), a file it cannot read (permissions, the disk, memory), a Python object the
    safe loader refuses (another program's file), not a readable checkpoint, missing keys, NaN or inf in the weights,
    model_args keys this code does not know (model_config).
    """
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, 'ckpt.pt')):
        raise SystemExit(f"{path} is a run folder: pass its checkpoint, {os.path.join(path, 'ckpt.pt')}")
    if not os.path.isfile(path):
        raise SystemExit(f"checkpoint {path} not found: train.py writes OUT_DIR/ckpt.pt, fold.py its --out")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except OSError as e:  # the file may be whole: the reading failed (permissions, the disk)
        raise SystemExit(f"cannot read the checkpoint {path}: {e.strerror or e}") from None
    except Exception as e:  # torch raises many kinds (UnpicklingError, EOFError, RuntimeError, ...)
        asked = re.search(r'allocate (\d+) bytes', str(e))  # the CPU allocator's words
        size = os.path.getsize(path)
        if out_of_memory(e) and (asked is None or int(asked[1]) <= size):  # more than the file holds: corrupt
            raise SystemExit(f"not enough memory to read the checkpoint {path} ({size / 2 ** 30:.1f} GiB): "
                             "free memory, or load it on a machine with more") from None
        # a global the safe loader does not run (torch 2.6 made weights_only the default): a whole file that
        # something else wrote, e.g. with a numpy scalar in its config (torch names it; its wording varies)
        if (found := re.search(r'GLOBAL ([\w.]+) was not an allowed global', str(e))) is not None:
            raise SystemExit(f"{path} holds a Python object of type {found[1]}, which torch.load's safe mode "
                             "(weights_only=True) does not load: train.py and fold.py save only tensors and plain "
                             "Python values, so another program wrote it; save it with those alone") from None
        raise SystemExit(f"{path} is not a readable checkpoint (truncated or corrupt); "
                         "use another copy or retrain") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise SystemExit(f"{path} is not a tapernorm checkpoint: it lacks {', '.join(missing)}")
    # names saved through torch.compile's ('_orig_mod.') or DDP's ('module.') wrapper, either over the other:
    # this repo saves the bare model, but a script edited to save the wrapper still loads (nanoGPT does the same)
    for prefix in ('_orig_mod.', 'module.', '_orig_mod.'):
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(ckpt['model'], prefix)
    # weights with NaN or inf sample empty text and fail fold's check as if folding had a bug: refused here
    # for every script. One pass over the weights: ~0.1 s at 124M
    bad = [k for k, t in ckpt['model'].items()
           if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise SystemExit(f"{path}: its weights hold NaN or inf ({bad[0]}{more}), which no script can use "
                         "(train.py stops at a non-finite loss); use another copy, or train again")
    ckpt['model_args'] = {**ABSENT_MEANS, **ckpt['model_args']}  # an older checkpoint: what it meant
    model_config(ckpt['model_args'], path)
    return ckpt


def unknown_keys(where, what, keys, known):
    """SystemExit naming the keys among `keys` that are not in `known` (the checkpoint at `where`,
    its `what`: 'model_args', 'config'): a newer version or a fork wrote it, and what they mean is
    not guessed. Returns None when every key is known."""
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise SystemExit(f"{where}: its {what} {'has a key' if len(unknown) == 1 else 'have keys'} this code does not "
                         f"know ({', '.join(unknown)}): it was written by a newer or different version of tapernorm; "
                         "load it with that version")


def model_config(model_args, where='the checkpoint'):
    """GPTConfig(**model_args); SystemExit in one line (unknown_keys) when model_args holds a key
    GPTConfig lacks, instead of GPTConfig's TypeError."""
    unknown_keys(where, 'model_args', model_args, {f.name for f in dataclasses.fields(GPTConfig)})
    return GPTConfig(**model_args)


def load_weights(model, state_dict, where='the checkpoint'):
    """model.load_state_dict(state_dict), strict: the one place a checkpoint's weights enter a model.
    SystemExit with one line when the weights do not fit the model that model_args describe (keys
    missing or unexpected, other shapes), instead of load_state_dict's page of names: a checkpoint
    of other code (nanoGPT's) or an altered one."""
    expected = model.state_dict()
    wrong = ([f"missing {k}" for k in expected if k not in state_dict]
             + [f"unexpected {k}" for k in state_dict if k not in expected]
             + [f"{k} is {tuple(state_dict[k].shape)}, not {tuple(t.shape)}" for k, t in expected.items()
                if k in state_dict and state_dict[k].shape != t.shape])
    if wrong:
        more = f", and {len(wrong) - 2} more" if len(wrong) > 2 else ""
        raise SystemExit(f"{where}: its weights do not fit the model its model_args describe ({'; '.join(wrong[:2])}"
                         f"{more}): tapernorm loads the checkpoints its train.py and fold.py write (GPT-2's "
                         "weights: train.py --init_from=gpt2)")
    model.load_state_dict(state_dict)


def model_from_state_dict(state_dict, model_args, where='the checkpoint'):
    """A model built from GPTConfig(**model_args) with state_dict loaded, in eval mode and
    in the phase its buffers imply. SystemExit for model_args this code does not know (model_config)
    or weights that do not fit them (load_weights)."""
    model = GPT(model_config(model_args, where))
    load_weights(model, state_dict, where)
    model.set_phase(implied_phase(model))
    return model.eval()


def load_model(path, device='cpu'):
    """Load a train.py or fold.py checkpoint for inference: returns (model on device, in eval mode,
    in the phase its buffers imply, the checkpoint dict with its tensors on the CPU). Errors as
    load_checkpoint and model_from_state_dict; the file is read on the CPU, so that a device's own error
    (no such GPU, out of memory) comes from .to(device) as itself, not as "not a readable checkpoint"."""
    ckpt = load_checkpoint(path)
    return model_from_state_dict(ckpt['model'], ckpt['model_args'], path).to(device), ckpt


# ---- the run: everything around train.py's loop, and what a signal does at each point of it ----

class Run:
    """The plumbing of one train.py run, so that its loop shows only the method: the run folder
    (claimed: claim_out_dir), checkpoints (atomic: save_checkpoint), the log, the estimates
    (Progress), evaluations when they are due, the end of the run, and what SIGINT (Ctrl-C),
    SIGTERM, SIGHUP and a closed output do at each point (a StopSignal), with every rank of a DDP
    run stopping together.

        with Run(cfg, env, folder, iter_num, state, hint) as run:
            while run.iter_num < cfg.max_iters:
                it = run.iter_num
                record = run.evaluate(it, estimate)          # {'val_loss': ...} when due, else {}
                t0 = time.perf_counter()
                stats = train_step(..., it, run.stop_asked)  # the step's all-reduce carries the flag
                dt_s = run.step_took(it, t0, synchronize)
                run.log({...})
                with run.during(f'the calibrate event after iteration {it}'):
                    ...
                run.end_iteration(it, stats['stop'])         # where a signal stops the run
            run.finish(phase, final_losses)                  # last checkpoint, final losses, record
                                                             # leaving: DDP's ranks end together

    state() gives what a checkpoint holds besides iter_num, config and world (model, optimizer,
    model_args, meta). iter_num: the iteration the run starts at (a resumed run's checkpoint's).

    The contract. The first signal prints one line at once (on stderr, rank 0) naming what the
    run finishes or cuts short; the run then writes the checkpoint of every finished step,
    prints one line with the iteration it resumes at and the command that resumes it, and exits
    with 128 + the signal (exit_code: 130 SIGINT, 143 SIGTERM, 129 SIGHUP, 141 when the output's
    reader ended; a rank stopped by another's flag, 143), on every rank, with no traceback (raising Stopped; under
    DDP the ranks end their processes together as they leave the context, as at a run's end).
    Where it lands:
    - before the loop (building, compiling: the context is entered): the first iteration begins
      as usual; its evaluation, when due, is cut at once (below), else its step runs and the run
      stops after it.
    - during an evaluation (only rank 0 evaluates): cut short at once; the checkpoint of the
      iteration it precedes is written (the resumed run evaluates again). One process stops
      there. Under DDP rank 0 still takes part in the rest of that iteration, its step (whose
      all-reduce tells every rank to stop), the warmup's statistics and the calibrate event,
      so that every collective the other ranks enter is met; it logs nothing more, and every
      rank stops at the end of the iteration, rank 0 keeping the checkpoint written before it.
    - during a step, the warmup statistics, the log or the calibrate event: the iteration
      finishes, its checkpoint (resuming at the next iteration) is written, the run stops.
      Under DDP the ranks agree through the step's all-reduce, which carries each rank's flag
      (stop_asked): a signal after that point is carried by the next step, which is then the
      last (the first line names it), or by the final checkpoint after the last step.
    - after the last step, while the final checkpoint is written: it is written whole, then the
      run stops (the resumed run computes the final losses). Under DDP the ranks agree there
      (signalled: an all-reduce), so that none enters the final losses alone.
    - during the final losses: one process cuts them short and stops (the last step's checkpoint
      is already written); under DDP they run to their end (their all-reduce), the final record
      is written and the run, complete, stops with one line saying so.
    - a second signal, anywhere: the process ends at once without saving, in one line; the
      checkpoint written last is whole (written atomically).
    """

    def __init__(self, cfg, env, folder, iter_num, state, hint=''):
        self.cfg, self.env, self.state, self.iter_num = cfg, env, state, iter_num
        self.lock = claim_on_every_rank(cfg, env, iter_num)  # held until the process ends
        self.ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
        self.progress, self.folder = Progress(cfg, env, folder, hint), folder
        self.signals = StopSignal(talk=env.master, doing=self.doing)
        self.current, self.asked, self.cut_at, self.said = None, False, None, set()
        self.first_iter = iter_num

    def __enter__(self):
        with ExitStack() as held:  # a failure while entering leaves nothing held
            held.enter_context(read_dataset(self.folder))  # the files the run began on, to its end
            held.enter_context(self.signals)
            self.held = held.pop_all()  # left in __exit__
        return self

    def __exit__(self, exc_type, exc, tb):
        """A run that ended or stopped (Stopped) ends its processes together (end_processes); an
        error propagates without a collective, which a rank that failed alone would never meet. Out
        of memory (out_of_memory) becomes one line: what did not fit and which keys to change; so
        does a full filesystem (disk_full: the log's append, a redirected stdout): free space and
        resume. save_checkpoint says its own (a SystemExit)."""
        doing = self.doing()
        try:
            if exc_type is None or issubclass(exc_type, Stopped):
                end_processes(self.env)
        finally:
            self.held.__exit__(exc_type, exc, tb)
            self.signals.doing = None  # the bound method's cycle would keep the lock after the run returns
        if exc is None or isinstance(exc, SystemExit):
            return
        saved = (f"{self.ckpt_path} (the last checkpoint) is whole" if os.path.exists(self.ckpt_path)
                 else "no checkpoint was written")
        if out_of_memory(exc):
            c = self.cfg
            raise SystemExit(f"out of memory on {self.env.dev} during {doing}: batch_size {c.batch_size} × block_size "
                             f"{c.block_size} does not fit. Lower --batch_size and raise --gradient_accumulation_steps as "
                             f"much (the same tokens a step; a new run: resume keeps its batch), or lower --block_size "
                             f"or the model; {saved}") from None
        if (full := disk_full(exc)) is not None:
            where = f" writing {full.filename}" if full.filename else ''
            then = (f"then continue with: {resume_command(self.cfg.out_dir, self.env.world)}"
                    if os.path.exists(self.ckpt_path) else "then start the run again")
            raise SystemExit(f"a filesystem is full ({full.strerror}){where} during {doing}: {saved}; free space, "
                             f"{then}") from None

    def doing(self):
        """What the run is doing, for the first signal's line (StopSignal)."""
        it = self.iter_num
        if self.env.ddp and self.asked:  # the step's all-reduce has passed: the next one carries the signal
            it += 1
        elif self.current is not None:
            return self.current
        return f'iteration {it}' if it < self.cfg.max_iters else 'the final checkpoint'

    @contextmanager
    def during(self, what):
        """A context in which a signal's first line says the run finishes `what` (e.g. the calibrate event)."""
        self.current = what
        try:
            yield
        finally:
            self.current = None

    def stop_asked(self):
        """Whether this process has received a signal, read by train_step as late as it can be (its
        all-reduce then tells every rank): from here on a signal stops the run after the next step."""
        self.asked = True
        return self.signals.received is not None

    def save(self, iter_num):
        """The checkpoint that resumes at iter_num (rank 0), written atomically."""
        if self.env.master:
            save_checkpoint({**self.state(), 'iter_num': iter_num, 'config': vars(self.cfg),
                             'world': self.env.world}, self.ckpt_path)

    def log(self, record):
        """log(record) unless rank 0 cut this iteration's evaluation under DDP: its checkpoint
        resumes before the iteration, so nothing of it is logged."""
        if self.cut_at is None:
            log(record, self.cfg, self.env, self.progress.status(record['iter']) if 'loss' in record else '')

    def say_once(self, key, line):
        """line on stderr (rank 0), the first time key is said."""
        if key not in self.said and self.env.master:
            self.said.add(key)
            print(line, file=sys.stderr, flush=True)

    def stop(self, when, resume_at, save=True):
        """After a signal: the checkpoint that resumes at resume_at (save=False: it is written
        already), one line saying when the run stopped and how it continues, SystemExit with the
        signal's exit_code (another rank's signal, under DDP: SIGTERM's)."""
        if save:
            self.save(resume_at)
        signum = self.signals.received or signal.SIGTERM
        if self.env.master:
            try:  # the step lines before the stop line, in a file too (train.out under study.py)
                sys.stdout.flush()
            except OSError:  # a full disk under a redirect: the stop goes on, its line on stderr
                pass
            say(f"stopped by {signal.Signals(signum).name} {when}: saved in {self.ckpt_path}, which resumes at "
                f"iteration {resume_at}; continue with: {resume_command(self.cfg.out_dir, self.env.world)}")
        raise Stopped(exit_code(signum))

    def any_rank(self, flag):
        """flag (bool), or under DDP whether any rank's is true: an all-reduce, made by every rank
        at the same point, so that they all stop there or none does."""
        if not self.env.ddp:
            return flag
        flag = torch.tensor([float(flag)], device=self.env.dev)
        torch.distributed.all_reduce(flag)
        return flag.item() > 0

    def signalled(self):
        """Whether a signal has reached this process, or under DDP any rank (any_rank)."""
        return self.any_rank(self.signals.received is not None)

    def evaluate(self, it, estimate):
        """When due (it a multiple of eval_interval), on rank 0: the validation loss
        estimate(first_batch) (train.estimate_val_loss, first_batch timing its first batch for
        Progress), then the checkpoint of iteration it. Returns {'val_loss': loss}, or {} when it
        is not due, on other ranks, or when a signal cut it short (the class's contract). Stopped
        (DIVERGED), the checkpoint not written, where the loss is not finite: the step before it
        diverged with a finite loss and gradient norm, so the last checkpoint is the last good state."""
        if it % self.cfg.eval_interval:
            return {}
        if not self.env.master:  # rank 0's verdict on the loss reaches every rank (DDP)
            self.diverged(it, False)
            return {}

        def evaluation(first_batch):  # its first line inside cut_short: a signal after it cuts it short
            if self.progress.batch_s is None:  # the first evaluation: nothing printed yet says how long it takes
                print(f"evaluating at iteration {it}: val loss over {self.cfg.eval_iters} batches of "
                      f"{self.cfg.batch_size} × {self.cfg.block_size} tokens", flush=True)
            return estimate(first_batch)

        val, cut = self.signals.cut_short(f'the evaluation at iteration {it}', evaluation,
                                          functools.partial(self.progress.evaluation_batch, it))
        self.diverged(it, not cut and not math.isfinite(val))
        self.save(it)
        if cut and not self.env.ddp:
            self.stop(f'during the evaluation at iteration {it}', it, save=False)
        if cut:  # DDP: the other ranks' collectives of this iteration are met first (end_iteration)
            self.cut_at = it
        return {} if cut else {'val_loss': val}

    def diverged(self, it, flag):
        """Stopped (DIVERGED), every rank together, where flag (a non-finite validation loss at
        iteration it) is true on any rank: nothing is saved, the last checkpoint stays."""
        if self.any_rank(flag):
            raise Stopped(f"{DIVERGED} at iteration {it} (the validation loss is not finite: an earlier step's "
                          f"update diverged); stopping without saving: {self.ckpt_path} keeps the last good state")

    def step_took(self, it, t0, synchronize):
        """Seconds since t0 (perf_counter) of training step it, for Progress and its log record; on
        CUDA and MPS, synchronize=True waits for the device first (logged steps only: one sync less per step)."""
        if synchronize:
            sync(self.env.device_type)
        seconds = time.perf_counter() - t0
        self.progress.step(it, seconds)
        return seconds

    def say_done(self, phase):
        """The finished run's last two lines: its time (this process's: a resumed run says where it
        resumed) and what comes next, fold.py then sample.py where its norms fold (TaperNorm in the
        linear phase, FakeLN), else sample.py."""
        cfg = self.cfg
        if not self.first_iter:
            ran = f"{self.iter_num:,} iterations"
        elif self.first_iter < self.iter_num:
            ran = f"iterations {self.first_iter:,}–{self.iter_num - 1:,} (resumed)"
        else:  # stopped after its last step (the final save, the final losses): none ran here
            ran = f"resumed after its last iteration ({self.iter_num - 1:,}) for the final losses"
        print(f"done: {ran}, {clock(time.perf_counter() - self.progress.start)} elapsed; the trained model is "
              f"{self.ckpt_path}", flush=True)
        if phase == 'linear' or cfg.norm_removal == 'fakeln':
            folded = os.path.join(cfg.out_dir, 'folded.pt')
            print(f"next, fold it, then sample: python fold.py --ckpt={shlex.quote(self.ckpt_path)} "
                  f"--out={shlex.quote(folded)} && python sample.py --ckpt={shlex.quote(folded)}", flush=True)
        else:
            print(f"next, sample: python sample.py --ckpt={shlex.quote(self.ckpt_path)}", flush=True)

    def end_iteration(self, it, stop):
        """Iteration it is done: iter_num becomes it + 1, or the run stops here after a signal.
        stop: the step's agreed flag (train_step's, all-reduced); one process reads its own signal,
        so one that landed after the step (in its log, its calibrate event) stops it here too."""
        self.iter_num, self.asked = it + 1, False
        if self.cut_at == it:
            self.stop(f'during the evaluation at iteration {it}', it, save=False)
        if stop if self.env.ddp else self.signals.received is not None:
            self.stop(f'after iteration {it}', self.iter_num)  # keep every finished step

    def finish(self, phase, final_losses):
        """The end of the run: the checkpoint of iter_num, then final_losses() ((val, train),
        runs.final_losses) and the final record, in which the model is in `phase`. Signals: the
        class's contract. Stopped (DIVERGED), with no final record, where a final loss is not finite
        (the last step's update diverged with a finite loss and gradient norm)."""
        cfg, env = self.cfg, self.env
        self.save(self.iter_num)
        if self.signalled():  # under DDP the ranks agree: the final losses are a collective
            self.stop('after the last iteration', self.iter_num, save=False)
        if env.master:
            print(f"final losses: the whole val split and as many train windows, {self.progress.final_batches} "
                  f"batches of {cfg.batch_size} × {cfg.block_size} tokens", flush=True)
        with self.during('the final losses'):
            # under DDP the ranks must agree on their all-reduces: the final losses run to the end there
            losses, cut = ((final_losses(), False) if env.ddp else
                           self.signals.cut_short('the final losses', final_losses))
        if cut:
            self.stop('during the final losses', self.iter_num, save=False)
        if not all(map(math.isfinite, losses)):  # the same on every rank: all-reduced (DDP)
            raise Stopped(f"{DIVERGED} at iteration {self.iter_num} (final val loss {losses[0]}, final train loss "
                          f"{losses[1]}: the last steps' updates diverged); the run is not finished, and "
                          f"{self.ckpt_path} holds that state: train again with a lower --learning_rate")
        self.log({'iter': self.iter_num, 'phase': phase, 'final_val_loss': losses[0], 'final_train_loss': losses[1],
                  'device': env.dev, 'dtype': env.dtype, 'tf32': env.tf32})
        if env.master:
            self.say_done(phase)
        if self.signals.received is not None:  # after the final losses (DDP): the run is complete
            if env.master:
                say(f"stopped by {signal.Signals(self.signals.received).name} after the final losses: the run in "
                    f"{cfg.out_dir} is complete")
            raise Stopped(exit_code(self.signals.received))
