"""
Export a checkpoint whose norms still normalize as a Hugging Face transformers GPT-2 folder
(config.json + model.safetensors), the inverse of train.py's --init_from=FOLDER (docs/method.md §7):

    python export_gpt2.py --ckpt=out-gpt2-openwebtext-vanilla/ckpt.pt --out=gpt2-vanilla-owt
    # then: GPT2LMHeadModel.from_pretrained('gpt2-vanilla-owt'), or train.py --init_from=gpt2-vanilla-owt;
    # the folder holds no tokenizer (its ids are GPT-2's): pipeline('text-generation',
    # model='gpt2-vanilla-owt', tokenizer='openai-community/gpt2')

A baseline with LayerNorm exports, and so does a TaperNorm checkpoint from its gate warmup (or the
taper phase's first step, at g = 1) or a FakeLN one from before its first removal; a model GPT-2
cannot express is refused with one line: RMSNorm, tapered (g < 1), folded, or FakeLN after a removal; so is one trained on a
compact vocabulary (a GPT-2 folder's token ids are GPT-2's own). Needs transformers
(pip install transformers). The script checks its work: it loads the folder back and compares
teacher-forced logits with the checkpoint's (fold.max_logit_error), and removes the folder if
they differ.
"""

import os
import shutil

import torch

from configurator import ConfigError, configure, run_command
from data.common import compact_vocabulary
from fold import CheckError, max_logit_error
from gpt2 import GPT2_MODELS, PretrainedError, export_gpt2, from_pretrained
from runs import load_model

# -----------------------------------------------------------------------------
ckpt = ''           # a train.py checkpoint: a LayerNorm baseline, a TaperNorm at g = 1 (its gate warmup), or FakeLN before its first removal
out = ''            # the folder to write (it must not exist yet, or be empty)
seed = 1337         # the random tokens of the logit check
# -----------------------------------------------------------------------------


def validate(cfg):
    """configure()'s check: --ckpt and --out given; --out absent or an empty folder, and not a bare
    GPT-2 name, which from_pretrained and --init_from read as OpenAI's weights on the hub."""
    if not cfg['ckpt'] or not cfg['out']:
        raise ConfigError("usage: python export_gpt2.py --ckpt=OUT_DIR/ckpt.pt --out=FOLDER")
    if cfg['out'] in GPT2_MODELS:
        raise ConfigError(f"--out={cfg['out']} is the name of OpenAI's GPT-2 on the hub, which train.py --init_from="
                          f"{cfg['out']} and from_pretrained('{cfg['out']}') would read instead of this folder: "
                          f"choose another name, or --out=./{cfg['out']}")
    if os.path.exists(cfg['out']) and (not os.path.isdir(cfg['out']) or os.listdir(cfg['out'])):
        raise ConfigError(f"--out={cfg['out']} exists and is not an empty folder; choose another")


def main(argv):
    """Export --ckpt to --out and check it; returns the largest |Δ logit|."""
    cfg = configure(argv, globals(), validate=validate)
    model, ckpt = load_model(cfg.ckpt)
    meta = ckpt.get('meta') or {}
    if compact_vocabulary(meta):  # a folder's ids are GPT-2's own to a tokenizer and to --init_from
        raise SystemExit(f"{cfg.ckpt} was trained on a compact vocabulary ({meta['vocab_size']:,} ids that its "
                         "dataset's meta.json maps to GPT-2's): a GPT-2 folder's ids are read as GPT-2's own, so its "
                         "text would decode wrong. Export a model trained on a dataset prepared with the full GPT-2 "
                         "vocabulary (--vocab_size=0)")
    try:
        export_gpt2(model, cfg.out)
        back = from_pretrained(cfg.out).eval()
    except PretrainedError as e:
        raise SystemExit(f"{cfg.ckpt}: {e}") from None
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.block_size),
                           generator=torch.Generator().manual_seed(cfg.seed))
    try:
        diff, scale = max_logit_error(model, back, tokens, 'checkpoint vs exported GPT-2')
    except CheckError as e:
        shutil.rmtree(cfg.out)
        raise SystemExit(f"{e}: {cfg.out} removed. This is a bug; please report it with the "
                         "checkpoint's model_args") from None
    print(f"wrote {cfg.out} (transformers GPT-2: {model.config.n_layer} layers, {model.config.n_embd} wide, "
          f"vocabulary {model.config.vocab_size}, context {model.config.block_size}); loaded back, "
          f"max |Δ logit| {diff:.3e} (max |logit| {scale:.2f}); it holds no tokenizer, GPT-2's: "
          f"pipeline('text-generation', model={cfg.out!r}, tokenizer='openai-community/gpt2')")
    return diff


if __name__ == '__main__':
    run_command(main)
