"""
GPT-2 in and out through Hugging Face transformers (an optional dependency, imported only when
used): the shape of a pretrained GPT-2 (pretrained_config, pretrained_args), its weights in a
model.GPT (from_pretrained, behind train.py --init_from=gpt2), and a GPT
written back as a transformers GPT-2 folder (export_gpt2, export_gpt2.py). docs/method.md §7.

GPT-2's Conv1D layers store W as (in, out): their weights are transposed both ways.
"""

import os

import torch

from baselines import FAKELN_EVENTS
from data.common import hub_offline
from model import GPT, GPTConfig

GPT2_MODELS = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
GPT2_HUB = {name: f'openai-community/{name}' for name in GPT2_MODELS}  # their Hugging Face hub names
GPT2_ACTIVATIONS = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu'}  # transformers -> ours
# GPTConfig fields a pretrained checkpoint fixes (block_size may be smaller: the position embedding is cropped)
PRETRAINED_SHAPE = ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'bias', 'norm', 'norm_eps', 'activation')
CONV1D_WEIGHTS = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')  # stored (in, out)


class PretrainedError(ValueError):
    """A GPT-2 checkpoint that cannot be loaded, or a model that cannot be exported as one; the
    message says why and what to do."""


def _first_line(e):
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)[:200]


def hub_source(name_or_folder):
    """transformers' from_pretrained arguments for a GPT2_MODELS name or a folder: the hub name, read
    from the local cache alone when the hub does not answer (data.common.hub_offline: one probe, where
    huggingface_hub would retry five times over ~25 s before failing), there under the bare name
    ('gpt2') where only that one is cached; or the folder as it is."""
    if name_or_folder not in GPT2_HUB:
        return (name_or_folder,), {}
    if not hub_offline():
        return (GPT2_HUB[name_or_folder],), {'local_files_only': False}
    # the cache keeps a model under the name it was asked by: nanoGPT's from_pretrained('gpt2') filled
    # models--gpt2, which a request for openai-community/gpt2 never reads (h2oai/h2ogpt#755)
    from huggingface_hub import try_to_load_from_cache  # transformers brings it
    cached = [repo for repo in (GPT2_HUB[name_or_folder], name_or_folder)  # weights, not config.json alone
              if any(isinstance(try_to_load_from_cache(repo, f), str) for f in ('model.safetensors', 'pytorch_model.bin'))]
    return (cached[0] if cached else GPT2_HUB[name_or_folder],), {'local_files_only': True}


def _transformers():
    """The transformers module; PretrainedError saying how to install it when it is missing."""
    try:
        import transformers
    except ImportError:
        raise PretrainedError("GPT-2 checkpoints are read and written through Hugging Face "
                              "transformers, which is not installed: pip install transformers") from None
    return transformers


def load_error(what, name_or_folder, e):
    """The PretrainedError for a config or weights transformers could not read: for a GPT-2 name
    (downloaded, so often a machine offline) it says how to train from a folder instead."""
    offline = ("; offline, give init_from a folder holding config.json and the weights, saved on a machine "
               f"online by transformers (GPT2LMHeadModel.from_pretrained({GPT2_HUB[name_or_folder]!r})"
               ".save_pretrained(folder)): train.py --init_from=/path/to/folder") if name_or_folder in GPT2_HUB else ''
    return PretrainedError(f"cannot {what} of {name_or_folder} ({_first_line(e)}){offline}")


def pretrained_config(name_or_folder):
    """GPTConfig fields of a GPT-2 checkpoint from its config alone (no weights are read): n_layer,
    n_head, n_embd, vocab_size, block_size = n_positions, bias=True, norm='layernorm', norm_eps =
    layer_norm_epsilon, activation from activation_function. Raises PretrainedError for a name that
    is neither a GPT2_MODELS name nor a folder with config.json, an unreadable config, or a
    variant this GPT cannot hold (another model type, n_inner ≠ 4·n_embd, other attention scaling,
    cross-attention, an untied head)."""
    if name_or_folder not in GPT2_HUB and not os.path.isfile(os.path.join(name_or_folder, 'config.json')):
        raise PretrainedError(f"{name_or_folder!r} is neither a GPT-2 name ({', '.join(GPT2_MODELS)}) nor a "
                              "folder holding a transformers GPT-2 checkpoint (config.json + weights)")
    tf = _transformers()
    try:
        source, kwargs = hub_source(name_or_folder)
        hf = tf.AutoConfig.from_pretrained(*source, **kwargs)
    except Exception as e:
        raise load_error('read the config', name_or_folder, e) from None
    if not isinstance(hf, tf.GPT2Config):
        raise PretrainedError(f"{name_or_folder} holds a {type(hf).__name__}, not a GPT-2 (GPT2Config)")
    unsupported = [f"{key}={value!r}" for key, value, ok in (
        ('activation_function', hf.activation_function, hf.activation_function in GPT2_ACTIVATIONS),
        ('n_inner', hf.n_inner, hf.n_inner in (None, 4 * hf.n_embd)),
        ('scale_attn_weights', hf.scale_attn_weights, hf.scale_attn_weights),
        ('scale_attn_by_inverse_layer_idx', hf.scale_attn_by_inverse_layer_idx, not hf.scale_attn_by_inverse_layer_idx),
        ('add_cross_attention', hf.add_cross_attention, not hf.add_cross_attention),
        ('tie_word_embeddings', hf.tie_word_embeddings, hf.tie_word_embeddings)) if not ok]
    if unsupported:
        raise PretrainedError(f"{name_or_folder} is a GPT-2 variant this model cannot hold: {', '.join(unsupported)}")
    return dict(n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd, vocab_size=hf.vocab_size,
                block_size=hf.n_positions, bias=True, norm='layernorm', norm_eps=hf.layer_norm_epsilon,
                activation=GPT2_ACTIVATIONS[hf.activation_function])


def pretrained_args(name_or_folder, overrides=None):
    """GPTConfig fields for a GPT-2 checkpoint (pretrained_config) with `overrides` on top. A key
    of PRETRAINED_SHAPE must agree with the checkpoint; block_size may be at most n_positions
    (a smaller one crops the position embedding); any other field (taper, aux_weight,
    norm_removal, dropout, ...) applies. Raises PretrainedError naming both values."""
    args = pretrained_config(name_or_folder)
    context = args['block_size']
    for key, value in (overrides or {}).items():
        if key == 'block_size' and value > context:
            raise PretrainedError(f"block_size={value} exceeds {name_or_folder}'s context n_positions={context}; "
                                  f"use at most {context} (a smaller one crops the position embedding)")
        if key in PRETRAINED_SHAPE and value != args[key]:
            fix = (f"leave {key} out to take it from the pretrained model" if key != 'vocab_size' else
                   "prepare the dataset with the full GPT-2 vocabulary (--vocab_size=0)" if value != 50257 else
                   # the data has GPT-2's own 50257 ids: the checkpoint's vocabulary was resized (transformers#9542)
                   "its vocabulary is not GPT-2's (resized, e.g. an added pad token); start from a checkpoint "
                   "with GPT-2's 50257 tokens")
            raise PretrainedError(f"{key}={value!r} contradicts {name_or_folder}'s {key}={args[key]!r}: {fix}")
        args[key] = value
    try:
        GPTConfig(**args)
    except (TypeError, ValueError) as e:
        raise PretrainedError(str(e)) from None
    return args


# what an export refusal calls each norm GPT-2 has not (model.NORMS)
NORM_NAMES = {'rmsnorm': 'RMSNorm', 'dyt': 'DyT (tanh, no per-token statistic)', 'derf': 'Derf (erf, no per-token statistic)'}


@torch.no_grad()
def export_gpt2(model, folder):
    """Write a model that still normalizes (a baseline, or a TaperNorm model in its gate warmup, or
    FakeLN before its first removal) as a transformers GPT-2 folder (save_pretrained: config.json
    and the weights), the inverse of from_pretrained: loading the folder gives the same logits.
    Conv1D weights are stored transposed; a model without biases gets zero biases. Raises
    PretrainedError for a model GPT-2 cannot express: RMSNorm, DyT or Derf, folded, tapered (g < 1
    in the taper phase, or the linear phase), or FakeLN after a removal."""
    c = model.config
    stage = int(model.fakeln_stage) if c.norm_removal == 'fakeln' else 0
    refusals = [
        (c.norm != 'layernorm', f"its norms are {NORM_NAMES.get(c.norm, c.norm)}; GPT-2 normalizes with LayerNorm"),
        (c.folded, "it is folded: its norms were merged into the next weights"),
        # at g = 1 a taper-phase norm is g·N(x) + 0·L(x) = N(x), exactly: the first taper step's checkpoint exports
        (model.phase == 'linear' or (model.phase == 'taper' and model.gate.item() < 1),
         f"it is in the {model.phase} phase (g = {model.gate.item():.4g}): its tapered norms no longer normalize"),
        (stage > 0, f"FakeLN has removed {FAKELN_EVENTS[stage - 1]} (and what came before): those norms no "
                    "longer normalize")]
    for refused, reason in refusals:
        if refused:
            raise PretrainedError(f"cannot export as GPT-2: {reason}; export a baseline, or a checkpoint "
                                  "at g = 1 (the gate warmup's) or before the first FakeLN removal")
    tf = _transformers()
    eot = 50256 if c.vocab_size == 50257 else None  # GPT-2's <|endoftext|>, only in its own vocabulary
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        layer_norm_epsilon=c.norm_eps, activation_function='gelu_new' if c.activation == 'gelu_tanh' else 'gelu',
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, tie_word_embeddings=True,
        bos_token_id=eot, eos_token_id=eot))
    ours = model.state_dict()
    sd = {}
    for key, target in hf.state_dict().items():
        value = target if key.endswith(('.attn.bias', '.attn.masked_bias')) else ours.get(key)  # mask buffers
        if value is None and key.endswith('bias') and not c.bias:
            value = torch.zeros_like(target)
        if value is None:
            raise PretrainedError(f"cannot export as GPT-2: the model has no {key}")
        sd[key] = (value.t() if key.endswith(CONV1D_WEIGHTS) else value).float().contiguous()
    hf.load_state_dict(sd)
    hf.save_pretrained(folder)
    return folder


def from_pretrained(name_or_folder, overrides=None):
    """A GPT holding a GPT-2 checkpoint's weights: a GPT2_MODELS name (downloaded by
    transformers) or a folder with a transformers GPT-2 checkpoint (config.json + weights).
    The shape comes from its config; overrides (GPTConfig fields) as in pretrained_args: the
    position embedding is cropped to a smaller block_size; taper / aux_weight / norm_removal /
    dropout apply on top, so a gate warmup calibrates c on the pretrained model's activations.
    Conv1D weights are transposed. Raises PretrainedError with a one-line message.
    """
    args = pretrained_args(name_or_folder, overrides)
    tf = _transformers()
    try:
        source, kwargs = hub_source(name_or_folder)
        hf, info = tf.GPT2LMHeadModel.from_pretrained(*source, output_loading_info=True, **kwargs)
    except Exception as e:  # no weights, offline, corrupt files: one line
        raise load_error('load the weights', name_or_folder, e) from None
    # transformers fills a weight the files lack with random values and only warns (transformers#13233):
    # a folder missing a layer, or a compiled model's '_orig_mod.' keys, trained from noise. Left on the
    # meta device: tied weights saved by safetensors' save_model (transformers#41038, 4.x)
    mismatched = [m[0] if isinstance(m, tuple) else m for m in info.get('mismatched_keys', [])]  # 4.x: (key, shapes)
    unloaded = sorted(k for k in {*info.get('missing_keys', []), *mismatched}  # 5.x gives a set
                      if not k.endswith(('.attn.bias', '.attn.masked_bias', 'lm_head.weight')))  # old buffers; tied
    unloaded += [k for k, v in hf.state_dict().items() if v.is_meta and k not in unloaded]
    if unloaded:
        raise PretrainedError(f"{name_or_folder} lacks weights its config.json names ({len(unloaded)}: "
                              f"{', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''}), which transformers "
                              "would fill at random: save the model with save_pretrained, or check the files")
    model = GPT(GPTConfig(**args))
    sd = {}
    for key, value in hf.state_dict().items():
        if key.endswith(('.attn.bias', '.attn.masked_bias')):  # causal-mask buffers of older versions
            continue
        if key.endswith(CONV1D_WEIGHTS):
            value = value.t()
        sd[key] = value[:args['block_size']] if key == 'transformer.wpe.weight' else value
    sd.setdefault('lm_head.weight', sd['transformer.wte.weight'])  # tied
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # what GPT-2 lacks is TaperNorm's / FakeNorm's own state (γ̃, β̃, c, s, ...) and the model's buffers
    missing = [k for k in missing if k.rpartition('.')[2] in ('weight', 'bias')]
    if missing or unexpected:
        raise PretrainedError(f"{name_or_folder} does not fit a GPT-2 of its config: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    return model
