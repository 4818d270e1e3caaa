# GPT-2 (124M) fine-tuned on OpenWebText with FakeLN (Heimersheim 2024; Baroni et al. 2025,
# arXiv 2507.02559), the norm-removal baseline TaperLN is compared with (docs/method.md §7): each
# LayerNorm's σ(h) becomes a fixed scalar, the mean σ(h) of the steps before its removal.
#   python train.py config/finetune_gpt2_fakeln.py
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_gpt2_fakeln.py --gradient_accumulation_steps=4
# The Pile: add --dataset=pile (after python data/pile/prepare.py).
# Same model, data, seed and budget as finetune_gpt2_vanilla.py.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'finetune_gpt2_vanilla.py'), encoding='utf-8').read())

taper = 'none'
aux_weight = 0.0
norm_removal = 'fakeln'
# Events every 30 steps: ln_2 of every block at 30, ln_1 at 60, ln_f at 90, then at 120 position 0
# loses its own scalar (s0 = s), after which the model folds (fold.py). Baroni et al.'s GPT-2
# small schedule takes the norms out one layer at a time, 2–3 steps apart, and is done with ln_f
# by step 104 and with the special first-position/end-of-text treatment by step ~116 of 300;
# removing a whole kind at once, each kind gets 30 steps (15.7M tokens) to settle instead, and
# the run ends at the same place: no normalization left by step 120, 180 steps without it.
fakeln_interval = 30
out_dir = 'out-gpt2-{dataset}-fakeln'
