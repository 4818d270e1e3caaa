"""
Plot training runs from their log.jsonl: loss, the scale of the pre-logit state s(h), the logits'
RMS and the radial share of the gradient, against the step, with the gate g and the calibrate
step marked. Or, with --ladder, the budget ladder of the study's part 3 (study.py's ladder
matrices): each variant's paired gap to the baseline against the tokens seen. Needs matplotlib
(pip install matplotlib), imported only by this script (--fit needs none).

    python plot.py --runs=study/baseline-end-s1,study/internal-end-s1,study/all-end-s1 --out=docs/plots/main.png
    python plot.py --ladder=study/results.json --out=docs/plots/budget_ladder.png
    python plot.py --gap=study/results.json --out=docs/plots/gap_per_param.png
    python plot.py --fit=study/results.json   # print the line of gap against log(tokens per parameter), per size
    python plot.py --shock=study/baseline-1M-t9M-lr0.008-s1:study/internal-1M-t9M-lr0.008-s1 --out=shock.png
"""

import math
import os
import statistics

from configurator import ConfigError, check_at_least, check_out_file, configure, run_command

# -----------------------------------------------------------------------------
runs = ''                   # comma-separated out_dirs (each with a log.jsonl)
ladder = ''                 # instead of --runs: a study results.json, drawn as the budget ladder (ladder_plot)
gap = ''                    # instead of --runs: a study results.json, drawn as the gap per token per parameter (gap_plot)
fit = ''                    # instead of --runs: a study results.json; print each size's line of 'ema' Internal-Taper's gap against log(tokens per parameter) (fit_report)
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
    import runs  # torch with it: only where a log is read
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: --runs takes the out_dir of train.py runs")
    records = runs.read_log(out_dir)
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


def point_tokens(args, size, budget):
    """Tokens one run at the ladder point (size, budget) sees (steps × tokens a step), read from the
    configuration of a cell of args ({name: train.py arguments}) declared there; StopIteration if
    args declares none."""
    import study
    c = study.cell_config(next(a for n, a in args.items() if n.split('-')[1:3] == [size, 't' + budget]))
    return c['max_iters'] * c['batch_size'] * c['block_size'] * c['gradient_accumulation_steps']


def best_points(results_path):
    """The ladder matrices' finished cells of a study results.json as points: (points, args),
    points = {(size, variant): [(tokens seen, [paired % gap per seed], [final val loss per seed],
    unsettled), ...]} for every variant but the baseline and study.LADDER_ABLATIONS, each at its
    best learning rate against the baseline at its own (study.ladder_best, study.paired_gap);
    unsettled: a best rate still on a running grid or at its edge. SystemExit if none."""
    import study
    done = study.read_results(results_path)['cells']
    args = {n: a for m in study.LADDER_MATRICES for n, a in study.MATRICES[m].items()}
    cells = {n: done[n] for n in args if n in done}
    if not cells:
        raise SystemExit(f"{results_path} holds no cell of the ladder matrices ({', '.join(study.LADDER_MATRICES)})")
    lines = {}
    for (size, budget), by_v in study.ladder_best(cells, args).items():
        base = by_v.get('baseline')
        if base is None:
            continue
        tokens = point_tokens(args, size, budget)
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
    save_figure(fig, out)


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


# the line fit (gap_fits): the gap it follows (TaperNorm with its users' default calibration), and the
# gaps at which it asks where the line gets to: zero, and the lower edge of the paper's Internal-Taper
# band (study.PAPER_BAND)
FIT_VARIANT = 'internal_ema'
FIT_TARGETS = (0.0, 0.7)


def line_fit(points, targets=FIT_TARGETS):
    """The least-squares line gap = intercept + slope · ln(x) through points [(x, gap, se)]: x in
    tokens seen per non-embedding parameter, gap in %, se that gap's standard error over seeds
    (sd / sqrt(n); nan for one seed). Through two points it is the line through both. Returns
    dict(points: sorted by x, slope: % per e-fold of x, intercept: % at x = 1, crossings: {target
    %: the x at which the line reaches it, math.inf past a float's range, None where the slope is
    0}); fit_at evaluates it. A crossing outside the points' range of x is an extrapolation.
    ValueError for an x <= 0 or fewer than two distinct x."""
    points = sorted(points)
    if any(x <= 0 for x, _, _ in points) or len({x for x, _, _ in points}) < 2:
        raise ValueError(f"line_fit: needs two or more distinct x > 0, got {[x for x, _, _ in points]}")
    us = [math.log(x) for x, _, _ in points]
    u_mean, y_mean = statistics.mean(us), statistics.mean(y for _, y, _ in points)
    slope = (sum((u - u_mean) * (y - y_mean) for u, (_, y, _) in zip(us, points)) /
             sum((u - u_mean) ** 2 for u in us))
    intercept = y_mean - slope * u_mean

    def crossing(target):
        if slope == 0:
            return None
        z = (target - intercept) / slope
        return math.exp(z) if z < 700 else math.inf  # 700: exp's float range ends near 709
    return dict(points=points, slope=slope, intercept=intercept, crossings={t: crossing(t) for t in targets})


def fit_at(fit, x):
    """(gap %, se %) of line_fit's line at x tokens per parameter. The line's value is a fixed
    weighted sum of the points' gaps, so se carries their standard errors through it: the spread the
    seeds alone leave, valid only if the gap is a straight line in ln(x) (nan where a point has one
    seed). ValueError for x <= 0."""
    if x <= 0:
        raise ValueError(f"fit_at: x must be > 0, got {x}")
    us = [math.log(p[0]) for p in fit['points']]
    u_mean = statistics.mean(us)
    sxx = sum((u - u_mean) ** 2 for u in us)
    weights = [1 / len(us) + (math.log(x) - u_mean) * (u - u_mean) / sxx for u in us]
    return (fit['intercept'] + fit['slope'] * math.log(x),
            math.sqrt(sum((w * p[2]) ** 2 for w, p in zip(weights, fit['points']))))


def gap_fits(results_path, variant=FIT_VARIANT, budgets=None, targets=FIT_TARGETS):
    """Per model size, variant's gap to the RMSNorm baseline at each budget measured (each at its best
    learning rate, paired by seed: best_points) and the line of it against ln(tokens per
    non-embedding parameter) (line_fit of the means, each with its standard error):
    {size: dict(params: non-embedding parameters, points: [dict(budget, tokens, per_param, gaps:
    per seed in %, mean, sd, low, high: the 95 % interval (study.mean_interval; nan for one seed),
    unsettled: a best rate on a grid still running or at its edge)] in budget order, rising: each
    budget's mean above the one before, toward_zero: each mean closer to zero than the one before,
    overlap: [whether each budget's interval overlaps the next one's; None where either has none],
    fit: the line (None below two budgets), full: (tokens, per_param) of one full pass of mix7 where
    study.FULL_POINTS puts the size and the ladder matrices declare its cells, else None)}.
    budgets: the budget names ('3M', '9M', '18M') to use, None every one measured. SystemExit as
    best_points."""
    import study
    lines, args = best_points(results_path)
    out = {}
    for size in sorted({s for s, v in lines if v == variant}, key=lambda s: float(s[:-1])):
        params = non_embedding_params(size)
        declared = {}  # budget name -> tokens, for the budgets the matrices declare at this size
        for b in study.BUDGETS:
            try:
                declared[b] = point_tokens(args, size, b)
            except StopIteration:
                pass
        label = {t: b for b, t in declared.items()}
        points = []
        for tokens, gaps, _, unsettled in sorted(lines[size, variant]):
            if budgets is not None and label[tokens] not in budgets:
                continue
            m, sd, lo, hi = study.mean_interval(gaps)
            points.append(dict(budget=label[tokens], tokens=tokens, per_param=tokens / params, gaps=gaps, mean=m,
                               sd=sd, low=lo, high=hi, unsettled=unsettled))
        means = [p['mean'] for p in points]
        full = next((declared[b] for s, b in study.FULL_POINTS if s == size and b in declared), None)
        out[size] = dict(
            params=params, points=points,
            rising=all(b > a for a, b in zip(means, means[1:])),
            toward_zero=all(abs(b) < abs(a) for a, b in zip(means, means[1:])),
            overlap=[None if math.isnan(p['sd']) or math.isnan(q['sd']) else p['low'] <= q['high'] and q['low'] <= p['high']
                     for p, q in zip(points, points[1:])],
            fit=line_fit([(p['per_param'], p['mean'], p['sd'] / math.sqrt(len(p['gaps']))) for p in points],
                         targets) if len(points) > 1 else None,
            full=(full, full / params) if full else None)
    return out


def fit_report(results_path, variant=FIT_VARIANT, targets=FIT_TARGETS):
    """The text `python plot.py --fit=RESULTS` prints: per model size, variant's gap at each budget
    (study.fmt_gap), whether the budgets move monotonically toward zero, the line through them
    (gap_fits) with the budget at which it reaches each target gap, and, at a size declared at one full
    pass of mix7 (study.FULL_POINTS), the line through the shorter budgets there (the prediction the
    full-pass cells test) beside the gap measured there once it is. Every value the line gives
    outside the budgets it was fitted to is labelled an extrapolation. SystemExit as best_points."""
    import study
    full_budgets = {b for _, b in study.FULL_POINTS}
    fits = gap_fits(results_path, variant, None, targets)
    before = gap_fits(results_path, variant, [b for b in study.BUDGETS if b not in full_budgets], targets)
    tokens = lambda n: f"{n / 1e6:.1f}M tokens"

    def miss(measured, gap, se):  # the measured gap against the line's, in standard errors of both together
        diff, both = measured['mean'] - gap, math.hypot(measured['sd'] / math.sqrt(len(measured['gaps'])), se)
        return f"{diff:+.2f} points from the prediction" + (
            '' if math.isnan(both) or both == 0 else f", {diff / both:+.1f} standard errors (the seeds' and the line's together)")
    out = [f"{variant} against the RMSNorm baseline, each at its best rate, paired by seed: % gap, mean ± sd "
           f"[95 % interval]. x: tokens seen per non-embedding parameter. Lines: gap = a + b·ln(x), least "
           f"squares through the mean gaps."]
    for size, f in fits.items():
        out.append(f"\n{size} model ({f['params']:,} non-embedding parameters)")
        out += [f"  {p['budget']} ({tokens(p['tokens'])}, x = {p['per_param']:.1f}): {study.fmt_gap(p['gaps'])}, "
                f"{len(p['gaps'])} seed(s)" + (", best rate not settled" if p['unsettled'] else '') for p in f['points']]
        if not f['fit']:
            continue
        out.append(f"  monotonically toward zero: {'yes' if f['rising'] and f['toward_zero'] else 'no'} "
                   f"(each budget above the one before: {'yes' if f['rising'] else 'no'}; each closer to zero: "
                   f"{'yes' if f['toward_zero'] else 'no'}); successive intervals overlap: "
                   + ', '.join('no interval' if o is None else 'yes' if o else 'no' for o in f['overlap']))
        fitted = [(f, 'line')] + ([(before[size], 'pre-stated line')] if f['full'] and before.get(size, {}).get('fit')
                                  and len(before[size]['points']) < len(f['points']) else [])
        for g, name in fitted:
            fit, xs = g['fit'], [p['per_param'] for p in g['points']]
            out.append(f"  {name} through {', '.join(p['budget'] for p in g['points'])}: a = {fit['intercept']:+.3f} %, "
                       f"b = {fit['slope']:+.3f} % per e-fold of x ({fit['slope'] * math.log(10):+.2f} points per tenfold)")
            for t, x in fit['crossings'].items():
                out.append(f"    reaches {t:+.1f} % " + ('never: the line is flat' if x is None else
                           f"at x = {x:.3g}, {tokens(x * g['params'])}" +
                           ('' if min(xs) <= x <= max(xs) else ' (an extrapolation)')))
            if f['full']:
                gap, se = fit_at(fit, f['full'][1])
                measured = next((p for p in f['points'] if p['tokens'] == f['full'][0]), None)
                spread = (f"± {se:.2f} (the seeds' standard error carried through the line)" if math.isfinite(se) else
                          "(no standard error: a point of one seed)")
                out.append(f"    at one full pass ({tokens(f['full'][0])}, x = {f['full'][1]:.1f}): {gap:+.2f} % {spread}" +
                           ('' if min(xs) <= f['full'][1] <= max(xs) else ' (an extrapolation)') +
                           (f"; measured there: {study.fmt_gap(measured['gaps'])}, " + miss(measured, gap, se)
                            if measured and name != 'line' else ''))
    return '\n'.join(out)


# the gap figure's panels: TaperNorm on an axis of its own and the norm-free baselines on another, so
# that the baselines' intervals (Derf's [−10, +25] at (1M, 9M)) do not set the scale TaperNorm's gaps
# of a point or two are read on
GAP_PANELS = (('internal_ema', 'all_ema'), ('dyt', 'derf'))
GAP_REACH = 3.0  # % points: an interval end further than this past a panel's means leaves its axis


def fit_axis(ax, core, bars, reach=GAP_REACH):
    """Set ax's y range (gaps in %) to hold every value of core (the means, zero, a band: what must
    show) and each interval end within `reach` points of them, padded by 8 %; an end beyond that
    range leaves the axis with an arrow at its edge and the end's value beside it. bars: [(x, low,
    high, colour)], nan ends for a point with no interval."""
    ends = [e for _, lo, hi, _ in bars for e in (lo, hi) if not math.isnan(e)]
    lo = min([min(core)] + [e for e in ends if e >= min(core) - reach])
    hi = max([max(core)] + [e for e in ends if e <= max(core) + reach])
    pad = 0.08 * ((hi - lo) or 1)
    lo, hi = lo - pad, hi + pad
    ax.set_ylim(lo, hi)
    for x, low, high, color in bars:
        for end, out_of_range, edge in ((low, low < lo, 0), (high, high > hi, 1)):
            if out_of_range:
                ax.annotate(f'{end:+.1f} %', xy=(x, edge), xycoords=('data', 'axes fraction'), fontsize=7,
                            xytext=(6, 22 if edge == 0 else -22), textcoords='offset points', color=color,
                            va='center', arrowprops=dict(arrowstyle='->', color=color, lw=0.8))


def gap_plot(plt, results_path, out, title):
    """The gap against the budget per parameter, in two panels (GAP_PANELS): 'ema' Internal- and
    All-Taper above, with the paper's range shaded, and the norm-free DyT and Derf below, each
    panel's y axis fitted to its own gaps (fit_axis: an interval reaching far past them leaves the
    axis with an arrow and its value). Each point: the final val loss at the variant's best learning
    rate against the RMSNorm baseline's at its own, paired by seed, in %, against tokens seen per
    non-embedding parameter (log axis), with its 95 % interval over seeds (study.mean_interval: t on
    n − 1 df), a one-seed point hollow and without one; one marker and line style per model size,
    one line through each size's budgets, one colour per variant. Over 'ema' Internal-Taper's points,
    its line per size (gap_fits: least squares in ln(tokens per parameter)), carried on to one full
    pass of mix7 where the size is declared there (study.FULL_POINTS), with the value the line
    through the shorter budgets gives there marked ×: an extrapolation, the prediction the
    full-pass cells test."""
    import study
    lines, _ = best_points(results_path)
    fig, axes = plt.subplots(2, 1, figsize=(12.5, 8.5), sharex=True, gridspec_kw=dict(height_ratios=(3, 2)))
    axes[0].axhspan(*PAPER_GAP, color='0.85', zorder=0, label='paper: +0.7 to +1.8 % (TinyStories)')
    sizes = sorted({s for s, _ in lines}, key=lambda s: float(s[:-1]))
    per_param = {size: non_embedding_params(size) for size in sizes}
    core = {0: list(PAPER_GAP), 1: []}
    bars = {0: [], 1: []}
    hollow = {0: False, 1: False}
    for (size, v), points in sorted(lines.items(), key=lambda kv: (GAP_ORDER.index(kv[0][1]) if kv[0][1] in
                                                                   GAP_VARIANTS else -1, sizes.index(kv[0][0]))):
        if v not in GAP_VARIANTS:
            continue
        (marker, ls), k = size_style(size, sizes), GAP_ORDER.index(v)
        panel = next(i for i, vs in enumerate(GAP_PANELS) if v in vs)
        ax, dodge = axes[panel], side_by_side(k)
        xs, ys = [], []
        for tokens, gaps, _, _ in sorted(points):
            m, _, lo, hi = study.mean_interval(gaps)
            one = len(gaps) == 1
            xs.append(tokens / per_param[size] * dodge)
            ys.append(m)
            ax.errorbar(xs[-1:], ys[-1:], yerr=None if one else [[m - lo], [hi - m]], marker=marker, ms=7, capsize=3,
                        color=f'C{k}', mfc='white' if one else f'C{k}', ls='none',
                        label=None if len(xs) > 1 else f'{GAP_VARIANTS[v]}, {size} model')
            core[panel].append(m)
            bars[panel].append((xs[-1], lo, hi, f'C{k}'))
            hollow[panel] |= one
        ax.plot(xs, ys, color=f'C{k}', ls=ls, lw=0.8, alpha=0.6)  # one size's budgets
    k = GAP_ORDER.index(FIT_VARIANT)
    full_budgets = {b for _, b in study.FULL_POINTS}
    before = gap_fits(results_path, budgets=[b for b in study.BUDGETS if b not in full_budgets])
    first = True
    for size, f in gap_fits(results_path).items():
        if not f['fit']:
            continue
        xs = [p['per_param'] for p in f['points']] + ([f['full'][1]] if f['full'] else [])
        grid = [min(xs) * (max(xs) / min(xs)) ** (i / 49) for i in range(50)]
        axes[0].plot([x * side_by_side(k) for x in grid], [fit_at(f['fit'], x)[0] for x in grid], color='0.3',
                     ls=':', lw=1.2, label="Internal-Taper's fitted line per size\n(past its budgets: an extrapolation)"
                     if first else None)
        first = False
        if f['full'] and before.get(size, {}).get('fit'):
            gap, _ = fit_at(before[size]['fit'], f['full'][1])
            axes[0].plot([f['full'][1] * side_by_side(k)], [gap], 'x', color='0.3', ms=8, mew=1.6,
                         label=None if any(ln.get_marker() == 'x' for ln in axes[0].lines)
                         else "the line through the shorter budgets\nat one full pass: the prediction")
            axes[0].annotate(f'{gap:+.2f} % ({size})', (f['full'][1] * side_by_side(k), gap), textcoords='offset points',
                             xytext=(6, -10), fontsize=7, color='0.3')
            core[0].append(gap)
    names = ("TaperNorm, the users' default calibration ('ema')", 'the norm-free baselines, on an axis of their own')
    for i, ax in enumerate(axes):
        ax.axhline(0, color='0.4', lw=0.8)
        fit_axis(ax, core[i] + [0], bars[i])
        if hollow[i]:
            ax.text(0.01, 0.02, 'hollow: one seed, no interval', transform=ax.transAxes, fontsize=8, color='0.3')
        ax.set_xscale('log')
        ax.set_ylabel('final val loss vs RMSNorm baseline,\npaired by seed (%; bars: 95 % interval)', fontsize=9)
        ax.set_title(names[i], fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))  # outside: on no point, wherever they land
    axes[1].set_xlabel('tokens seen per non-embedding parameter (log axis; one budget\'s variants drawn slightly apart)')
    fig.suptitle(title or 'The gap against the budget per parameter (mix7, read once)', fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)


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
    save_figure(fig, out)


def check_out(out):
    """ConfigError unless --out names an image file: a folder, or a name without a format suffix, made
    matplotlib write OUT.png beside it while plot.py said it wrote OUT; a suffix matplotlib has no
    writer for (--out=lr_v1.2) failed in savefig, after the plot was drawn."""
    check_out_file(out, 'the image', 'plot.png')
    suffix = os.path.splitext(out)[1]
    if not suffix:
        raise ConfigError(f"--out={out} has no format suffix: name the image with one, e.g. --out={out}.png")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # main says to install it
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix[1:].lower() not in formats:  # savefig's ValueError came after all the work
        raise ConfigError(f"--out={out}: matplotlib writes no {suffix} images (what follows the name's last dot "
                          f"is its format): end it with one of .{', .'.join(sorted(formats))}, e.g. --out={out}.png")


def save_figure(fig, out):
    """fig to the image out (its folder made if needed), and the line saying so."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def validate(cfg):
    """configure()'s check: --out an image file (check_out; not for --fit, which draws nothing), and
    counts and spans that draw something (smooth=0 divided by zero, a negative span drew nothing)."""
    if not cfg['fit']:
        check_out(cfg['out'])
    check_at_least(cfg, 1, ('smooth', 'shock_steps'))
    if cfg['ce_span'] == math.inf:  # before check_at_least's finite check: this one says what 0 means
        raise ConfigError("ce_span=inf: give a finite span, or 0 to show everything", ('ce_span',))
    check_at_least(cfg, 0, ('max_iter', 'ce_span'))


def main(argv):
    cfg = configure(argv, globals(), validate=validate)
    if not cfg.runs and not cfg.ladder and not cfg.gap and not cfg.fit and not cfg.shock:
        raise SystemExit("config error: --runs=DIR[,DIR...] (or --ladder=study/results.json, --gap=study/results.json, "
                         "--fit=study/results.json or --shock=BASELINE:RUN[,...]) is required")
    if cfg.fit:  # text only: no matplotlib needed
        return print(fit_report(cfg.fit))
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
        pairs = [[os.path.expanduser(d) for d in p.split(':')] for p in cfg.shock.split(',')]  # ~ in each (home)
        if any(len(p) != 2 for p in pairs):
            raise SystemExit(f"config error: shock={cfg.shock!r}: give BASELINE_DIR:RUN_DIR pairs, comma-separated")
        labels = cfg.labels.split(',') if cfg.labels else [os.path.basename(r.rstrip('/')) for _, r in pairs]
        if len(labels) != len(pairs):
            raise SystemExit(f"config error: {len(labels)} labels for {len(pairs)} pairs")
        return shock_plot(plt, pairs, labels, cfg.out, cfg.title, cfg.shock_steps, cfg.smooth)
    dirs = [os.path.expanduser(d) for d in cfg.runs.split(',')]  # configure expands a leading ~ only: here each
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
    save_figure(fig, cfg.out)


if __name__ == '__main__':
    run_command(main)
