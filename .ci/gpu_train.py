"""`bash .ci/gpu quick`'s training step: a compiled bf16 run of each taper kind (default calibration,
'ema') on tests/test_cuda.py's toy stories and its 4-layer model, then per run the median step time
of each phase and how many versions of the forward dynamo compiled (train.py's expected count: 7
tapered, 2 baseline). Each run's log.jsonl goes to $OUT/train-<taper>/.

    python3 .ci/gpu_train.py [STEPS]      # 200 steps: gate warmup 40, taper 100, linear 60
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / 'tests')]

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import train  # noqa: E402
from test_cuda import args, read_log, write_stories  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
W, T = steps // 5, steps // 2
data = Path(tempfile.mkdtemp()) / 'data'
write_stories(data / 'stories')
real_compile = torch.compile
for taper, aux in (('none', 0.0), ('internal', 0.1), ('all', 0.1)):
    out = Path(os.environ.get('OUT', tempfile.mkdtemp())) / f'train-{taper}'
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend('inductor')  # the model's compiles; check_compiler's probe not
    torch.compile = lambda fn, **kw: real_compile(fn, backend=counter, **kw) if isinstance(fn, torch.nn.Module) \
        else real_compile(fn, **kw)
    t0 = time.perf_counter()
    train.main(args(data, out, taper=taper, aux_weight=aux, max_iters=steps, gate_warmup_iters=W, taper_iters=T,
                    lr_decay_iters=steps, eval_interval=steps // 2, overwrite=True))
    wall = time.perf_counter() - t0
    torch.compile = real_compile
    log = read_log(out)
    phases = {}
    for r in log:
        if 'loss' in r and 'val_loss' not in r:
            phases.setdefault(r['phase'], []).append(r['step_ms'])
    # each phase's first two steps compile (training, then the next phase's), the rest are steady
    medians = ', '.join(f"{p} {statistics.median(ms[2:] or ms):.1f} ms" for p, ms in phases.items())
    print(f"train taper={taper}: median step time per phase: {medians} | {counter.frame_count} versions of "
          f"the forward compiled, {sum(counters['graph_break'].values())} graph breaks | final_val_loss "
          f"{log[-1]['final_val_loss']:.4f} | {wall:.0f} s wall", flush=True)
