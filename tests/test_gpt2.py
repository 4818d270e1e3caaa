"""The GPT-2 family (docs/method.md §7): pretrained weights in and out through transformers, the
FakeLN baseline, the OpenWebText / Pile prepare scripts, the fine-tuning configs.

The loader and export tests need Hugging Face transformers (optional for users; CI installs it
from requirements-dev.txt) and skip without it; they build a tiny random GPT-2 with transformers itself,
offline. FakeLN and the data tests need nothing beyond requirements.txt.
"""

import importlib.util
import json
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import configurator
import export_gpt2
import fold
import sample
import runs
import train
from test_data import load_script
from test_train import interrupt_at, linear_phase_model, read_log
from baselines import FakeNorm, fakeln_step, fakenorms, remove_norms
from gpt2 import PretrainedError, export_gpt2 as export, from_pretrained, pretrained_args
from baselines import FAKELN_EVENTS
from model import GPT, GPTConfig, TaperNorm
from runs import load_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'data'))
import common  # noqa: E402

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec('transformers') is None,
    reason='Hugging Face transformers is not installed (optional: pip install transformers, or '
           'pip install -r requirements-dev.txt as CI does)')


def toy_args(data_dir, out_dir, **overrides):
    cfg = dict(dataset='toy', data_dir=str(data_dir), out_dir=str(out_dir), device='cpu', compile=False,
               block_size=16, batch_size=4, gradient_accumulation_steps=2, max_iters=12,
               learning_rate=3e-3, min_lr=3e-4, warmup_iters=2, lr_decay_iters=12,
               eval_interval=4, eval_iters=2, log_interval=1)
    cfg.update(overrides)
    return [f'--{k}={v}' for k, v in cfg.items()]


# ---- a tiny random GPT-2, written by transformers itself ----------------------------------

def tiny_gpt2(folder, vocab_size=64, n_positions=32, seed=0):
    """A random GPT2LMHeadModel (2 layers, 32 wide, gelu_new) with LayerNorm gains and biases
    far from 1 and 0 and MLP inputs of order 1 (where the tanh GELU and the exact one differ),
    saved to folder (config.json + model.safetensors). Returns it, in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    eot = vocab_size - 1
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2,
                                    n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    bos_token_id=eot, eos_token_id=eot)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if '.ln_' in name:
                p.copy_(torch.exp(0.5 * torch.randn_like(p)) if name.endswith('weight') else 0.3 * torch.randn_like(p))
            elif name.endswith('mlp.c_fc.weight'):
                p.mul_(15)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope='module')
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp('gpt2')
    return folder, tiny_gpt2(folder)


def hf_logits(hf, x):
    with torch.no_grad():
        return hf(x).logits


# ---- loading ------------------------------------------------------------------------------

@needs_transformers
def test_pretrained_gpt2_loads_with_transformers_logits_and_greedy_tokens(gpt2_folder):
    folder, hf = gpt2_folder
    model = from_pretrained(str(folder)).eval()
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size) == (2, 2, 32, 64, 32)
    assert (c.norm, c.norm_eps, c.bias, c.activation) == ('layernorm', 1e-5, True, 'gelu_tanh')
    x = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x, x)[0]
    assert_close(ours, hf_logits(hf, x), rtol=0, atol=1e-5)
    # greedy decoding: the KV-cached path against transformers' full recompute
    prompt, tokens = x[:, :5], x[:, :5]
    for _ in range(12):
        tokens = torch.cat([tokens, hf_logits(hf, tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(model.generate(prompt, 12, temperature=0), tokens)


@needs_transformers
def test_gpt2s_tanh_gelu_is_what_makes_the_logits_equal_and_the_default_stays_exact(gpt2_folder):
    folder, hf = gpt2_folder
    model = from_pretrained(str(folder)).eval()
    for block in model.transformer.h:
        block.mlp.approximate = 'none'  # the exact GELU in place of GPT-2's gelu_new
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(x, x)[0] - hf_logits(hf, x)).abs().max() > 5e-5  # well above the 1e-5 of the tests above
    scratch = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=16, block_size=8))
    assert scratch.config.activation == 'gelu' and scratch.transformer.h[0].mlp.approximate == 'none'


@needs_transformers
def test_a_smaller_block_size_crops_the_position_embedding(gpt2_folder):
    folder, hf = gpt2_folder
    model = from_pretrained(str(folder), {'block_size': 16}).eval()
    assert model.transformer.wpe.weight.shape == (16, 32)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(model(x, x)[0], hf_logits(hf, x), rtol=0, atol=1e-5)


@needs_transformers
@pytest.mark.parametrize('override, message', [
    ({'n_layer': 3}, "n_layer=3 contradicts .*'s n_layer=2: leave n_layer out"),
    ({'norm': 'rmsnorm'}, "norm='rmsnorm' contradicts .*'s norm='layernorm'"),
    ({'activation': 'gelu'}, "activation='gelu' contradicts .*'s activation='gelu_tanh'"),
    ({'vocab_size': 10000}, r"vocab_size=10000 contradicts .*'s vocab_size=64: prepare the dataset with the "
                            r"full GPT-2 vocabulary \(--vocab_size=0\)"),
    # data in GPT-2's own ids against a resized vocabulary (transformers#9542): --vocab_size=0 would change nothing
    ({'vocab_size': 50257}, r"vocab_size=50257 contradicts .*'s vocab_size=64: its vocabulary is not GPT-2's "
                            r"\(resized, e.g. an added pad token\); start from a checkpoint with GPT-2's 50257 tokens$"),
    ({'block_size': 64}, "block_size=64 exceeds .*'s context n_positions=32; use at most 32"),
])
def test_a_key_that_contradicts_the_pretrained_shape_is_refused_naming_both_values(gpt2_folder, override, message):
    with pytest.raises(PretrainedError, match=message):
        pretrained_args(str(gpt2_folder[0]), override)


@needs_transformers
def test_what_cannot_be_loaded_says_why(tmp_path):
    with pytest.raises(PretrainedError, match="neither a GPT-2 name .*gpt2-xl.* nor a folder"):
        pretrained_args(str(tmp_path / 'nowhere'))
    from transformers import GPT2Config
    GPT2Config(n_embd=32, n_layer=1, n_head=2, n_inner=64, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(PretrainedError, match="variant this model cannot hold: n_inner=64"):
        pretrained_args(str(tmp_path))
    with pytest.raises(PretrainedError, match="cannot load the weights"):  # a config without weights
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=10).save_pretrained(tmp_path)
        from_pretrained(str(tmp_path))


@needs_transformers
@pytest.mark.parametrize('how', ['a layer left out', "a compiled model's _orig_mod. keys", 'tied, by save_model'])
def test_a_folder_that_lacks_weights_is_refused_not_filled_at_random(tmp_path, how):
    """transformers fills missing weights at random and only warns (transformers#13233): such a folder
    trained from noise. safetensors' save_model keeps one of the tied pair, and transformers 4.x left
    the other on the meta device (a 'Cannot copy out of meta tensor' traceback)."""
    import transformers
    from safetensors.torch import load_file, save_file, save_model
    hf = tiny_gpt2(tmp_path)
    path = tmp_path / 'model.safetensors'
    sd = load_file(path)
    if how == 'a layer left out':
        save_file({k: v for k, v in sd.items() if '.h.1.' not in f'.{k}'}, path, metadata={'format': 'pt'})
        lacks = '12: transformer.h.1.attn.c_attn.bias, '
    elif how.startswith('a compiled'):
        save_file({f'_orig_mod.{k}': v for k, v in sd.items()}, path, metadata={'format': 'pt'})
        lacks = '28: '  # every weight: 2 layers × 12, ln_f × 2, wte, wpe
    else:
        path.unlink()
        save_model(hf, path, metadata={'format': 'pt'})
        if 'transformer.wte.weight' in load_file(path):
            pytest.skip('this safetensors keeps both tied names')
        if int(transformers.__version__.split('.')[0]) >= 5:  # 5.x ties the kept one to both: a whole model
            assert torch.equal(from_pretrained(str(tmp_path)).transformer.wte.weight, hf.transformer.wte.weight)
            return
        lacks = ''
    with pytest.raises(PretrainedError, match=rf"^{re.escape(str(tmp_path))} lacks weights its config.json names "
                                              rf"\({re.escape(lacks)}.*would fill at random: save the model with "
                                              r"save_pretrained, or check the files$"):
        from_pretrained(str(tmp_path))


@needs_transformers
def test_a_gpt2_name_that_cannot_be_read_offline_says_how_to_train_from_a_folder(monkeypatch, tmp_path):
    """Offline, transformers cannot download 'gpt2': the one line train.py prints names the folder route,
    and a folder that cannot be read does not get that advice (it is no download)."""
    import gpt2
    import transformers
    asked = []

    def offline(*args, **kwargs):
        asked.append((args, kwargs))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files\nand more")
    monkeypatch.setattr(transformers.AutoConfig, 'from_pretrained', offline)
    monkeypatch.setattr(gpt2, 'hub_offline', lambda: True)  # the probe found no hub
    with pytest.raises(PretrainedError) as e:
        pretrained_args('gpt2-medium')
    # no hub: the local cache alone, at once, not huggingface_hub's five retries
    assert asked == [(('openai-community/gpt2-medium',), {'local_files_only': True})]
    assert str(e.value) == (
        "cannot read the config of gpt2-medium (We couldn't connect to 'https://huggingface.co' to load the "
        "files); offline, give init_from a folder holding config.json and the weights, saved on a machine online by "
        "transformers (GPT2LMHeadModel.from_pretrained('openai-community/gpt2-medium').save_pretrained(folder)): "
        "train.py --init_from=/path/to/folder")
    (tmp_path / 'config.json').write_text('{}')
    with pytest.raises(PretrainedError, match=r"^cannot read the config of .*\)$"):
        pretrained_args(str(tmp_path))
    assert asked[-1] == ((str(tmp_path),), {})  # a folder: read as it is, no probe of the hub


@needs_transformers
def test_offline_a_gpt2_cached_under_its_bare_name_loads(monkeypatch, tmp_path):
    """nanoGPT's from_pretrained('gpt2') caches it as models--gpt2; offline we asked only for
    openai-community/gpt2, and failed with the weights on disk (HPC nodes without a network)."""
    import gpt2
    from huggingface_hub import constants
    monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(tmp_path / 'hub'))
    monkeypatch.setattr(gpt2, 'hub_offline', lambda: True)
    assert gpt2.hub_source('gpt2') == (('openai-community/gpt2',), {'local_files_only': True})  # nothing cached
    for repo in ('gpt2', 'openai-community/gpt2'):
        cache = tmp_path / 'hub' / f"models--{repo.replace('/', '--')}"
        (cache / 'refs').mkdir(parents=True)
        (cache / 'refs' / 'main').write_text('0' * 40)
        if repo == 'gpt2':  # the cache's layout, by hand
            tiny_gpt2(cache / 'snapshots' / ('0' * 40))
        else:  # AutoTokenizer.from_pretrained('openai-community/gpt2') caches config.json, no weights
            (cache / 'snapshots' / ('0' * 40)).mkdir(parents=True)
            (cache / 'snapshots' / ('0' * 40) / 'config.json').write_text('{}')
    assert gpt2.hub_source('gpt2') == (('gpt2',), {'local_files_only': True})
    import transformers  # what it is asked for: transformers reads its cache folder as it was at import
    asked = []
    monkeypatch.setattr(transformers.AutoConfig, 'from_pretrained',
                        lambda *a, **k: asked.append((a, k)) or transformers.AutoConfig.for_model('gpt2', n_embd=32, n_head=2))
    assert pretrained_args('gpt2')['n_embd'] == 32 and asked == [(('gpt2',), {'local_files_only': True})]
    assert gpt2.hub_source('folder/x') == (('folder/x',), {})


def test_without_transformers_the_error_says_pip_install_transformers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, 'transformers', None)  # not installed: import fails
    (tmp_path / 'config.json').write_text('{}')
    with pytest.raises(PretrainedError, match='pip install transformers'):
        pretrained_args(str(tmp_path))
    with pytest.raises(PretrainedError, match='pip install transformers'):
        export(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=16, block_size=8, norm='layernorm')),
               str(tmp_path / 'out'))


@needs_transformers
def test_taperln_at_gate_one_is_the_pretrained_layernorm_and_calibrates_on_its_activations(gpt2_folder):
    folder, hf = gpt2_folder
    model = from_pretrained(str(folder), {'taper': 'all', 'aux_weight': 0.1}).eval()
    assert model.phase == 'warmup' and all(isinstance(m, TaperNorm) for _, m in model.tapernorms())
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        ours = model(x, x)[0]
    assert_close(ours, out.logits, rtol=0, atol=1e-5)
    hidden = out.hidden_states  # hidden[i]: what block i's ln_1 reads
    for i in range(2):
        hf_ln, ln = hf.transformer.h[i].ln_1, model.transformer.h[i].ln_1
        with torch.no_grad():
            assert_close(ln(hidden[i], model.gate), hf_ln(hidden[i]), rtol=0, atol=1e-6)
    # the gate warmup calibrates c on the pretrained model's activations: c of ln_1 in block 1 by hand
    model.set_collect('calibration')
    with torch.no_grad():
        model(x, x)
    model.set_collect(None)
    event = model.calibrate('end')
    h = hidden[1].double()
    p = h - h.mean(-1, keepdim=True)
    sigma = (p.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    g2 = hf.transformer.h[1].ln_1.weight.double().pow(2)
    num = (g2 * (p.pow(2) / sigma).flatten(0, 1).mean(0)).sum()
    den = (g2 * p.pow(2).flatten(0, 1).mean(0)).sum()
    assert event['c']['h.1.ln_1'] == pytest.approx((num / den).item(), rel=1e-5)


# ---- export -------------------------------------------------------------------------------

@needs_transformers
@pytest.mark.parametrize('kind', ['baseline', 'no_bias', 'warmup_taper', 'taper_at_g1', 'fakeln_before_removal',
                                  'pretrained'])
def test_export_then_load_gives_the_same_logits(kind, gpt2_folder, tmp_path):
    from transformers import GPT2LMHeadModel
    torch.manual_seed(5)
    shape = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=24, norm='layernorm')
    model = {'baseline': lambda: GPT(GPTConfig(**shape, activation='gelu')),
             'no_bias': lambda: GPT(GPTConfig(**shape, bias=False)),
             'warmup_taper': lambda: GPT(GPTConfig(**shape, taper='internal', activation='gelu_tanh')),
             'taper_at_g1': lambda: taper_phase_at(1.0),  # the first taper step: g·N + (1 − g)·L is N
             'fakeln_before_removal': lambda: GPT(GPTConfig(**shape, norm_removal='fakeln')),
             'pretrained': lambda: from_pretrained(str(gpt2_folder[0]))}[kind]().eval()
    with torch.no_grad():  # gains and biases away from 1 and 0, so that a dropped one shows
        for n, p in model.named_parameters():
            if '.ln_' in n and '_tilde' not in n:
                p.add_(0.3 * torch.randn_like(p))
    export(model, str(tmp_path))
    back = from_pretrained(str(tmp_path)).eval()
    assert back.config.activation == model.config.activation and back.config.block_size == model.config.block_size
    x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    with torch.no_grad():
        ours = model(x, x)[0]
        assert_close(back(x, x)[0], ours, rtol=0, atol=1e-5)
        assert_close(GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()(x).logits, ours, rtol=0, atol=1e-5)


def linear_phase_taper():
    return linear_phase_model(vocab_size=50, norm='layernorm', taper='internal').eval()


def taper_phase_at(g):
    model = linear_phase_taper()  # calibrated: c and γ̃ away from N's scale, so that any share of L shows
    model.set_phase('taper')
    model.set_gate(g)
    return model


def fakeln_model(events, kind='layernorm', seed=0, steps_per_event=2):
    """A tiny FakeLN model after `events` removal events, each after steps_per_event training-mode
    forwards (no optimizer: the weights stay, only the σ windows fill)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, norm=kind,
                          norm_removal='fakeln'))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if '.ln_' in n:
                p.add_(0.3 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in range(events):
        for _ in range(steps_per_event):
            x = torch.randint(0, 64, (4, 16), generator=gen)
            model(x, x)
            fakeln_step(model)
        remove_norms(model)
    return model.eval()


@needs_transformers
def test_export_refuses_what_gpt2_cannot_express(tmp_path):
    shape = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
    cases = [(GPT(GPTConfig(**shape)), "its norms are RMSNorm"),
             (GPT(GPTConfig(**shape, norm='dyt', taper='none')), r"its norms are DyT \(tanh"),
             (GPT(GPTConfig(**shape, norm='derf', taper='none')), r"its norms are Derf \(erf"),
             (linear_phase_taper(), r"it is in the linear phase \(g = 0\)"),
             (taper_phase_at(0.999), r"it is in the taper phase \(g = 0.999\)"),
             (fold.fold_model(linear_phase_taper()), "it is folded"),
             (fakeln_model(1), "FakeLN has removed ln_2")]
    for model, message in cases:
        with pytest.raises(PretrainedError, match=f"cannot export as GPT-2: {message}"):
            export(model, str(tmp_path / 'out'))
        assert not (tmp_path / 'out').exists()


@needs_transformers
def test_export_script_checks_its_work_and_refuses_in_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=40, block_size=8, norm='layernorm'))
    runs.save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(tmp_path / 'a.pt'))
    diff = export_gpt2.main([f'--ckpt={tmp_path / "a.pt"}', f'--out={tmp_path / "hf"}'])
    out = capsys.readouterr().out
    # the folder holds no tokenizer (a pipeline on it alone fails, oobabooga/textgen#735): the line says which
    assert diff <= 1e-5 and 'loaded back' in out and (
        f"tokenizer, GPT-2's: pipeline('text-generation', model='{tmp_path / 'hf'}', tokenizer='openai-community/gpt2')"
        in out) and not (tmp_path / 'hf' / 'tokenizer.json').exists()
    with pytest.raises(SystemExit, match='exists and is not an empty folder'):
        export_gpt2.main([f'--ckpt={tmp_path / "a.pt"}', f'--out={tmp_path / "hf"}'])
    rms = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=40, block_size=8))
    runs.save_checkpoint({'model': rms.state_dict(), 'model_args': vars(rms.config)}, str(tmp_path / 'b.pt'))
    with pytest.raises(SystemExit, match=r'b\.pt: cannot export as GPT-2: its norms are RMSNorm'):
        export_gpt2.main([f'--ckpt={tmp_path / "b.pt"}', f'--out={tmp_path / "hf2"}'])
    compact = {'vocab_size': 40, 'unk_id': 39, 'eot_id': 0, 'tokenizer': 'gpt2'}  # a prepare.py meta.json's keys
    runs.save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config), 'meta': compact},
                         str(tmp_path / 'c.pt'))  # its ids are not GPT-2's: a tokenizer would decode other text
    with pytest.raises(SystemExit, match=r'c\.pt was trained on a compact vocabulary \(40 ids .* prepared with the '
                                         r'full GPT-2 vocabulary \(--vocab_size=0\)$'):
        export_gpt2.main([f'--ckpt={tmp_path / "c.pt"}', f'--out={tmp_path / "hf3"}'])
    assert not (tmp_path / 'hf3').exists()


def test_export_refuses_a_bare_gpt2_name_as_its_folder(tmp_path, monkeypatch):
    """--out=gpt2 wrote ./gpt2, then checked it by loading 'gpt2': OpenAI's weights from the hub, which
    failed the logit check and removed the folder as 'a bug' (transformers#13836)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^config error: --out=gpt2-medium is the name of OpenAI's GPT-2 on the hub, .* choose "
                                         r"another name, or --out=\./gpt2-medium$"):
        export_gpt2.main(['--ckpt=a.pt', '--out=gpt2-medium'])
    assert not (tmp_path / 'gpt2-medium').exists()


def test_export_script_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        export_gpt2.main(['-h'])
    out = capsys.readouterr().out
    assert all(f'{k} =' in out for k in configurator.defaults_of(vars(export_gpt2)))


# ---- train.py from a pretrained GPT-2 -----------------------------------------------------

@needs_transformers
def test_train_from_a_pretrained_folder_takes_its_shape_and_starts_from_its_weights(gpt2_folder, toy_data, tmp_path):
    folder, hf = gpt2_folder
    out = tmp_path / 'run'
    # n_layer / n_head / n_embd given and agreeing; norm, activation, bias from the pretrained config
    model = train.main(toy_args(toy_data, out, init_from=folder, n_layer=2, n_head=2, n_embd=32,
                                taper='internal', aux_weight=0.1, gate_warmup_iters=3, taper_iters=4))
    c = model.config
    assert (c.norm, c.activation, c.block_size, c.vocab_size) == ('layernorm', 'gelu_tanh', 16, 64)
    log = read_log(out)
    assert [r['iter'] for r in log if r.get('event') == 'calibrate'] == [2]
    # the first validation loss is the pretrained model's: same batches, its own weights
    pretrained = from_pretrained(str(folder), {'block_size': 16}).eval()
    cfg, losses = train.load_config(toy_args(toy_data, out)), []
    for k in range(cfg.eval_iters):
        x, y = train.get_batch(str(toy_data / 'toy'), 'val', train.batch_rng(cfg.seed, 1, k), 4, 16, 'cpu')
        with torch.no_grad():
            losses.append(pretrained(x, y)[1])
    assert log[0]['val_loss'] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)
    # a resumed run rebuilds the same model from its checkpoint (no transformers involved)
    resumed = train.main([f'--out_dir={out}', '--init_from=resume'])
    assert resumed.config == model.config
    # with a schedule_scale (config/smoke.py's), the command that started it + --init_from=resume continues
    # it: its shape stays the pretrained folder's, where train.py's defaults were said to "change the run"
    scaled = toy_args(toy_data, tmp_path / 'scaled', init_from=folder, schedule_scale=0.5)
    first = train.main(scaled)
    cfg, ckpt = train.run_config(scaled + ['--init_from=resume'])
    assert (cfg.max_iters, cfg.n_layer, cfg.n_embd, cfg.norm, cfg.activation) == \
        (ckpt['config']['max_iters'], first.config.n_layer, first.config.n_embd, 'layernorm', 'gelu_tanh')
    assert cfg.max_iters == train.load_config(toy_args(toy_data, out)).max_iters // 2  # scaled once, not twice
    # a checkpoint a resumed segment wrote stores init_from='resume': the shape must still come from it
    torch.save({**ckpt, 'config': {**ckpt['config'], 'init_from': 'resume'}}, tmp_path / 'scaled' / 'ckpt.pt')
    again, _ = train.run_config(scaled + ['--init_from=resume'])
    assert vars(again) == vars(cfg)
    # the same fine-tune started again (not resumed) would replace the checkpoint: refused, as a scratch run is
    before = (out / 'log.jsonl').read_text()
    with pytest.raises(SystemExit, match=r'already holds a run \(ckpt.pt, log.jsonl\): continue it with --init_from=resume'):
        train.main(toy_args(toy_data, out, init_from=folder, max_iters=2))
    assert (out / 'log.jsonl').read_text() == before
    train.main(toy_args(toy_data, out, init_from=folder, max_iters=2, overwrite=True))
    assert [r['iter'] for r in read_log(out) if 'final_val_loss' in r] == [2]  # only the new run


@needs_transformers
@pytest.mark.parametrize('overrides, message', [
    (dict(n_layer=3), r"n_layer=3 contradicts .*'s n_layer=2"),
    (dict(norm='rmsnorm'), r"norm='rmsnorm' contradicts .*'s norm='layernorm'"),  # the default, set explicitly
    (dict(block_size=64), r"block_size=64 exceeds .*'s context n_positions=32"),
])
def test_train_refuses_a_config_that_contradicts_the_pretrained_shape(gpt2_folder, toy_data, tmp_path,
                                                                      overrides, message):
    with pytest.raises(SystemExit, match=f'init_from=.*: {message}'):
        train.main(toy_args(toy_data, tmp_path / 'run', init_from=gpt2_folder[0], **overrides))
    assert not (tmp_path / 'run').exists()  # refused before anything is written


def test_keys_set_tells_an_explicit_default_from_an_unset_key(tmp_path):
    defaults = configurator.defaults_of(vars(train))
    keys = train.SHAPE_KEYS
    conf = tmp_path / 'c.py'
    conf.write_text("n_layer = 8\nblock_size = 2 * 512\n")  # n_layer: the default, set on purpose
    given = configurator.keys_set([str(conf), '--norm=rmsnorm', '--bias=True'], defaults, keys, train.CHOICES)
    assert given == {'n_layer', 'block_size', 'norm', 'bias'}
    assert configurator.keys_set(['--dropout=0.1'], defaults, keys, train.CHOICES) == set()


@needs_transformers
def test_train_refuses_a_dataset_in_a_compact_vocabulary_or_another_one(gpt2_folder, toy_data, tmp_path):
    meta = toy_data / 'toy' / 'meta.json'
    meta.write_text(json.dumps({'vocab_size': 64, 'tokenizer': 'gpt2', 'unk_id': 63}))
    with pytest.raises(SystemExit, match="reads GPT-2's own token ids, .*compact vocabulary of 64 .*--vocab_size=0"):
        train.main(toy_args(toy_data, tmp_path / 'a', init_from=gpt2_folder[0]))
    meta.write_text(json.dumps({'vocab_size': 64, 'tokenizer': 'toy'}))
    other = tmp_path / 'gpt2-97'
    tiny_gpt2(other, vocab_size=97)
    with pytest.raises(SystemExit, match=r"vocab_size=64 contradicts .*vocab_size=97: prepare the dataset"):
        train.main(toy_args(toy_data, tmp_path / 'b', init_from=other))


def test_init_from_must_be_a_known_name_or_a_folder():
    with pytest.raises(SystemExit, match="init_from='gpt3': choose 'scratch', 'resume', one of gpt2, "
                                         "gpt2-medium, gpt2-large, gpt2-xl or a folder"):
        train.load_config(['--init_from=gpt3'])


# ---- FakeLN -------------------------------------------------------------------------------

def capture_inputs(model):
    """{norm name: [input h of every forward]} through forward pre-hooks."""
    seen = {name: [] for name, _ in fakenorms(model)}
    for name, m in fakenorms(model):
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].detach().clone()))
    return seen


def plain_sigma(h, eps=1e-5):
    """σ(h) = sqrt(mean (h − mean h)² + ε) per token, written out: (N, T)."""
    p = h - h.mean(-1, keepdim=True)
    return (p.pow(2).mean(-1) + eps).sqrt()


def test_fakeln_freezes_the_mean_std_of_its_window_and_divides_by_it():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, norm='layernorm',
                          norm_removal='fakeln'))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = capture_inputs(model)
    gen = torch.Generator().manual_seed(1)

    def steps(n):
        model.train()
        for _ in range(n):
            for _ in range(2):  # two micro-batches
                x = torch.randint(0, 64, (4, 16), generator=gen)
                model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
            fakeln_step(model)
        model.eval()
        with torch.no_grad():  # evaluation forwards measure nothing
            model(x, x)

    steps(3)
    for hs in seen.values():
        del hs[-1]  # the evaluation forward
    event = remove_norms(model)
    assert event['removed'] == 'ln_2' and set(event['std']) == {'h.0.ln_2', 'h.1.ln_2'}
    for name in ('h.0.ln_2', 'h.1.ln_2'):
        sigma = plain_sigma(torch.cat(seen[name]).double())
        assert event['std'][name] == pytest.approx(sigma[:, 1:].mean().item(), rel=1e-5)
        assert event['std_first'][name] == pytest.approx(sigma[:, 0].mean().item(), rel=1e-5)
    # the removed layer is (h − mean h) / s ⊙ γ + β, with s0 at position 0
    m = model.transformer.h[1].ln_2
    assert isinstance(m, FakeNorm) and m.removed and not model.transformer.h[1].ln_1.removed
    h = 3 * torch.randn(2, 16, 32)
    scale = torch.where(torch.arange(16)[:, None] == 0, m.std_first, m.std)
    expected = (h - h.mean(-1, keepdim=True)) / scale * m.weight + m.bias
    assert_close(m(h, None, torch.arange(16)), expected)
    assert_close(m(h[:, 5:6], None, torch.tensor([5])), expected[:, 5:6])  # a decode step at position 5

    # ln_1's window restarted at the event: its s comes from the forwards after it only
    for hs in seen.values():
        hs.clear()
    steps(2)
    for hs in seen.values():
        del hs[-1]
    event = remove_norms(model)
    sigma = plain_sigma(torch.cat(seen['h.0.ln_1']).double())
    assert event['removed'] == 'ln_1'
    assert event['std']['h.0.ln_1'] == pytest.approx(sigma[:, 1:].mean().item(), rel=1e-5)
    steps(1)
    assert remove_norms(model)['removed'] == 'ln_f'
    # every norm removed, position 0 still its own until the last event: s0 there, s elsewhere
    assert m.first_position and m.std_first != m.std
    expected = (h - h.mean(-1, keepdim=True)) / torch.where(torch.arange(16)[:, None] == 0, m.std_first, m.std)
    assert_close(m(h, None, torch.arange(16)), expected * m.weight + m.bias)
    event = remove_norms(model)
    assert event['removed'] == 'first_position' and event['std_first'] == event['std']
    assert not m.first_position
    with pytest.raises(RuntimeError, match='every FakeLN removal event has happened'):
        remove_norms(model)


def test_fakeln_rms_kind_divides_h_itself():
    model = fakeln_model(1, kind='rmsnorm')
    m = model.transformer.h[0].ln_2
    h = torch.randn(2, 16, 32)
    scale = torch.where(torch.arange(16)[:, None] == 0, m.std_first, m.std)
    assert_close(m(h), h / scale * m.weight)


def test_a_compiled_fakeln_model_recompiles_once_per_removal_never_per_step():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, norm='layernorm',
                          norm_removal='fakeln'))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16))
    frames = []
    model.train()
    for it in range(12):  # fakeln_interval = 2: events before iterations 2, 4, 6, 8
        while int(model.fakeln_stage) < train.get_fakeln_stage(it, 'fakeln', 2):
            remove_norms(model)
        _, loss = compiled(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        fakeln_step(model)
        frames.append(counter.frame_count)
    assert frames == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5, 5]
    torch._dynamo.reset()


@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm'])
def test_fakeln_folds_exactly_after_its_last_event_and_not_before(kind):
    model = fakeln_model(len(FAKELN_EVENTS), kind)
    folded = fold.fold_model(model)
    assert folded.config.untied_head() and folded.transformer.ln_f is None
    assert all(b.ln_1 is None and b.ln_2 is None for b in folded.transformer.h)
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(9))
    diff, scale = fold.max_logit_error(model, folded, x, 'FakeLN vs folded')
    assert diff <= 1e-5 * scale
    # a prefill and decode step agree too: position 0 is not special any more
    assert torch.equal(model.generate(x[:, :4], 8, temperature=0), folded.generate(x[:, :4], 8, temperature=0))

    before = fakeln_model(len(FAKELN_EVENTS) - 1, kind)
    with pytest.raises(fold.FoldError, match=r"position 0 still has its own scalar s0 != s in 5 norms .*no weight "
                                             r"matrix \(the same at every position\) holds"):
        fold.fold_state_dict(before.state_dict(), vars(before.config))
    early = fakeln_model(1, kind)
    with pytest.raises(fold.FoldError, match="FakeLN has done 1 of its 4 events: ln_1, ln_f still normalize"):
        fold.fold_state_dict(early.state_dict(), vars(early.config))


def test_fakeln_config_checks():
    with pytest.raises(ValueError, match="norm_removal='fakeln' is a baseline of its own: it needs taper='none'"):
        GPTConfig(norm_removal='fakeln', taper='internal')
    with pytest.raises(SystemExit, match=r"fakeln_interval=4: its 4 events need 1 <= 4 × fakeln_interval <= "
                                         r"max_iters=12"):
        train.load_config(['--norm_removal=fakeln', '--fakeln_interval=4', '--max_iters=12'])
    assert [train.get_fakeln_stage(it, 'fakeln', 3) for it in (0, 2, 3, 5, 6, 9, 12, 20)] == [0, 0, 1, 1, 2, 3, 4, 4]
    assert train.get_fakeln_stage(100, 'none', 3) == 0


FAKELN_RUN = dict(norm='layernorm', norm_removal='fakeln', fakeln_interval=3, max_iters=16, lr_decay_iters=16,
                  n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def test_a_fakeln_run_logs_its_events_folds_and_resumes_exactly(toy_data, tmp_path, monkeypatch, capsys):
    straight = tmp_path / 'straight'
    model = train.main(toy_args(toy_data, straight, **FAKELN_RUN))
    log = read_log(straight)
    events = [r for r in log if r.get('event') == 'fakeln']
    assert [(r['iter'], r['removed']) for r in events] == [(2, 'ln_2'), (5, 'ln_1'), (8, 'ln_f'), (11, 'first_position')]
    assert {r['phase'] for r in log if 'loss' in r} == {'baseline'}
    ckpt = torch.load(straight / 'ckpt.pt', weights_only=True)
    assert ckpt['model']['fakeln_stage'].item() == 4 and 'transformer.ln_f.std' in ckpt['model']
    loaded, _ = load_model(str(straight / 'ckpt.pt'))
    assert all(m.removed and not m.first_position for _, m in fakenorms(loaded))
    assert torch.equal(loaded.transformer.ln_f.std, model.transformer.ln_f.std)

    # interrupted at step 10 (last checkpoint: 8, inside ln_f's window), resumed: the same run
    interrupted = tmp_path / 'interrupted'
    interrupt_at(10, toy_args(toy_data, interrupted, **FAKELN_RUN), monkeypatch)
    train.main(toy_args(toy_data, interrupted, **FAKELN_RUN, init_from='resume'))
    again = read_log(interrupted)
    assert [r for r in again if r.get('event') == 'fakeln'] == events  # none repeated, none lost
    steps_a = {r['iter']: r['loss'] for r in log if 'loss' in r}
    assert {r['iter']: r['loss'] for r in again if 'loss' in r} == steps_a
    assert again[-1]['final_val_loss'] == log[-1]['final_val_loss']

    # fold.py folds the finished run exactly; sample.py and bench.py --ckpt take both forms
    capsys.readouterr()
    report = fold.main([f'--ckpt={straight / "ckpt.pt"}', f'--out={tmp_path / "folded.pt"}'])
    assert report['max_abs_logit_diff'] <= 1e-5 * report['max_abs_logit']
    assert 'folded 5 layernorm norms (FakeLN)' in capsys.readouterr().out
    import bench
    bench.main(['--size=', '--n_layer=1', '--n_embd=32', '--n_head=2', '--vocab_size=64', '--block_size=16',
                '--prompt_len=4', '--new_tokens=4', '--trials=1', '--compile=eager', '--device=cpu',
                f'--ckpt={tmp_path / "folded.pt"}'])
    assert 'ckpt:folded.pt' in capsys.readouterr().out


# ---- data: OpenWebText and The Pile ------------------------------------------------------

owt = load_script('owt_prepare', REPO / 'data' / 'openwebtext' / 'prepare.py')
pile = load_script('pile_prepare', REPO / 'data' / 'pile' / 'prepare.py')


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ['the', 'web', 'page', 'said', 'that', 'a', 'model', 'reads', 'tokens', 'and', 'ends', '.']
    return [f"Page {i}: " + ' '.join(rng.choice(words, size=int(rng.integers(5, 40)))) for i in range(n)]


def expected_split(docs, val_tokens, max_tokens):
    """(val ids, train ids) by the rule of data/hub_corpus.py, in plain numpy: val up to the first
    document end at or past val_tokens, train up to the last one within val_tokens + max_tokens."""
    enc = common.get_encoder()
    ids = [enc.encode_ordinary(d) + [common.GPT2_EOT] for d in docs]
    ends = np.cumsum([len(i) for i in ids])
    i = int(np.argmax(ends >= val_tokens))
    j = int(np.flatnonzero(ends <= val_tokens + max_tokens)[-1])
    flat = np.concatenate(ids)
    return flat[:ends[i]], flat[ends[i]:ends[j]]


def read_split(folder, split):
    return np.fromfile(folder / f'{split}.bin', dtype=np.uint16)


@pytest.mark.parametrize('fmt', ['jsonl', 'parquet', 'txt'])
def test_prepare_local_files_full_vocab_val_first_then_train_cut_at_document_ends(tmp_path, fmt):
    docs = documents(120)
    path = tmp_path / f'owt.{fmt}'
    if fmt == 'jsonl':
        path.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    elif fmt == 'parquet':
        pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
        pq.write_table(pa.table({'text': docs}), path)
    else:
        path.write_text(''.join(d + '\n<|endoftext|>\n' for d in docs))
    meta = owt.main([f'--input={path}', '--val_tokens=300', '--max_tokens=1000', f'--out_dir={tmp_path / "o"}'])
    assert (meta['vocab_size'], meta['unk_id'], meta['eot_id'], meta['tokenizer']) == (50257, None, 50256, 'gpt2')
    val, train_ids = expected_split(docs, 300, 1000)
    assert np.array_equal(read_split(tmp_path / 'o', 'val'), val) and len(val) >= 300
    assert np.array_equal(read_split(tmp_path / 'o', 'train'), train_ids) and 0 < len(train_ids) <= 1000
    assert meta['tokens'] == {'train': len(train_ids), 'val': len(val)} and meta['sources'] == [str(path)]
    text = common.decode(read_split(tmp_path / 'o', 'val'), meta)
    assert text.startswith(docs[0] + '<|endoftext|>' + docs[1])
    assert not list((tmp_path / 'o').glob('*.tmp'))


def fake_datasets(monkeypatch, rows, calls, version='4.4.1'):
    def load_dataset(repo, split=None, streaming=False, **kwargs):
        calls.append((repo, split, streaming, *kwargs.items()))
        return rows
    monkeypatch.setitem(sys.modules, 'datasets', types.SimpleNamespace(load_dataset=load_dataset, __version__=version))
    monkeypatch.setitem(sys.modules, 'zstandard', types.ModuleType('zstandard'))  # the Pile's, installed
    monkeypatch.setattr(owt.hub_corpus.common, 'hub_offline', lambda: False)  # the hub answers


@pytest.mark.parametrize('script, repo', [(owt, 'Skylion007/openwebtext'), (pile, 'monology/pile-uncopyrighted')])
@pytest.mark.parametrize('version, trusted', [('4.4.1', ()), ('3.6.0', (('trust_remote_code', True),)),
                                              ('2.16.0', (('trust_remote_code', True),)), ('2.15.0', ())])
def test_prepare_streams_from_the_hub_and_stops_reading_at_max_tokens(tmp_path, monkeypatch, script, repo, version,
                                                                      trusted):
    """datasets 2.16-3.x streams a repo that loads by script (openwebtext's) only with trust_remote_code=True:
    3.x raised without it, after the message for datasets >= 4 had said to install 'datasets<4'."""
    docs = documents(400, seed=1)
    pulled = []

    def endless():  # a stream with no end: the script must stop reading by itself
        for i in range(10 ** 9):
            pulled.append(i)
            yield {'text': docs[i % len(docs)], 'meta': {}}

    calls = []
    fake_datasets(monkeypatch, endless(), calls, version)
    monkeypatch.setattr(script.hub_corpus, 'BATCH_CHARS', 2000)  # a few documents per encoding task
    meta = script.main(['--val_tokens=200', '--max_tokens=2000', f'--out_dir={tmp_path}'])
    assert calls == [(repo, 'train', True, *trusted)]
    assert meta['sources'] == [f'https://huggingface.co/datasets/{repo}']
    val, train_ids = expected_split(docs, 200, 2000)
    assert np.array_equal(read_split(tmp_path, 'val'), val)
    assert np.array_equal(read_split(tmp_path, 'train'), train_ids)
    assert len(pulled) < 400  # read about as far as needed, not further: bounded memory


def test_prepare_offline_names_the_exact_local_command(tmp_path, monkeypatch):
    def broken():
        raise ConnectionError('network is unreachable')
        yield

    fake_datasets(monkeypatch, broken(), [])
    with pytest.raises(SystemExit) as e:
        owt.main([f'--out_dir={tmp_path / "new"}'])
    assert not (tmp_path / 'new').exists()  # a failed first run leaves no empty data/<name>/ behind
    (tmp_path / 'mine').mkdir()
    fake_datasets(monkeypatch, broken(), [])
    with pytest.raises(SystemExit, match='cannot stream'):
        owt.main([f'--out_dir={tmp_path / "mine"}'])
    assert (tmp_path / 'mine').is_dir()  # a folder the user made stays
    msg = str(e.value)
    assert 'cannot stream Skylion007/openwebtext from the Hugging Face hub (ConnectionError: network is unreachable)' in msg
    assert 'python data/openwebtext/prepare.py --input=PATH/TO/openwebtext.jsonl' in msg
    def script_repo():  # datasets >= 4 on a repo that still has its loading script (nanoGPT#633)
        raise RuntimeError('Dataset scripts are no longer supported, but found openwebtext.py')
        yield

    fake_datasets(monkeypatch, script_repo(), [])
    with pytest.raises(SystemExit) as e:
        owt.main([f'--out_dir={tmp_path / "new"}'])
    assert str(e.value).startswith("cannot stream Skylion007/openwebtext: it loads through a script, which datasets "
                                   ">= 4 no longer runs (RuntimeError: Dataset scripts are no longer supported, but "
                                   "found openwebtext.py). pip install 'datasets<4' runs it; or pass local files: "
                                   "python data/openwebtext/prepare.py --input=PATH/TO/openwebtext.jsonl")
    monkeypatch.setitem(sys.modules, 'zstandard', None)  # not installed: datasets does not bring it
    with pytest.raises(SystemExit, match=r'needs the zstandard package \(pip install datasets zstandard\)\. Offline, '
                                         r'pass local files: python data/pile/prepare\.py --input=PATH/TO/pile\.jsonl'):
        pile.main([f'--out_dir={tmp_path}'])  # its .jsonl.zst stream failed as "zstd not supported"
    monkeypatch.setitem(sys.modules, 'datasets', None)  # not installed
    with pytest.raises(SystemExit, match=r'needs the datasets package \(pip install datasets\)\. Offline, pass '
                                         r'local files: python data/openwebtext/prepare\.py'):
        owt.main([f'--out_dir={tmp_path}'])
    assert not list(tmp_path.glob('*.bin'))


@pytest.mark.parametrize('case, message', [
    ('zst', r'pile.jsonl.zst is zstd-compressed: decompress it first \(zstd -d .*pile.jsonl.zst\)'),
    ('gz', r'owt.jsonl.gz is gzip-compressed: decompress it first \(gunzip -k .*owt.jsonl.gz\)'),
    ('tiny', 'leaves no document for training'),
    ('missing', 'input file not found'),
    ('huge_doc', 'past --val_tokens, more than --max_tokens=5'),
])
def test_prepare_bad_inputs_give_clear_errors(tmp_path, case, message):
    import gzip
    path = tmp_path / {'zst': 'pile.jsonl.zst', 'gz': 'owt.jsonl.gz'}.get(case, 'owt.jsonl')
    rows = ''.join(json.dumps({'text': d}) + '\n' for d in documents(3)).encode()
    if case == 'zst':  # zstd's frame magic, then what a compressor writes: mostly undecodable bytes
        path.write_bytes(b'\x28\xb5\x2f\xfd' + bytes(range(256)) * 40)
    elif case == 'gz':
        path.write_bytes(gzip.compress(rows))
    elif case != 'missing':
        path.write_bytes(rows)
    args = {'huge_doc': ['--val_tokens=1', '--max_tokens=5']}.get(case, [])
    with pytest.raises(SystemExit, match=message):
        owt.main([f'--input={path}', f'--out_dir={tmp_path / "o"}'] + args)
    assert not list(tmp_path.glob('o/*'))


def test_train_names_the_prepare_command_of_the_web_corpora(tmp_path):
    for name in ('openwebtext', 'pile'):
        to = f'--out_dir={tmp_path}/{name}'  # where train.py looks, with this data_dir
        with pytest.raises(SystemExit, match=f'python data/{name}/prepare.py {to}   \\(offline: python data/{name}/'
                                             f'prepare.py --input=PATH/TO/{name}.jsonl {to}\\)'):
            train.main([f'--data_dir={tmp_path}', f'--dataset={name}', '--device=cpu'])


# ---- full-vocabulary GPT-2 checkpoints in sample.py; the configs -------------------------

@needs_transformers
def test_sample_decodes_a_full_vocabulary_gpt2_checkpoint_with_the_gpt2_tokenizer(tmp_path, capsys):
    docs = documents(60, seed=2)
    (tmp_path / 'owt.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    data = tmp_path / 'data'
    owt.main([f'--input={tmp_path / "owt.jsonl"}', '--val_tokens=300', '--max_tokens=100000',
              f'--out_dir={data / "owt"}'])
    tiny_gpt2(tmp_path / 'gpt2', vocab_size=50257, n_positions=32)
    out = tmp_path / 'run'
    train.main([f'--data_dir={data}', '--dataset=owt', f'--out_dir={out}', f'--init_from={tmp_path / "gpt2"}',
                '--device=cpu', '--compile=False', '--block_size=32', '--batch_size=2',
                '--gradient_accumulation_steps=1', '--max_iters=2', '--warmup_iters=1', '--lr_decay_iters=2',
                '--eval_interval=2', '--eval_iters=1'])
    capsys.readouterr()
    text = sample.main([f'--ckpt={out / "ckpt.pt"}', '--start=Page 3: the web', '--num_samples=1',
                        '--max_new_tokens=6', '--temperature=0'])[0]
    assert text.startswith('Page 3: the web') and '<unk>' not in text
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['meta']['vocab_size'] == 50257 and ckpt['meta']['unk_id'] is None


@pytest.mark.parametrize('name', ['vanilla', 'internal_taper', 'all_taper', 'fakeln'])
def test_the_finetune_configs_share_one_budget_and_finish_removing_norms_in_time(name):
    cfg = train.load_config([f'config/finetune_gpt2_{name}.py'])
    assert (cfg.init_from, cfg.dataset, cfg.block_size) == ('gpt2', 'openwebtext', 1024)
    assert cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps == 2 ** 19
    assert (cfg.max_iters, cfg.lr_decay_iters) == (300, 300)
    assert cfg.taper == {'internal_taper': 'internal', 'all_taper': 'all'}.get(name, 'none')
    assert cfg.norm_removal == ('fakeln' if name == 'fakeln' else 'none')
    if cfg.taper != 'none':
        assert cfg.gate_warmup_iters + cfg.taper_iters < cfg.max_iters and cfg.aux_weight == 0.1
        assert cfg.calibration == 'ema'  # the paper's (docs/method.md §3)
    if name == 'fakeln':
        assert len(FAKELN_EVENTS) * cfg.fakeln_interval < cfg.max_iters
    assert 'dataset = \'pile\'' in (REPO / 'config' / 'finetune_gpt2_vanilla.py').read_text()
    pile_cfg = train.load_config([f'config/finetune_gpt2_{name}.py', '--dataset=pile'])
    assert pile_cfg.out_dir.startswith('out-gpt2-pile-')



@pytest.mark.parametrize('name', ['vanilla', 'internal_taper', 'all_taper', 'fakeln'])
def test_the_cpu_proxy_changes_only_the_size_of_each_finetune_config(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the pretraining run has exported its folder (init_from must exist)
    (tmp_path / 'study' / 'gpt2proxy-pretrain' / 'hf').mkdir(parents=True)
    finetune, proxy = str(REPO / f'config/finetune_gpt2_{name}.py'), str(REPO / 'config/gpt2_proxy.py')
    gpu = train.load_config([finetune])
    cpu = train.load_config([finetune, proxy])
    pre = train.load_config([str(REPO / 'config/gpt2_proxy_pretrain.py')])
    size = {'init_from', 'dataset', 'device', 'block_size', 'batch_size', 'gradient_accumulation_steps',
            'out_dir'}
    assert {k for k in vars(gpu) if vars(gpu)[k] != vars(cpu)[k]} == size
    # fine-tuned from what the pretraining run exports, at its whole context, in GPT-2's shape
    assert cpu.init_from == os.path.join(pre.out_dir, 'hf') and cpu.block_size == pre.block_size
    assert (pre.norm, pre.bias, pre.activation, pre.taper) == ('layernorm', True, 'gelu_tanh', 'none')
    assert cpu.batch_size * cpu.gradient_accumulation_steps == pre.batch_size * pre.gradient_accumulation_steps
    with pytest.raises(SystemExit, match='comes after the overlay .*gpt2_proxy.py'):
        train.load_config([proxy, finetune])

def test_bench_times_a_gpt2_checkpoint_next_to_a_baseline_with_its_activation(tmp_path):
    import bench
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16, norm='layernorm',
                          activation='gelu_tanh'))
    runs.save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(tmp_path / 'g.pt'))
    cfg = types.SimpleNamespace(ckpt=str(tmp_path / 'g.pt'), prompt_len=4, new_tokens=4, seed=0)
    timed = bench.checkpoint_variants(cfg)[0]
    assert timed['ckpt_baseline'].config == timed['ckpt:g.pt'].config  # same shape, same GELU
