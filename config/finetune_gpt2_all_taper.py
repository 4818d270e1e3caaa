# GPT-2 (124M) fine-tuned on OpenWebText with All-TaperLN: ln_f tapers too, so nothing but L_aux
# (λ = 0.1) fixes the scale of the pre-logit state (docs/method.md §4). Baroni et al. used the
# same weight, 0.1, for their residual-std anchor on GPT-2 small.
#   python train.py config/finetune_gpt2_all_taper.py
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_gpt2_all_taper.py --gradient_accumulation_steps=4
# The Pile: add --dataset=pile (after python data/pile/prepare.py).
# Same model, data, seed, budget and schedule as finetune_gpt2_vanilla.py.
import os
exec(open(os.path.join(os.path.dirname(__file__), 'finetune_gpt2_vanilla.py'), encoding='utf-8').read())

taper = 'all'
aux_weight = 0.1
out_dir = 'out-gpt2-{dataset}-all-taper'
