"""Run by test_ddp.py under torchrun: train, then write this rank's calibration results."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

model = train.main(sys.argv[1:])
out_dir = next(a.split('=', 1)[1].strip("'") for a in sys.argv if a.startswith('--out_dir='))
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), 'w') as f:
    json.dump({'c': {n: m.c.item() for n, m in model.tapernorms()}, 's_tgt': model.s_tgt.item(),
               'phase': model.phase, 'lm_head_sum': model.lm_head.weight.double().sum().item()}, f)
