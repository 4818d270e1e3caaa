# GPT-2 (124M) fine-tuned on OpenWebText with Internal-TaperLN: ln_1 and ln_2 of every block taper
# into fixed linear maps (docs/method.md §1), ln_f stays a real LayerNorm (the implicit scale
# anchor); λ = 0.1 anchors the pre-final-norm scale too (the paper's "+aux").
#   python train.py config/finetune_gpt2_internal_taper.py
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_gpt2_internal_taper.py --gradient_accumulation_steps=4
# The Pile: add --dataset=pile (after python data/pile/prepare.py).
# Same model, data, seed, budget and schedule as finetune_gpt2_vanilla.py (W = 25, T = 100: the
# gate reaches 0 at step 125, then 175 steps in the linear phase, the model fold.py folds).
import os
exec(open(os.path.join(os.path.dirname(__file__), 'finetune_gpt2_vanilla.py'), encoding='utf-8').read())

taper = 'internal'
aux_weight = 0.1
out_dir = 'out-gpt2-{dataset}-internal-taper'
