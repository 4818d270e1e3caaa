# The CPU proxy of the GPT-2 experiments (README, "GPT-2 fine-tuning"), step 1 of 3: pretrain a
# small model of GPT-2's own shape — LayerNorm, biases, tanh GELU, the full 50,257-token GPT-2
# vocabulary — on one corpus, to stand in for the pretrained GPT-2 these machines cannot download.
#   python data/text/prepare.py --name=sotu_gpt2 --input=PATH/TO/sotu.txt --vocab_size=0
#   python train.py config/gpt2_proxy_pretrain.py
#   python export_gpt2.py --ckpt=study/gpt2proxy-pretrain/ckpt.pt --out=study/gpt2proxy-pretrain/hf
# Step 3 fine-tunes the exported folder on another corpus: config/gpt2_proxy.py.
# The full vocabulary is what makes the two corpora share token ids, as they do for real GPT-2.

dataset = 'sotu_gpt2'      # State of the Union addresses, 1.96M training tokens
out_dir = 'study/gpt2proxy-pretrain'
device = 'cpu'

norm = 'layernorm'
bias = True
activation = 'gelu_tanh'
taper = 'none'
aux_weight = 0.0

# 6 layers of width 64 (one head of 64, GPT-2's head size): 0.3M weights in the blocks, 3.2M in
# the tied 50,257 × 64 embedding. The output layer over the full vocabulary is most of the cost.
n_layer = 6
n_head = 1
n_embd = 64
block_size = 128

# 8 × 128 = 1,024 tokens per step; 1,000 steps = 1.0M tokens (0.5 epochs), ~1 s per step on one core
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 1000
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 100
lr_decay_iters = 1000
eval_interval = 250
eval_iters = 20
log_interval = 10
