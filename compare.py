"""
Compare finished runs from their out_dir/log.jsonl; the first run is the reference.

    python compare.py out-cpu-austen-none-aux0 out-cpu-austen-internal-aux0.1 \
        out-cpu-austen-all-aux0.1 out-cpu-austen-all-aux0

Prints one row per run: final_val_loss and its relative difference to the reference, the last
logged hidden_rms, logit_rms and final_scale_rms, and the median step time over the taper
iterations of the first tapered run (evaluation steps excluded), over the same iterations in
every run, relative to the reference. The last line is the same table as one JSON object.
"""

import json
import os
import statistics
import sys


def read_log(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: is {out_dir!r} the out_dir of a run?")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    final = [r['final_val_loss'] for r in records if 'final_val_loss' in r]
    if not final:
        raise SystemExit(f"{path} has no final_val_loss: the run has not finished")
    steps = {}
    for r in records:
        if 'loss' in r:
            steps[r['iter']] = r  # a resumed run logs some iterations twice: keep the later
    return final[-1], steps


def main(out_dirs):
    if len(out_dirs) < 2:
        raise SystemExit(__doc__)
    runs = {d: read_log(d) for d in out_dirs}
    tapered = [steps for _, steps in runs.values() if any(r['phase'] == 'taper' for r in steps.values())]
    taper_iters = sorted(it for it, r in tapered[0].items() if r['phase'] == 'taper') if tapered else []

    def median_step_ms(steps):
        times = [steps[it]['step_ms'] for it in taper_iters if it in steps and 'val_loss' not in steps[it]]
        return statistics.median(times) if times else float('nan')

    ref_loss, ref_steps = runs[out_dirs[0]]
    ref_ms = median_step_ms(ref_steps)
    rows = []
    for d, (loss, steps) in runs.items():
        last = steps[max(steps)]
        ms = median_step_ms(steps)
        rows.append(dict(run=d, final_val_loss=loss, rel_diff=loss / ref_loss - 1,
                         hidden_rms=last['hidden_rms'], logit_rms=last['logit_rms'],
                         final_scale_rms=last.get('final_scale_rms'), median_taper_step_ms=ms,
                         step_time_ratio=ms / ref_ms))
    print(f"{'run':32s} {'final_val_loss':>14s} {'vs ref':>8s} {'hidden_rms':>10s} {'logit_rms':>9s} "
          f"{'final_scale':>11s} {'step ms':>8s} {'vs ref':>7s}")
    for r in rows:
        fs = f"{r['final_scale_rms']:.3f}" if r['final_scale_rms'] is not None else '-'
        print(f"{r['run']:32s} {r['final_val_loss']:14.4f} {100 * r['rel_diff']:+7.2f}% {r['hidden_rms']:10.3f} "
              f"{r['logit_rms']:9.3f} {fs:>11s} {r['median_taper_step_ms']:8.1f} {r['step_time_ratio']:6.3f}x")
    if taper_iters:
        print(f"step times: median over iterations {taper_iters[0]}-{taper_iters[-1]} "
              f"({len(taper_iters)} logged taper steps of the first tapered run), evaluation steps excluded")
    print(json.dumps({'reference': out_dirs[0], 'runs': rows}))


if __name__ == '__main__':
    main(sys.argv[1:])
