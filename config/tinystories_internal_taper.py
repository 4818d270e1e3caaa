# Internal-Taper: ln_1 and ln_2 of every block taper; ln_f stays an RMSNorm, the implicit scale anchor (docs/method.md §4). λ = 0.1 anchors the pre-final-norm scale too.
#   python train.py config/tinystories_internal_taper.py
# Same model, data, seed and budget as tinystories_baseline.py; only taper and aux_weight differ.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'tinystories_baseline.py'), encoding='utf-8').read())

taper = 'internal'
aux_weight = 0.1
out_dir = 'out-tinystories-internal-taper'
