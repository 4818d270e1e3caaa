"""Runs a user can trust (issue 10): one run per out_dir, resume as one uninterrupted run,
signals, bad data and bad input that end in one line instead of a traceback."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import configurator
import train
from runs import load_checkpoint, load_model
from test_train import read_log, toy_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {'step_ms', 'tokens_per_s'}


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


# ---- one run per out_dir ------------------------------------------------------------------

def test_a_scratch_run_refuses_a_used_out_dir_and_overwrite_replaces_it(toy_data, tmp_path):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    before = (out / 'log.jsonl').read_text()
    with pytest.raises(SystemExit, match=r'already holds a run \(ckpt.pt, log.jsonl\): continue it with '
                                         r'--init_from=resume, choose another --out_dir, or replace it with --overwrite=True'):
        train.main(toy_args(toy_data, out, max_iters=10))
    assert (out / 'log.jsonl').read_text() == before  # nothing written
    train.main(toy_args(toy_data, out, max_iters=10, overwrite=True))
    assert [r['iter'] for r in read_log(out) if "final_val_loss" in r] == [10]  # only the new run
    assert max(r["iter"] for r in read_log(out)) == 10


def test_a_second_process_cannot_write_into_a_run_in_progress(toy_data, tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    with open(out / '.lock', 'a') as held:  # what a running train.py holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match='in use by another train.py run'):
            train.main(toy_args(toy_data, out))
    assert not (out / 'log.jsonl').exists()


def run_train(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_for_records(out, n, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (out / 'log.jsonl').exists() and len((out / 'log.jsonl').read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError('no log records')


@pytest.mark.parametrize('how', ['SIGINT', 'SIGTERM', 'SIGKILL'])
def test_interrupted_and_resumed_run_logs_exactly_one_uninterrupted_run(toy_data, tmp_path, how):
    """Ctrl-C / SIGTERM: a checkpoint of the last finished step, one line, exit non-zero; kill -9:
    the last evaluation's checkpoint and no stale lock. Resumed either way, log.jsonl equals an
    uninterrupted run's line by line (timing fields aside)."""
    args = dict(max_iters=60, eval_interval=20, gate_warmup_iters=10, taper_iters=20, lr_decay_iters=60)
    straight = tmp_path / 'straight'
    train.main(toy_args(toy_data, straight, **args))

    out = tmp_path / 'interrupted'
    proc = run_train(toy_args(toy_data, out, **args))
    wait_for_records(out, 26, proc)  # past the calibrate event (iteration 9) and the checkpoint at 20
    proc.send_signal(getattr(signal, how))
    stdout, stderr = proc.communicate(timeout=60)
    if how == 'SIGKILL':
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == (130 if how == 'SIGINT' else 143)
        assert 'Traceback' not in stderr and len(stderr.strip().splitlines()) == 1, stderr
        last = max(r['iter'] for r in read_log(out) if 'loss' in r)
        assert f"stopped by {how} after iteration {last}" in stderr
        assert f"continue with: python train.py --init_from=resume --out_dir={out}" in stderr
        assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == last + 1  # nothing finished is lost
    assert read_log(out)[-1]['iter'] < 59  # really interrupted
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert without_timing(read_log(out)) == without_timing(read_log(straight))


# ---- data --------------------------------------------------------------------------------

def break_dataset(toy_data, how):
    folder = toy_data / 'toy'
    if how == 'odd':
        with open(folder / 'train.bin', 'ab') as f:
            f.write(b'\0')
    elif how == 'vocab':
        data = np.fromfile(folder / 'val.bin', dtype=np.uint16)
        data[5] = 64
        data.tofile(folder / 'val.bin')
    elif how == 'short':
        np.zeros(16, dtype=np.uint16).tofile(folder / 'val.bin')
    elif how == 'meta':
        (folder / 'meta.json').write_text('{"vocab_size": ')


def test_data_exactly_one_window_long_trains_and_is_evaluated_on_that_window(toy_data, tmp_path):
    """block_size + 1 tokens hold one window (16 inputs, 16 targets): accepted for both splits."""
    folder = toy_data / 'toy'
    stream = np.fromfile(folder / 'train.bin', dtype=np.uint16)
    stream[:17].tofile(folder / 'train.bin')
    stream[100:117].tofile(folder / 'val.bin')
    model = train.main(toy_args(toy_data, tmp_path / 'run', taper='none', aux_weight=0.0, max_iters=2, warmup_iters=1,
                                lr_decay_iters=2, eval_interval=2))
    x = torch.from_numpy(stream[100:117].astype(np.int64))
    model.eval()
    with torch.no_grad():
        _, ce = model(x[None, :16], x[None, 1:])
    assert read_log(tmp_path / 'run')[-1]['final_val_loss'] == pytest.approx(ce.item(), rel=1e-5)


@pytest.mark.parametrize('how, message', [
    ('odd', r'train.bin holds 20001 bytes, not a whole number of uint16 tokens .*prepare the dataset again'),
    ('vocab', r"val.bin holds token id 64, outside meta.json's vocab_size 64"),
    ('short', r'val.bin has 16 tokens, fewer than block_size \+ 1 = 17 \(one window\)'),
    ('meta', r'meta.json is not a readable dataset description'),
])
def test_bad_data_is_refused_at_start_up_before_anything_is_written(toy_data, tmp_path, how, message):
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    ckpt, log = (out / 'ckpt.pt').read_bytes(), (out / 'log.jsonl').read_text()
    break_dataset(toy_data, how)
    with pytest.raises(SystemExit, match=message):
        train.main([f'--out_dir={out}', '--init_from=resume'])
    with pytest.raises(SystemExit, match=message):
        train.main(toy_args(toy_data, tmp_path / 'fresh'))
    assert (out / 'ckpt.pt').read_bytes() == ckpt and (out / 'log.jsonl').read_text() == log
    assert not (tmp_path / 'fresh').exists()


def test_data_paths_do_not_depend_on_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=os.path.join(ROOT, 'data', 'nope', 'train.bin') + ' not found'):
        train.main(['--dataset=nope', '--device=cpu'])
    with pytest.raises(SystemExit, match=r'--dataset names a prepared folder, not a text file'):
        train.main(['--dataset=austen.txt', '--device=cpu'])


# ---- checkpoints, devices, compiler, configuration ---------------------------------------------

@pytest.mark.parametrize('content, message', [
    (b'', 'is not a readable checkpoint (truncated or corrupt)'),
    (os.urandom(4096), 'is not a readable checkpoint (truncated or corrupt)'),
    (None, 'is not a tapernorm checkpoint: it lacks model_args'),
])
def test_one_checkpoint_loader_with_one_line_errors(tmp_path, content, message):
    path = tmp_path / 'ckpt.pt'
    if content is None:
        torch.save({'model': {}}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        load_checkpoint(str(path))
    assert message in str(e.value) and 'weights_only' not in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(SystemExit, match='is a run folder: pass its checkpoint'):
        load_checkpoint(str(tmp_path))
    with pytest.raises(SystemExit, match=message.replace('(', r'\(').replace(')', r'\)')):
        train.main([f'--out_dir={tmp_path}', '--init_from=resume'])


@pytest.mark.parametrize('device, message', [
    ('mps', 'no MPS'), ('cuda', 'no CUDA device'), ('tpu', "use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    ('cuda:x', "use 'auto'"),
])
def test_devices_this_machine_lacks_get_one_line(device, message):
    if device == 'mps' and torch.backends.mps.is_available() or device == 'cuda' and torch.cuda.is_available():
        pytest.skip(f'this machine has {device}')
    with pytest.raises(SystemExit, match=message):
        configurator.resolve_device(device)


def test_compile_without_a_cxx_compiler_is_one_line():
    env = dict(os.environ, CXX='/bin/false', TORCHINDUCTOR_CACHE_DIR=os.path.join(ROOT, '.no-cache-test'))
    proc = subprocess.run([sys.executable, '-c', 'import configurator; configurator.check_compiler("cpu")'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr
    assert '--compile=False runs without it' in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize('args, message', [
    (['config/cpu.py', 'config/tinystories_internal_taper.py'],
     'config/tinystories_internal_taper.py comes after the overlay config/cpu.py and would undo it'),
    (['-max_iters=60'], 'did you mean --max_iters=60?'),
    (['--dataset=austen', 'was'], "'was' is neither a config file nor --key=value; a value with spaces needs quotes"),
])
def test_misleading_inputs_get_the_message_the_user_needs(args, message):
    with pytest.raises(SystemExit, match=message.replace('?', r'\?').replace('.', r'\.')):
        train.load_config(args)


def test_the_smoke_overlay_crosses_every_phase_and_no_example_keeps_a_longer_schedule():
    for base in ('baseline', 'internal_taper', 'all_taper', 'all_taper_noaux'):
        for overlays in (['cpu'], ['smoke'], ['cpu', 'smoke']):
            cfg = train.load_config([f'config/tinystories_{base}.py'] + [f'config/{o}.py' for o in overlays])
            assert cfg.lr_decay_iters == cfg.max_iters
            if overlays[-1] == 'smoke':
                assert cfg.max_iters == 150 and cfg.schedule_scale == 1.0  # resolved: the real step counts
            if cfg.taper != 'none':
                assert cfg.gate_warmup_iters + cfg.taper_iters < cfg.max_iters  # a linear phase too


def test_schedule_scale_scales_every_step_count_once_and_a_resume_keeps_them(toy_data, tmp_path):
    # config/cpu.py: 1500 steps, LR warmup 150, W 150, T 750, evaluations every 250; worked by hand at 0.1
    cfg = train.load_config(['config/tinystories_internal_taper.py', 'config/cpu.py', '--schedule_scale=0.1'])
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.warmup_iters, cfg.gate_warmup_iters, cfg.taper_iters,
            cfg.eval_interval, cfg.schedule_scale) == (150, 150, 15, 15, 75, 25, 1.0)
    import study  # the study's view of a cell is the resolved one too
    assert study.cell_config(['config/cpu.py', '--schedule_scale=2'])['max_iters'] == 3000
    with pytest.raises(SystemExit, match=r'schedule_scale=0.0 must be > 0'):
        train.load_config(['--schedule_scale=0'])
    # the toy run at half its schedule (16 -> 8 steps, W 4 -> 2, T 6 -> 3): stored resolved, so a
    # resume does not scale it a second time
    out = tmp_path / 'half'
    train.main(toy_args(toy_data, out, schedule_scale=0.5))
    stored = load_checkpoint(str(out / 'ckpt.pt'))['config']
    assert (stored['max_iters'], stored['gate_warmup_iters'], stored['taper_iters'], stored['schedule_scale']) == \
        (8, 2, 3, 1.0)
    assert max(r['iter'] for r in read_log(out) if 'loss' in r) == 7
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert load_checkpoint(str(out / 'ckpt.pt'))['config']['max_iters'] == 8
    # the command that started it resumes it: its scale is not applied to the stored counts
    # (fakeln_interval, which toy_args leaves to its default 30, stored as 15, would become 8)
    assert stored['fakeln_interval'] == 15
    train.main(toy_args(toy_data, out, schedule_scale=0.5) + ['--init_from=resume'])
    with pytest.raises(SystemExit, match=r' max_iters=4 \(stored: 8\).* would change the run'):
        train.main(toy_args(toy_data, out, schedule_scale=0.25) + ['--init_from=resume'])


def test_a_checkpoint_from_before_each_model_key_loads_samples_and_resumes_as_it_ran(tmp_path, monkeypatch):
    """A DyT run from before the embedding scalar (9b3e8c9) and the other model keys added since the
    first release: its model_args and config lack them. Absent, each means what it meant then
    (dyt_embed_scale: False, no scalar), so the checkpoint loads, samples and resumes to the weights of
    the same run never stopped; a resume that would change such a key names what the run held."""
    from data.text import prepare
    import sample
    from model import ABSENT_MEANS
    from test_train import interrupt_at
    words = 'the cat sat on a mat and then it ran away very quickly said Emma to her sister'.split()
    rng = np.random.default_rng(0)
    (tmp_path / 'corpus.txt').write_text('.\n'.join(' '.join(rng.choice(words, 9)) for _ in range(300)))
    prepare.main([f'--input={tmp_path / "corpus.txt"}', '--vocab_size=64', f'--out_dir={tmp_path / "data" / "words"}'])
    run = lambda out, **kw: toy_args(tmp_path / 'data', out, **{**dict(
        dataset='words', norm='dyt', taper='none', aux_weight=0.0, dyt_embed_scale=False, max_iters=8, lr_decay_iters=8), **kw})
    train.main(run(tmp_path / 'straight'))
    old = tmp_path / 'old'
    interrupt_at(6, run(old), monkeypatch)  # its checkpoint: iteration 4
    ckpt = torch.load(old / 'ckpt.pt', weights_only=True)
    gone = [k for k in ABSENT_MEANS if k in ckpt['model_args']]  # 'folded' is fold.py's: never in a run's
    for k in gone:
        del ckpt['model_args'][k]
        ckpt['config'].pop(k, None)
    assert 'dyt_embed_scale' in gone and not any(k in ckpt['model_args'] or k in ckpt['config'] for k in ABSENT_MEANS)
    torch.save(ckpt, old / 'ckpt.pt')

    model, _ = load_model(str(old / 'ckpt.pt'))
    assert model.config.norm == 'dyt' and model.embed_scale is None  # absent: no scalar, as the run had
    text = sample.main([f'--ckpt={old / "ckpt.pt"}', '--start=the cat', '--num_samples=1', '--max_new_tokens=8',
                        '--temperature=0', '--device=cpu'])
    assert text[0].startswith('the cat') and len(text[0]) > len('the cat')
    with pytest.raises(SystemExit, match=r"dyt_embed_scale=True \(not stored: the run predates the key, so it ran "
                                         r"as dyt_embed_scale=False\)"):
        train.main(run(old, init_from='resume', dyt_embed_scale=True))
    resumed = train.main(run(old, init_from='resume'))  # the command that started it, dyt_embed_scale=False given
    straight, _ = load_model(str(tmp_path / 'straight' / 'ckpt.pt'))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_checkpoint_from_before_the_calibration_key_loads_and_resumes_as_ema(toy_data, tmp_path):
    """Checkpoints written before calibration='end' existed hold the same tensors and a config
    without calibration / calib_batches / overwrite: they load, and resume with the EMA they used."""
    out = tmp_path / 'old'
    train.main(toy_args(toy_data, out, max_iters=12, calibration='ema'))
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    for key in ('calibration', 'calib_batches', 'overwrite'):
        del ckpt['config'][key]
    torch.save(ckpt, out / 'ckpt.pt')
    model, _ = load_model(str(out / 'ckpt.pt'))
    assert model.phase == 'linear'
    resumed = train.main([f'--out_dir={out}', '--init_from=resume'])
    assert torch.equal(resumed.lm_head.weight, model.lm_head.weight)
    with pytest.raises(SystemExit, match=r"calibration='end' \(not stored: the run predates the key, so it ran "
                                         r"as calibration='ema'\)"):  # what the run held, not a default
        train.main([f'--out_dir={out}', '--init_from=resume', '--calibration=end'])
