# The CPU proxy of the GPT-2 experiments, step 3 of 3 (steps 1–2: config/gpt2_proxy_pretrain.py):
# an overlay that turns each GPT-2 fine-tuning config into a run of minutes on one CPU core,
# starting from the small pretrained model exported to a transformers folder, exactly the route
# an offline user takes with --init_from=FOLDER:
#   python data/text/prepare.py --name=austen_gpt2 --input=PATH/TO/austen.txt --vocab_size=0
#   python train.py config/finetune_gpt2_all_taper.py config/gpt2_proxy.py     # or _vanilla, _internal_taper, _fakeln
#   python study.py --matrix=gpt2proxy                                          # all four, then their table
# Only the size changes: the learning rate, W = 25, T = 100, FakeLN's removals every 30 steps and
# the 300 steps are the GPU configs' own.

_overlay = 1            # configurator: after the base config (a base config given after it is refused)

init_from = 'study/gpt2proxy-pretrain/hf'
dataset = 'austen_gpt2'  # Jane Austen's novels, full GPT-2 vocabulary: another domain than the pretraining
device = 'cpu'
block_size = 128         # the pretrained model's whole context
batch_size = 8           # 8 × 128 = 1,024 tokens per step, as in pretraining
gradient_accumulation_steps = 1
out_dir = 'out-gpt2proxy-{taper}-{norm_removal}'
