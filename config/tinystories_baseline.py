# TinyStories pre-training, RMSNorm baseline (taper='none'): the reference the three
# TaperNorm runs are compared against. They exec this file and change only taper/aux_weight.
#   python train.py config/tinystories_baseline.py
# On a 2-core CPU add the overlay: python train.py config/tinystories_baseline.py config/cpu.py

dataset = 'tinystories'          # data/tinystories/prepare.py: 10k compact GPT-2 vocabulary
out_dir = 'out-tinystories-baseline'

# Model: the 9M row of the docs/method.md §6 ladder (8 layers, context 512, tied embeddings).
# Parameters ≈ V·d + T·d + 8·(12·d² + 11·d) + d with V = 10000, T = 512:
#   1M: n_embd=64,  n_head=2 (1.07M)    3M: n_embd=128, n_head=4 (2.93M)
#   9M: n_embd=256, n_head=4 (9.01M)    30M: n_embd=512, n_head=8 (30.6M)
# To pick another size, override both, e.g. --n_embd=512 --n_head=8.
n_layer = 8
n_embd = 256
n_head = 4
block_size = 512
dropout = 0.0
bias = True
norm = 'rmsnorm'
taper = 'none'
aux_weight = 0.0

# Budget: 32 sequences × 512 tokens × 4 micro-steps = 65,536 tokens per step;
# 5000 steps = 328M tokens, about 0.7 epochs of TinyStories-V2 (~470M training tokens).
batch_size = 32
gradient_accumulation_steps = 4
max_iters = 5000
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 500
lr_decay_iters = 5000

# TaperNorm schedule (used by the taper configs; ignored by the baseline): the gate is held
# at 1 during the LR warmup (W = 500), tapers over half the run (T = 2500), and the last
# 2000 steps train the purely linear model, the one that folds (docs/method.md §5).
gate_warmup_iters = 500
taper_iters = 2500

eval_interval = 500
eval_iters = 50
log_interval = 10
seed = 1337
