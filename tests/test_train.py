"""train.py: configuration, schedule, checkpoints, resume, failure handling (docs/method.md §2)."""

import json
import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import runs
import sample
import train
import configurator
from model import GPT, GPTConfig, TaperNorm
from runs import load_model, save_checkpoint
from train import get_gate, get_lr, get_phase, load_config


def toy_args(data_dir, out_dir, **overrides):
    """A run on the toy dataset that crosses warmup → calibrate → taper → linear in 16 steps."""
    cfg = dict(dataset='toy', data_dir=str(data_dir), out_dir=str(out_dir), device='cpu', compile=False,
               n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, gradient_accumulation_steps=2,
               taper='all', aux_weight=0.1, max_iters=16, gate_warmup_iters=4, taper_iters=6,
               learning_rate=3e-3, min_lr=3e-4, warmup_iters=2, lr_decay_iters=16,
               eval_interval=4, eval_iters=2, log_interval=1, dropout=0.1,
               calibration='end')  # the tests of the closed form over the calibration tokens measure 'end'
    cfg.update(overrides)
    return [f'--{k}={v}' for k, v in cfg.items()]


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def interrupt_at(it_stop, args, monkeypatch):
    """train.main(args), stopped by a KeyboardInterrupt when iteration it_stop begins."""
    real_get_lr = train.get_lr

    def ctrl_c(it, *a):
        if it == it_stop:
            raise KeyboardInterrupt
        return real_get_lr(it, *a)

    monkeypatch.setattr(train, 'get_lr', ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train.main(args)
    monkeypatch.setattr(train, 'get_lr', real_get_lr)


# ---- schedule -------------------------------------------------------------------------

def test_schedule_at_and_around_each_boundary():
    W, T = 10, 20
    assert [get_phase(it, 'all', W, T) for it in (0, 9, 10, 11, 29, 30, 31)] == \
        ['warmup', 'warmup', 'taper', 'taper', 'taper', 'linear', 'linear']
    assert get_gate(0, 'all', W, T) == get_gate(W - 1, 'all', W, T) == 1.0
    assert get_gate(W, 'all', W, T) == 1.0                                 # g(W) = 1
    assert get_gate(W + T // 2, 'all', W, T) == pytest.approx(0.5)         # half way
    assert get_gate(W + 1, 'all', W, T) == pytest.approx(0.5 * (1 + math.cos(math.pi / T)))
    assert get_gate(W + T - 1, 'all', W, T) == pytest.approx(0.5 * (1 - math.cos(math.pi / T)))
    assert get_gate(W + T, 'all', W, T) == get_gate(10 ** 6, 'all', W, T) == 0.0
    gates = [get_gate(it, 'internal', W, T) for it in range(W, W + T + 1)]
    assert all(a > b for a, b in zip(gates, gates[1:]))                    # strictly decreasing
    assert {get_phase(it, 'none', W, T) for it in range(50)} == {'baseline'}
    assert {get_gate(it, 'none', W, T) for it in range(50)} == {1.0}


def test_a_gate_outside_0_1_stops_the_run_in_one_line_naming_the_value_and_the_iteration(toy_data, tmp_path,
                                                                                          monkeypatch):
    """A linear schedule edited wrong (its ramp over T / 2 steps: g = 1, 2/3, 1/3, 0, then below 0 at
    iteration W + 4 = 8) is refused where g leaves [0, 1], not trained on to the end."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, taper='all'))
    for g in (1.5, -0.25, float('nan')):
        with pytest.raises(ValueError, match=r"^gate g = \S+ is outside \[0, 1\]"):
            model.set_gate(g)
    model.set_gate(0.0)
    model.set_gate(1.0)
    monkeypatch.setattr(train, 'get_gate', lambda it, taper, W, T: min(1.0, 1 - (it - W) / (T / 2)))
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, tmp_path / 'run'))
    assert str(e.value) == ("iteration 8: gate g = -0.333333 is outside [0, 1]: the gate schedule (train.get_gate) "
                            "must run from 1 to 0")
    assert not any(r.get('iter', 0) >= 8 for r in read_log(tmp_path / 'run'))


def test_learning_rate_schedule():
    lr = lambda it: get_lr(it, 1e-3, 1e-4, 10, 100)
    assert lr(0) == pytest.approx(1e-3 / 11) and lr(9) == pytest.approx(1e-3 * 10 / 11)
    assert lr(10) == pytest.approx(1e-3)
    assert lr(55) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr(100) == lr(500) == 1e-4


# ---- configuration --------------------------------------------------------------------

def test_config_files_compose_and_overrides_win():
    cfg = load_config(['config/tinystories_all_taper.py', 'config/cpu.py', '--max_iters=2000'])
    assert (cfg.taper, cfg.aux_weight, cfg.dataset, cfg.n_embd, cfg.max_iters) == ('all', 0.1, 'austen', 64, 2000)
    names = ['baseline', 'internal_taper', 'all_taper', 'all_taper_noaux']
    full = [load_config([f'config/tinystories_{n}.py']) for n in names]
    cpu = [load_config([f'config/tinystories_{n}.py', 'config/cpu.py']) for n in names]
    assert len({c.out_dir for c in full}) == len({c.out_dir for c in cpu}) == 4
    ignore = {'taper', 'aux_weight', 'out_dir'}
    for group in (full, cpu):  # the four runs differ only in taper and aux_weight
        assert len({tuple(sorted((k, v) for k, v in vars(c).items() if k not in ignore)) for c in group}) == 1
    assert {c.calibration for c in full + cpu} == {'ema'}  # the paper's runs calibrate as the paper does
    assert load_config(['--compile=True']).compile is True
    assert load_config(['--compile=False']).compile is False
    assert load_config(['--learning_rate=1']).learning_rate == 1.0  # int where a float is due
    assert load_config(['--dataset=austen']).dataset == 'austen'   # bare words are strings
    # cpu.py's out_dir names dataset and variant after every override
    assert load_config(['config/cpu.py', '--dataset=kjv', '--taper=all', '--aux_weight=0.1']).out_dir \
        == 'out-cpu-kjv-all-aux0.1'


@pytest.mark.parametrize('args, message', [
    (['--n_layers=4'], "unknown config key 'n_layers'; did you mean --n_layer"),
    (['--lr=1e-3'], "unknown config key 'lr'; did you mean --learning_rate"),  # another codebase's name
    (['--n_layer=4.5'], 'n_layer=4.5 is of type float'),
    (['--bias=1'], 'bias=1 is of type int'),
    (['--compile=1'], 'compile=1'),
    (['--bias=false'], "bias='false' is of type str, expected bool like the default True: write "
                       "bias=True or bias=False"),  # another CLI's habit
    (['--max_iters'], '--key=value'),
    (['config/nope.py'], 'not found'),
    (['--taper=internal', '--gate_warmup_iters=0'], 'gate_warmup_iters=0 must be >= 1'),
    (['--taper=internal', '--taper_iters=0'], 'taper_iters=0 must be >= 1'),
    (['--taper=internal', '--max_iters=100', '--gate_warmup_iters=50', '--taper_iters=51'], 'exceeds max_iters=100'),
    (['--taper=none', '--aux_weight=0.1'], 'aux_weight > 0 needs taper'),
    (['--warmup_iters=100', '--lr_decay_iters=100'], 'lr_decay_iters=100 must exceed warmup_iters=100'),  # no decay
    (['--norm=batchnorm'], "norm='batchnorm'"),
    (['--learning_rate=-1'], 'learning_rate=-1.0 must be a finite number > 0'),
    (['--dropout=1'], 'dropout=1.0 must be in [0, 1)'),
    (['--learning_rate=1e400'], 'learning_rate=inf must be a finite number > 0'),  # an overflow in AdamW's step
    (['--beta1=1.0'], 'beta1=1.0 must be in [0, 1)'),  # AdamW's ValueError traceback
    (['--learning_rate=1e-5'], 'min_lr=0.0001 exceeds learning_rate=1e-05'),  # the default min_lr: a rising decay
    (['--beta2=-0.5'], 'beta2=-0.5 must be in [0, 1)'),
    (['--schedule_scale=1e400'], 'schedule_scale=inf must be a finite number > 0'),  # an OverflowError
    (['--norm_eps=1e400'], 'norm_eps=inf must be a finite number >= 0'),  # trained to ln(V), silently
    (['--weight_decay=1e400'], 'weight_decay=inf must be a finite number >= 0'),  # NaN from the first step
    (['--out_dir='], "out_dir is empty: name the run's folder"),  # "cannot write in  (No such file ...)"
    (['--seed=-1'], 'seed=-1 must be in [0, 2**63): torch and numpy take no other'),  # numpy's ValueError, late
    (['max_iters=60'], "did you mean --max_iters=60?"),
    (['--out_dir=out-{tapr}'], "out_dir='out-{tapr}': placeholders must be config keys"),
])
def test_config_errors_name_the_key(args, message):
    with pytest.raises(SystemExit, match='^config error: .*' + re.escape(message)):
        load_config(args)


def test_an_infinite_grad_clip_is_allowed():
    assert load_config(['--grad_clip=1e400']).grad_clip == math.inf  # clips nothing, as 0: a stored run may hold it


def test_a_derf_run_trains_on_the_toy_data_and_its_checkpoint_loads_as_derf(toy_data, tmp_path):
    """norm='derf' (baselines.Derf) through train.py: finite losses from the first step, a finite val
    loss, and a checkpoint that loads (runs.load_model) into the same Derf model it saved."""
    from baselines import Derf
    out = tmp_path / 'derf'
    model = train.main(toy_args(toy_data, out, norm='derf', taper='none', aux_weight=0.0, max_iters=4,
                                lr_decay_iters=4, eval_interval=4))
    log = read_log(out)
    losses = [r['loss'] for r in log if 'loss' in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert [r['phase'] for r in log if 'loss' in r] == ['baseline'] * 4
    assert all(math.isfinite(r['val_loss']) for r in log if 'val_loss' in r) and any('val_loss' in r for r in log)
    loaded, _ = load_model(str(out / 'ckpt.pt'))
    assert loaded.config.norm == 'derf' and loaded.embed_scale is not None
    assert all(type(m) is Derf for m in (loaded.transformer.ln_f, *(b.ln_1 for b in loaded.transformer.h)))
    assert loaded.transformer.ln_f.shift.item() != 0  # s learned in 4 steps (s₀ = 0)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_dyt_run_whose_final_norm_saturates_says_so_once_and_it_is_true(tmp_path, capsys):
    """Real text (Emma's first chapters, tests/data/emma.txt, public domain), DyT with its paper's recipe at
    a rate high for the model: within ~25 steps the residual stream grows past the final DyT's tanh range
    (docs/results.md, "DyT on the quick start"), and from then on no gradient reaches the blocks. The
    run says so in one line, once; the same run with RMSNorm does not."""
    from data.text import prepare
    prepare.main([f'--input={os.path.join(os.path.dirname(__file__), "data", "emma.txt")}', '--vocab_size=1024',
                  f'--out_dir={tmp_path / "data" / "emma"}'])
    run = lambda norm: train.main(toy_args(tmp_path / 'data', tmp_path / norm, dataset='emma', norm=norm, taper='none',
                                           aux_weight=0.0, n_layer=4, n_head=1, n_embd=16, block_size=32, batch_size=8,
                                           gradient_accumulation_steps=1, dropout=0.0, max_iters=40, warmup_iters=10,
                                           lr_decay_iters=40, learning_rate=1e-2, min_lr=1e-3, eval_interval=40))
    data = np.fromfile(tmp_path / 'data' / 'emma' / 'train.bin', dtype=np.uint16).astype(np.int64)
    x = torch.from_numpy(np.stack([data[i:i + 33] for i in range(0, 8 * 33, 33)]))  # (8, 33): 8 windows

    def block_grads(model):  # |∂CE/∂θ| summed per tensor of the blocks, on 8 windows of the text
        model.train()
        model(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1].backward()
        return [p.grad.abs().sum().item() for n, p in model.named_parameters() if n.startswith('transformer.h.')]

    capsys.readouterr()
    dyt = run('dyt')
    err = capsys.readouterr().err
    assert err.count('the final DyT saturated') == 1 and 'norm=\'rmsnorm\'' in err, err
    assert 0 < int(re.search(r'warning: iteration (\d+):', err).group(1)) < 40
    assert max(block_grads(dyt)) == 0  # what it says: not one gradient entry reaches a block
    rms = run('rmsnorm')
    assert 'saturated' not in capsys.readouterr().err and min(block_grads(rms)) > 0


def test_a_decay_longer_than_the_run_is_allowed_and_ends_the_run_above_min_lr():
    """lr_decay_iters > max_iters: the first max_iters steps of a longer schedule (deliberate, train.py's key)."""
    cfg = load_config(['--max_iters=100', '--warmup_iters=10', '--lr_decay_iters=190', '--min_lr=0'])
    last = get_lr(cfg.max_iters - 1, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
    assert last == pytest.approx(cfg.learning_rate * 0.5 * (1 + math.cos(math.pi * 89 / 180)))  # not yet min_lr


def test_string_keys_keep_their_text():
    defaults = {'start': 'x', 'n': 1}
    assert configurator.parse_args(['--start=1984', '--n=3'], defaults) == {'start': '1984', 'n': 3}
    assert configurator.parse_args(['--start=a b'], defaults)['start'] == 'a b'
    assert configurator.parse_args(['--start="quoted"'], defaults)['start'] == '"quoted"'  # a prompt is text
    with pytest.raises(SystemExit, match="compile=1: choose one of 'auto', True, False"):
        load_config(["--compile=1"])  # a choice: no fallback to the text


def test_the_printed_log_says_where_each_phase_begins_and_ends_and_log_jsonl_does_not(toy_data, tmp_path, capsys,
                                                                                         monkeypatch):
    """One line per phase, where it begins (W = 4, T = 6 of 16 steps: 0-3, 4-9, 10-15, worked by hand),
    and where a resumed run continues (at 8, inside the taper); log.jsonl holds no record for them."""
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=16, log_interval=100))
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('phase ')]
    assert [l.split(':')[0] for l in lines] == ['phase warmup, iterations 0-3', 'phase taper, iterations 4-9',
                                                'phase linear, iterations 10-15']
    assert [r['iter'] for r in read_log(out) if 'loss' in r] == [0, 4, 8, 12]  # the evaluations' alone: not 10
    stopped = tmp_path / 'stopped'
    interrupt_at(9, toy_args(toy_data, stopped, max_iters=16), monkeypatch)  # resumes at 8, its last checkpoint
    capsys.readouterr()
    train.main([f'--out_dir={stopped}', '--init_from=resume'])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('phase ')]
    assert lines == ['phase taper, iterations 8-9: g falls from 1 to 0 on a half cosine: each tapered norm is '
                     'g · N(h) + (1 − g) · L(h)', 'phase linear, iterations 10-15: g = 0: each tapered norm is its '
                     'fixed linear map L(h) = c · h ⊙ γ̃, what fold.py folds']
    assert train.phase_line(0, train.load_config(toy_args(toy_data, out, taper='none', aux_weight=0))) is None

def test_a_leading_tilde_in_a_path_is_the_home_folder_wherever_it_is_given(tmp_path, monkeypatch):
    """--out_dir=~/runs reaches the script unexpanded (a shell expands ~ only at a word's start), and so
    does a config file's '~/runs': both mean the home folder, not a folder named '~' in the current one.
    A prompt (sample.py's --start) keeps its ~; its FILE: path expands."""
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    home = str(tmp_path / 'home')
    (tmp_path / 'cfg.py').write_text("data_dir = '~/data'\n")
    cfg = configurator.parse_args([str(tmp_path / 'cfg.py'), '--out_dir=~/runs/{dataset}', '--start=~/not a path',
                                   '--title=~ a title'],
                                  {'out_dir': 'out', 'data_dir': '', 'dataset': 'austen', 'start': '', 'title': ''})
    assert cfg == {'out_dir': f'{home}/runs/austen', 'data_dir': f'{home}/data', 'dataset': 'austen',
                   'start': '~/not a path', 'title': '~ a title'}
    os.makedirs(home)
    with open(f'{home}/prompt.txt', 'w') as f:
        f.write('It was')
    assert sample.read_prompt('FILE:~/prompt.txt') == 'It was'


def test_the_header_shows_every_key_changed_and_an_overlay_alone_says_which_base_it_changed(toy_data, tmp_path,
                                                                                             capsys):
    """The header line shows taper, norm, λ, where and how the run computes; the line under it every other
    key that differs from train.py's defaults (the calibration and the schedule included) and acts in
    this run: the smoke overlay scales fakeln_interval, which only a FakeLN run lists. An overlay given
    alone runs over those defaults, the baseline: it says so."""
    train.main(toy_args(toy_data, tmp_path / 'run', seed=1337))
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if ' parameters | taper=all norm=rmsnorm λ=0.1 | ' in line)
    changed = out[header + 1].split("changed from train.py's defaults beyond the header: ")[1].split()
    assert {"dataset='toy'", "calibration='end'", 'gate_warmup_iters=4', 'taper_iters=6', 'n_layer=2',
            'dropout=0.1'} <= set(changed)
    assert not any(k.startswith(('taper=', 'seed=', 'device=')) for k in changed)  # in the header, or unchanged
    line = train.config_line(['config/cpu.py'], load_config(['config/cpu.py']))
    assert line.startswith("no base config before config/cpu.py: it changes train.py's defaults, the TinyStories "
                           "baseline's (config/tinystories_baseline.py, taper='none'; ")
    assert "changed from train.py's defaults beyond the header: dataset='austen' " in line and ' max_iters=1500 ' in line
    args = ['config/tinystories_internal_taper.py', 'config/cpu.py']
    assert train.config_line(args, load_config(args)).startswith(
        "changed from train.py's defaults beyond the header: dataset='austen' ")
    assert train.config_line([], load_config([])) == "changed from train.py's defaults beyond the header: nothing"
    base = ['config/tinystories_baseline.py', 'config/cpu.py']
    lists = {name: train.config_line(a + ['config/smoke.py'], load_config(a + ['config/smoke.py'])).split()
             for name, a in [('all', ['config/tinystories_all_taper.py', 'config/cpu.py']),
                             ('fakeln', base + ['--norm_removal=fakeln']),
                             ('baseline', base + ['--calibration=end', '--aux_form=relative', '--dyt_alpha0_scale=2.0']),
                             ('dyt', base + ['--norm=dyt', '--dyt_alpha0_scale=2.0'])]}
    assert 'taper_iters=75' in lists['all'] and 'fakeln_interval=3' not in lists['all']
    assert 'fakeln_interval=3' in lists['fakeln']
    assert not any(k.startswith(('calibration=', 'aux_form=', 'dyt_alpha0_scale=', 'gate_warmup_iters='))
                   for k in lists['baseline'])
    assert 'dyt_alpha0_scale=2.0' in lists['dyt']


def test_unknown_key_in_a_config_file(tmp_path):
    path = tmp_path / 'bad.py'
    path.write_text('import math\nlearning_rate = math.sqrt(1e-6)\nlearnig_rate = 3e-4\n')
    with pytest.raises(SystemExit, match="bad.py: unknown config key 'learnig_rate'; did you mean --learning_rate"):
        load_config([str(path)])


# ---- checkpoints, resume, failures ------------------------------------------------------

def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    save_checkpoint({'iter_num': 1}, path)
    real_save = torch.save

    def interrupted(obj, f):
        real_save(obj, f)
        f.truncate(10)  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, 'save', interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({'iter_num': 2}, path)
    assert torch.load(path)['iter_num'] == 1
    assert os.listdir(tmp_path) == ['ckpt.pt']


@pytest.mark.parametrize('sampler', ['random', 'epoch'])
def test_resume_continues_exactly_across_the_calibrate_event(toy_data, tmp_path, monkeypatch, capsys, sampler):
    """16 steps straight == interrupted at step 10 (last checkpoint: 8) + resume to 16."""
    straight = tmp_path / 'straight'
    train.main(toy_args(toy_data, straight, sampler=sampler))

    interrupted = tmp_path / 'interrupted'
    interrupt_at(10, toy_args(toy_data, interrupted, sampler=sampler), monkeypatch)
    assert torch.load(interrupted / 'ckpt.pt', weights_only=False)['iter_num'] == 8
    train.main(toy_args(toy_data, interrupted, init_from='resume'))

    a, b = read_log(straight), read_log(interrupted)
    steps_a = {r['iter']: r for r in a if 'loss' in r}
    steps_b = {r['iter']: r for r in b if 'loss' in r}  # resumed records overwrite 8 and 9
    assert steps_a.keys() == steps_b.keys() == set(range(16))
    assert {r['phase'] for r in steps_a.values()} == {'warmup', 'taper', 'linear'}
    for it in range(16):
        for key in ('loss', 'ce', 'aux', 'gate', 'lr', 'grad_norm'):
            assert steps_b[it][key] == steps_a[it][key], (it, key)
    assert [r for r in b if r.get('event') == 'calibrate'] == [r for r in a if r.get('event') == 'calibrate']
    assert len([r for r in b if r.get('event') == 'calibrate']) == 1  # never repeated on resume
    assert a[-1]['final_val_loss'] == b[-1]['final_val_loss']
    # resuming a finished run says so, trains and evaluates nothing, and reports its state: linear, g = 0
    before = (straight / 'log.jsonl').read_text()
    capsys.readouterr()
    model = train.main(toy_args(toy_data, straight, init_from='resume', sampler=sampler))
    assert (model.phase, model.gate.item()) == ('linear', 0.0)
    assert f"is a finished run (16 of 16 steps, final_val_loss {a[-1]['final_val_loss']:.4f})" in capsys.readouterr().out
    assert (straight / 'log.jsonl').read_text() == before


def test_resume_mid_warmup_under_ema_keeps_the_moving_averages(toy_data, tmp_path, monkeypatch):
    """calibration='ema', W = 8: interrupted at step 6 (last checkpoint: 4, mid-warmup) and resumed, the
    run calibrates to the same c and s_tgt and logs the same losses as a run straight through: the EMAs
    of N, D and s(h) and their step count travel in the checkpoint."""
    args = dict(calibration='ema', gate_warmup_iters=8, taper_iters=4)
    straight, interrupted = tmp_path / 'straight', tmp_path / 'interrupted'
    train.main(toy_args(toy_data, straight, **args))
    interrupt_at(6, toy_args(toy_data, interrupted, **args), monkeypatch)
    assert torch.load(interrupted / 'ckpt.pt', weights_only=False)['iter_num'] == 4
    train.main(toy_args(toy_data, interrupted, init_from='resume', **args))
    a, b = read_log(straight), read_log(interrupted)
    calib_a = [r for r in a if r.get('event') == 'calibrate']
    assert len(calib_a) == 1 and calib_a == [r for r in b if r.get('event') == 'calibrate']
    assert [r['loss'] for r in a if 'loss' in r and r['iter'] >= 8] == [r['loss'] for r in b if 'loss' in r and r['iter'] >= 8]


@pytest.fixture
def positions(tmp_path):
    """A dataset folder whose token i is i: a window's first token is its start."""
    (tmp_path / 'train.bin').write_bytes(np.arange(10_000, dtype=np.uint16).tobytes())
    return str(tmp_path)


def starts_of(folder, cfg, world, steps):
    """{(it, rank, micro): window starts} of train.train_batch, checking y = x shifted by one."""
    out = {}
    for it in range(steps):
        for rank in range(world):
            env = SimpleNamespace(world=world, rank=rank, dev='cpu')
            for micro in range(cfg.gradient_accumulation_steps):
                x, y = train.train_batch(folder, cfg, env, it, micro)
                assert x.shape == (cfg.batch_size, cfg.block_size) and torch.equal(y, x + 1)
                out[it, rank, micro] = x[:, 0].tolist()
    return out


def test_epoch_sampler_reads_every_window_at_most_once_over_steps_ranks_and_micro_steps(positions):
    cfg = SimpleNamespace(sampler='epoch', seed=3, batch_size=4, block_size=16, gradient_accumulation_steps=2)
    windows = (10_000 - 1) // 16  # 624 non-overlapping windows, each with its shifted target
    steps = windows // (4 * 2 * 2)  # 39 steps of 2 ranks × 2 micro-steps × 4 sequences
    got = starts_of(positions, cfg, 2, steps)
    flat = [s for b in got.values() for s in b]
    assert len(flat) == len(set(flat)) == steps * 16 and all(s % 16 == 0 and s + 16 < 10_000 for s in flat)
    assert len(set(flat)) > 0.98 * windows  # one pass, nearly all of it
    assert starts_of(positions, cfg, 2, steps) == got  # a function of (it, rank, micro): resume sees the same
    assert sorted(got[0, 0, 0]) != list(range(0, 64, 16))  # shuffled, not read in order
    cfg.seed = 4
    assert starts_of(positions, cfg, 2, 1)[0, 0, 0] != got[0, 0, 0]  # the seed orders the pass


def test_random_sampler_is_unchanged(positions):
    # the committed cells ran with it: windows at seeded random starts, drawn with replacement
    cfg = SimpleNamespace(sampler='random', seed=5, batch_size=3, block_size=16, gradient_accumulation_steps=2)
    got = starts_of(positions, cfg, 2, 3)
    for (it, rank, micro), starts in got.items():
        rng = np.random.default_rng(np.random.SeedSequence([5, 0, it, rank, micro]))
        assert starts == rng.integers(10_000 - 16, size=3).tolist()


def test_epoch_sampler_refuses_a_run_longer_than_one_pass(toy_data, tmp_path):
    # toy: 10,000 training tokens = 624 windows of 16; 4 × 2 windows a step: 78 steps at most
    with pytest.raises(SystemExit, match=r"need 632 windows, but one pass .* holds 624: use max_iters <= 78"):
        train.main(toy_args(toy_data, tmp_path / 'run', sampler='epoch', max_iters=79, lr_decay_iters=79))
    assert not (tmp_path / 'run' / 'log.jsonl').exists()
    train.main(toy_args(toy_data, tmp_path / 'run', sampler='epoch', max_iters=78, lr_decay_iters=78,
                        eval_interval=100))


def test_log_records(toy_data, tmp_path):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out))
    log = read_log(out)
    steps = [r for r in log if 'loss' in r]
    for r in steps:
        assert {'iter', 'phase', 'gate', 'lr', 'loss', 'ce', 'aux', 'hidden_rms', 'logit_rms',
                'final_scale_rms', 'grad_norm', 'tokens_per_s'} <= r.keys()
        assert r['loss'] == pytest.approx(r['ce'] + r['aux'], rel=1e-5)
        assert (r['aux'] > 0) == (r['phase'] != 'warmup')  # L_aux from the taper start on
    assert [r['iter'] for r in steps if 'val_loss' in r] == [0, 4, 8, 12]
    assert 'final_val_loss' in log[-1] and math.isfinite(log[-1]['final_val_loss'])
    calib = [r for r in log if r.get('event') == 'calibrate']
    assert len(calib) == 1 and calib[0]['iter'] == 3 and len(calib[0]['c']) == 2 * 2 + 1


@pytest.mark.parametrize('calibration', ['end', 'ema'])
def test_only_ema_collects_in_the_training_steps_and_every_step_trains_in_train_mode(toy_data, tmp_path, monkeypatch,
                                                                                    calibration):
    """'end' measures on forwards of its own at the calibrate event (eval mode), 'ema' in each micro-batch
    of every warmup step (W = 3 steps × 2 micro-batches × 5 tapered norms); and the step after the
    event's eval-mode forwards trains in train mode (dropout on) with no evaluation between (every 4)."""
    observed, modes = [], []
    real_observe, real_step = TaperNorm.observe, train.train_step

    def observe(self, h, y):
        observed.append((self.collect, self.training))
        return real_observe(self, h, y)

    def step(train_model, raw_model, *args, **kwargs):
        modes.append(raw_model.training)
        return real_step(train_model, raw_model, *args, **kwargs)

    monkeypatch.setattr(TaperNorm, 'observe', observe)
    monkeypatch.setattr(train, 'train_step', step)
    train.main(toy_args(toy_data, tmp_path / 'run', calibration=calibration, gate_warmup_iters=3, taper_iters=5,
                        max_iters=10, lr_decay_iters=10))
    assert len(modes) == 10 and all(modes)
    in_training = [collect for collect, training in observed if training]
    assert in_training == ([] if calibration == 'end' else ['calibration'] * (3 * 2 * 5))
    assert ('mismatch', False) in observed  # the event's own forwards, in eval mode


def test_baseline_run_and_internal_taper_keep_a_real_final_norm(toy_data, tmp_path):
    for taper, aux in (('none', 0.0), ('internal', 0.1)):
        out = tmp_path / taper
        train.main(toy_args(toy_data, out, taper=taper, aux_weight=aux, max_iters=12))
        steps = [r for r in read_log(out) if 'loss' in r]
        assert all('final_scale_rms' not in r for r in steps)
        if taper == 'none':
            assert {r['phase'] for r in steps} == {'baseline'} and {r['gate'] for r in steps} == {1.0}


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(toy_data, tmp_path, monkeypatch):
    out = tmp_path / 'nan'
    real_ce, calls = F.cross_entropy, []

    def ce_nan_at_step_6(*args, **kwargs):
        loss = real_ce(*args, **kwargs)
        if torch.is_grad_enabled():  # training forwards only: 2 micro-steps per step
            calls.append(None)
        return loss * float('nan') if len(calls) > 2 * 6 else loss

    monkeypatch.setattr(F, 'cross_entropy', ce_nan_at_step_6)
    with pytest.raises(runs.Stopped, match=r'non-finite loss or gradient at iteration 6 \(loss nan, grad norm nan\)'):  # under DDP: every rank's end
        train.main(toy_args(toy_data, out))
    assert torch.load(out / 'ckpt.pt', weights_only=False)['iter_num'] == 4


@pytest.mark.parametrize('last', [False, True])
def test_an_update_that_diverges_before_an_evaluation_or_the_end_saves_nothing_and_records_no_end(
        toy_data, tmp_path, monkeypatch, last):
    """The step before an evaluation (iteration 8, eval_interval 4) or the last step has a finite loss
    and gradient norm, and its update blows the weights up: the evaluation's checkpoint would have
    replaced the last good one (iteration 4), and the final record would have said NaN and done."""
    out, at = tmp_path / 'up', 15 if last else 7
    real_step = train.train_step

    def step_then_blow_up(train_model, raw_model, optimizer, batches, cfg, env, it, *a, **k):
        stats = real_step(train_model, raw_model, optimizer, batches, cfg, env, it, *a, **k)
        if it == at:
            with torch.no_grad():
                for p in raw_model.parameters():
                    p.mul_(1e30)
        return stats

    monkeypatch.setattr(train, 'train_step', step_then_blow_up)
    want = r'final val loss nan' if last else r'the validation loss is not finite'
    with pytest.raises(runs.Stopped, match=rf'non-finite loss or gradient at iteration {at + 1} \({want}'):
        train.main(toy_args(toy_data, out))
    assert torch.load(out / 'ckpt.pt', weights_only=False)['iter_num'] == (16 if last else 4)
    assert not [r for r in read_log(out) if 'final_val_loss' in r]


def test_a_non_finite_gradient_with_a_finite_loss_stops_and_says_which(toy_data, tmp_path, monkeypatch):
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda *a, **k: real_clip(*a, **k) * float('inf'))
    with pytest.raises(runs.Stopped, match=r'non-finite loss or gradient at iteration 0 \(loss \d+\.\d+, grad norm inf\)'):
        train.main(toy_args(toy_data, tmp_path / 'inf'))


def test_the_study_corpora_are_prepared_by_their_recipe_built_only_when_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, 'REPO', str(tmp_path))
    inputs = ' '.join(f'--input=data/downloads/mix7/{n}.txt' for n in ('austen', 'sotu', 'kjv'))
    assert runs.prepare_command('mix') == f'python data/mix7/build_corpora.py && python data/text/prepare.py ' \
                                         f'--name=mix {inputs}'
    (tmp_path / 'data' / 'downloads' / 'mix7').mkdir(parents=True)
    for name in ('austen', 'sotu', 'kjv'):  # built before: no second download
        (tmp_path / 'data' / 'downloads' / 'mix7' / f'{name}.txt').write_text('text')
    assert runs.prepare_command('mix') == f'python data/text/prepare.py --name=mix {inputs}'


def test_missing_dataset_names_the_prepare_command_that_writes_where_train_looks(tmp_path):
    assert runs.prepare_command('austen') == runs.prepare_command('austen', f'{runs.REPO}/./data/austen') == (
        'python data/text/prepare.py --name=austen   (offline: python data/text/prepare.py --name=austen '
        '--input=PATH/TO/austen.txt)')  # the default data_dir: prepare.py's default folder
    # --dataset=austen.txt (a file where a name belongs): the folder to prepare is austen, in the same data_dir
    assert '--input=austen.txt   (then' in runs.prepare_command('austen.txt', f'{runs.REPO}/data/austen.txt')
    assert f'--input=austen.txt --out_dir={tmp_path}/austen   (then' in runs.prepare_command('austen.txt',
                                                                                           f'{tmp_path}/austen.txt')
    with pytest.raises(SystemExit) as e:  # another data_dir: the command said nothing of it, and wrote to data/austen
        train.main([f'--data_dir={tmp_path}', '--dataset=austen', '--device=cpu'])
    assert str(e.value).endswith(f'python data/text/prepare.py --name=austen --out_dir={tmp_path}/austen   (offline: '
                                 f'python data/text/prepare.py --name=austen --input=PATH/TO/austen.txt '
                                 f'--out_dir={tmp_path}/austen)')
    from data.text import prepare  # the offline command, run as given, prepares where train.py looks
    (tmp_path / 'austen.txt').write_text('It is a truth universally acknowledged.\n' * 400)
    offline = str(e.value).rsplit('(offline: ', 1)[1].removesuffix(')').split()[2:]
    prepare.main([a.replace('PATH/TO/austen.txt', str(tmp_path / 'austen.txt')) for a in offline] + ['--vocab_size=32'])
    cfg = train.load_config([f'--data_dir={tmp_path}', '--dataset=austen', '--block_size=16'])
    assert runs.find_dataset(cfg, may_prepare=False)[0] == os.path.join(tmp_path, 'austen')


def test_a_misspelled_dataset_names_the_prepared_one_nearest_it(toy_data):
    with pytest.raises(SystemExit) as e:
        train.main([f'--data_dir={toy_data}', '--dataset=tpy', '--device=cpu'])
    assert str(e.value).startswith(f"{toy_data}/tpy/train.bin not found. Did you mean --dataset=toy (prepared in "
                                   f"{toy_data})? otherwise prepare it first:")
    (toy_data / 'tpo').mkdir()  # a folder without meta.json is not a prepared dataset: not suggested for tpoo
    with pytest.raises(SystemExit) as e:
        train.main([f'--data_dir={toy_data}', '--dataset=tpoo', '--device=cpu'])
    assert 'Did you mean' not in str(e.value) and 'Prepare the dataset first' in str(e.value)


def test_resume_uses_the_stored_config_and_lists_every_difference(toy_data, tmp_path):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    with pytest.raises(SystemExit) as e:  # every difference at once
        train.main(toy_args(toy_data, out, max_iters=12, init_from='resume', gate_warmup_iters=3, batch_size=2,
                            seed=7))
    assert 'gate_warmup_iters=3 (stored: 4)' in str(e.value) and 'batch_size=2 (stored: 4)' in str(e.value)
    assert re.search(r'seed=7 \(stored: \d+\)', str(e.value))  # the seed chooses the batches: not free
    with pytest.raises(SystemExit, match='resume: .*ckpt.pt not found'):
        train.main(toy_args(toy_data, tmp_path / 'none', init_from='resume'))
    # keys that cannot change the result may differ; nothing else needs to be given
    model = train.main([f'--out_dir={out}', '--init_from=resume', '--log_interval=5', '--eval_interval=7'])
    assert model.config.n_embd == 32 and model.phase == 'linear'


def test_resume_on_another_number_of_processes_is_refused(toy_data, tmp_path):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['world'] == 1
    ckpt.update(iter_num=6, world=2)  # as if stopped halfway under torchrun --nproc_per_node=2
    torch.save(ckpt, out / 'ckpt.pt')
    with pytest.raises(SystemExit, match=r'trained on 2 process\(es\), this run has 1: .* resume it on 2 '
                                         r'\(torchrun --standalone --nproc_per_node=2 train.py --init_from=resume'):
        train.main([f'--out_dir={out}', '--init_from=resume'])
    del ckpt['world']  # a checkpoint from before the key: not refused
    torch.save(ckpt, out / 'ckpt.pt')
    assert train.main([f'--out_dir={out}', '--init_from=resume']).phase == 'linear'


def test_a_resume_on_another_device_keeps_the_saved_adam_state_and_takes_this_devices_kernel(toy_data, tmp_path,
                                                                                          monkeypatch):
    """A CUDA run saves its AdamW groups with fused=True; resumed on the CPU, the moments and step
    counts are the saved ones but the kernel is the CPU's (fused=False), as a fresh run here builds it."""
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    ckpt['iter_num'] = 6
    for group in ckpt['optimizer']['param_groups']:
        group['fused'] = True  # as configure_optimizer builds it on CUDA
    torch.save(ckpt, out / 'ckpt.pt')
    built = []
    configure = train.configure_optimizer
    monkeypatch.setattr(train, 'configure_optimizer', lambda *a: built.append(configure(*a)) or built[-1])
    train.main([f'--out_dir={out}', '--init_from=resume'])
    (optimizer,) = built
    assert [g['fused'] for g in optimizer.param_groups] == [False, False]
    saved = {k: v['step'].item() for k, v in ckpt['optimizer']['state'].items()}
    resumed = {k: v['step'].item() for k, v in optimizer.state_dict()['state'].items()}
    assert all(saved[k] < resumed[k] <= saved[k] + 6 for k in saved)  # the saved counts, then iterations 6-11 again


def test_main_command_prepares_tinystories_when_missing(tmp_path, monkeypatch):
    """`python train.py config/tinystories_*.py` on a fresh machine downloads and prepares first."""
    import sys
    import types
    asked = []

    def hf_hub_download(repo_id, repo_type, filename, local_files_only):  # the hub, faked with the V2 text layout
        asked.append((repo_id, repo_type, filename))
        n = 400 if 'train' in filename else 40
        path = tmp_path / filename
        path.write_text(''.join(f'Once upon a time, Tom had {i} red balls. He was happy.\n<|endoftext|>\n'
                                for i in range(n)))
        return str(path)

    monkeypatch.setitem(sys.modules, 'huggingface_hub', types.SimpleNamespace(hf_hub_download=hf_hub_download))
    args = ['config/tinystories_internal_taper.py', f'--data_dir={tmp_path}', f'--out_dir={tmp_path}/out',
            '--device=cpu', '--compile=False', '--n_layer=1', '--n_embd=16', '--n_head=2', '--block_size=16',
            '--batch_size=2', '--gradient_accumulation_steps=1', '--max_iters=4', '--gate_warmup_iters=1',
            '--taper_iters=2', '--eval_iters=1', '--eval_interval=2']
    model = train.main(args)
    assert [a[2] for a in asked] == ['TinyStoriesV2-GPT4-train.txt', 'TinyStoriesV2-GPT4-valid.txt']
    assert {a[:2] for a in asked} == {('roneneldan/TinyStories', 'dataset')}
    assert (tmp_path / 'tinystories' / 'meta.json').exists() and model.phase == 'linear'

    def offline(**kwargs):
        raise OSError('network is unreachable')

    monkeypatch.setitem(sys.modules, 'huggingface_hub', types.SimpleNamespace(hf_hub_download=offline))
    with pytest.raises(SystemExit, match='--input=/path/to/TinyStoriesV2-GPT4-train.txt') as e:
        train.main(args[:1] + [f'--data_dir={tmp_path}/empty'] + args[2:])
    # on a CPU (--device=cpu) the failed download also says what the run would take there, as the run
    # itself says once the data is on disk: the variant at CPU size, config/cpu.py
    # (the variant on austen, which needs no download): the overrides kept but where config/cpu.py sets
    # the key (--device, --max_iters, ...), and --data_dir (the data) and --out_dir (this run's folder)
    last = str(e.value).splitlines()[-1]
    assert last.startswith("this run is on a CPU: the same variant at CPU size needs no download (the 1M model on "
                           "Jane Austen's novels, prepared by python data/text/prepare.py --name=austen): ")
    command = last.split('): ', 1)[1].split()
    assert command[:4] == ['python', 'train.py', 'config/tinystories_internal_taper.py', 'config/cpu.py']
    assert '--compile=False' in command and '--n_layer=1' in command
    assert not [a for a in command if a.startswith(('--data_dir', '--out_dir', '--device', '--max_iters', '--n_embd'))]


# ---- the numbers train.py reports, against plain torch ---------------------------------

def linear_phase_model(aux_weight=0.0, **config):
    """A tiny GPT calibrated ('end') on one random batch and put in the linear phase (g = 0)."""
    torch.manual_seed(0)
    config = {**dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, taper='all'), **config}
    model = GPT(GPTConfig(aux_weight=aux_weight, **config))
    x = torch.randint(0, config['vocab_size'], (4, 16))
    model.set_collect('calibration')
    model(x, x)
    model.set_collect(None)
    model.calibrate('end')
    model.set_phase('linear')
    model.set_gate(0.0)
    return model


def plain_losses(model, x, y):
    """(CE, L_aux) written out: F.cross_entropy and λ · mean over tokens of (sqrt(mean h² + ε) − s_tgt)²."""
    seen = {}
    hook = model.transformer.ln_f.register_forward_pre_hook(lambda m, a: seen.__setitem__('h', a[0]))
    logits, _ = model(x, y)
    hook.remove()
    ce = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    s = (seen['h'].pow(2).mean(-1) + 1e-5).sqrt()
    return ce, model.config.aux_weight * (s - model.s_tgt).pow(2).mean()


def test_a_training_step_is_the_mean_of_its_micro_batches_losses(toy_data, tmp_path):
    """Two micro-batches: the gradient is that of mean_m (CE_m + L_aux_m), clipped to norm 1."""
    cfg = load_config(toy_args(toy_data, tmp_path / 'x', dropout=0.0, batch_size=2, grad_clip=1.0))
    env = train.setup(cfg)
    folder = str(toy_data / 'toy')
    model, reference = linear_phase_model(1.0), linear_phase_model(1.0)
    grads = {}

    class Capture:  # stands in for the optimizer: keeps the gradients train_step produced
        def step(self):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=set_to_none)

    stats = train.train_step(model, model, Capture(), train.Batches(folder, cfg, env), cfg, env, it=5)
    total = 0
    for micro in range(2):
        x, y = train.get_batch(folder, 'train', train.batch_rng(cfg.seed, 0, 5, 0, micro), 2, 16, 'cpu')
        ce, aux = plain_losses(reference, x, y)
        total = total + (ce + aux) / 2
    total.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters() if p.grad is not None))
    assert stats['loss'] == pytest.approx(total.item(), rel=1e-5)
    assert stats['grad_norm'] == pytest.approx(norm.item(), rel=1e-5) and norm > 1  # so clipping acted
    for n, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad / norm, rtol=1e-4, atol=1e-7)


def test_validation_loss_is_cross_entropy_alone(toy_data, tmp_path):
    cfg = load_config(toy_args(toy_data, tmp_path / 'x', eval_iters=3))
    env = train.setup(cfg)
    model = linear_phase_model(aux_weight=100.0)
    model.s_tgt.mul_(3)  # an L_aux that would show
    folder = str(toy_data / 'toy')
    got = train.estimate_val_loss(model, model, folder, cfg, env)
    with torch.no_grad():
        batches = [train.get_batch(folder, 'val', train.batch_rng(cfg.seed, 1, k), 4, 16, 'cpu') for k in range(3)]
        ces = [plain_losses(model, x, y) for x, y in batches]
    assert got == pytest.approx(sum(ce.item() for ce, _ in ces) / 3, rel=1e-6)
    assert sum(aux.item() for _, aux in ces) > 0.01 * got


def test_final_losses_cover_the_whole_val_split_and_as_many_train_windows(toy_data, tmp_path):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12, block_size=16))
    final = read_log(out)[-1]
    model, _ = load_model(str(out / 'ckpt.pt'))
    val = np.fromfile(toy_data / 'toy' / 'val.bin', dtype=np.uint16).astype(np.int64)
    train_data = np.fromfile(toy_data / 'toy' / 'train.bin', dtype=np.uint16).astype(np.int64)
    n = (len(val) - 1) // 16  # every whole window of the split
    starts = np.random.default_rng(np.random.SeedSequence([1337, 3])).integers(len(train_data) - 16, size=n)
    with torch.no_grad():
        for data, starts_, key in ((val, np.arange(n) * 16, 'final_val_loss'), (train_data, starts, 'final_train_loss')):
            x = torch.from_numpy(np.stack([data[s:s + 16] for s in starts_]))
            y = torch.from_numpy(np.stack([data[s + 1:s + 17] for s in starts_]))
            ce = F.cross_entropy(model(x, y)[0].reshape(-1, 64), y.reshape(-1))
            assert final[key] == pytest.approx(ce.item(), rel=1e-5), key


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host (on a GPU each one waits for it)."""
    READS = ('item', 'tolist', 'numpy', 'cpu', '__bool__', '__float__', '__int__')

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, '__name__', '') in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('taper', ['none', 'all'])
def test_a_training_step_reads_the_device_once(toy_data, tmp_path, taper):
    # loss, metrics, grad norm and the stop flag come back in one .tolist(): the step's only host sync
    cfg = load_config(toy_args(toy_data, tmp_path / 'x', taper=taper, aux_weight=0.1 if taper != 'none' else 0.0))
    env = train.setup(cfg)
    model = GPT(GPTConfig(**{k: getattr(cfg, k) for k in train.MODEL_KEYS}, vocab_size=64))
    opt = SimpleNamespace(step=lambda: None, zero_grad=model.zero_grad)  # torch's own optimizer is not counted
    batches = train.Batches(str(toy_data / 'toy'), cfg, env)
    train.train_step(model, model, opt, batches, cfg, env, it=0)  # the first step: lazy state built
    with HostReads() as reads:
        stats = train.train_step(model, model, opt, batches, cfg, env, it=1)
    assert reads.calls == ['tolist'] and math.isfinite(stats['grad_norm'])
    # the next step's first micro-batch was built ahead, and is the one train_batch gives
    x, y = batches.get(2, 0)
    assert torch.equal(x, train.train_batch(str(toy_data / 'toy'), cfg, env, 2, 0)[0])


def test_the_ema_warmup_step_updates_the_statistics_before_its_host_read(toy_data, tmp_path):
    """In the 'ema' warmup train_step runs calibration_step itself, after the backward and before the
    step's one host read (tolist): on a GPU its host work then overlaps the device's backward, and
    under DDP every rank makes its all-reduce at the same point. A step that collects nothing runs none."""
    cfg = load_config(toy_args(toy_data, tmp_path / 'x', taper='all', calibration='ema'))
    env = train.setup(cfg)
    model = GPT(GPTConfig(**{k: getattr(cfg, k) for k in train.MODEL_KEYS}, vocab_size=64))
    opt = SimpleNamespace(step=lambda: None, zero_grad=model.zero_grad)
    batches = train.Batches(str(toy_data / 'toy'), cfg, env)
    real = model.calibration_step
    with HostReads() as reads:
        model.calibration_step = lambda: (reads.calls.append('calibration_step'), real())[1]
        train.train_step(model, model, opt, batches, cfg, env, it=0)  # collect None: no statistics
        model.set_collect('calibration')
        train.train_step(model, model, opt, batches, cfg, env, it=1)
    assert [c for c in reads.calls if c != 'item'] == ['tolist', 'calibration_step', 'tolist']
    assert int(model.calib_steps) == 1 and model.transformer.h[0].ln_1.calib_den.min() > 0


def flat(record, prefix=''):
    """A log record's fields as {'key' or 'key.sub': value}, the timings left out (they vary)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flat(v, f'{prefix}{k}.'))
        elif k not in ('step_ms', 'tokens_per_s'):
            out[prefix + k] = v
    return out


@pytest.mark.parametrize('variant, expected', [
    # warmup, taper, linear: training and evaluation each (6), and the calibrate event's two
    # collect modes in evaluation ('calibration', 'mismatch')
    (dict(taper='all', calibration='end'), 8),
    # 'ema' collects in the warmup's training forwards instead: training and evaluation in each
    # phase, and the calibrate event's 'mismatch' pass
    (dict(taper='all', calibration='ema'), 7),
    # FakeLN: five stages (events before iterations 4, 8, 12, 16), training and evaluation in each
    (dict(taper='none', aux_weight=0.0, norm='layernorm', norm_removal='fakeln', fakeln_interval=4,
          max_iters=20, lr_decay_iters=20), 10),
])
def test_a_compiled_run_compiles_each_version_of_the_forward_once_and_stays_compiled(
        toy_data, tmp_path, monkeypatch, variant, expected):
    """dynamo's own count (CompileCounter), validation and calibration passes included; the default
    recompile limit (8) would have left FakeLN's last versions running uncompiled. With dynamo's
    'aot_eager' backend (the graphs dynamo captures, through AOT autograd and functionalization: the
    path inductor takes on a GPU, with the calibration statistics' in-place updates inside the
    forward and RadialCos's backward; the plain 'eager' backend sees the same graphs and checks
    nothing more), the run computes what the uncompiled one does: the same log (losses, radial_cos,
    the calibrate and FakeLN events) and final weights."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter, real_compile = CompileCounterWithBackend('aot_eager'), torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model, **kw: real_compile(model, backend=counter, **kw))
    monkeypatch.setattr(train, 'check_compiler', lambda device: None)  # its probe would count too
    # the first estimate times an evaluation batch that compiles nothing: the second
    events, real_get_batch, real_timed = [], train.get_batch, runs.Progress.evaluation_batch
    monkeypatch.setattr(train, 'get_batch', lambda folder, split, *a: events.append(split) or
                        real_get_batch(folder, split, *a))
    monkeypatch.setattr(runs.Progress, 'evaluation_batch', lambda self, it, s: events.append('timed') or
                        real_timed(self, it, s))
    compiled = train.main(toy_args(toy_data, tmp_path / 'run', compile=True, dropout=0.0, **variant))
    assert events[:3] == ['val', 'val', 'timed']
    assert counter.frame_count == expected
    assert expected <= runs.RECOMPILE_LIMIT
    uncompiled = train.main(toy_args(toy_data, tmp_path / 'uncompiled', compile=False, dropout=0.0, **variant))
    got, want = ([flat(r) for r in read_log(tmp_path / out)] for out in ('run', 'uncompiled'))
    assert [r.keys() for r in got] == [r.keys() for r in want]
    for a, b in zip(got, want):
        assert a == {k: pytest.approx(v, rel=1e-5, abs=1e-7) if isinstance(v, float) else v for k, v in b.items()}
    for name, tensor in uncompiled.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize('error', [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 128000000000 bytes. Error code 12 (Cannot allocate memory)"),  # --batch_size=100000, tried
    torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 64.00 GiB.'),
    MemoryError('Unable to allocate 7.28 TiB for an array with shape (1000000000000, 17)'),  # numpy's, the batch's
])
def test_a_step_that_does_not_fit_in_memory_ends_in_one_line_naming_the_keys(toy_data, tmp_path, monkeypatch, error):
    """A batch too large for the device ended train.py in the allocator's traceback; now in one line that
    says what did not fit and what to change, with the checkpoints already written whole. Any other error
    keeps its traceback."""
    real, calls = train.train_step, []

    def train_step(*args, **kwargs):  # a stand-in for the allocator: the step of iteration 5 does not fit
        calls.append(args[6])
        if args[6] == 5:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(train, 'train_step', train_step)
    out = tmp_path / 'run'
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, out))
    assert str(e.value) == (
        "out of memory on cpu during iteration 5: batch_size 4 × block_size 16 does not fit. Lower --batch_size and "
        "raise --gradient_accumulation_steps as much (the same tokens a step; a new run: resume keeps its batch), or "
        f"lower --block_size or the model; {out / 'ckpt.pt'} (the last checkpoint) is whole")
    assert torch.load(out / 'ckpt.pt', weights_only=False)['iter_num'] == 4  # the evaluation at 4 wrote it
    error = ValueError('something else')
    with pytest.raises(ValueError, match='something else'):
        train.main(toy_args(toy_data, tmp_path / 'other'))


def test_the_out_of_memory_check_works_on_torch_2_4(monkeypatch):
    """torch 2.4 (README's minimum) has torch.cuda.OutOfMemoryError but no torch.OutOfMemoryError (2.5):
    every error a run ended with became an AttributeError in runs.out_of_memory."""
    cuda_oom = torch.cuda.OutOfMemoryError('CUDA out of memory.')
    monkeypatch.delattr(torch, 'OutOfMemoryError')
    assert runs.out_of_memory(cuda_oom) and not runs.out_of_memory(ValueError('something else'))


def test_readmes_torchrun_line_keeps_the_single_gpu_tokens_per_step():
    """batch_size and gradient_accumulation_steps count per process (nanoGPT#283): README's 8-GPU
    line trained on 8 × the 65,536 tokens a step that the configs' budget states."""
    readme = open(os.path.join(os.path.dirname(train.__file__), 'README.md'), encoding='utf-8').read()
    per_step = lambda argv, world: (lambda c: c.batch_size * c.block_size * c.gradient_accumulation_steps * world)(
        load_config(argv))
    torchrun = [line.split('#')[0].split() for line in readme.splitlines() if line.startswith('torchrun ')]
    assert torchrun
    for words in torchrun:
        world = int(next(w for w in words if w.startswith('--nproc_per_node=')).split('=')[1])
        argv = words[words.index('train.py') + 1:]
        assert per_step(argv, world) == per_step(argv[:1], 1) == 65536, words
