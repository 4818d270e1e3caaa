"""
Plot training runs from their log.jsonl: loss, the scale of the pre-logit state s(h), the logits'
RMS and the radial share of the gradient, against the step, with the gate g and the calibrate
step marked. Or, with --ladder, the budget ladder of the study's part 3 (study.py's ladder
matrices): each variant's paired gap to the baseline against the tokens seen. Needs matplotlib
(pip install matplotlib), imported only here.

    python plot.py --runs=study/baseline-end-s1,study/internal-end-s1,study/all-end-s1 --out=docs/plots/main.png
    python plot.py --ladder=study/results.json --out=docs/plots/budget_ladder.png
    python plot.py --gap=study/results.json --out=docs/plots/gap_per_param.png
    python plot.py --shock=study/baseline-1M-t9M-lr0.008-s1:study/internal-1M-t9M-lr0.008-s1 --out=shock.png
"""

import json
import os
import statistics
import sys

from configurator import configure

# -----------------------------------------------------------------------------
runs = ''                   # comma-separated out_dirs (each with a log.jsonl)
ladder = ''                 # instead of --runs: a study results.json, drawn as the budget ladder (ladder_plot)
gap = ''                    # instead of --runs: a study results.json, drawn as the gap per token per parameter (gap_plot)
shock = ''                  # instead of --runs: BASELINE:RUN out_dir pairs (comma-separated), drawn by shock_plot
shock_steps = 300           # with --shock: the steps drawn after each run's calibrate event
labels = ''                 # comma-separated legend labels (default: the folder names)
out = 'plot.png'            # the PNG to write
title = ''                  # a title over the panels
smooth = 5                  # moving average over this many logged training steps (1: none)
max_iter = 0                # draw steps up to this one only (0: the whole run)
ce_span = 2.5               # the cross-entropy panel shows [lowest − 0.2, lowest + ce_span]; 0: everything (a spike)
# -----------------------------------------------------------------------------


def read_run(out_dir, max_iter=0):
    """(step records up to max_iter (0: all), calibrate record or None) of out_dir/log.jsonl;
    SystemExit if it has none."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: --runs takes the out_dir of train.py runs")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if 'loss' in r and (not max_iter or r['iter'] <= max_iter)]
    if not steps:
        raise SystemExit(f"{path} holds no training steps yet")
    return steps, next((r for r in records if r.get('event') == 'calibrate'), None)


def moving_average(xs, n):
    return [sum(xs[max(0, i - n + 1):i + 1]) / len(xs[max(0, i - n + 1):i + 1]) for i in range(len(xs))]


PAPER_GAP = (0.7, 1.8)  # % above the baseline: the paper's tapered models on TinyStories (its budgets not public)
LINEAR_GAP = 2.0  # %: a gap beyond ±this (DyT's) puts the y axis on a symmetric log scale, linear within it


def label_points(ax, labels, gap=9):
    """Write each label [(x, y, text, colour)] just above and right of its point, in its line's
    colour; at one x, a label closer than `gap` points below the one above it moves down to clear it
    (the variants of one budget often end within a few hundredths of a nat of each other)."""
    ax.get_ylim()  # the autoscaled limits, so that data map to points
    to_points = lambda y: ax.transData.transform((1, y))[1] * 72 / ax.figure.dpi
    for x in sorted({lab[0] for lab in labels}):
        above = None
        for _, y, text, color in sorted((lab for lab in labels if lab[0] == x), key=lambda lab: -lab[1]):
            at = to_points(y) + 4 if above is None else min(to_points(y) + 4, above - gap)
            ax.annotate(text, (x, y), textcoords='offset points', xytext=(5, at - to_points(y)), fontsize=7,
                        color=color)
            above = at


def best_points(results_path):
    """The ladder matrices' finished cells of a study results.json as points: (points, args),
    points = {(size, variant): [(tokens seen, [paired % gap per seed], [final val loss per seed],
    unsettled), ...]} for every variant but the baseline and study.LADDER_ABLATIONS, each at its
    best learning rate against the baseline at its own (study.ladder_best, study.paired_gap);
    unsettled: a best rate still on a running grid or at its edge. SystemExit if none."""
    import study
    with open(results_path) as f:
        done = json.load(f)['cells']
    args = {n: a for m in study.LADDER_MATRICES for n, a in study.MATRICES[m].items()}
    cells = {n: done[n] for n in args if n in done}
    if not cells:
        raise SystemExit(f"{results_path} holds no cell of the ladder matrices ({', '.join(study.LADDER_MATRICES)})")
    lines = {}
    for (size, budget), by_v in study.ladder_best(cells, args).items():
        base = by_v.get('baseline')
        if base is None:
            continue
        c = study.cell_config(next(a for n, a in args.items() if n.split('-')[1:3] == [size, 't' + budget]))
        tokens = c['max_iters'] * c['batch_size'] * c['block_size'] * c['gradient_accumulation_steps']
        for v, (lr, by_seed, note) in by_v.items():
            gaps = list(study.paired_gap(by_seed, base[1]).values())
            if v != 'baseline' and v not in study.LADDER_ABLATIONS and gaps:
                lines.setdefault((size, v), []).append((tokens, gaps, [x['final_val_loss'] for x in by_seed.values()
                                                                       if x['status'] == 'finished'],
                                                        bool(note or base[2])))  # a best rate not yet settled
    return lines, args


def size_style(size, sizes):
    """(marker, line style) of a model size among the sizes drawn: each size its own."""
    k = sizes.index(size) % 4
    return 'os^v'[k], ('--', '-', ':', '-.')[k]


def ladder_plot(plt, results_path, out, title):
    """The budget ladder: for every variant but the baseline, its final val loss at its best
    learning rate against the baseline's at its own, paired by seed, in %, against the tokens a
    run saw (log axis); one line per model size and variant, ± sd over seeds as error bars where
    seeds were run, the val loss written beside each point, the paper's range as a band."""
    import study
    lines, _ = best_points(results_path)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    ax.axhspan(*PAPER_GAP, color='0.85', zorder=0, label='paper: +0.7 to +1.8 % (budget not public)')
    ax.axhline(0, color='0.4', lw=0.8)
    variants = list(study.VARIANTS7)  # each variant keeps its colour as others join the plot
    labels = []  # (tokens, gap, text, colour): each point's val loss, written once the lines are drawn
    sizes = sorted({s for s, _ in lines}, key=lambda s: float(s[:-1]))  # each size its marker and line style
    for (size, v), points in sorted(lines.items()):
        points.sort()
        xs = [p[0] for p in points]
        ys = [sum(p[1]) / len(p[1]) for p in points]
        err = [statistics.stdev(p[1]) if len(p[1]) > 1 else 0 for p in points]  # the tables' ± sd
        (marker, ls), color = size_style(size, sizes), f'C{variants.index(v)}'
        ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, color=color, ls=ls,
                    label=f'{v}, {size} model')
        for x, y, p in zip(xs, ys, points):
            labels.append((x, y, f"{sum(p[2]) / len(p[2]):.3f}", color))
            if p[3]:
                ax.plot(x, y, marker=marker, color=color, mfc='white', ls='none', zorder=3)
    symlog = any(abs(sum(p[1]) / len(p[1])) > 2 * LINEAR_GAP for points in lines.values() for p in points)
    if symlog:
        ax.set_yscale('symlog', linthresh=LINEAR_GAP, linscale=2)  # TaperNorm's ±0.5 % stays readable
        lo, hi = ax.get_ylim()
        ax.set_yticks([t for t in (-20, -10, -5, -2, -1, -0.5, 0, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= t <= hi])
        ax.yaxis.set_major_formatter('{x:g}')
    ax.set_ylabel('final val loss vs RMSNorm baseline, paired (%'
                  + (f'; log beyond ±{LINEAR_GAP:g} %)' if symlog else ')'))
    ax.margins(x=0.1)  # room for the labels right of the last budget
    label_points(ax, labels)
    if any(p[3] for points in lines.values() for p in points):
        ax.text(0.01, 0.01, 'hollow: a learning-rate grid still running, or a best rate at its edge',
                transform=ax.transAxes, fontsize=7, color='0.3')
    ax.set_xscale('log')
    ax.set_xlabel('tokens seen (each variant at its best learning rate; beside each point: its final val loss)')
    ax.set_title(title or 'TaperNorm against the budget (mix7, read once)', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))  # outside: DyT's points sit high
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


# the gap figure's variants (TaperNorm with its default calibration, the norm-free baselines), named
# as README's summary table names them
GAP_VARIANTS = {'internal_ema': 'Internal-Taper, ema', 'all_ema': 'All-Taper, ema', 'dyt': 'DyT', 'derf': 'Derf'}
GAP_ORDER = list(GAP_VARIANTS)


def side_by_side(k):
    """The factor on the x of the gap figure's variant k: a point's variants side by side, not on top
    of each other (the x axis is logarithmic)."""
    return 1.05 ** (k - 1.5)


def non_embedding_params(size):
    """Parameters of the ladder's model `size` (study.SIZES over config/cpu.py's shape) outside its
    token and position embeddings (the tied LM head counted with them): the blocks and ln_f."""
    import study
    from model import GPT, GPTConfig
    c = study.cell_config(study.BASE7 + list(study.SIZES[size]))
    model = GPT(GPTConfig(**{k: c[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias')}, vocab_size=1))
    return sum(p.numel() for p in model.transformer.h.parameters()) + sum(
        p.numel() for p in model.transformer.ln_f.parameters())


def gap_plot(plt, results_path, out, title):
    """The gap against the budget per parameter: for 'ema' Internal- and All-Taper, DyT and Derf,
    the final val loss at the variant's best learning rate against the RMSNorm baseline's at its
    own, paired by seed, in %, against tokens seen per non-embedding parameter (log axis); each
    point with its 95 % interval over seeds (study.mean_interval: t on n − 1 df), a one-seed point
    hollow and without one; one marker per model size, one colour per variant, the paper's range
    shaded."""
    import study
    lines, _ = best_points(results_path)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.axhspan(*PAPER_GAP, color='0.85', zorder=0, label='paper: +0.7 to +1.8 % (TinyStories)')
    ax.axhline(0, color='0.4', lw=0.8)
    sizes = sorted({s for s, _ in lines}, key=lambda s: float(s[:-1]))
    per_param = {size: non_embedding_params(size) for size in sizes}
    for (size, v), points in sorted(lines.items(), key=lambda kv: (GAP_ORDER.index(kv[0][1]) if kv[0][1] in
                                                                   GAP_VARIANTS else -1, sizes.index(kv[0][0]))):
        if v not in GAP_VARIANTS:
            continue
        (marker, ls), k = size_style(size, sizes), GAP_ORDER.index(v)
        dodge = side_by_side(k)
        xs, ys = [], []
        for tokens, gaps, _, _ in sorted(points):
            m, _, lo, hi = study.mean_interval(gaps)
            one = len(gaps) == 1
            xs.append(tokens / per_param[size] * dodge)
            ys.append(m)
            ax.errorbar(xs[-1:], ys[-1:], yerr=None if one else [[m - lo], [hi - m]], marker=marker, ms=7, capsize=3,
                        color=f'C{k}', mfc='white' if one else f'C{k}', ls='none',
                        label=None if len(xs) > 1 else f'{GAP_VARIANTS[v]}, {size} model')
        ax.plot(xs, ys, color=f'C{k}', ls=ls, lw=0.8, alpha=0.6)  # one size's budgets
    if any(len(p[1]) == 1 for (_, v), points in lines.items() if v in GAP_VARIANTS for p in points):
        ax.text(0.01, 0.01, 'hollow: one seed, no interval', transform=ax.transAxes, fontsize=8, color='0.3')
    ax.set_xscale('log')
    ax.set_xlabel('tokens seen per non-embedding parameter (log axis; the variants of one budget drawn slightly apart)')
    ax.set_ylabel('final val loss vs RMSNorm baseline, paired by seed (%; bars: 95 % interval)')
    ax.set_title(title or 'The gap against the budget per parameter (mix7, read once)', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def shock_plot(plt, pairs, labels, out, title, steps, smooth):
    """The calibrate event with the logged loss taken apart (it is CE + L_aux): for each
    (baseline out_dir, tapered out_dir) pair, the tapered run's training cross-entropy minus its
    baseline's at the same step (left; a pair that ran on one machine is equal until the taper
    starts), and its L_aux (right, log scale), against the steps from the first step after the
    calibrate event (0: the first step L_aux acts on, g still 1), from 50 steps before it to
    `steps` after; moving averages over `smooth` logged steps. SystemExit for a run without a
    calibrate event."""
    fig, (ax_ce, ax_aux) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, ((base_dir, run_dir), label) in enumerate(zip(pairs, labels)):
        base, _ = read_run(base_dir)
        run, calib = read_run(run_dir)
        if calib is None:
            raise SystemExit(f"{run_dir} has no calibrate event: --shock pairs a tapered run with its baseline")
        first = calib['iter'] + 1
        ce = {r['iter']: r['ce'] for r in base}
        pts = [(r['iter'] - first, r['ce'] - ce[r['iter']], r['aux']) for r in run
               if r['iter'] in ce and -50 <= r['iter'] - first <= steps]
        ax_ce.plot([p[0] for p in pts], moving_average([p[1] for p in pts], smooth), color=f'C{i}', lw=1.3, label=label)
        after = [p for p in pts if p[0] >= 0]
        ax_aux.plot([p[0] for p in after], moving_average([p[2] for p in after], smooth), color=f'C{i}', lw=1.3,
                    label=label)
    ax_ce.axhline(0, color='0.4', lw=0.8)
    ax_ce.set_title('training cross-entropy minus the baseline\'s at the same step', fontsize=10)
    ax_aux.set_yscale('log')
    ax_aux.set_title('L_aux (the rest of the logged loss)', fontsize=10)
    for ax in (ax_ce, ax_aux):
        ax.axvline(0, color='0.6', ls=':', lw=1)
        ax.set_xlabel('steps after the calibrate event')
        ax.grid(alpha=0.3)
    ax_ce.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv):
    cfg = configure(argv, globals())
    if not cfg.runs and not cfg.ladder and not cfg.gap and not cfg.shock:
        raise SystemExit("config error: --runs=DIR[,DIR...] (or --ladder=study/results.json, --gap=study/results.json "
                         "or --shock=BASELINE:RUN[,...]) is required")
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install matplotlib") from None
    if cfg.ladder:
        return ladder_plot(plt, cfg.ladder, cfg.out, cfg.title)
    if cfg.gap:
        return gap_plot(plt, cfg.gap, cfg.out, cfg.title)
    if cfg.shock:
        pairs = [p.split(':') for p in cfg.shock.split(',')]
        if any(len(p) != 2 for p in pairs):
            raise SystemExit(f"config error: shock={cfg.shock!r}: give BASELINE_DIR:RUN_DIR pairs, comma-separated")
        labels = cfg.labels.split(',') if cfg.labels else [os.path.basename(r.rstrip('/')) for _, r in pairs]
        if len(labels) != len(pairs):
            raise SystemExit(f"config error: {len(labels)} labels for {len(pairs)} pairs")
        return shock_plot(plt, pairs, labels, cfg.out, cfg.title, cfg.shock_steps, cfg.smooth)
    dirs = cfg.runs.split(',')
    names = cfg.labels.split(',') if cfg.labels else [os.path.basename(d.rstrip('/')) for d in dirs]
    if len(names) != len(dirs):
        raise SystemExit(f"config error: {len(names)} labels for {len(dirs)} runs")
    panels = [('ce', 'cross-entropy (train, smoothed; dots: validation)'), ('hidden_rms', 's(h) before the final norm'),
              ('logit_rms', 'logit RMS'), ('radial_cos', 'cos(∂CE/∂h, h) at the pre-logit state')]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex=True)
    runs = [read_run(d, cfg.max_iter) for d in dirs]
    # one gate curve per distinct schedule (W, T), in the colour of the first run that has it
    gates = {}
    for i, (steps, calib) in enumerate(runs):
        if calib is not None and any(r['phase'] == 'taper' for r in steps):
            linear = min((r['iter'] for r in steps if r['phase'] == 'linear'), default=None)
            gates.setdefault((calib['iter'], linear), (i, steps))
    for (key, label), ax in zip(panels, axes.flat):
        for i, (name, (steps, calib)) in enumerate(zip(names, runs)):
            color = f'C{i}'
            its = [r['iter'] for r in steps]
            ax.plot(its, moving_average([r.get(key, float('nan')) for r in steps], cfg.smooth), color=color,
                    lw=1.3, label=name)
            if key == 'ce':
                val = [(r['iter'], r['val_loss']) for r in steps if 'val_loss' in r]
                ax.plot(*zip(*val), 'o', color=color, ms=4)
            if calib is not None:
                ax.axvline(calib['iter'] + 1, color='0.6', ls=':', lw=1)
            if key == 'hidden_rms' and calib is not None:
                ax.axhline(calib['s_tgt'], color=color, ls='--', lw=0.8)
        if gates:  # the gate g on an axis of its own in every panel
            twin = ax.twinx()
            for i, steps in gates.values():
                twin.plot([r['iter'] for r in steps], [r['gate'] for r in steps], color=f'C{i}', alpha=0.3,
                          lw=2, zorder=0)
            twin.set_ylim(-0.05, 1.6)
            twin.set_yticks([0, 1])
            twin.set_ylabel('gate g' + (f' ({len(gates)} schedules)' if len(gates) > 1 else ''), color='0.6')
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if key == 'ce' and cfg.ce_span:
            lo = min(min(r['ce'] for r in steps) for steps, _ in runs)
            ax.set_ylim(lo - 0.2, lo + cfg.ce_span)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel('step (dotted line: calibrate; dashed: s_tgt)')
    if cfg.title:
        fig.suptitle(cfg.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    fig.savefig(cfg.out, dpi=110)
    print(f"wrote {cfg.out}")


if __name__ == '__main__':
    main(sys.argv[1:])
