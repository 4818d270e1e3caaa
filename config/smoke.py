# Overlay: every phase in about a minute on a 2-core CPU (a check that things run, not a result).
#   python train.py config/tinystories_all_taper.py config/smoke.py
# config/cpu.py's model and data (austen), 150 steps instead of 1500: gate warmup 20, taper
# 80, linear 50; the learning rate decays over the 150 steps.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'cpu.py')).read())

max_iters = 150
warmup_iters = 20
lr_decay_iters = 150
gate_warmup_iters = 20
taper_iters = 80
eval_interval = 50
eval_iters = 5
out_dir = 'out-smoke-{dataset}-{taper}-aux{aux_weight:g}'
