"""`bash .ci/gpu quick`'s training step: a compiled bf16 run of each taper kind (default calibration,
'ema') on tests/test_cuda.py's toy stories and its 4-layer model, then per run the median step time
of each phase and how many versions of the forward dynamo compiled, beside the count its schedule
implies (EXPECTED_VERSIONS): 6 for a tapered run, 2 for the baseline. Each run's log.jsonl goes to
$OUT/train-<taper>/.

    python3 .ci/gpu_train.py [STEPS]      # 200 steps: gate warmup 40, taper 100, linear 60

The count: the run evaluates at iterations 0 (warmup) and ceil(STEPS / 2) (taper, which ends at
7/10 of the run), never in the linear phase, so a tapered run compiles training in its three
phases, evaluation in two, and the calibrate event's 'mismatch' pass ('ema' measures c in the
warmup's own training forwards, so the event has no 'calibration' pass); the baseline compiles
training and evaluation. The final losses run uncompiled. tests/test_ci.py counts them on the CPU.
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / 'tests')) if p not in sys.path]

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import train  # noqa: E402
from test_cuda import args, read_log, write_stories  # noqa: E402

KINDS = (('none', 0.0), ('internal', 0.1), ('all', 0.1))  # (taper, aux_weight), one run each
EXPECTED_VERSIONS = {'none': 2, 'internal': 6, 'all': 6}  # versions of the forward compiled (docstring)


def schedule(steps):
    """train.py's schedule for a run of `steps` iterations (at least 10): gate warmup steps // 5,
    taper steps // 2, linear the rest; an evaluation at iterations 0 and ceil(steps / 2)."""
    return dict(max_iters=steps, gate_warmup_iters=steps // 5, taper_iters=steps // 2, lr_decay_iters=steps,
                eval_interval=(steps + 1) // 2)


def run_args(data_dir, out_dir, taper, aux_weight, steps):
    """train.py's arguments for the run of taper kind `taper`: tests/test_cuda.py's args (its model,
    bf16 and compile 'auto', the default calibration) with schedule(steps), overwriting out_dir."""
    return args(data_dir, out_dir, taper=taper, aux_weight=aux_weight, overwrite=True, **schedule(steps))


def main(steps):
    """The three runs of KINDS, each printing one line; returns {taper: versions compiled}."""
    data = Path(tempfile.mkdtemp()) / 'data'
    write_stories(data / 'stories')
    real_compile, versions = torch.compile, {}
    for taper, aux in KINDS:
        out = Path(os.environ.get('OUT', tempfile.mkdtemp())) / f'train-{taper}'
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend('inductor')  # the model's compiles; check_compiler's probe not
        torch.compile = lambda fn, **kw: real_compile(fn, backend=counter, **kw) if isinstance(fn, torch.nn.Module) \
            else real_compile(fn, **kw)
        t0 = time.perf_counter()
        try:
            train.main(run_args(data, out, taper, aux, steps))
        finally:
            torch.compile = real_compile
        wall = time.perf_counter() - t0
        log = read_log(out)
        phases = {}
        for r in log:
            if 'loss' in r and 'val_loss' not in r:
                phases.setdefault(r['phase'], []).append(r['step_ms'])
        # each phase's first two steps compile (training, then the next phase's), the rest are steady
        medians = ', '.join(f"{p} {statistics.median(ms[2:] or ms):.1f} ms" for p, ms in phases.items())
        versions[taper] = counter.frame_count
        print(f"train taper={taper}: median step time per phase: {medians} | {counter.frame_count} versions of "
              f"the forward compiled (the schedule implies {EXPECTED_VERSIONS[taper]}), "
              f"{sum(counters['graph_break'].values())} graph breaks | final_val_loss "
              f"{log[-1]['final_val_loss']:.4f} | {wall:.0f} s wall", flush=True)
    return versions


if __name__ == '__main__':
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
