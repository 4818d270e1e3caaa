# GPT-2 (124M) fine-tuned on OpenWebText with its LayerNorms kept (taper='none'): the reference
# the TaperLN and FakeLN fine-tunes are compared against (docs/method.md §6, §7). The others exec
# this file and change only the keys of their method.
#   pip install transformers datasets
#   python data/openwebtext/prepare.py                  # streams 4.5M val + 200M train tokens (full GPT-2 vocabulary)
#   python train.py config/finetune_gpt2_vanilla.py     # one GPU
#   torchrun --standalone --nproc_per_node=8 train.py config/finetune_gpt2_vanilla.py --gradient_accumulation_steps=4
# The Pile instead of OpenWebText: python data/pile/prepare.py, then add --dataset=pile
# (or set dataset = 'pile' below). Larger GPT-2s: --init_from=gpt2-medium (-large, -xl) with a
# smaller --batch_size and a larger --gradient_accumulation_steps (same tokens per step).

init_from = 'gpt2'       # the model shape (12 layers, 768 wide, LayerNorm ε 1e-5, gelu_tanh, vocab 50257) comes from it
dataset = 'openwebtext'
out_dir = 'out-gpt2-{dataset}-vanilla'
block_size = 1024        # GPT-2's whole context
dropout = 0.0
taper = 'none'
aux_weight = 0.0

# Budget: 16 sequences × 1024 tokens × 32 micro-steps = 524,288 = 2^19 tokens per step (under
# torchrun, gradient_accumulation_steps is per process: divide it by the number of GPUs);
# 300 steps = 157M tokens, the budget of Baroni et al.'s LayerNorm-free GPT-2 small (300 steps
# of 2^19 tokens), and below the 200M training tokens prepare.py writes, so little is seen twice.
batch_size = 16
gradient_accumulation_steps = 32
max_iters = 300
# Their optimizer settings (Baroni et al.'s), except two: peak 6e-4, cosine decay, weight decay 0.01;
# here min_lr 6e-5 (theirs 3e-4) and a 25-step warm-up (theirs 20), shared with the TaperLN runs' W.
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 25
lr_decay_iters = 300
weight_decay = 0.01

# The norm-removal schedules of the other three configs, side by side (ignored here): each
# method starts from the pretrained model, has no normalizing norm left by step ~120, and
# trains the last ~180 steps without one.
#   TaperLN: gate held at 1 over the LR warmup (W = 25, c from the EMA of the pretrained
#            model's own activations over steps 0-24), tapered over T = 100 steps, linear from 125.
#   FakeLN:  ln_2 removed at 30, ln_1 at 60, ln_f at 90, position 0's own scalar at 120.
gate_warmup_iters = 25
taper_iters = 100
fakeln_interval = 30

eval_interval = 50
eval_iters = 20          # 20 × 16 × 1024 = 328k tokens per validation estimate
log_interval = 1
seed = 1337
