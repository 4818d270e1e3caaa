"""
Run a declared matrix of train.py runs, resumably, two at a time, and build the results tables.

    python study.py                          # run the 'main' matrix into study/, then print its tables
    python study.py --matrix=timing --jobs=1 --threads=2   # another declared matrix (see MATRICES)
    python study.py --run=False              # only the tables, from study/results.json
    python study.py --matrix=timing --only=all-timing-s1 --study_dir=/tmp/again   # one cell again
    python study.py --matrix=ladder --device=cuda --jobs=8 --study_dir=study_cuda  # on a GPU, float32

Every cell gets its own out_dir (study_dir/NAME). A cell whose log.jsonl has final_val_loss is
skipped (its record keeps the configuration it ran with: a matrix edited under it is refused,
check_unchanged); one with a ckpt.pt continues with --init_from=resume; one whose loss went non-finite
is recorded as diverged (with its iteration) and never retried. After each cell, its summary
goes into study_dir/results.json (with the git commit, torch version, thread count, device and
dtype it ran with, and its wall time summed over every train.py run it took), written
atomically: a stopped study loses nothing and the same command continues it. To stop one, send
the driver SIGINT, SIGTERM or SIGHUP (Ctrl-C, kill PID also in the background, a closed terminal): it
passes the signal once to each running train.py (each in a session of its own), which saves and
says where it stopped, begins no other cell, and exits 128 + the signal (Stop). Two drivers may
share a study_dir: each cell runs in the one that takes its lock first (CELL_LOCK), and the other
skips it, saying it runs elsewhere. The tables of
docs/results.md are printed by --table from that file (--readme=docs/results.md writes them
there; --readme=README.md fills the README's <!-- study:ladder:summary --> block). Each cell
runs with OMP_NUM_THREADS=threads; jobs cells run at once (2 on a 2-core machine).
"""

import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

try:
    import fcntl  # the cells' and results.json's locks: Unix only
except ImportError:  # Windows: tables only (--run=False); main says so before running a cell
    fcntl = None

import runs
from configurator import check_at_least, configure, defaults_of, parse_args, resolve_device, run_command, uses_tf32
from data.common import replacing

ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
matrix = 'main'             # a key of MATRICES
study_dir = 'study'         # one folder per cell below it, and results.json
jobs = 2                    # cells trained at once
threads = 1                 # OMP_NUM_THREADS of each cell
cpu_isa = 'avx2'            # CPU cells' kernels pinned to AVX2 (cpu_pins): every x86-64 host runs the same kernels (a cell repeats bit for bit on the same CPU model, not across vendors); '': each follows its machine
run = True                  # train the cells that are not finished
table = True                # print the tables of the matrix's finished cells
only = ''                   # run and report only these cells of the matrix (comma-separated names)
device = ''                 # '': each cell's own (config/cpu.py's: cpu); 'cuda': every cell there in float32, into its own --study_dir
readme = ''                 # also write them into this markdown file (docs/results.md, README.md), between <!-- study:MATRIX --> and <!-- /study:MATRIX --> (and <!-- study:MATRIX:PART --> blocks: TABLES)
# -----------------------------------------------------------------------------
DEFAULTS = dict(defaults_of(globals()), __file__=__file__, __doc__=__doc__)  # before anything else is defined

# the 1M model, config/cpu.py's schedule, on the single-epoch corpus (mix: austen + sotu + kjv,
# 3.9M training tokens; 1500 steps × 2,048 tokens = 0.79 epochs)
BASE = ['config/tinystories_baseline.py', 'config/cpu.py', '--dataset=mix']
VARIANTS = {  # name: train.py overrides
    'baseline': ['--taper=none', '--aux_weight=0.0'],
    'internal': ['--taper=internal', '--aux_weight=0.1'],
    'all': ['--taper=all', '--aux_weight=0.1'],
    'all_noaux': ['--taper=all', '--aux_weight=0.0'],
}


def cells_of(variants, seeds, calibration='end'):
    """{cell name: train.py arguments} for every variant × seed."""
    return {f'{v}-{calibration}-s{s}': BASE + VARIANTS[v] + [f'--calibration={calibration}', f'--seed={s}']
            for v, s in itertools.product(variants, seeds)}


# model overrides by name: rows of the docs/method.md §6 ladder ('' and '1M': config/cpu.py's own model)
SIZES = {'': (), '0.4M': ('--n_embd=32', '--n_head=1'), '1M': (), '3M': ('--n_embd=128', '--n_head=4')}


def lr_cells(variants, lrs, seeds=(1,), size=''):
    """{cell name: train.py arguments} for every variant × peak learning rate × seed, with
    min_lr = lr / 10 as in config/cpu.py, for the model SIZES[size] (named in the cell). The
    lr = 2e-3 cells are the main and 3M matrices' own runs."""
    tag = f'-{size}' if size else ''
    name = lambda v, lr, s: (f'{v}{tag or "-end"}-s{s}' if lr == 2e-3 else f'{v}{tag}-lr{lr:g}-s{s}')
    return {name(v, lr, s): BASE + VARIANTS[v] + list(SIZES[size]) + ['--calibration=end', f'--seed={s}',
                                                                     f'--learning_rate={lr:g}', f'--min_lr={lr / 10:g}']
            for v, lr, s in itertools.product(variants, lrs, seeds)}


# part 3, the budget ladder: mix7 (the seven corpora, 18.5M training tokens) read once, in
# config/cpu.py's proportions (W, the LR warmup: 10 % of the run, T: 50 %; min_lr = lr / 10)
BASE7 = ['config/tinystories_baseline.py', 'config/cpu.py', '--dataset=mix7', '--sampler=epoch']
DYT7 = ['--norm=dyt', '--taper=none', '--aux_weight=0.0', '--calibration=end']
VARIANTS7 = {  # every cell names its calibration ('end' where nothing tapers: the records' configs as they ran)
    'baseline': VARIANTS['baseline'] + ['--calibration=end'],
    'internal': VARIANTS['internal'] + ['--calibration=end'],
    'all': VARIANTS['all'] + ['--calibration=end'],
    'internal_ema': VARIANTS['internal'] + ['--calibration=ema'],                          # the paper's calibration
    'internal_rel': VARIANTS['internal'] + ['--calibration=end', '--aux_form=relative'],  # beyond the paper
    'dyt': DYT7 + ['--dyt_embed_scale=True'],        # with the DyT paper's embedding scalar
    'dyt_noemb': DYT7 + ['--dyt_embed_scale=False'],  # without it: the ablation
    'all_ema': VARIANTS['all'] + ['--calibration=ema'],                                   # part 4's block 5
    'dyt_a2': DYT7 + ['--dyt_embed_scale=True', '--dyt_alpha0_scale=2'],  # twice the DyT paper's α₀: part 4's block 6
    'derf': ['--norm=derf', '--taper=none', '--aux_weight=0.0', '--calibration=end', '--dyt_embed_scale=True'],  # part 5
}
BUDGETS = {'3M': 1500, '9M': 4500, '18M': 9000}  # optimizer steps of 2,048 tokens: 3.07M, 9.22M, 18.4M tokens


def ladder_cells(variants, size, budget, lrs, seeds=(1,)):
    """{cell name: train.py arguments} of part 3: each variant × peak learning rate × seed for the
    model SIZES[size] trained for BUDGETS[budget] steps on mix7 read once; named
    VARIANT-SIZE-tBUDGET-lrLR-sSEED."""
    n = BUDGETS[budget]
    schedule = [f'--max_iters={n}', f'--lr_decay_iters={n}', f'--warmup_iters={n // 10}',
                f'--gate_warmup_iters={n // 10}', f'--taper_iters={n // 2}', f'--eval_interval={n // 6}']
    return {f'{v}-{size}-t{budget}-lr{lr:g}-s{s}': BASE7 + VARIANTS7[v] + list(SIZES[size]) + schedule +
            [f'--seed={s}', f'--learning_rate={lr:g}', f'--min_lr={lr / 10:g}']
            for v, lr, s in itertools.product(variants, lrs, seeds)}


def point_cells(v, point, lrs, seeds=(1,)):
    """ladder_cells of one variant v at one (size, budget) point."""
    return ladder_cells((v,), *point, lrs, seeds)


# block 1's learning-rate grid at each (size, budget), the same for both variants, extended where
# the baseline was still improving at the largest rate: 6.4e-2 at the 0.4M model's 3M point
# (3.2e-2: 4.7492 -> 4.7293), 3.2e-2 at the 1M model's (1.6e-2: 4.5885 -> 4.5426)
LADDER_LRS = {('1M', '3M'): (4e-3, 8e-3, 1.6e-2, 3.2e-2), ('1M', '9M'): (4e-3, 8e-3, 1.6e-2),
              ('0.4M', '3M'): (8e-3, 1.6e-2, 3.2e-2, 6.4e-2), ('0.4M', '18M'): (8e-3, 1.6e-2, 3.2e-2)}
LADDER_POINTS = (('0.4M', '3M'), ('1M', '3M'), ('1M', '9M'), ('0.4M', '18M'))  # the order cells start in
LONG_POINTS = (('1M', '9M'), ('0.4M', '18M'))  # where blocks 2 and 5 run
EMA_POINT = ('1M', '9M')                        # where blocks 3 and 6 run

# block 5's grid for DyT at each long point: block 1's (the DyT paper, too, trains its DyT models
# at their normalized baselines' tuned rates), extended where DyT's best landed at its lower edge:
# 1M: 4e-3 4.2919, 8e-3 4.2983, 1.6e-2 4.5011, so 2e-3 joins; 0.4M: 8e-3 4.3655, 1.6e-2 4.3669,
# so 4e-3 joins, and 3.2e-2, a doubling above a rate already no better, leaves
DYT_LRS = {('1M', '9M'): (2e-3, 4e-3, 8e-3, 1.6e-2), ('0.4M', '18M'): (4e-3, 8e-3, 1.6e-2)}
# DyT without the DyT paper's embedding scalar ('dyt_noemb', GPTConfig.dyt_embed_scale=False): the
# cells run before the scalar was added, kept as an ablation. It broke down just after the LR
# warmup at the baseline's best rates and at 4e-3 (1M), stalling near val loss 6.2 where the
# baseline was at 4.5-4.9, as the paper says it does ("training struggles to progress")
DYT_NOEMB_LRS = {('1M', '9M'): (4e-3, 8e-3), ('0.4M', '18M'): (1.6e-2,)}
LADDER_ABLATIONS = ('dyt_noemb', 'dyt_a2', 'internal_w25', 'internal_ema_w25')  # in the tables, not on the plot: no bracketed best rate

# block 1's best rates, each bracketed, entered here as each point's grid finishes (test_study
# checks every entry against study/results.json); blocks 2-6 run at them
LADDER_BEST = {('0.4M', '3M'): {'baseline': 3.2e-2, 'internal': 1.6e-2},
               ('1M', '3M'): {'baseline': 1.6e-2, 'internal': 8e-3},
               ('1M', '9M'): {'baseline': 8e-3, 'internal': 8e-3},
               ('0.4M', '18M'): {'baseline': 1.6e-2, 'internal': 1.6e-2}}


def ladder_blocks(best):
    """{cell name: train.py arguments} of part 3's blocks 2-6 at the points of best
    ({(size, budget): {'baseline': lr, 'internal': lr}}), in the blocks' order of priority:
    (2) seeds 2 and 3 of both at their best rates at the long points; (3) Internal-Taper with the
    paper's calibration='ema', seeds 1-3 at its best rate at EMA_POINT; (4) All-Taper at
    Internal-Taper's best rate at every point; (5) DyT at its own grid (DYT_LRS) at the long points;
    (6) the relative anchor (beyond the paper) at EMA_POINT at the baseline's best rate, seeds 1-2,
    and at twice Internal-Taper's best, where the absolute anchor falls off (seed 1), each beside
    the absolute cell at its rate."""
    at = point_cells
    blocks = [[at(v, p, (best[p][v],), (2, 3)) for p in LONG_POINTS if p in best for v in ('baseline', 'internal')],
              [at('internal_ema', p, (best[p]['internal'],), (1, 2, 3)) for p in (EMA_POINT,) if p in best],
              [at('all', p, (best[p]['internal'],)) for p in LADDER_POINTS if p in best],
              [at('dyt', p, DYT_LRS[p]) for p in LONG_POINTS if p in best] +
              [at('dyt_noemb', p, DYT_NOEMB_LRS[p]) for p in LONG_POINTS if p in best],
              [{**at('internal_rel', p, (best[p]['baseline'],), (1, 2)), **at('internal_rel', p, (2 * best[p]['internal'],)),
                **at('internal', p, (best[p]['baseline'],), (1, 2)), **at('internal', p, (2 * best[p]['internal'],))}
               for p in (EMA_POINT,) if p in best]]  # the absolute cells at those rates: block 1's when in its grid
    return {n: a for block in blocks for cells in block for n, a in cells.items()}


def ema_grid(best):
    """{cell name: train.py arguments} of part 4's block 2: Internal-Taper with the users' default
    calibration='ema' at every point of best ({(size, budget): {'internal': lr, ...}}), seed 1, at
    half, once and twice the rate tuned with 'end', so that its own best is bracketed or the grid
    says which way to extend. Every new cell runs pinned (cpu_isa)."""
    return {n: a for p in LADDER_POINTS if p in best
            for n, a in ladder_cells(('internal_ema',), *p, [f * best[p]['internal'] for f in (0.5, 1, 2)]).items()}


# part 4's best rates, each bracketed, entered as each grid finishes (test_study checks every entry
# against study/results.json); blocks 3-6 run at them. 'ema' Internal-Taper's come from block 2
# (ema_grid); DyT's from part 3's block 5 (DYT_LRS)
EMA_BEST = {('0.4M', '3M'): 1.6e-2, ('1M', '3M'): 8e-3, ('1M', '9M'): 8e-3, ('0.4M', '18M'): 1.6e-2}
DYT_BEST = {('1M', '9M'): 4e-3, ('0.4M', '18M'): 8e-3}


def midpoints(lr):
    """The √2 midpoints either side of lr, to 3 digits: [5.66e-3, 1.13e-2] around 8e-3."""
    return [float(f'{lr * f:.3g}') for f in (2 ** -0.5, 2 ** 0.5)]


def part4_blocks(best, ema_best, dyt_best):
    """{cell name: train.py arguments} of part 4's blocks 3-6 where their rates are known (best:
    LADDER_BEST's form; ema_best, dyt_best: {(size, budget): lr} of 'ema' Internal-Taper and DyT):
    (3) the √2 midpoints either side of the best rate (to 3 digits: 5.66e-3 and 1.13e-2 around 8e-3)
    of the baseline and 'ema' Internal-Taper at the long points, seed 1; (4) seeds 2 and 3 of both
    at their best rates at every point; (5) All-Taper with 'ema' at the long points at 'ema'
    Internal-Taper's best rate, seeds 1-3; (6) DyT's seeds 2 and 3 at its best rate at the long
    points, and DyT at twice the paper's α₀ there ('dyt_a2', seed 1: its paper asks larger α₀ of
    narrower models). A midpoint that beats the best moves the best: seeds follow in a later run."""
    mid = midpoints
    rates = lambda p: {**({'baseline': best[p]['baseline']} if p in best else {}),
                       **({'internal_ema': ema_best[p]} if p in ema_best else {})}
    at = point_cells
    blocks = [[at(v, p, mid(lr)) for p in LONG_POINTS for v, lr in rates(p).items()],
              [at(v, p, (lr,), (2, 3)) for p in LADDER_POINTS for v, lr in rates(p).items()],
              [at('all_ema', p, (ema_best[p],), (1, 2, 3)) for p in LONG_POINTS if p in ema_best],
              [{**at('dyt', p, (dyt_best[p],), (2, 3)), **at('dyt_a2', p, (dyt_best[p],))}
               for p in LONG_POINTS if p in dyt_best]]
    return {n: a for block in blocks for cells in block for n, a in cells.items()}


# part 4's block 7: the ladder's third rung, the 3M model (n_embd 128, n_head 4) at 3M and 9M tokens,
# the baseline and 'ema' Internal-Taper, seed 1. The grid began as 4e-3, 8e-3, 1.6e-2 at both points
# (around the 1M model's best rates); at 3M tokens both variants were best at its lower edge
# (baseline 4.4429, 4.5689, 4.7280; 'ema' 4.3133, 4.4021, 4.9816), so 2e-3 joins there, and at 9M
# tokens, where part 3's best rates were no larger than at 3M, the grid moves down to 2e-3-8e-3
RUNG_POINTS = (('3M', '3M'), ('3M', '9M'))
RUNG_LRS = {('3M', '3M'): (2e-3, 4e-3, 8e-3, 1.6e-2), ('3M', '9M'): (2e-3, 4e-3, 8e-3)}
# part 5: at 9M tokens the baseline was best at that grid's top edge (3.9977, 3.9466, 3.9353 at 2e-3,
# 4e-3, 8e-3), so its grid there extends to 1.6e-2 ('ema' Internal-Taper: 3.9319, 3.8774 at 2e-3, 4e-3)
RUNG_EDGE = {('3M', '9M'): {'baseline': (1.6e-2,)}}


def rung_cells(point):
    """The 3M rung's seed-1 grid at point (size, budget): the baseline and 'ema' Internal-Taper at
    RUNG_LRS[point], and a variant's extra rates in RUNG_EDGE; {name: train.py args}."""
    return {**ladder_cells(('baseline', 'internal_ema'), *point, RUNG_LRS[point]),
            **{n: a for v, lrs in RUNG_EDGE.get(point, {}).items() for n, a in ladder_cells((v,), *point, lrs).items()}}


# part 5: seeds 2 and 3 of both variants at their bracketed best rate of each 3M point, entered as
# each grid finishes (at 3M tokens both were best at 4e-3: baseline 4.5695, 4.4429, 4.5689 at
# 2e-3, 4e-3, 8e-3; 'ema' 4.4306, 4.3133, 4.4021; at 9M tokens the baseline at 8e-3: 3.9977, 3.9466,
# 3.9353, 3.9426 at 2e-3-1.6e-2; 'ema' at 4e-3: 3.9319, 3.8774, 3.9233 at 2e-3-8e-3)
RUNG_BEST = {('3M', '3M'): {'baseline': 4e-3, 'internal_ema': 4e-3},
             ('3M', '9M'): {'baseline': 8e-3, 'internal_ema': 4e-3}}


# part 5: Derf (baselines.Derf) at the long points, seed 1, on DyT's grids (DYT_LRS: its best rate is
# DyT's neighbour or the grid's edge moves it); seeds 2 and 3 follow at its best rate, entered as each
# grid finishes (at (1M, 9M): 4.5688, 4.2995, 4.2070, 4.4316 at 2e-3, 4e-3, 8e-3, 1.6e-2). At (0.4M,
# 18M) 1.6e-2 beat 8e-3 (4.3575, 4.3930), its top edge: the grid moves up to 3.2e-2, and 4e-3, not
# yet run and below a rate already worse, is dropped; 3.2e-2 ended 4.4850 (its final Derf saturated), so
# 1.6e-2 is bracketed
DERF_LRS = {**DYT_LRS, ('0.4M', '18M'): (8e-3, 1.6e-2, 3.2e-2)}
DERF_BEST = {('1M', '9M'): 8e-3, ('0.4M', '18M'): 1.6e-2}


# part 5: the default calibration against the gate warmup's length. At EMA_POINT with W at 10 % of the
# run 'ema' beat 'end' by 0.70 %; an independent implementation with W at 25 % found them tied. Both
# Internal-Taper calibrations at their best rate there (EMA_BEST: 8e-3 for both), seed 1, with W at 25 % of the run
# (T 50 %, the rest linear): the variants VARIANT_w25


def warmup25_cells(point=EMA_POINT, lr=EMA_BEST[EMA_POINT], seeds=(1,)):
    """{cell name: train.py arguments}: 'end' and 'ema' Internal-Taper at point with the gate warmup
    W = max_iters // 4 in place of ladder_cells' max_iters // 10 (a later --key=value wins), named
    internal_w25-... and internal_ema_w25-..."""
    n = BUDGETS[point[1]]
    return {f'{v}_w25-{name.split("-", 1)[1]}': args + [f'--gate_warmup_iters={n // 4}']
            for v in ('internal', 'internal_ema') for name, args in point_cells(v, point, (lr,), seeds).items()}


def best_seeds(best):
    """{cell name: train.py arguments} of seeds 2 and 3 of each variant at its best rate at each
    point of best ({(size, budget): {variant: lr}})."""
    return {n: a for p, rates in best.items() for v, lr in rates.items()
            for n, a in point_cells(v, p, (lr,), (2, 3)).items()}


# part 6: the 1M and 3M models at one full pass of mix7's training split (18M: 9,000 steps, 18.4M
# tokens), the baseline and 'ema' Internal-Taper, seed 1, on a grid around each size's 9M-token best
# rates (1M: 8e-3 for both; 3M: baseline 8e-3, 'ema' 4e-3), so that a best at an edge says which way
# to extend; the √2 midpoints, seeds 2-3 and All-Taper follow once each grid is bracketed
FULL_POINTS = (('1M', '18M'), ('3M', '18M'))
FULL_LRS = {('1M', '18M'): (4e-3, 8e-3, 1.6e-2), ('3M', '18M'): (2e-3, 4e-3, 8e-3)}
# the 3M baseline's grid ended best at its top (8e-3: 3.6663; 4e-3: 3.6670; 2e-3: 3.7122): one rate up
FULL_EXTENDED = ladder_cells(('baseline',), '3M', '18M', (1.6e-2,))
# seeds 2 and 3 at each bracketed best rate of part 6, entered as each grid brackets, and at the 1M model
# the √2 midpoints beside it first (the 3M model's grids take none): the 3M baseline at 8e-3 (3.7122,
# 3.6670, 3.6663, 3.7441 at 2e-3-1.6e-2) and 'ema' at 4e-3 (3.6778, 3.6617, 3.7273 at 2e-3-8e-3), the 1M
# baseline at 8e-3 (4.0060, 3.9436, 3.9767 at 4e-3-1.6e-2) and 'ema' at 8e-3 (3.9976, 3.9454, 4.0001 at 4e-3-1.6e-2)
FULL_BEST = {('3M', '18M'): {'baseline': 8e-3, 'internal_ema': 4e-3},
             ('1M', '18M'): {'baseline': 8e-3, 'internal_ema': 8e-3}}
FULL_MIDPOINTS = {n: a for p, rates in FULL_BEST.items() if p[0] == '1M' for v, lr in rates.items()
                  for n, a in point_cells(v, p, midpoints(lr)).items()}
# and All-Taper 'ema' at the 1M model at Internal-Taper's best rate, seeds 1-3 (as part 4's block 5)
FULL_ALL = point_cells('all_ema', ('1M', '18M'), (FULL_BEST['1M', '18M']['internal_ema'],), (1, 2, 3))


# part 6's loose ends from part 5, at EMA_POINT: seeds 2-3 of the W = 25 % pair (seed 1 tied: 4.1238 'end',
# 4.1259 'ema'), so that the tie becomes an interval; Derf seeds 2-3 at 4e-3, the rate below its best,
# since one of its three seeds at 8e-3 saturated (+15.2 %)
LOOSE_ENDS = {**warmup25_cells(seeds=(2, 3)), **best_seeds({EMA_POINT: {'derf': 4e-3}})}


def full_pass_cells(point):
    """Part 6's seed-1 grid at point (size, '18M'): the baseline and 'ema' Internal-Taper at
    FULL_LRS[point]; {name: train.py args}."""
    return ladder_cells(('baseline', 'internal_ema'), *point, FULL_LRS[point])


LRS = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)  # 1.6e-2: the baseline was still improving at 8e-3
SHORT = ['--gate_warmup_iters=20', '--taper_iters=50']  # W = 20, T = 50 in the same 1500-step run
MATRICES = {
    # the main comparison: four variants × three seeds with calibration='end', and the paper's
    # EMA calibration beside it for the two anchored tapered variants, seed 1 (14 runs)
    'main': {**cells_of(VARIANTS, (1, 2, 3)), **cells_of(('internal', 'all'), (1,), 'ema')},
    # the README's quick start (All-Taper on austen, 3.3 epochs) with both calibration modes
    'quickstart': {f'austen-all-{m}-s1': ['config/tinystories_all_taper.py', 'config/cpu.py', f'--calibration={m}']
                   for m in ('end', 'ema')},
    # part 2. Each variant at its own best learning rate (seed 1)
    # (3.2e-2 for the baseline only: Internal-Taper was already worse at 1.6e-2 than at 8e-3)
    'lr': {**lr_cells(('baseline', 'internal'), LRS), **lr_cells(('baseline',), (3.2e-2,))},
    # where logit chasing bites: λ (All-Taper λ = 0 and 0.1 are the main matrix's), a short gate
    # schedule, and the largest learning rate of the 'lr' matrix; logged every step so that a
    # spike is seen at its peak
    'chasing': {**{f'{v}-end-s1': BASE + VARIANTS[v] + ['--calibration=end', '--seed=1'] for v in ('all_noaux', 'all')},
                **{f'all_aux{a:g}-end-s1': BASE + ['--taper=all', f'--aux_weight={a:g}', '--calibration=end',
                                                   '--seed=1', '--log_interval=1'] for a in (0.01, 1.0)},
                **{f'{v}-short-s1': BASE + VARIANTS[v] + SHORT + ['--calibration=end', '--seed=1', '--log_interval=1']
                   for v in ('all_noaux', 'all', 'internal')},
                **{n: a + ['--log_interval=1'] for n, a in lr_cells(('all_noaux', 'all'), (8e-3,)).items()}},
    # the 3M model of the docs/method.md §6 ladder (n_embd=128, n_head=4), seed 1
    '3M': {f'{v}-3M-s1': BASE + VARIANTS[v] + list(SIZES['3M']) + ['--calibration=end', '--seed=1']
           for v in ('baseline', 'internal', 'all')},
    # seeds 2 and 3 at each variant's best learning rate of the 'lr' matrix (seed 1 is its own)
    'tuned': {**lr_cells(('baseline',), (1.6e-2,), (1, 2, 3)), **lr_cells(('internal',), (8e-3,), (1, 2, 3))},
    # the 3M model away from lr 2e-3 (its cells at 2e-3 are the 3M matrix's)
    '3M_lr': lr_cells(('baseline', 'internal'), (2e-3, 8e-3, 1.6e-2), size='3M'),
    # seed 2 at the 3M model's best learning rate (both variants: 8e-3)
    '3M_tuned': lr_cells(('baseline', 'internal'), (8e-3,), (1, 2), size='3M'),
    # the CPU proxy of the GPT-2 family (docs/results.md): the small GPT-2-shaped model pretrained on
    # sotu_gpt2 by config/gpt2_proxy_pretrain.py and exported with export_gpt2.py, fine-tuned on
    # austen_gpt2 through --init_from=FOLDER with each of the four GPT-2 configs
    'gpt2proxy': {f'{v}-proxy-s1': [f'config/finetune_gpt2_{v}.py', 'config/gpt2_proxy.py', '--seed=1', '--calibration=end']
                  for v in ('vanilla', 'internal_taper', 'all_taper', 'fakeln')},
    # the contrast: the four variants on austen alone (3.3 epochs in the same 1500 steps)
    'austen': {f'{v}-austen-s1': BASE[:-1] + ['--dataset=austen'] + VARIANTS[v] + ['--calibration=end', '--seed=1']
               for v in VARIANTS},
    # step times per phase on a machine left to one run at a time (run with --jobs=1 --threads=2):
    # the main matrix's two-at-a-time runs share the memory bandwidth, so their times are noisier
    'timing': {f'{v}-timing-s1': BASE + VARIANTS[v] + ['--calibration=end', '--max_iters=300', '--warmup_iters=30', '--lr_decay_iters=300',
                                                   '--gate_warmup_iters=30', '--taper_iters=150',
                                                   '--eval_interval=100', '--log_interval=1']
               for v in ('baseline', 'internal', 'all')},
    # part 3. Block 1: baseline and Internal-Taper at the LADDER_LRS grid at each point of the
    # budget ladder, seed 1 (the two 1M cells at 9M tokens first, so that the long cells start
    # while the short points run beside them); then blocks 2-6 where block 1's best rates are known
    'ladder': {**ladder_cells(('baseline', 'internal'), '1M', '9M', (8e-3,)),
               **{n: a for size, budget in LADDER_POINTS
                  for n, a in ladder_cells(('baseline', 'internal'), size, budget, LADDER_LRS[size, budget]).items()},
               **ladder_blocks(LADDER_BEST), **ema_grid(LADDER_BEST), **part4_blocks(LADDER_BEST, EMA_BEST, DYT_BEST),
               **{n: a for p in RUNG_POINTS for n, a in rung_cells(p).items()},
               **best_seeds(RUNG_BEST),
               **{n: a for p in LONG_POINTS for n, a in ladder_cells(('derf',), *p, DERF_LRS[p]).items()},
               **best_seeds({p: {'derf': lr} for p, lr in DERF_BEST.items()}),
               **warmup25_cells(),
               **{n: a for p in FULL_POINTS for n, a in full_pass_cells(p).items()}, **FULL_EXTENDED,
               **LOOSE_ENDS, **FULL_MIDPOINTS, **best_seeds(FULL_BEST), **FULL_ALL},
    # a two-cell matrix of a few seconds on the toy data of the tests
    'tiny': {f'{v}-end-s1': ['--dataset=toy', '--device=cpu', '--n_layer=1', '--n_head=1', '--n_embd=16',
                             '--block_size=16', '--batch_size=2', '--gradient_accumulation_steps=1',
                             '--max_iters=12', '--gate_warmup_iters=3', '--taper_iters=4', '--warmup_iters=2',
                             '--lr_decay_iters=12', '--eval_interval=6', '--eval_iters=1', '--log_interval=1',
                             '--calib_batches=2', '--calibration=end'] + VARIANTS[v]
             for v in ('baseline', 'all')},
}


LADDER_MATRICES = ('ladder',)  # part 3's matrices: plot.py --ladder draws their cells


def git_commit():
    try:
        return subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def read_log(out_dir):
    """The records of out_dir/log.jsonl ([] if none); for an iteration logged twice (a resumed
    run), the later record."""
    last = {}
    for r in runs.read_log(out_dir):
        last[(r.get('event'), r['iter'], 'final_val_loss' in r)] = r
    return sorted(last.values(), key=lambda r: (r['iter'], 'final_val_loss' in r))


def summarize(records):
    """A finished run's numbers: final losses, the calibrate event, the largest and last values
    of the scale diagnostics, and the median step time of each phase (evaluation steps excluded)."""
    final = next(r for r in records if 'final_val_loss' in r)
    steps = [r for r in records if 'loss' in r]
    calib = next((r for r in records if r.get('event') == 'calibrate'), None)
    out = dict(final_val_loss=final['final_val_loss'], final_train_loss=final.get('final_train_loss'),
               max_loss=max(r['loss'] for r in steps),
               **{f'{k}_last': steps[-1].get(k) for k in ('hidden_rms', 'logit_rms', 'radial_cos')},
               **{f'{k}_max': max(abs(r.get(k, 0.0)) for r in steps) for k in ('hidden_rms', 'logit_rms', 'radial_cos')},
               step_ms={str(r['iter']): r['step_ms'] for r in steps if 'val_loss' not in r},
               linear_from=min((r['iter'] for r in steps if r['phase'] == 'linear'), default=None))
    if calib is not None:
        out['calibrate'] = dict(iter=calib['iter'], s_tgt=calib['s_tgt'], c=calib['c'],
                                mismatch=calib.get('mismatch'))
        # the taper's spike: the largest loss from iteration W on, against the last loss before W
        before = [r for r in steps if r['iter'] <= calib['iter']]
        peak = max((r for r in steps if r['iter'] > calib['iter']), key=lambda r: r['loss'])
        out['spike'] = dict(loss_at_W=before[-1]['loss'] if before else None, peak=peak['loss'], peak_iter=peak['iter'])
    return out


def read_json(path):
    with open(path) as f:
        return json.load(f)


def atomic_write(text, path):
    """Write text to path whole or not at all (a temp file of this writer's own, then a rename:
    data.common.replacing): a stop mid-write keeps the previous file, and two drivers writing one
    README never rename each other's half-written file into place."""
    with replacing(path) as tmp, open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)


def atomic_write_json(obj, path):
    atomic_write(json.dumps(obj, indent=1), path)


def read_results(path):
    """A study's results.json: {'cells': {name: record}}. SystemExit in one line, naming the file
    and how to recover, where it is not that (a disk error, an edit, a merge's conflict markers)."""
    try:
        with open(path, 'rb') as f:
            data = json.loads(f.read())
        if not isinstance(data, dict) or not isinstance(data.get('cells'), dict):
            raise ValueError("no {'cells': {...}} object")
    except OSError as e:  # missing, a folder, unreadable (plot.py --fit/--gap/--ladder name it)
        raise SystemExit(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SystemExit(f"{path} is not a study's results file ({e}): restore it (from git, or a backup), or "
                         f"move it away and rerun study.py, which rebuilds each finished cell's record from its "
                         f"log.jsonl (without its wall time; a diverged cell runs again)") from None
    return data


class Results:
    """study_dir/results.json: {'cells': {name: record}}, rewritten after every cell. Two drivers
    (two matrices at once) may share it: each write re-reads the file under an flock and
    changes only its own cell, and a driver re-reads it before each cell it takes (refresh)."""

    def __init__(self, path):
        self.path, self.lock = path, threading.Lock()
        self.data = self.read()

    def read(self):
        return read_results(self.path) if os.path.exists(self.path) else {'cells': {}}

    @contextlib.contextmanager
    def held(self):
        """The file re-read into self.data under its flock (and this driver's thread lock), held for the block."""
        with self.lock, open(self.path + '.lock', 'w') as lock:
            runs.take_lock(lock, wait=True)
            self.data = self.read()
            yield

    def refresh(self):
        """What another driver recorded since this one read the file."""
        with self.held():
            pass

    def put(self, name, record):
        with self.held():
            self.data['cells'][name] = record
            atomic_write_json(self.data, self.path)


def open_segment(out_dir):
    """Start the wall-time account of one train.py run of a cell in out_dir/segments.json
    ([[start, end], ...], Unix seconds). A segment left open (its driver was stopped before the run
    returned) is closed at the last write to the cell's train.out or log.jsonl, the run's last
    output (not before the segment began: a machine lost before the run wrote anything leaves the
    mtimes of the run before), so a resumed cell's wall time covers every segment it ran. A cell
    resumed from a checkpoint written before this account began gets a segment [None, None]:
    unknown, and its record says so (wall_s_partial)."""
    path = os.path.join(out_dir, 'segments.json')
    segments = read_json(path) if os.path.exists(path) else []
    if not segments and os.path.exists(os.path.join(out_dir, 'ckpt.pt')):
        segments.append([None, None])
    if segments and segments[-1][0] is not None and segments[-1][1] is None:
        outputs = [os.path.join(out_dir, f) for f in ('train.out', 'log.jsonl')]
        segments[-1][1] = max([segments[-1][0]] + [os.path.getmtime(f) for f in outputs if os.path.exists(f)])
    segments.append([time.time(), None])
    atomic_write_json(segments, path)


def close_segment(out_dir, ran=True):
    """Close the segment open_segment started (ran=False: the run never began, a signal came
    first: the segment goes); returns the cell's wall-time fields: wall_s, the seconds of every
    known segment, segments, how many train.py runs it took, and wall_s_partial where one of them
    is unknown."""
    path = os.path.join(out_dir, 'segments.json')
    segments = read_json(path)
    if ran:
        segments[-1][1] = time.time()
    else:
        segments.pop()
    atomic_write_json(segments, path)
    known = [end - start for start, end in segments if start is not None]
    return dict(wall_s=sum(known), segments=len(segments), **({'wall_s_partial': True} if len(known) < len(segments) else {}))


def cpu_pins(isa):
    """The environment that pins a CPU run's kernels to the instruction set isa ('avx2'; '': none):
    torch's own (ATEN_CPU_CAPABILITY), MKL's matrix products (MKL_CBWR) and oneDNN's
    (ONEDNN_MAX_CPU_ISA). Unpinned, each follows the machine, so the same cell rounds differently on
    an AVX2 and an AVX512 host and training amplifies it (docs/results.md, the machine effect).
    Measured: a cell rerun pinned on an AMD AVX512 host ended where the same cell unpinned on an
    AVX2 host did (4.529511), and 0.30 % away from that host's own unpinned rerun. Pinning does not
    make CPU vendors agree: a cell pinned on an AMD EPYC, rerun pinned on an Intel Xeon, differed from
    its first step and ended 0.09 % apart (MKL's and oneDNN's blocking follows each CPU). Off x86-64
    there is nothing to pin ({}). ValueError for an isa other than those."""
    if isa not in ('', 'avx2'):
        raise ValueError(f"cpu_isa={isa!r}: use 'avx2' (every x86-64 CPU this study runs on has it) or '' (unpinned)")
    if not isa or platform.machine() not in ('x86_64', 'AMD64'):
        return {}
    return dict(ATEN_CPU_CAPABILITY=isa, MKL_CBWR=isa.upper(), ONEDNN_MAX_CPU_ISA=isa.upper())


CELL_LOCK = '.driver.lock'  # in a cell's out_dir: held by the study.py driver that runs the cell
# how a train.py run stopped by a signal exits: runs.exit_code after its stop line (runs.Run.stop, or a
# second signal's line without saving), or killed by the signal itself before its handlers were in place
SIGNAL_EXITS = {code: s for s in runs.STOP_SIGNALS for code in (runs.exit_code(s), -s)}


def start_train(cmd, **kw):
    """subprocess.Popen of a cell's train.py, in a session of its own: a signal to the driver's process
    group (Ctrl-C, GNU timeout) reaches the run once, forwarded by Stop, never twice."""
    return subprocess.Popen(cmd, start_new_session=True, **kw)


class Stop:
    """The driver's SIGINT, SIGTERM and SIGHUP (runs.STOP_SIGNALS; SIGHUP unless ignored, as under
    nohup), while its cells run (a `with`; handlers in the main thread only, where Python allows
    them). Whether the signal came to the process group (Ctrl-C) or to the driver alone (kill
    PID), each running train.py gets it once: it finishes its step, saves and stops (runs.Run's
    contract); a second signal, forwarded too, stops them at once without saving. From the first
    signal on, no cell begins. Handlers set here replace inherited ones, so a driver started in
    the background (where a shell ignores SIGINT) stops too."""

    def __init__(self):
        self.received, self.running, self.lock, self.previous = None, set(), threading.RLock(), {}
        self.first_at = None  # time.monotonic() of the first signal

    def __enter__(self):
        self.streams = None
        self.previous = runs.stop_handlers(self.handle)  # as train.py's: SIGHUP too, unless nohup's
        if self.previous:  # the main thread's driver
            # the driver's lines are progress only (the records are in results.json, the cells' output in their
            # train.out): once their reader is gone (`| tee` ended, a closed terminal) it goes on quietly
            self.streams = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = (runs.OutputGuard(stream, lambda: None) for stream in self.streams)
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
        if self.streams:
            sys.stdout, sys.stderr = self.streams

    def handle(self, signum, frame):
        now = time.monotonic()
        if self.received == signum and now - self.first_at < runs.StopSignal.REPEAT_S:
            return  # one signal delivered twice (to the process group and to the driver): passed on once
        first = self.received is None
        if first:
            self.received, self.first_at = signum, now
        with self.lock:  # an RLock: a second signal can land while this handler holds it
            procs = list(self.running)
        runs.say(f"study.py: {signal.Signals(signum).name} passed to {len(procs)} running cell(s), which "
                 + ("save and stop; no other cell begins (again: they stop at once, without saving)" if first
                    else "stop at once, without saving"))  # os.write: the handler may interrupt a print
        for proc in procs:
            proc.send_signal(signum)

    def run(self, cmd, **kw):
        """start_train(cmd, **kw) to its end: its exit code, or None where a signal came first."""
        with self.lock:
            if self.received:
                return None
            proc = start_train(cmd, **kw)
            self.running.add(proc)
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.running.discard(proc)


def run_cell(name, args, out_dir, results, threads, isa='', stop=None):
    """Train one cell to its end (or its divergence) and record it, its wall time summed over every
    train.py run it took (open_segment), its kernels pinned to isa (cpu_pins), its train.py run through
    stop (a Stop: None, one that never stops). Returns its status: 'finished', 'diverged', 'failed',
    'stopped' (by a signal: its checkpoint resumes it), 'not begun' (the driver was stopping) or
    'elsewhere': another driver holds the cell's CELL_LOCK (it runs the cell now) and this one leaves
    the cell alone (its train.out, its wall-time account)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CELL_LOCK), 'a') as lock:
        if not runs.take_lock(lock):
            print(f"{name}: skipped, it runs elsewhere (another study.py holds {lock.name})", flush=True)
            return 'elsewhere'
        return run_held_cell(name, args, out_dir, results, threads, isa, lock, stop or Stop())


def run_held_cell(name, args, out_dir, results, threads, isa, lock, stop):
    """run_cell's work once this driver holds the cell's lock (the open file lock: train.py inherits
    it, so a driver killed mid-run leaves the cell held until its train.py ends too)."""
    results.refresh()  # another driver may have finished the cell, or seen it diverge, since this one began
    try:
        records = read_log(out_dir)
    except SystemExit as e:  # a log damaged before its last line: this cell waits for its repair, not the others
        print(f"{name}: {e}", flush=True)
        return 'failed'
    if any('final_val_loss' in r for r in records):
        status = 'finished'
    elif name in results.data['cells'] and results.data['cells'][name]['status'] == 'diverged':
        return 'diverged'
    elif stop.received:
        return 'not begun'
    else:
        resume = os.path.exists(os.path.join(out_dir, 'ckpt.pt'))
        cmd = [sys.executable, os.path.join(ROOT, 'train.py'), *args, f'--out_dir={out_dir}']
        if resume:
            cmd.append('--init_from=resume')
        # its progress, the run's own estimate included, is in train.out: say where
        print(f"{name}: {'resuming' if resume else 'starting'} (progress: tail -f {out_dir}/train.out)", flush=True)
        open_segment(out_dir)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **cpu_pins(isa))
        train_out = os.path.join(out_dir, 'train.out')
        begun = os.path.getsize(train_out) if os.path.exists(train_out) else 0  # train.out keeps earlier runs'
        with open(train_out, 'a') as out:
            code = stop.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                            pass_fds=(lock.fileno(),))
        wall = close_segment(out_dir, ran=code is not None)
        if code is None:  # the signal came between the check above and the start
            print(f"{name}: not begun after all: the driver is stopping", flush=True)
            return 'not begun'
        with open(train_out, 'rb') as f:  # this run's output, its last 2,000 bytes
            f.seek(max(begun, os.path.getsize(train_out) - 2000))
            tail = f.read().decode('utf-8', 'replace')
        if code in SIGNAL_EXITS:  # the driver's stop, forwarded (Stop), or a signal of the run's own
            said = next((line.split('; continue with:')[0] for line in reversed(tail.splitlines())
                         if line.startswith(('stopped by ', 'second '))),  # step lines may come after it
                        f"stopped by {SIGNAL_EXITS[code].name} while starting")
            print(f"{name}: {said}; the same study.py command continues it", flush=True)
            return 'stopped'
        if code != 0:
            if runs.DIVERGED not in tail:
                print(f"{name}: train.py failed (exit {code}); see {out_dir}/train.out:\n{tail}",
                      flush=True)
                return 'failed'
            it = int(tail.rsplit(f'{runs.DIVERGED} at iteration ', 1)[1].split()[0])
            results.put(name, dict(status='diverged', diverged_at=it, args=args, config=acting_config(args),
                                   data=data_of(args), **provenance(wall, threads, args, isa)))
            print(f"{name}: diverged at iteration {it}", flush=True)
            return 'diverged'
        records, status = read_log(out_dir), 'finished'
        results.put(name, dict(status=status, args=args, config=acting_config(args), data=data_of(args),
                               **provenance(wall, threads, args, isa), **summarize(records)))
        print(f"{name}: final_val_loss {results.data['cells'][name]['final_val_loss']:.4f} "
              f"({wall['wall_s'] / 60:.1f} min over {wall['segments']} run(s))", flush=True)
        return status
    # a finished cell's summary is rebuilt from its log, so a new summary field reaches old cells
    old = results.data['cells'].get(name)
    if old is None or old.get('status') != 'finished':  # finished before results.json knew
        # no config, and no cpu_capability or cpu_pins: how the run was pinned is unknown (not this host's kernels)
        old = {k: v for k, v in dict(status=status, args=args, **provenance({'wall_s': None}, threads, args)).items()
               if k not in ('cpu_capability', 'cpu_pins')}
    new = {**old, **summarize(records)}
    if new != old:
        results.put(name, new)
    return status


def data_of(args):
    """The dataset a cell trains on: {dataset, tokens {train, val}, meta_sha256}, so that no table
    mixes cells of two datasets, or of two preparations of one. meta_sha256 is the sha256 of
    meta.json's JSON (keys sorted) less its 'sources' (runs.data_identity), so the same corpus
    prepared from another folder matches."""
    cfg = cell_config(args)
    folder = os.path.join(ROOT, cfg['data_dir'], cfg['dataset'])
    with open(os.path.join(folder, 'meta.json')) as f:
        meta = runs.data_identity(json.load(f))
    tokens = {s: os.path.getsize(os.path.join(folder, f'{s}.bin')) // 2 for s in ('train', 'val')}
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    return dict(dataset=cfg['dataset'], tokens=tokens, meta_sha256=digest)


def acting_config(args):
    """What a cell's record keeps of its configuration, and an edited matrix is checked against
    (check_unchanged): cell_config's keys that act in the run (train.idle_keys), less those a resume
    may change because no result depends on them (train.RESUME_FREE: out_dir, device, ...)."""
    import train
    cfg = cell_config(args)
    skip = {*train.idle_keys(SimpleNamespace(**cfg)), *train.RESUME_FREE}
    return {k: v for k, v in cfg.items() if k not in skip}


def check_unchanged(cells, records):
    """SystemExit before any cell runs or table is written, unless each cell whose record keeps its
    configuration (`config`: records from before that key are not checked) would run with it again:
    a matrix edited under a finished cell would otherwise skip the cell and tabulate its old result
    as the new arguments'. Keys in both are compared: one train.py added or dropped since, or one
    that starts or stops acting, comes with a change to a key in both (taper, norm_removal, ...).
    The message names each cell and each key, old value → new."""
    changed = []
    for name, args in cells.items():
        old = records.get(name, {}).get('config')
        if old is None:
            continue
        new = acting_config(args)
        keys = [k for k in sorted(set(old) & set(new)) if old[k] != new[k]]
        if keys:
            changed.append(f"{name} ({', '.join(f'{k}: {old[k]!r} → {new[k]!r}' for k in keys)})")
    if changed:
        raise SystemExit(f"the matrix changed under {len(changed)} recorded cell(s): {'; '.join(changed)}. Their records "
                         "hold the old configuration's results: give the new cells new names, or restore the matrix "
                         "(or move each folder away and delete its entry in results.json)")


def check_comparable(cells, args):
    """SystemExit unless every cell trained on the same dataset (by name; by meta.json's hash where
    the record has one: records from before part 3 name only their arguments) and on the same
    device (a record without one ran on this repository's 2-core CPU: no GPU was used before the key)."""
    names = {cell_config(args[n])['dataset'] for n in cells}
    hashes = {c['data']['meta_sha256'] for c in cells.values() if c.get('data')}
    if len(names) > 1 or len(hashes) > 1:
        raise SystemExit(f"the cells of one table trained on different data ({', '.join(sorted(names))}; "
                         f"{len(hashes)} preparations by meta.json's hash): tabulate them separately")
    devices = {c.get('device', 'cpu') for c in cells.values()}
    if len(devices) > 1:
        raise SystemExit(f"the cells of one table ran on different devices ({', '.join(sorted(devices))}): "
                         "tabulate them separately (each device's cells in their own --study_dir)")


def on_device(cells, device, study_dir):
    """The cells with every one moved to `device` in float32 (study.py --device=cuda: a GPU run
    takes a whole block, several cells at once); SystemExit if study_dir is the CPU cells'."""
    if os.path.abspath(study_dir) in (os.path.abspath('study'), os.path.join(ROOT, 'study')):
        raise SystemExit(f"device={device!r}: its cells go in their own folder, apart from the CPU cells "
                         f"of study/ (add --study_dir=study_{device.split(':')[0]})")
    return {n: a + [f'--device={device}', '--dtype=float32'] for n, a in cells.items()}


def cpu_model():
    """The CPU's model name ('AMD EPYC', ...): /proc/cpuinfo's on Linux, else platform.processor()."""
    try:
        with open('/proc/cpuinfo') as f:
            return next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '')
    except OSError:
        return platform.processor()


def provenance(wall, threads, args, isa=''):
    """Where and with what a cell ran: git commit, torch, threads, the wall-time fields of
    close_segment ({'wall_s': seconds, ...}), device and dtype, and on
    a CPU the instruction set torch's kernels used (AVX2, AVX512, ...): two hosts with the same
    torch can round differently, so a cell rerun elsewhere matches only to within float noise,
    which training amplifies (docs/results.md, the machine effect); with the pins of cpu_pins(isa)
    that set it, where the cell ran pinned; and the host itself (host_cpu: its model name;
    host_capability: what its kernels use unpinned), so that cells are compared like with like."""
    cfg = cell_config(args)
    dev, dtype = resolve_device(cfg['device'], cfg['dtype'])
    where = f"{dev}: {torch.cuda.get_device_name(dev)}" if dev.startswith('cuda') else dev
    pins = cpu_pins(isa)
    cpu = {} if dev.startswith('cuda') else dict(
        cpu_capability=isa.upper() if pins else torch.backends.cpu.get_cpu_capability(), **({'cpu_pins': pins} if pins else {}),
        host_cpu=cpu_model(), host_capability=torch.backends.cpu.get_cpu_capability())  # the driver runs unpinned
    return dict(git_commit=git_commit(), torch=torch.__version__, threads=threads, **wall,
                device=where, dtype=dtype, tf32=uses_tf32(dev, dtype), **cpu)


# ---- tables -----------------------------------------------------------------------------

def mean_sd(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else float('nan'))


def t_quantile(p, df):
    """The p-quantile of Student's t distribution with df degrees of freedom (0.5 < p < 1, df a
    whole number >= 1): bisection on its CDF in closed form, P(|T| <= t) as Abramowitz & Stegun
    26.7.3 (odd df) and 26.7.4 (even df) write it (scipy.stats.t.ppf, without needing scipy).
    ValueError for a p or df outside those ranges."""
    if not 0.5 < p < 1 or df < 1 or df != int(df):
        raise ValueError(f"t_quantile(p={p}, df={df}): needs 0.5 < p < 1 and a whole df >= 1")
    df = int(df)  # 3.0 is a whole number too; the series below count terms with it

    def central(t):  # P(|T| <= t) with theta = atan(t / sqrt(df))
        theta = math.atan(t / math.sqrt(df))
        s, c = math.sin(theta), math.cos(theta)
        total, term = 0.0, 1.0
        if df % 2:  # (2/pi) (theta + sin(theta) (cos + 2/3 cos^3 + ... + 2·4···(df−3)/(1·3···(df−2)) cos^(df−2)))
            for k in range((df - 1) // 2):
                term = c if k == 0 else term * c * c * (2 * k) / (2 * k + 1)
                total += term
            return 2 / math.pi * (theta + s * total)
        for k in range(df // 2):  # sin(theta) (1 + 1/2 cos^2 + 1·3/(2·4) cos^4 + ... up to cos^(df−2))
            term = 1.0 if k == 0 else term * c * c * (2 * k - 1) / (2 * k)
            total += term
        return s * total

    lo, hi = 0.0, 1.0
    while central(hi) < 2 * p - 1:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central(mid) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def mean_interval(xs, level=0.95):
    """(mean, sd, low, high) of xs: the two-sided `level` confidence interval of the mean,
    mean ± t_{(1+level)/2, n−1} · sd / sqrt(n); sd, low and high are nan for one value (no spread
    to measure, no interval)."""
    m, sd = mean_sd(xs)
    if len(xs) < 2:
        return m, sd, float('nan'), float('nan')
    half = t_quantile((1 + level) / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
    return m, sd, m - half, m + half


def fmt(m_sd, digits=4, pct=False):
    m, sd = m_sd
    if pct:
        return f"{m:+.2f} %" if math.isnan(sd) else f"{m:+.2f} ± {sd:.2f} %"
    return f"{m:.{digits}f}" if math.isnan(sd) else f"{m:.{digits}f} ± {sd:.{digits}f}"


def fmt_gap(gaps, over=''):
    """Per-seed % gaps as 'mean ± sd % [low, high]' (the 95 % interval, t on n − 1 df), or
    'gap % (one seed: no interval)'. over: the seeds they pair ('s1–2', as seeds writes them), named
    where they are not those of the mean beside the gap (gap_text): '... over s1–2', '(one seed, s2: ...)'."""
    m, sd, lo, hi = mean_interval(gaps)
    if math.isnan(sd):
        return f"{m:+.2f} % (one seed{', ' * bool(over)}{over}: no interval)"
    return f"{m:+.2f} ± {sd:.2f} % [{lo:+.2f}, {hi:+.2f}]" + (f" over {over}" if over else '')


# which tables a matrix reports (step times only from runs that had the machine to themselves), by
# markdown block: <!-- study:MATRIX --> holds the matrix's own tables, <!-- study:MATRIX:PART --> more
# of its tables for another place (the ladder's summary, atop docs/results.md and in the README)
TABLES = {'timing': ('steps',), 'lr': ('lr',), '3M_lr': ('lr',), 'chasing': ('chasing',), 'gpt2proxy': ('losses',),
          'ladder': ('ladder_sizes', 'ladder'), 'ladder:summary': ('ladder_summary',)}


def tables(cells, parts=('losses', 'scales'), args=None, everything=None):
    """Markdown tables of the finished cells, grouped by the name without its seed: 'losses'
    (over seeds, with the per-seed paired difference to the baseline), 'scales' (the calibrate
    event and the scale diagnostics), 'steps' (median step time per phase vs the baseline's),
    'lr' (each variant at its best learning rate), 'chasing' (the taper's spike and the scale
    diagnostics against the baseline at the same learning rate), 'ladder', 'ladder_sizes' and
    'ladder_summary' (part 3: ladder_table, ladder_sizes, ladder_summary). args: {name: train.py
    arguments} of the cells; everything: all cells of the results file (the baselines 'chasing'
    compares with)."""
    groups = {}
    for name, c in cells.items():
        group, seed = name.rsplit('-s', 1)
        groups.setdefault(group, {})[int(seed)] = c
    base_name = next((g for g in groups if g.startswith(('baseline', 'vanilla'))), None)
    make = {'losses': lambda: loss_table(groups, base_name), 'scales': lambda: scale_table(groups, base_name),
            'steps': lambda: step_table(groups, base_name), 'lr': lambda: lr_table(cells, args),
            'chasing': lambda: chasing_table(cells, args, everything or cells),
            'ladder': lambda: ladder_table(cells, args), 'ladder_sizes': lambda: ladder_sizes(cells, args),
            'ladder_summary': lambda: ladder_summary(cells, args)}
    return '\n\n'.join(make[p]() for p in parts)


def check_data(cells, records):
    """SystemExit, in one message, where a cell still to run (not in records) trains on a dataset
    that is not prepared (TinyStories excepted: train.py prepares it), with the command that
    prepares it; else every such cell's train.py would fail, each with the same message."""
    missing = {}
    for name, args in cells.items():
        if name in records:
            continue
        cfg = cell_config(args)
        folder = os.path.join(ROOT, cfg['data_dir'], cfg['dataset'])
        if cfg['dataset'] != 'tinystories' and not all(
                os.path.exists(os.path.join(folder, f)) for f in ('train.bin', 'val.bin', 'meta.json')):
            missing.setdefault(folder, []).append(name)
    if missing:
        raise SystemExit('\n'.join(
            f"{len(names)} cell(s) train on {folder}, which is not prepared (no train.bin, val.bin and meta.json); "
            f"prepare it first:\n    {runs.prepare_command(os.path.basename(folder), folder)}"
            for folder, names in missing.items()))


def cell_config(args):
    """A cell's whole train.py configuration as a dict: train.py's defaults, then the cell's
    config files (relative to the repository) and overrides, resolved as train.py resolves them."""
    import train  # its run is behind `if __name__ == '__main__'`; importing it only reads its keys
    cfg = parse_args([a if a.startswith('--') else os.path.join(ROOT, a) for a in args],
                     defaults_of(vars(train)), train.CHOICES)
    train.scale_schedule(cfg)  # the step counts the run will have
    return cfg


def lr_table(cells, args):
    """Final val loss of each variant (the name before its first '-') at each peak learning
    rate, its best learning rate, and the difference to the baseline at the baseline's best."""
    by = {}
    for name, c in cells.items():
        by.setdefault(name.split('-')[0], {})[cell_config(args[name])['learning_rate']] = c
    lrs = sorted({lr for v in by.values() for lr in v})
    val = lambda c: c['final_val_loss'] if c['status'] == 'finished' else math.inf
    best = {v: min(row, key=lambda lr: val(row[lr])) for v, row in by.items()}
    best = {v: lr for v, lr in best.items() if math.isfinite(val(by[v][lr]))}  # every rate diverged: none is best
    base = 'baseline' if 'baseline' in best else None
    lines = ["| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr | vs baseline at its best lr |",
             "|---|" + "---|" * (len(lrs) + 2)]
    for v, row in by.items():
        cell = lambda lr: ('—' if lr not in row else f"diverged at {row[lr]['diverged_at']}"
                           if row[lr]['status'] == 'diverged' else f"{row[lr]['final_val_loss']:.4f}")
        diff = (f"{100 * (val(row[best[v]]) / val(by[base][best[base]]) - 1):+.2f} %"
                if base and v != base and v in best else '—')
        so_far = ' (so far)' if any(n.split('-')[0] == v and n not in cells for n in args) else ''  # cells still to run
        rate = f"{best[v]:g}" if v in best else 'none (all diverged)'
        lines.append(f"| {v} | " + " | ".join(cell(lr) for lr in lrs) + f" | {rate}{so_far} | {diff} |")
    return '\n'.join(lines)


def ladder_best(cells, args):
    """Part 3's cells (named VARIANT-SIZE-tBUDGET-lrLR-sSEED) at each variant's best learning rate:
    {(size, budget): {variant: (best lr, {seed: cell}, note)}}. The best lr is chosen on seed 1,
    the seed every rate of the grid runs (a diverged cell counts as infinite), so that seeds 2-3
    added at the best rate cannot move it; {seed: cell} holds every seed run there. note is
    '(so far)' while a seed-1 cell of the variant at that point is still to run, else 'all diverged'
    where every seed-1 cell diverged (no rate is best: the tables say none), else 'edge' when
    the best is the smallest or largest rate of a grid of three or more (block 6's two rates are no
    grid). A variant with no seed-1 cell at a point has no entry there."""
    runs = {}
    for name, c in cells.items():
        v, size, budget, lr, seed = name.split('-')
        runs.setdefault((size, budget[1:]), {}).setdefault(v, {}).setdefault(float(lr[2:]), {})[int(seed[1:])] = c
    val = lambda c: c['final_val_loss'] if c['status'] == 'finished' else math.inf
    out = {}
    for point, by_v in runs.items():
        out[point] = {}
        for v, by_lr in by_v.items():
            ranked = [lr for lr in by_lr if 1 in by_lr[lr]]
            if not ranked:  # seed 1 ranks the grid: without it (running elsewhere, left out by --only) no best yet
                continue
            best = min(ranked, key=lambda lr: val(by_lr[lr][1]))
            todo = any(n.startswith(f'{v}-{point[0]}-t{point[1]}-') and n.endswith('-s1') and n not in cells
                       for n in args)
            edge = len(by_lr) > 2 and best in (min(by_lr), max(by_lr))
            note = ('(so far)' if todo else 'all diverged' if math.isinf(val(by_lr[best][1])) else
                    'edge' if edge else '')
            out[point][v] = (best, by_lr[best], note)
    return out


def paired_gap(by_seed, base):
    """{seed: % gap}, in seed order: each finished cell of {seed: cell} against the finished baseline
    cell of the same seed in base {seed: cell}, 100 · (final val loss / the baseline's − 1); a seed
    either lacks, or where either did not finish, is left out. Paired by seed, never by position."""
    return {s: 100 * (c['final_val_loss'] / base[s]['final_val_loss'] - 1) for s, c in sorted(by_seed.items())
            if c['status'] == 'finished' and base.get(s, {}).get('status') == 'finished'}


def gap_text(by_seed, base):
    """The paired gap of by_seed to base (paired_gap) as the tables write it (fmt_gap), naming the
    seeds it pairs where they are not every finished seed of by_seed (those of the mean loss beside
    it: a mean over s1–3 beside a gap over s1–2 says so); '' when no seed pairs."""
    gaps = paired_gap(by_seed, base)
    done = sorted(s for s, c in by_seed.items() if c['status'] == 'finished')
    return fmt_gap(list(gaps.values()), '' if list(gaps) == done else seeds(gaps)) if gaps else ''


def seeds(xs):
    xs = sorted(xs)
    return f's{xs[0]}' if len(xs) == 1 else f's{xs[0]}–{xs[-1]}' if xs == list(range(xs[0], xs[-1] + 1)) \
        else 's' + ','.join(map(str, xs))


def calibration_of(v, by_seed):
    """The calibration a part-3 variant's cells ran with ('end' or 'ema'), read from their records'
    arguments (VARIANTS7's where a record has none), or '—' where nothing tapers."""
    args = next((c['args'] for c in by_seed.values() if c.get('args')), VARIANTS7.get(v, []))
    value = lambda key, default: next((a.split('=', 1)[1] for a in reversed(args) if a.startswith(f'--{key}=')), default)
    return '—' if value('taper', 'none') == 'none' else value('calibration', '?')


def rates_tried(cells, v, size, budget):
    """The peak learning rates a part-3 variant ran at a point with seed 1 (the grid its best is chosen on)."""
    return sorted({float(n.split('-')[3][2:]) for n in cells
                   if n.startswith(f'{v}-{size}-t{budget}-') and n.endswith('-s1')})


def rate_how(note, n_rates):
    """How a best rate of ladder_best (its note, and the number of rates run at seed 1) was found:
    '' when bracketed by a grid of three or more, 'edge' at that grid's edge, 'so far' while
    the grid runs, 'all diverged' where no rate is best; for one or two rates no best at all: 'only
    rate run', 'better of two'."""
    how = (note if n_rates > 2 or note in ('(so far)', 'all diverged') else
           'only rate run' if n_rates == 1 else 'better of two')
    return how.strip('()')


def rate_text(lr, note):
    """A best rate of ladder_best as a number ('0.008'), or 'none' where every rate diverged."""
    return 'none' if note == 'all diverged' else f"{lr:g}"


def rate_label(lr, note, n_rates):
    """A best rate as the tables write it: '0.008', or '0.008 (HOW)' (rate_how); 'none (all diverged)'."""
    how = rate_how(note, n_rates)
    return rate_text(lr, note) + (f" ({how})" if how else '')


def ladder_sizes(cells, args):
    """Part 3's result, one table per model size: each variant (with the calibration its cells ran)
    at its best learning rate at each budget: the final val loss (mean ± sd over the seeds run
    there), the rate (marked where it is no bracketed best: rate_label) and seeds, and the paired
    gap to the baseline at the baseline's best rate (mean ± sd of the per-seed gaps, with its 95 %
    interval, t on n − 1 df: fmt_gap)."""
    best = ladder_best(cells, args)
    out = []
    for size in sorted({p[0] for p in best}, key=lambda s: float(s[:-1])):
        budgets = sorted((p[1] for p in best if p[0] == size), key=lambda b: float(b[:-1]))
        variants = [v for v in VARIANTS7 if any(v in best[size, b] for b in budgets)]
        lines = [f"**{size} model**", "", "| variant (calibration) | " + " | ".join(f"{b} tokens" for b in budgets) + " |",
                 "|---|" + "---|" * len(budgets)]
        for v in variants:
            row, cal = [], '—'
            for b in budgets:
                if v not in best[size, b]:
                    row.append('—')
                    continue
                lr, by_seed, note = best[size, b][v]
                cal = calibration_of(v, by_seed)
                done = [c['final_val_loss'] for c in by_seed.values() if c['status'] == 'finished']
                base = best[size, b].get('baseline')
                gap = gap_text(by_seed, base[1]) if base and v != 'baseline' else ''
                how = rate_how(note, len(rates_tried(cells, v, size, b)))
                row.append((fmt(mean_sd(done)) if done else 'diverged') +
                           f" (lr {rate_text(lr, note)}{', ' * bool(how)}{how}, {seeds(by_seed)})" + (f": {gap}" if gap else ''))
            lines.append(f"| {v}" + (f" ('{cal}')" if cal != '—' else '') + " | " + " | ".join(row) + " |")
        out.append('\n'.join(lines))
    return '\n\n'.join(out)


def ladder_table(cells, args):
    """One row per (size, budget, variant) of part 3: the calibration its cells ran with, the
    learning rates tried (seed 1), the best one (rate_label), the final val loss there (mean ± sd
    over seeds), the paired gap to the baseline at its own best rate (per seed run by both: mean ±
    sd and the 95 % interval of the mean, t on n − 1 df), and val − train there (mean over seeds:
    the val split is the last ~5 % of each source file, text unlike the training windows, so this
    is a distribution shift as much as fitting; compare it between variants at one seed)."""
    lines = ["| size | tokens | variant | calibration | lrs tried (seed 1): final val loss | best lr | "
             "final val loss (seeds) | vs baseline at its best, paired: mean ± sd [95 % interval] | val − train |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (size, budget), by_v in sorted(ladder_best(cells, args).items(), key=lambda kv: (kv[0][0], float(kv[0][1][:-1]))):
        base = by_v.get('baseline')
        for v, (lr, by_seed, note) in by_v.items():
            done = {s: c for s, c in by_seed.items() if c['status'] == 'finished'}
            tried = sorted((float(n.split('-')[3][2:]), c) for n, c in cells.items()
                           if n.startswith(f'{v}-{size}-t{budget}-') and n.endswith('-s1'))
            grid = ', '.join(f"{x:g}: " + (f"{c['final_val_loss']:.4f}" if c['status'] == 'finished'
                                           else f"diverged at {c['diverged_at']}") for x, c in tried)
            paired = gap_text(by_seed, base[1]) if base and v != 'baseline' else ''
            loss = fmt(mean_sd([c['final_val_loss'] for c in done.values()])) if done else '—'
            fit = (f"{statistics.mean(c['final_val_loss'] - c['final_train_loss'] for c in done.values()):.3f}"
                   if done else '—')
            lines.append(f"| {size} | {budget} | {v} | {calibration_of(v, by_seed)} | {grid} | "
                         f"{rate_label(lr, note, len(tried))} | {loss} ({','.join(map(str, sorted(done)))}) | "
                         f"{paired or '—'} | {fit} |")
    return '\n'.join(lines)


# the summary table (ladder_summary): one row per (label, the first of its variants measured at a
# point): the users' default calibration ('ema') first; Internal-Taper with 'end' too, part 3's rows
# with three seeds at both long points; and the paper's TinyStories band (% above the RMSNorm
# baseline, 1M-30M parameters: method.md §6), where it reports one
SUMMARY_VARIANTS = (('baseline (RMSNorm)', ('baseline',)), ('Internal-Taper', ('internal_ema',)),
                    ('Internal-Taper', ('internal',)), ('All-Taper', ('all_ema', 'all')), ('DyT', ('dyt',)),
                    ('Derf', ('derf',)))
PAPER_BAND = {'Internal-Taper': (0.7, 1.5), 'All-Taper': (0.8, 1.8)}


def ladder_summary(cells, args):
    """The study's answer in one table: each method at each model size's longest budget where it ran
    and whose baseline grid is done (its best rate not '(so far)'; a longer budget still running is
    reported in its part only; a size with no budget done shows its longest), and the baseline at
    every budget a method row of its size shows: the baseline,
    Internal-Taper (with 'ema', the default, and 'end'), All-Taper ('ema' where its cells exist,
    else 'end') and DyT (SUMMARY_VARIANTS; each row names its calibration) at their best learning
    rate (rate_label), with seeds, the final val loss (mean ± sd), the paired gap to the baseline at
    its best rate with its 95 % interval (fmt_gap), and the paper's band beside it (PAPER_BAND)."""
    best = ladder_best(cells, args)
    budgets = {}  # size -> its budgets to read, longest first: those whose baseline grid is done, else its longest
    for size in {p[0] for p in best if 'baseline' in best[p]}:
        ran = sorted((p[1] for p in best if p[0] == size and 'baseline' in best[p]), key=lambda b: -float(b[:-1]))
        budgets[size] = [b for b in ran if best[size, b]['baseline'][2] != '(so far)'] or ran[:1]
    rows = {}  # (label, keys, size) -> the budget its row reads
    for label, keys in SUMMARY_VARIANTS[1:]:
        for size, bs in budgets.items():
            b = next((b for b in bs if any(k in best[size, b] for k in keys)), None)
            if b is not None:
                rows[label, keys, size] = b
    for size, bs in budgets.items():  # the baseline beside every budget its size's rows read
        rows.update({(*SUMMARY_VARIANTS[0], size, b): b for b in bs if b == bs[0] or b in
                     {rows[k] for k in rows if k[2] == size}})
    lines = ["| variant | calibration | model size · tokens of mix7 (read once) | lr | seeds | final val loss | "
             "vs baseline, paired: mean ± sd [95 % interval] | the paper (TinyStories) |",
             "|---|---|---|---|---|---|---|---|"]
    order = lambda k: ([v for v in SUMMARY_VARIANTS].index(k[:2]), -float(k[2][:-1]), -float(rows[k][:-1]))
    for key in sorted(rows, key=order):
        label, keys, size = key[:3]
        point = (size, rows[key])
        v = next(k for k in keys if k in best[point])
        lr, by_seed, note = best[point][v]
        done = [c['final_val_loss'] for c in by_seed.values() if c['status'] == 'finished']
        gap = gap_text(by_seed, best[point]['baseline'][1]) if v != 'baseline' else ''
        band = PAPER_BAND.get(label)
        how = rate_how(note, len(rates_tried(cells, v, *point))) or 'bracketed'
        lines.append(f"| {label} | {calibration_of(v, by_seed)} | {size} params · {point[1]} tokens | "
                     f"{rate_text(lr, note)} ({how}) | {seeds(by_seed)} | "
                     f"{fmt(mean_sd(done)) if done else 'diverged'} | {gap or '—'} | "
                     f"{f'+{band[0]:g} to +{band[1]:g} %' if band else '—'} |")
    return '\n'.join(lines)


def chasing_table(cells, args, everything):
    """One row per cell: λ, W / T, peak learning rate; the largest loss from W on (and the loss
    just before W); the largest hidden_rms s(h), logit_rms and |radial_cos|; the final val loss
    against the baseline's at the same learning rate (the cell baseline-end-s1 or
    baseline-lr{lr}-s1 of the results file). 'spiked': the loss from W on rose more than 10 %
    above its value at W; 'recovered': the final train loss is below the loss at W again."""
    lines = ["| cell | λ | W / T | lr | loss at W → largest after (iter) | spiked (recovered) | "
             "s(h) max | logit_rms max | abs radial_cos max | final val loss | vs baseline (same lr) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in cells.items():
        a = cell_config(args[name])
        lr = a['learning_rate']
        head = f"| {name} | {a['aux_weight']:g} | {a['gate_warmup_iters']} / {a['taper_iters']} | {lr:g} |"
        if c['status'] == 'diverged':
            lines.append(head + f" diverged at {c['diverged_at']} |" + " |" * 6)
            continue
        sp = c['spike']
        spiked = sp['peak'] > 1.1 * sp['loss_at_W']
        base = everything.get('baseline-end-s1' if lr == 2e-3 else f'baseline-lr{lr:g}-s1', {})
        vs = (f"{100 * (c['final_val_loss'] / base['final_val_loss'] - 1):+.2f} %"
              if base.get('status') == 'finished' else '—')
        lines.append(head + f" {sp['loss_at_W']:.2f} → {sp['peak']:.2f} ({sp['peak_iter']}) | "
                     f"{('yes, ' + ('yes' if c['final_train_loss'] < sp['loss_at_W'] else 'no')) if spiked else 'no'} | "
                     f"{c['hidden_rms_max']:.2f} | {c['logit_rms_max']:.2f} | {c['radial_cos_max']:.2g} | "
                     f"{c['final_val_loss']:.4f} | {vs} |")
    return '\n'.join(lines)


def loss_table(groups, base_name):
    base = groups.get(base_name, {})
    lines = ["| variant | seeds | final val loss | vs baseline, paired: mean ± sd [95 % interval] | final train loss | val − train |",
             "|---|---|---|---|---|---|"]
    for g, by_seed in groups.items():
        done = {s: c for s, c in by_seed.items() if c['status'] == 'finished'}
        diverged = [f"s{s} diverged at {c['diverged_at']}" for s, c in by_seed.items() if c['status'] == 'diverged']
        if not done:
            lines.append(f"| {g} | {', '.join(diverged) or '-'} | | | | |")
            continue
        val = [c['final_val_loss'] for c in done.values()]
        train = [c['final_train_loss'] for c in done.values()]
        paired = gap_text(by_seed, base) if g != base_name else ''
        ran = ','.join(str(s) for s in sorted(done)) + (f" ({'; '.join(diverged)})" if diverged else '')
        lines.append(f"| {g} | {ran} | {fmt(mean_sd(val))} | {paired or '—'} | "
                     f"{fmt(mean_sd(train))} | {fmt(mean_sd([v - t for v, t in zip(val, train)]), 3)} |")
    return '\n'.join(lines)


def scale_table(groups, base_name):
    lines = ["| variant | seeds | c range | s_tgt | branch mismatch ‖L−N‖/‖N‖ | hidden_rms last (max) | "
             "logit_rms last (max) | radial_cos, absolute: last (max) |", "|---|---|---|---|---|---|---|---|"]
    rng = lambda xs: f"{min(xs):.3f}–{max(xs):.3f}" if xs else '—'
    for g, by_seed in groups.items():
        done = [c for c in by_seed.values() if c['status'] == 'finished']
        if not done:
            continue
        cal = [c['calibrate'] for c in done if 'calibrate' in c]
        cs = [v for k in cal for v in k['c'].values()]
        mm = [v for k in cal for v in (k['mismatch'] or {}).values()]
        diag = lambda k, f='.3f': (f"{statistics.mean(abs(c[k + '_last']) for c in done):{f}} "
                                   f"({max(c[k + '_max'] for c in done):{f}})")
        lines.append(f"| {g} | {len(done)} | {rng(cs)} | {rng([k['s_tgt'] for k in cal])} | {rng(mm)} | "
                     f"{diag('hidden_rms')} | {diag('logit_rms')} | {diag('radial_cos', '.2g')} |")
    return '\n'.join(lines)


def step_table(groups, base_name):
    base = groups.get(base_name, {})
    tapered = next((c for g, by in groups.items() if g != base_name for c in by.values()
                    if c['status'] == 'finished' and c.get('linear_from')), None)
    if tapered is None or not base:
        return ''
    W, L = tapered['calibrate']['iter'] + 1, tapered['linear_from']  # the phases' first iterations
    phases = {'warmup': (0, W), 'taper': (W, L), 'linear': (L, 10 ** 9)}
    lines = ["| variant | " + " | ".join(f"{p} step (vs baseline)" for p in phases) + " |",
             "|---|" + "---|" * len(phases)]
    for g, by_seed in groups.items():
        cells = [(s, c) for s, c in by_seed.items() if c['status'] == 'finished' and s in base]
        row = []
        for lo, hi in phases.values():
            ratios, ms = [], []
            for s, c in cells:
                its = [it for it in c['step_ms'] if lo <= int(it) < hi and it in base[s]['step_ms']]
                if its:
                    ms.append(statistics.median(c['step_ms'][it] for it in its))
                    ratios.append(ms[-1] / statistics.median(base[s]['step_ms'][it] for it in its))
            row.append(f"{statistics.mean(ms):.0f} ms ({statistics.mean(ratios):.3f}×)" if ms else '—')
        if cells:
            lines.append(f"| {g} | " + " | ".join(row) + " |")
    return '\n'.join(lines)


def marks(block):
    """The two comments a markdown file holds around a study block: (opening, closing)."""
    return f'<!-- study:{block} -->', f'<!-- /study:{block} -->'


def marked_blocks(path, names):
    """(a markdown file's text, those of `names` whose marks it holds). SystemExit in one line if
    path is not a file that can be read, or holds none of them: main checks --readme so before any
    cell runs, not after hours of them."""
    try:
        with open(path, encoding='utf-8') as f:
            doc = f.read()
    except OSError as e:  # a typo (FileNotFoundError), a folder
        raise SystemExit(f"--readme={path}: {e.strerror}: name the markdown file whose study blocks to fill "
                         "(docs/results.md, README.md)") from None
    present = [b for b in names if all(m in doc for m in marks(b))]
    if not present:
        raise SystemExit(f"{path} has no " + " or ".join(' ... '.join(marks(b)) for b in names) + " block to fill")
    return doc, present


def write_between_markers(path, blocks):
    """Replace what lies between <!-- study:BLOCK --> and <!-- /study:BLOCK --> in a markdown file,
    for each {BLOCK: text} whose marks the file holds; SystemExit as marked_blocks."""
    doc, present = marked_blocks(path, blocks)
    for b in present:
        start, end = marks(b)
        head, rest = doc.split(start, 1)
        doc = head + start + '\n' + blocks[b] + '\n' + end + rest.split(end, 1)[1]
    atomic_write(doc, path)


def main(argv):
    """Run (and/or tabulate) the matrix given by argv; returns the results file's contents."""
    cfg = configure(argv, DEFAULTS, choices={'matrix': tuple(MATRICES), 'cpu_isa': ('avx2', '')},
                    validate=lambda c: check_at_least(c, 1, ('jobs', 'threads')))
    cells = MATRICES[cfg.matrix]
    if cfg.only:
        unknown = set(cfg.only.split(',')) - set(cells)
        if unknown:
            raise SystemExit(f"config error: only={cfg.only!r}: {', '.join(sorted(unknown))} not in matrix "
                             f"{cfg.matrix!r} ({', '.join(cells)})")
        cells = {n: a for n, a in cells.items() if n in cfg.only.split(',')}
    if cfg.device:
        if cfg.run:  # a device this machine lacks: one line here, not a failure in every cell
            try:
                resolve_device(cfg.device, 'float32')
            except SystemExit as e:  # its "use --device=cpu" would meet on_device's refusal of study/
                why = str(e.code).removeprefix('config error: ').split('; use ')[0]
                raise SystemExit(f"config error: {why}: leave --device out to run the cells on this CPU") from None
        cells = on_device(cells, cfg.device, cfg.study_dir)
    parts = {cfg.matrix: TABLES.get(cfg.matrix, ('losses', 'scales')),
             **{b: p for b, p in TABLES.items() if b.startswith(cfg.matrix + ':')}}
    if cfg.readme:
        marked_blocks(cfg.readme, parts)
    os.makedirs(cfg.study_dir, exist_ok=True)
    results = Results(os.path.join(cfg.study_dir, 'results.json'))
    check_unchanged(cells, results.data['cells'])
    if cfg.run and fcntl is None:
        raise SystemExit("study.py runs cells on Linux and macOS only: it locks each cell and results.json with "
                         "fcntl, which Windows lacks (run it under WSL); --run=False prints the tables here")
    if cfg.run:
        check_data(cells, results.data['cells'])
        with Stop() as stop, ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
            status = dict(zip(cells, pool.map(lambda n: run_cell(n, cells[n], os.path.abspath(os.path.join(
                cfg.study_dir, n)), results, cfg.threads, cfg.cpu_isa, stop), cells)))
        if stop.received:
            runs.say(f"study.py stopped by {signal.Signals(stop.received).name}: each running cell said above "
                     "where it stopped; the same command continues them")  # say: stderr may have no reader now
            raise SystemExit(runs.exit_code(stop.received))
        count = lambda s: sum(v == s for v in status.values())
        if count('elsewhere'):
            print(f"{count('elsewhere')} cell(s) skipped: another study.py runs them and records them in "
                  f"{results.path}", flush=True)
        ended = [f"{count(s)} cell(s) {how}" for s, how in (('failed', 'failed: fix them'),
                                                           ('stopped', 'stopped by a signal, saved')) if count(s)]
        if ended:
            raise SystemExit('; '.join(ended) + '; then rerun the same command')
    if cfg.table or cfg.readme:
        # under results.json's flock: what another driver has written meanwhile, and one driver at a time
        # reads, fills and replaces cfg.readme (two at once would each drop the other's blocks)
        with results.held():
            done = {n: results.data['cells'][n] for n in cells if n in results.data['cells']}
            check_comparable(done, cells)
            blocks = {b: tables(done, p, cells, results.data['cells']) for b, p in parts.items()}
            print('\n\n'.join(blocks.values()))
            if cfg.readme and not done:  # the tables would be emptied: a wrong --study_dir, most likely
                raise SystemExit(f"no cell of matrix {cfg.matrix!r} has finished in {results.path}: {cfg.readme}'s "
                                 f"tables are kept (is --study_dir the study's folder?)")
            if cfg.readme:
                write_between_markers(cfg.readme, blocks)
    return results.data


if __name__ == '__main__':
    run_command(main)
