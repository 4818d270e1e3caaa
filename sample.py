"""
Sample from a trained (or folded) checkpoint with the static KV cache.

    python sample.py --ckpt=out-cpu-austen-internal-aux0.1/ckpt.pt --start="It was"
    python sample.py --ckpt=internal-folded.pt --start=FILE:prompt.txt --num_samples=3 --temperature=0.5

FILE: reads the prompt as UTF-8, less the one line ending an editor puts at the end of a file.

Text goes through the dataset's compact vocabulary (meta.json, stored in the checkpoint):
GPT-2 BPE ids outside it become <unk> (a warning says when more than UNK_WARN of the prompt
did). The text <|endoftext|> in a prompt is the end-of-text id, the document separator:
--start='<|endoftext|>' begins a new document, as TinyStories stories begin. temperature=0 is
greedy decoding; top_k=0 keeps every token. max_new_tokens=0 fills the checkpoint's context
(block_size) after the prompt.
"""

import os
import sys

import torch

from configurator import ConfigError, check_at_least, check_compiler, configure, resolve_device, run_command, set_tf32
from data.common import decode, encode_prompt
from model import check_sampling, unfused
from runs import load_model

# -----------------------------------------------------------------------------
ckpt = ''                   # a train.py or fold.py checkpoint
start = '\n'                # the prompt, or FILE:path to read it from a file
num_samples = 3             # continuations printed, one after another
max_new_tokens = 0          # 0: as many as the context allows after the prompt
temperature = 0.8           # 0: greedy; higher: more random
top_k = 200                 # keep only the top_k most likely tokens; 0: all
seed = 1337                 # torch.manual_seed before sampling
device = 'auto'             # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:N' | 'mps'
dtype = 'auto'              # 'auto' (bfloat16 weights on CUDA where supported, else float32) | 'float32' | 'bfloat16' | 'float16'
compile = False             # torch.compile the model (worth it on a GPU for long samples)
# -----------------------------------------------------------------------------

UNK_WARN = 0.1  # warn when more than this share of the prompt becomes <unk>


def read_prompt(start):
    """The prompt text: `start` itself, or the contents of the file after 'FILE:' less one final
    line ending: editors and `echo` end a file with one, and the continuation would begin on a new
    line (end the file with two to keep one)."""
    if not start.startswith('FILE:'):
        return start
    path = os.path.expanduser(start[len('FILE:'):])  # FILE:~/prompt.txt: no shell expands it there
    try:
        with open(path, encoding='utf-8') as f:  # not utf-8-sig, whose errors count bytes after the mark
            text = f.read().removeprefix('\ufeff')  # a byte-order mark (Notepad's) is not prompt text
    except OSError as e:
        raise SystemExit(f"--start={start}: cannot read the prompt file ({e.strerror})")
    except UnicodeDecodeError as e:
        raise SystemExit(f"--start={start}: the prompt file is not UTF-8 text (byte {e.start}: {e.reason}); "
                         f"convert it, e.g. iconv -f ITS_ENCODING -t UTF-8 {path} > prompt.txt") from None
    return text.removesuffix('\n')  # open's universal newlines read \r\n and \r as \n


def validate(cfg):
    """configure()'s check: a checkpoint given, and no negative count or temperature."""
    if not cfg['ckpt']:
        raise ConfigError("usage: python sample.py --ckpt=OUT_DIR/ckpt.pt [--start=...]")
    check_at_least(cfg, 0, ('temperature', 'top_k', 'max_new_tokens'))
    try:  # model's own check (an infinite temperature), as a config error; top_k 0 keeps every token
        check_sampling(cfg['temperature'], cfg['top_k'] or None)
    except ValueError as e:
        raise ConfigError(str(e), keys=('temperature',)) from None
    check_at_least(cfg, 1, ('num_samples',))


def main(argv):
    """Print num_samples continuations of the prompt; returns them as a list of strings."""
    cfg = configure(argv, globals(), validate=validate)
    dev, dt = resolve_device(cfg.device, cfg.dtype)
    if cfg.compile:
        check_compiler(dev)
    set_tf32(dev, dt)
    torch.manual_seed(cfg.seed)

    model, ck = load_model(cfg.ckpt, dev)
    if model.phase == 'linear' and not model.config.folded:
        unfused(model)  # g = 0: the tapered norms are one multiply each
    model.to(dtype=getattr(torch, dt))  # inference in the weights' dtype: the KV cache takes it too
    if cfg.compile:
        model.compile()  # in place: generate()'s prefill and decode steps run compiled (one graph each)
    meta = ck.get('meta') or {}
    if 'gpt2_ids' not in meta:
        raise SystemExit(f"{cfg.ckpt} holds no tokenizer table (meta.json's gpt2_ids): sample.py "
                         "decodes datasets made by data/*/prepare.py")
    prompt, unk_rate = encode_prompt(read_prompt(cfg.start), meta)
    if unk_rate > UNK_WARN:
        print(f"warning: {unk_rate:.0%} of the prompt's {len(prompt)} tokens are outside the checkpoint's "
              f"vocabulary and reach the model as <unk>", file=sys.stderr)
    if not prompt:
        raise SystemExit(f"the prompt file {cfg.start[len('FILE:'):]} holds no text (its final line ending is "
                         "dropped): write the prompt into it" if cfg.start.startswith('FILE:') else
                         "the prompt is empty: give at least one character with --start")
    block_size = ck['model_args']['block_size']
    if len(prompt) >= block_size:
        raise SystemExit(f"the prompt is {len(prompt)} tokens; the checkpoint's context of {block_size} "
                         f"leaves room for new tokens only after a prompt of at most {block_size - 1}")
    room = block_size - len(prompt)
    new = cfg.max_new_tokens or room
    if new > room:
        raise SystemExit(f"a prompt of {len(prompt)} tokens + {new} new tokens exceeds the checkpoint's "
                         f"context of {block_size}: use --max_new_tokens={room} or less, or a shorter prompt")
    idx = torch.tensor([prompt], dtype=torch.long, device=dev)
    samples, n = [], cfg.num_samples
    if cfg.temperature == 0 and n > 1:  # greedy decoding has one continuation
        print(f"temperature=0 is greedy: its {n} samples would be identical, so it prints one "
              "(a temperature above 0 gives different ones)", file=sys.stderr)
        n = 1
    for _ in range(n):
        out = model.generate(idx, new, temperature=cfg.temperature, top_k=cfg.top_k or None)  # top_k 0: all
        samples.append(decode(out[0].tolist(), meta))
        print(samples[-1])
        print('---------------')
    return samples


if __name__ == '__main__':
    run_command(main)
