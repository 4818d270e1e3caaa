"""Run by test_ddp.py under torchrun: train, then write this rank's calibration results and the
statistics of the calibration tokens it saw, computed here in plain torch."""
import faulthandler
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import model as M  # noqa: E402
import train  # noqa: E402

# a rank still alive after HANG_S (a normal run takes 10-50 s) prints every thread's stack and exits 1, so that
# torchrun ends and the test fails showing where the rank hung, not a bare timeout (a CI run once hung
# here past the test's 300 s, with no trace of where); left armed through the interpreter's exit
HANG_S = 150
faulthandler.dump_traceback_later(HANG_S, exit=True)

seen = {}  # TaperNorm -> [Σ_tokens x²/r(x), Σ_tokens x², tokens, γ at the calibrate event]
observe = M.TaperNorm.observe


def recording_observe(self, h, y):
    if self.collect == 'calibration':
        x = h.detach().double().reshape(-1, h.size(-1))
        r = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        acc = seen.setdefault(self, [0, 0, 0, None])
        acc[0], acc[1], acc[2] = acc[0] + (x.pow(2) / r).sum(0), acc[1] + x.pow(2).sum(0), acc[2] + x.size(0)
        acc[3] = self.weight.detach().double().clone()
    return observe(self, h, y)


compiled = '--compile=True' in sys.argv
if not compiled:  # dynamo would trace the recording (a graph break per norm): compiled runs check only ranks agree
    M.TaperNorm.observe = recording_observe
# the model's compiles counted, with DDP_WORKER_BACKEND: dynamo's 'eager' (the default) or 'aot_eager'
# (AOT autograd and functionalization, as inductor sees the graph): no C++ compiler either way, and
# DDP's DDPOptimizer still splits each training graph at DDP's gradient buckets, calling the backend
# once per piece; check_compiler's inductor probe is not what is tested here
counter, real_compile = CompileCounterWithBackend(os.environ.get('DDP_WORKER_BACKEND', 'eager')), torch.compile
torch.compile = lambda model, **kw: real_compile(model, backend=counter, **kw)
train.check_compiler = lambda device: None
model = train.main(sys.argv[1:])
out_dir = next(a.split('=', 1)[1].strip("'") for a in sys.argv if a.startswith('--out_dir='))
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), 'w') as f:
    json.dump({'c': {n: m.c.item() for n, m in model.tapernorms()}, 's_tgt': model.s_tgt.item(),
               'phase': model.phase, 'lm_head_sum': model.lm_head.weight.double().sum().item(),
               'compiled_graphs': counter.frame_count,  # the backend's calls: one per piece of a split graph
               'versions': counters['stats']['unique_graphs'],  # the graphs dynamo captured
               'state': {k: v.double().sum().item() for k, v in model.state_dict().items()},
               'stats': {n: [seen[m][0].tolist(), seen[m][1].tolist(), seen[m][2], seen[m][3].tolist()]
                         for n, m in model.tapernorms()} if not compiled else None}, f)
