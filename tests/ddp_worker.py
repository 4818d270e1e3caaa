"""Run by test_ddp.py under torchrun: train, then write this rank's calibration results and the
statistics of the calibration tokens it saw, computed here in plain torch."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import train  # noqa: E402

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


M.TaperNorm.observe = recording_observe
model = train.main(sys.argv[1:])
out_dir = next(a.split('=', 1)[1].strip("'") for a in sys.argv if a.startswith('--out_dir='))
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), 'w') as f:
    json.dump({'c': {n: m.c.item() for n, m in model.tapernorms()}, 's_tgt': model.s_tgt.item(),
               'phase': model.phase, 'lm_head_sum': model.lm_head.weight.double().sum().item(),
               'stats': {n: [seen[m][0].tolist(), seen[m][1].tolist(), seen[m][2], seen[m][3].tolist()]
                         for n, m in model.tapernorms()}}, f)
