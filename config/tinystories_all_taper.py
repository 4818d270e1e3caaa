# All-Taper: ln_f tapers too, so nothing but L_aux (λ = 0.1) fixes the scale of the pre-logit state (docs/method.md §4).
#   python train.py config/tinystories_all_taper.py
# Same model, data, seed and budget as tinystories_baseline.py; only taper and aux_weight differ.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'tinystories_baseline.py'), encoding='utf-8').read())

taper = 'all'
aux_weight = 0.1
out_dir = 'out-tinystories-all-taper'
