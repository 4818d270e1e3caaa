# Overlay for a real run on a 2-core CPU in about 6–8 minutes, on Jane Austen's novels.
# Compose it after any of the four TinyStories configs:
#   python data/text/prepare.py --name=austen       # downloads the novels (offline: --input=PATH/TO/austen.txt)
#   python train.py config/tinystories_internal_taper.py config/cpu.py
# It keeps their taper / aux_weight and scales everything else down.

_overlay = 1            # configurator: after the base config, before config/smoke.py; other orders are refused

dataset = 'austen'       # ~0.94M training tokens, 10k compact vocabulary (99.3 % kept)
device = 'cpu'

# The 1M row of the docs/method.md §6 ladder (n_embd=64, n_head=2; 1.07M parameters at context 512,
# 1.05M here) with a 4× shorter context.
n_embd = 64
n_head = 2
block_size = 128

# 16 × 128 = 2,048 tokens per step, ~0.23 s per step on 2 cores: 1500 steps ≈ 6 minutes,
# 3.1M tokens ≈ 3.3 epochs of austen.
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 1500
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 150
lr_decay_iters = 1500

# The TinyStories schedule's proportions (W = 10 %, T = 50 % of the run): gate held at 1 for
# the LR warmup, tapered over steps 150–899, purely linear for the last 600.
gate_warmup_iters = 150
taper_iters = 750

eval_interval = 250
eval_iters = 20
log_interval = 10

# one folder per dataset and variant, so runs do not overwrite each other; train.py fills in
# the braces after every override, so --dataset=kjv or --taper=all pick their own folder
out_dir = 'out-cpu-{dataset}-{taper}-aux{aux_weight:g}'
