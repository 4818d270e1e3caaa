"""
Fold the tapered norms of a linear-phase checkpoint into the next linear layers (docs/method.md §5).

    python fold.py --ckpt=out-cpu-austen-internal-aux0.1/ckpt.pt --out=internal-folded.pt

At g = 0 a tapered norm is the fixed map x ↦ c·x⊙γ̃ (LN kind: c·(P x)⊙γ̃ + β̃, P x = x − mean x).
For the linear layer y = W x + b that reads its output (W stored (out, in), as nn.Linear does):

    RMS kind:  W' = W · diag(c·γ̃)
    LN kind:   W' = A − A.mean(dim=1, keepdim=True),  A = W · diag(c·γ̃);   b' = b + W β̃

ln_1 folds into attn.c_attn, ln_2 into mlp.c_fc, and (All-Taper) ln_f into the LM head, which
then gets its own weight: the token embedding keeps the old one. The folded model
(model_args['folded'] = True) runs no normalization op where the tapered norms were.

A FakeLN checkpoint (norm_removal='fakeln', docs/method.md §7) folds the same way, every norm,
with c = 1/s, γ̃ = γ, β̃ = β, once all its events are done. Until the last one its norms give
position 0 its own scalar s0: there the map is s/s0 times the map of every other position, and
a weight matrix acts the same at every position, so such a checkpoint is refused, not folded
approximately.

The script checks its work: it prints the largest |Δ logit| between the unfolded model at
g = 0 and the folded one on a batch of the run's validation tokens (random tokens when its
dataset is not on disk, or what is there is other data), and writes nothing if the folded model
is further from an fp64 copy of the unfolded one than LOGIT_SLACK times the unfolded fp32 model's
own error, plus LOGIT_FLOOR of the largest logit (max_logit_error, the check bench.py's gate runs
too); then the parameter and byte counts.
"""

import copy
import json
import os

import numpy as np
import torch

from baselines import FAKELN_EVENTS, NORM_FREE
from configurator import ConfigError, check_at_least, check_out_file, configure, resolve_device, run_command, set_tf32
from model import GPTConfig
from runs import (REPO, check_writable, data_identity, load_model, model_from_state_dict, resume_command,
                  save_checkpoint)

# -----------------------------------------------------------------------------
ckpt = ''           # a train.py checkpoint in the linear phase (g = 0)
out = ''            # where to write the folded checkpoint
device = 'cpu'      # for the logit check, in fp32: 'auto' | 'cpu' | 'cuda' | 'cuda:N' | 'mps'
batch_size = 4      # sequences of block_size tokens in the logit check
seed = 1337         # picks the check's windows (or its random tokens)
# -----------------------------------------------------------------------------

# fold.py's check and bench.py's gate, both against an fp64 copy of the unfolded model: the folded
# model's error may be at most LOGIT_SLACK times the unfolded fp32 model's own, plus LOGIT_FLOOR of
# the largest logit (a large residual stream gives fp32 an error of its own far above 1e-6)
LOGIT_SLACK = 4.0
LOGIT_FLOOR = 1e-6
FOLD_INTO = {'ln_1': 'attn.c_attn', 'ln_2': 'mlp.c_fc', 'ln_f': 'lm_head'}  # a norm -> the layer it feeds
NORM_KEYS = ('weight', 'bias', 'weight_tilde', 'bias_tilde', 'c', 'calib_num', 'calib_den',
             'std', 'std_first', 'window')  # TaperNorm's and FakeNorm's state


class FoldError(ValueError):
    """A checkpoint that cannot be folded; the message says why and what to do."""


class CheckError(RuntimeError):
    """Two models that must compute the same logits (or tokens) do not."""


def is_fakeln(model_args):
    return model_args.get('norm_removal', 'none') == 'fakeln'  # older checkpoints lack the key


def fold_pairs(model_args):
    """State-dict prefixes (norm, linear layer) of every tapered (or FakeLN) norm, in forward order."""
    pairs = [(f'transformer.h.{i}.{ln}', f'transformer.h.{i}.{FOLD_INTO[ln]}')
             for i in range(model_args['n_layer']) for ln in ('ln_1', 'ln_2')]
    if model_args['taper'] == 'all' or is_fakeln(model_args):
        pairs.append(('transformer.ln_f', FOLD_INTO['ln_f']))
    return pairs


def check_fakeln(state_dict, model_args):
    """FoldError unless every FakeLN norm is removed and position 0 has no scalar of its own."""
    stage = state_dict['fakeln_stage'].item()
    if stage < len(FAKELN_EVENTS) - 1:
        raise FoldError(f"FakeLN has done {stage} of its {len(FAKELN_EVENTS)} events: "
                        f"{', '.join(FAKELN_EVENTS[stage:-1])} still normalize. Train past "
                        f"{len(FAKELN_EVENTS)} × fakeln_interval: the ckpt.pt of a finished run folds")
    first = [norm for norm, _ in fold_pairs(model_args)
             if not torch.equal(state_dict[f'{norm}.std_first'], state_dict[f'{norm}.std'])]
    if first:
        raise FoldError(f"FakeLN's position 0 still has its own scalar s0 != s in {len(first)} norms "
                        f"({first[0].removeprefix('transformer.')}, ...): there the map is s/s0 times the "
                        "map of every other position, which no weight matrix (the same at every position) "
                        f"holds. Train past {len(FAKELN_EVENTS)} × fakeln_interval: the last event sets s0 = s")


def linear_branch(sd, norm, model_args):
    """(c·γ̃, β̃ or None) of a norm at g = 0, in fp32; for a removed FakeLN norm (1/s · γ, β)."""
    if is_fakeln(model_args):
        beta = sd.get(f'{norm}.bias')
        return sd[f'{norm}.weight'].float() / sd[f'{norm}.std'].float(), beta
    return sd[f'{norm}.c'].float() * sd[f'{norm}.weight_tilde'].float(), sd.get(f'{norm}.bias_tilde')


@torch.no_grad()
def fold_state_dict(state_dict, model_args):
    """Fold every tapered norm into the linear layer after it (docs/method.md §5), in fp32.

    state_dict: a GPT state dict in the linear phase (buffer gate = 0, calibrated);
    model_args: its GPTConfig fields. Returns (new state dict, new model_args with
    folded=True); the inputs are not modified, and the tensors keep their dtypes but the folded
    ones, which are at least fp32 (a bf16 or fp16 checkpoint's folded layers are fp32).
    Raises FoldError for a model with nothing tapered, an already folded one, or one whose
    gate is not 0 (its phase and g are named); for FakeLN, one before its last event (check_fakeln).
    """
    if model_args.get('folded'):
        raise FoldError("this checkpoint is already folded: pass the checkpoint train.py wrote")
    if model_args.get('norm') in NORM_FREE:
        kind = NORM_FREE[model_args['norm']]
        raise FoldError(f"nothing folds in a {kind.__name__} model: {kind.MAP} is not a linear map, so no "
                        "weight matrix can absorb it; only TaperNorm (taper='internal' | 'all') and FakeLN fold")
    if is_fakeln(model_args):
        check_fakeln(state_dict, model_args)
    elif model_args['taper'] == 'none':
        raise FoldError("nothing to fold: the checkpoint is a baseline (taper='none'); its norms "
                        "normalize every token. Train with --taper=internal or --taper=all")
    elif not state_dict['calibrated'].item() or state_dict['gate'].item() != 0:
        g = state_dict['gate'].item()
        phase = 'taper' if state_dict['calibrated'].item() else 'warmup'
        raise FoldError(f"the checkpoint is in the {phase} phase (g = {g:.6g}); only the linear "
                        "phase (g = 0) folds exactly. Train past gate_warmup_iters + taper_iters: "
                        "the ckpt.pt of a finished run is in the linear phase")
    sd = dict(state_dict)
    layernorm = model_args['norm'] == 'layernorm'
    for norm, linear in fold_pairs(model_args):
        a, beta = linear_branch(sd, norm, model_args)  # c·γ̃ (in,), β̃
        W = sd[f'{linear}.weight']
        A = W.float() * a  # W · diag(c·γ̃): scales the columns
        if layernorm:  # absorb P = I − 11ᵀ/d: every row of W' sums to zero
            A = A - A.mean(dim=1, keepdim=True)
        # a new tensor (a tied embedding keeps its weight), at least fp32: rounding W·diag(c·γ̃) back to a
        # bf16 checkpoint's dtype put 1e-3 into the logits, where the model it loads into is fp32 anyway
        wide = torch.promote_types(W.dtype, torch.float32)
        sd[f'{linear}.weight'] = A.to(wide)
        if beta is not None:  # LN kind with bias: b' = b + W β̃, with the original W
            b = sd.get(f'{linear}.bias')
            shift = W.float() @ beta.float()
            sd[f'{linear}.bias'] = (shift if b is None else b.float() + shift).to(wide)
        for key in NORM_KEYS:
            sd.pop(f'{norm}.{key}', None)
    return sd, dict(model_args, folded=True)


def fold_model(model):
    """The folded GPT (CPU, eval mode) of a linear-phase model: fold_state_dict of its weights."""
    return model_from_state_dict(*fold_state_dict(model.state_dict(), vars(model.config)))


@torch.no_grad()
def max_logit_error(a, b, tokens, what):
    """Teacher-forced logits (B, T, V) on tokens (B, T) of a (the reference form, e.g. unfolded)
    and b (the form under test), both judged against an fp64 copy of a on the CPU. Returns
    (max |logit_a − logit_b|, max |logit| in fp64). Raises CheckError, naming `what`, when
    err(b, fp64) > LOGIT_SLACK · err(a, fp64) + LOGIT_FLOOR · max |logit|: b may be no worse than
    a's own fp32 rounding, whatever the scale of the residual stream. fold.py's check and
    bench.py's gate."""
    ref = copy.deepcopy(a).to('cpu', torch.float64)  # on the host: MPS (Apple silicon) has no float64
    host = tokens.cpu()
    l64 = ref(host, host)[0]
    la, lb = a(tokens, tokens)[0].cpu().double(), b(tokens, tokens)[0].cpu().double()
    err_a, err_b = (la - l64).abs().max().item(), (lb - l64).abs().max().item()
    scale = l64.abs().max().item()
    if not err_b <= LOGIT_SLACK * err_a + LOGIT_FLOOR * scale:
        raise CheckError(f"{what}: teacher-forced logits are {err_b:.3e} from an fp64 copy of the first, "
                         f"whose own fp32 error is {err_a:.3e} (max |logit| {scale:.3e}; allowed: "
                         f"{LOGIT_SLACK:g} × its error + {LOGIT_FLOOR:g} of max |logit|)")
    return (la - lb).abs().max().item(), scale


def tensor_bytes(tensors):
    """Bytes of the tensors, each storage counted once (a tied embedding and head once)."""
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


def model_size(model):
    """(parameters, bytes of the state dict), each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters()), tensor_bytes(model.state_dict().values())


def check_batch(ckpt_dict, batch_size, seed):
    """A (batch_size, block_size) int64 batch of val tokens from the data the checkpoint trained
    on, its data_dir/dataset resolved as runs.find_dataset does. Random ids below vocab_size when
    that val.bin is missing, not whole uint16 tokens or shorter than block_size, or is other data:
    a meta.json that is missing or not the checkpoint's `meta` (runs.data_identity), or an id >=
    vocab_size, as when the name was prepared again with another vocabulary. Returns (tokens, where
    they came from: the val.bin path, or 'random tokens' and why)."""
    args, cfg = ckpt_dict['model_args'], ckpt_dict.get('config', {})
    T, V = args['block_size'], args['vocab_size']
    folder = os.path.join(REPO, cfg.get('data_dir', 'data'), cfg.get('dataset', ''))
    path = os.path.join(folder, 'val.bin')
    if not os.path.isfile(path):
        why = f'{path} not found'
    elif (other := other_data(ckpt_dict.get('meta'), folder)):
        why = other
    elif os.path.getsize(path) % 2 or os.path.getsize(path) // 2 < T:
        why = f'{path} is not a whole number of tokens, or fewer than block_size = {T}'
    else:
        data = np.memmap(path, dtype=np.uint16, mode='r')
        ix = np.random.default_rng(seed).integers(len(data) - T + 1, size=batch_size)
        tokens = torch.from_numpy(np.stack([data[i:i + T] for i in ix]).astype(np.int64))
        if tokens.max() < V:
            return tokens, path
        why = f'{path} holds ids >= the model\'s vocab_size = {V}'
    random = np.random.default_rng(seed).integers(V, size=(batch_size, T))
    return torch.from_numpy(random), f'random tokens: {why}'


def other_data(ckpt_meta, folder):
    """Why folder is not the dataset ckpt_meta describes, or '' when it is (or when the checkpoint
    records no meta: nothing to compare with)."""
    if ckpt_meta is None:
        return ''
    path = os.path.join(folder, 'meta.json')
    try:
        with open(path) as f:
            meta = json.load(f)
    except OSError:
        return f'{path} not found: what data {folder} holds is unknown'
    except ValueError:
        return f'{path} is not JSON: what data {folder} holds is unknown'
    same = isinstance(meta, dict) and data_identity(meta) == data_identity(ckpt_meta)
    return '' if same else f'{path} is not the data the run trained on'


def is_folded_checkpoint(path):
    """Whether path holds a checkpoint fold.py wrote (model_args['folded']); False for anything else,
    unreadable files included."""
    try:
        ck = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except Exception:  # not a zip checkpoint, not torch's, unreadable: not ours to replace
        return False
    return isinstance(ck, dict) and isinstance(ck.get('model_args'), dict) and bool(ck['model_args'].get('folded'))


def validate(cfg):
    """configure()'s check: --ckpt and --out given, distinct (a link to --ckpt too), --out a file name
    whose folder exists and, where it exists, an earlier fold (anything else there is kept: a run's
    log or a dataset's train.bin was replaced), a check batch of at least one sequence."""
    if not cfg['ckpt'] or not cfg['out']:
        raise ConfigError("usage: python fold.py --ckpt=OUT_DIR/ckpt.pt --out=FOLDED.pt")
    check_at_least(cfg, 1, ('batch_size',))
    check_out_file(cfg['out'], 'the file', 'folded.pt')
    if os.path.realpath(cfg['ckpt']) == os.path.realpath(cfg['out']):
        raise ConfigError("--out must differ from --ckpt: folding keeps the trained checkpoint")
    if os.path.exists(cfg['out']) and not is_folded_checkpoint(cfg['out']):
        raise ConfigError(f"--out={cfg['out']} exists and is not a folded checkpoint: fold.py replaces only "
                          f"its own output; choose another --out")
    if not os.path.isdir(os.path.dirname(os.path.abspath(cfg['out']))):
        raise ConfigError(f"--out={cfg['out']}: its folder does not exist; create it first")


def unfinished(ck):
    """For a checkpoint of a run that stopped before its last step (Ctrl-C, a time limit): a
    sentence giving the command that finishes it; '' otherwise."""
    run, it = ck.get('config') or {}, ck.get('iter_num')
    if it is None or 'max_iters' not in run or it >= run['max_iters']:
        return ''
    return (f". Its run stopped after {it} of its {run['max_iters']} iterations; finish it with: "
            f"{resume_command(run['out_dir'], ck.get('world', 1))}")


def main(argv):
    """Fold --ckpt into --out and print the check; returns the report as a dict."""
    cfg = configure(argv, globals(), validate=validate)
    check_writable(os.path.dirname(os.path.abspath(cfg.out)), '--out')  # before the fold, not after it
    dev, _ = resolve_device(cfg.device, 'float32')
    set_tf32(dev, 'float32')  # the check compares with fp64: IEEE fp32 products, whatever ran before
    unfolded, ck = load_model(cfg.ckpt, dev)
    try:
        sd, args = fold_state_dict(ck['model'], ck['model_args'])
    except FoldError as e:
        raise SystemExit(f"cannot fold {cfg.ckpt}: {e}{unfinished(ck)}")
    folded = model_from_state_dict(sd, args).to(dev)

    tokens, source = check_batch(ck, cfg.batch_size, cfg.seed)
    try:
        diff, scale = max_logit_error(unfolded, folded, tokens.to(dev), 'unfolded (g = 0) vs folded')
    except CheckError as e:
        raise SystemExit(f"{e}: nothing written. This is a bug; please report it with the "
                         "checkpoint's model_args")

    out_ckpt = {k: v for k, v in ck.items() if k != 'optimizer'}  # the optimizer state is for training
    names = [n for n, _ in fold_pairs(ck['model_args'])]
    folded.cpu()  # the file, the inference artifact, holds CPU tensors whatever device checked it: it loads anywhere
    out_ckpt.update(model=folded.state_dict(), model_args=args, folded_norms=names,
                    folded_from=os.path.abspath(cfg.ckpt))
    save_checkpoint(out_ckpt, cfg.out)

    (p0, b0), (p1, b1) = model_size(unfolded), model_size(folded)
    how = 'FakeLN' if is_fakeln(ck['model_args']) else f"{ck['model_args']['taper']}-taper"
    print(f"folded {len(names)} {ck['model_args']['norm']} norms ({how}): "
          f"{names[0].removeprefix('transformer.')} .. {names[-1].removeprefix('transformer.')}")
    print(f"max |Δ logit| unfolded (g = 0) vs folded: {diff:.3e}  (max |logit| {scale:.2f}; "
          f"{tokens.numel():,} positions of {source})")
    print(f"parameters {p0:,} -> {p1:,} ({p1 - p0:+,}; the first count includes γ̃ (and β̃), which train.py's "
          f"header leaves out) | bytes {b0:,} -> {b1:,} ({b1 - b0:+,})")
    if GPTConfig(**args).untied_head():
        print("the LM head now has its own weight (untied from the token embedding)")
    print(f"wrote {cfg.out}")
    return dict(max_abs_logit_diff=diff, max_abs_logit=scale, params=(p0, p1), bytes=(b0, b1))


if __name__ == '__main__':
    run_command(main)
