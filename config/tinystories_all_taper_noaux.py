# All-Taper without the scale anchor (λ = 0): the ablation that shows logit chasing, logit_rms growing through the taper and linear phases (docs/method.md §4).
#   python train.py config/tinystories_all_taper_noaux.py
# Same model, data, seed and budget as tinystories_baseline.py; only taper and aux_weight differ.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'tinystories_baseline.py'), encoding='utf-8').read())

taper = 'all'
aux_weight = 0.0
out_dir = 'out-tinystories-all-taper-noaux'
