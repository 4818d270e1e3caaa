"""Runs a user can trust: one run per out_dir, resume as one uninterrupted run,
signals, bad data and bad input that end in one line instead of a traceback."""

import builtins
import errno
import fcntl
import glob
import io
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import configurator
import fold
import runs
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


def test_a_resume_on_a_full_disk_is_one_line_and_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """The log's rewrite runs before `with run`, whose exit says a full disk in one line: a resume on
    a full disk was an OSError traceback (OpenNMT-py#373), and left an empty log.jsonl.tmp."""
    if not os.path.exists('/dev/full'):
        pytest.skip('needs /dev/full (Linux)')
    log = tmp_path / 'log.jsonl'
    log.write_text(''.join(json.dumps({'iter': i, 'loss': 1.0}) + '\n' for i in range(6)))
    before = log.read_bytes()
    real_open = open
    monkeypatch.setattr(runs, 'open', lambda path, mode='r', *a, **k: real_open(
        '/dev/full' if str(path).endswith('log.jsonl.tmp') else path, mode, *a, **k), raising=False)
    cfg = SimpleNamespace(out_dir=str(tmp_path), init_from='resume', overwrite=False)
    with pytest.raises(SystemExit) as e:
        runs.claim_out_dir(cfg, iter_num=4)
    assert str(e.value) == (f"a filesystem is full (No space left on device): the resume could not rewrite {log}, "
                            "and left the run as it was; free space there, then run the same command")
    assert log.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ['.lock', 'log.jsonl']


def test_a_second_process_cannot_write_into_a_run_in_progress(toy_data, tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    with open(out / '.lock', 'a') as held:  # what a running train.py holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match='in use by another train.py run'):
            train.main(toy_args(toy_data, out))
    assert not (out / 'log.jsonl').exists()


def test_a_filesystem_that_cannot_lock_warns_once_and_the_run_goes_on(toy_data, tmp_path, monkeypatch, capfd):
    """Lustre mounted without -o flock (ENOSYS), NFS without its lock daemon (ENOLCK): flock's OSError
    ended every train.py before step 0 (tox-dev/filelock#67). Now one warning, then the run; any
    other OSError from flock still propagates."""
    def flock(f, op, errno_=errno.ENOLCK):
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(fcntl, 'flock', flock)
    monkeypatch.setattr(runs, '_unlocked', set())
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out))
    assert [r['iter'] for r in read_log(out) if 'final_val_loss' in r] == [16]
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith('warning:')]
    assert warnings == [f'warning: {out} is on a filesystem that cannot lock files (No locks available): '
                        f'nothing keeps two processes from writing in {out} at the same time']
    with open(out / '.lock', 'a') as f:
        assert runs.take_lock(f) is True and 'warning' not in capfd.readouterr().err  # once per folder
        monkeypatch.setattr(fcntl, 'flock', lambda f, op: flock(f, op, errno.EBADF))
        with pytest.raises(OSError, match='Bad file descriptor'):
            runs.take_lock(f)
        monkeypatch.setattr(runs, 'fcntl', None)  # Windows: no lock at all, and the same warning (it said nothing)
        monkeypatch.setattr(runs, '_unlocked', set())
        assert runs.take_lock(f) is True and runs.take_lock(f) is True
    assert capfd.readouterr().err == ('warning: this system cannot lock files (no fcntl: Windows): nothing keeps two '
                                      f'processes from writing in {out} at the same time\n')


@pytest.mark.parametrize('error', [SystemExit('DIR is in use by another train.py run'),
                                   OSError(errno.ENOSPC, 'No space left on device')])
def test_every_rank_meets_rank_0s_claim_whatever_it_raises(monkeypatch, error):
    """Rank 0 refusing out_dir (or failing in it: the log's rewrite on a full disk) still meets the
    all-reduce every other rank waits in, which would otherwise wait until DDP's timeout (30 min); then
    the group ends on every rank, rank 0 raises its error and the others exit 1 in silence."""
    reduced, ended = [], []

    def all_reduce(flag):  # the ranks' sum: rank 0's flag is the only one that can be set
        reduced.append(flag.item())
        flag.fill_(float(error is not None))

    def claim(cfg, iter_num):
        raise error

    monkeypatch.setattr(torch.distributed, 'all_reduce', all_reduce)
    monkeypatch.setattr(runs, 'end_processes', lambda env: ended.append(env.rank))
    monkeypatch.setattr(runs, 'claim_out_dir', claim)
    for rank in (0, 1):
        env = SimpleNamespace(rank=rank, master=rank == 0, ddp=True, dev='cpu')
        with pytest.raises(type(error) if rank == 0 else SystemExit) as e:
            runs.claim_on_every_rank(SimpleNamespace(), env, 0)
        assert e.value is error if rank == 0 else e.value.code == 1
    assert reduced == [1.0, 0.0] and ended == [0, 1]


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
    """Ctrl-C / SIGTERM: at once a line naming the step it finishes, then a checkpoint of that step
    (the step in progress is the last), one line, exit non-zero; kill -9:
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
        assert 'Traceback' not in stderr and len(stderr.strip().splitlines()) == 2, stderr
        last = max(r['iter'] for r in read_log(out) if 'loss' in r)
        said, stopped = stderr.strip().splitlines()
        assert said == f"{how}: finishing iteration {last}, then saving and stopping (Ctrl-C again stops at once, " \
                       "without saving)"
        assert stopped.startswith(f"stopped by {how} after iteration {last}: ")
        assert f"continue with: python train.py --init_from=resume --out_dir={out}" in stderr
        assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == last + 1  # nothing finished is lost
    assert read_log(out)[-1]['iter'] < 59  # really interrupted
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert without_timing(read_log(out)) == without_timing(read_log(straight))


def signal_at(monkeypatch, module, name, when, signum):
    """Patch module.name so that the first call for which when(*args) is true first sends signum
    to this process, once (its handler runs as soon as the call returns)."""
    real, sent = getattr(module, name), []

    def patched(*args, **kw):
        if not sent and when(*args):
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, patched)


@pytest.fixture
def no_default_sigterm():
    """A SIGTERM that train.py does not handle fails the test instead of ending pytest."""
    def unhandled(signum, frame):
        raise AssertionError('SIGTERM reached the default handler: the process would have died without a word')
    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize('where', ['during the step', 'after the step'])
def test_a_signal_stops_after_the_step_in_progress(toy_data, tmp_path, monkeypatch, capfd, where, no_default_sigterm):
    """SIGTERM while iteration 6 runs (its second micro-batch being read, or its record being
    logged): iteration 6 is the last, saved, and resumes at 7."""
    out = tmp_path / 'run'
    if where == 'during the step':
        signal_at(monkeypatch, train, 'train_batch', lambda f, c, e, it, micro: (it, micro) == (6, 1), signal.SIGTERM)
    else:
        signal_at(monkeypatch, runs, 'log', lambda r, *rest: r.get('iter') == 6 and 'loss' in r, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, out))
    assert e.value.code == 143
    del e  # its traceback holds the run's lock file open
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 7
    assert max(r['iter'] for r in read_log(out)) == 6
    err = capfd.readouterr().err
    assert 'SIGTERM: finishing iteration 6, then saving' in err
    assert 'stopped by SIGTERM after iteration 6: saved in' in err and 'resumes at iteration 7' in err


def test_a_signal_during_an_evaluation_cuts_it_short_and_saves_the_step_before_it(toy_data, tmp_path, monkeypatch,
                                                                                  capfd):
    """Ctrl-C while the evaluation at iteration 8 reads its second of 5 batches: no batch after it is
    read, iteration 8 does not run, the checkpoint resumes at 8, and the resumed run logs what an
    uninterrupted one does."""
    args = toy_args(toy_data, tmp_path / 'straight', eval_iters=5)
    train.main(args)
    read = []
    real_get_batch = train.get_batch

    def get_batch(folder, split, *rest):
        if split == 'val':
            read.append(len(read))
            if len(read) == 2 * 5 + 2:  # evaluations at 0 and 4, then the second batch at 8
                os.kill(os.getpid(), signal.SIGINT)
        return real_get_batch(folder, split, *rest)

    monkeypatch.setattr(train, 'get_batch', get_batch)
    out = tmp_path / 'cut'
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, out, eval_iters=5))
    assert e.value.code == 130
    del e  # its traceback holds the run's lock file open
    assert len(read) == 12  # cut at once: the batch being read was not evaluated, none after it was read
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 8
    assert max(r['iter'] for r in read_log(out)) == 7
    err = capfd.readouterr().err
    assert 'SIGINT: cutting the evaluation at iteration 8 short, then saving and stopping' in err
    assert (f"stopped by SIGINT during the evaluation at iteration 8: saved in {out / 'ckpt.pt'}, which resumes at "
            f"iteration 8; continue with: python train.py --init_from=resume --out_dir={out}") in err
    assert 'Traceback' not in err
    monkeypatch.setattr(train, 'get_batch', real_get_batch)
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert without_timing(read_log(out)) == without_timing(read_log(tmp_path / 'straight'))


def test_the_resume_command_survives_a_shell_when_out_dir_has_a_space():
    """The printed command, pasted into a shell, gives train.py out_dir as one argument (amoffat/sh#756:
    'runs/b' is neither a config file nor --key=value); a plain path prints as it is."""
    import shlex
    assert shlex.split(runs.resume_command('/tmp/my runs/b', 1)) == [
        'python', 'train.py', '--init_from=resume', '--out_dir=/tmp/my runs/b']
    assert runs.resume_command('out-x', 2) == ('torchrun --standalone --nproc_per_node=2 train.py --init_from=resume '
                                               '--out_dir=out-x')


def test_a_stdout_that_cannot_encode_greek_letters_gets_escapes_not_a_traceback(toy_data, tmp_path):
    """PYTHONIOENCODING=ascii (a redirected stdout on Windows is cp1252, which has no λ or Δ):
    train.py's header and fold.py's Δ come out as \\u escapes (configurator.run_command) and both
    exit 0, where a UnicodeEncodeError ended train.py before its first step and fold.py after it
    had written its file (ValvePython/steamctl#67's case)."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONIOENCODING='ascii')
    out = tmp_path / 'run'
    r = subprocess.run([sys.executable, 'train.py', *toy_args(toy_data, out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and ' \\u03bb=0.1 ' in r.stdout, r.stderr
    r = subprocess.run([sys.executable, 'fold.py', f'--ckpt={out / "ckpt.pt"}', f'--out={tmp_path / "f.pt"}'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'max |\\u0394 logit| unfolded' in r.stdout, r.stderr


def test_a_dataset_prepared_again_mid_run_changes_nothing_the_run_reads(toy_data, tmp_path, monkeypatch):
    """prepare.py renames a new train.bin and val.bin over the old ones (nanoGPT#428: a memmap made
    by path per batch reads the new ones). Replaced so after iteration 3, with other tokens, both
    split files leave the run's later steps, evaluations and final losses those of an undisturbed
    run; a run started afterwards reads the new files."""
    straight, replaced = tmp_path / 'straight', tmp_path / 'replaced'
    train.main(toy_args(toy_data, straight, sampler='epoch', max_iters=12, lr_decay_iters=12))
    folder = toy_data / 'toy'
    real_step = train.train_step

    def train_step(*args):
        if args[6] == 4:  # it: the data prepared again, as data.common writes it
            for split in ('train', 'val'):
                path = folder / f'{split}.bin'
                new = (np.fromfile(path, dtype=np.uint16)[::-1] * 7 % 64).astype(np.uint16)
                new.tofile(folder / f'{split}.bin.tmp')
                os.replace(folder / f'{split}.bin.tmp', path)
        return real_step(*args)

    monkeypatch.setattr(train, 'train_step', train_step)
    train.main(toy_args(toy_data, replaced, sampler='epoch', max_iters=12, lr_decay_iters=12))
    assert without_timing(read_log(replaced)) == without_timing(read_log(straight))
    monkeypatch.setattr(train, 'train_step', real_step)
    after = tmp_path / 'after'
    train.main(toy_args(toy_data, after, sampler='epoch', max_iters=12, lr_decay_iters=12))
    assert read_log(after)[0]['loss'] != read_log(straight)[0]['loss']


@pytest.mark.parametrize('where', ['the final save', 'the final losses'])
def test_a_signal_after_the_loop_exits_143_with_its_line(toy_data, tmp_path, monkeypatch, capfd, where,
                                                         no_default_sigterm):
    """SIGTERM while the last checkpoint is written, or while the final losses run: exit 143 with
    one line; the checkpoint of the last iteration is whole, and its resume logs the final losses."""
    out = tmp_path / 'run'
    if where == 'the final save':
        signal_at(monkeypatch, runs, 'save_checkpoint', lambda obj, path: obj['iter_num'] == 16, signal.SIGTERM)
    else:
        signal_at(monkeypatch, runs, 'windows', lambda *a: True, signal.SIGTERM)  # mean_ce's batches only
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, out))
    assert e.value.code == 143
    del e  # its traceback holds the run's lock file open
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 16
    assert not list(out.glob('*.tmp'))
    assert not any('final_val_loss' in r for r in read_log(out))
    err = capfd.readouterr().err
    when = 'after the last iteration' if where == 'the final save' else 'during the final losses'
    assert f"stopped by SIGTERM {when}: saved in {out / 'ckpt.pt'}, which resumes at iteration 16" in err
    monkeypatch.undo()
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert 'final_val_loss' in read_log(out)[-1]
    # no step ran in the resume (it said "iterations 16–15" once, and "16–16" before that)
    assert 'done: resumed after its last iteration (15) for the final losses, ' in capfd.readouterr().out


def test_the_resume_line_of_a_torchrun_run_is_a_torchrun_command(toy_data, tmp_path, monkeypatch, capfd):
    """A run of 2 processes (rank 0's view; its all-reduces are not what this checks) stopped by a
    signal says how to resume it on 2 processes, as the resume check demands."""
    real_setup = train.setup
    monkeypatch.setattr(train, 'setup', lambda cfg: SimpleNamespace(**{**vars(real_setup(cfg)), 'world': 2}))
    signal_at(monkeypatch, train, 'train_batch', lambda f, c, e, it, micro: it == 2, signal.SIGINT)
    out = tmp_path / 'run'
    with pytest.raises(SystemExit):
        train.main(toy_args(toy_data, out))
    assert (f"continue with: torchrun --standalone --nproc_per_node=2 train.py --init_from=resume --out_dir={out}"
            in capfd.readouterr().err)


def test_a_run_removes_stale_temp_files_from_its_folder(toy_data, tmp_path):
    """A process killed between writing a temp file and renaming it leaves the temp file behind
    (PID-N.NAME.tmp; NAME.tmp before each writer had its own); the next run in that folder removes
    it, and leaves a live process's and a file of the user's."""
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                          text=True, check=True).stdout.strip()
    for name in ('log.jsonl.tmp', 'ckpt.pt.tmp', f'{dead}-0.ckpt.pt.tmp', f'{os.getppid()}-0.ckpt.pt.tmp', 'notes.tmp'):
        (out / name).write_text('left by a killed process')
    train.main(toy_args(toy_data, out, max_iters=12, overwrite=True))
    assert sorted(p.name for p in out.glob('*.tmp')) == sorted([f'{os.getppid()}-0.ckpt.pt.tmp', 'notes.tmp'])


def test_a_checkpoint_is_written_through_a_temp_file_of_its_own(tmp_path):
    """A file named like the old fixed temp name (PATH.tmp: the user's, or fold.py's own --ckpt)
    is neither truncated nor renamed over path."""
    path = tmp_path / 'x.pt'
    (tmp_path / 'x.pt.tmp').write_bytes(b'the trained checkpoint')
    runs.save_checkpoint({'model': {'w': torch.arange(3.)}, 'model_args': {}}, str(path))
    assert (tmp_path / 'x.pt.tmp').read_bytes() == b'the trained checkpoint'
    assert torch.equal(torch.load(path, weights_only=True)['model']['w'], torch.arange(3.))
    assert sorted(os.listdir(tmp_path)) == ['x.pt', 'x.pt.tmp']


def test_a_log_whose_last_line_was_cut_short_resumes_and_a_bad_line_before_it_is_refused(toy_data, tmp_path,
                                                                                           monkeypatch, capfd):
    """A full disk or a power loss mid-append leaves log.jsonl's last line cut short: resume drops
    it, saying so in one line, and the log reads as one uninterrupted run. A line that is not a
    record anywhere else is refused in one line naming the file and the line."""
    from test_train import interrupt_at
    straight = tmp_path / 'straight'
    train.main(toy_args(toy_data, straight))
    out = tmp_path / 'run'
    interrupt_at(10, toy_args(toy_data, out), monkeypatch)  # its checkpoint: iteration 8
    log = out / 'log.jsonl'
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(''.join(lines) + lines[-1][:30])  # the next record, cut mid-write
    capfd.readouterr()
    train.main([f'--out_dir={out}', '--init_from=resume'])
    err = capfd.readouterr().err
    assert f"{log}: its last line ({len(lines) + 1}) is cut short" in err and 'Traceback' not in err
    assert without_timing(read_log(out)) == without_timing(read_log(straight))

    lines = log.read_text().splitlines(keepends=True)
    log.write_text(''.join(lines[:3]) + lines[3][:30] + '\n' + ''.join(lines[3:]))  # a bad line 4 of many
    with pytest.raises(SystemExit) as e:
        train.main([f'--out_dir={out}', '--init_from=resume'])
    assert str(e.value).startswith(f"{log}, line 4: not a log record (") and '\n' not in str(e.value)
    assert 'repair or delete that line' in str(e.value)
    log.write_text(''.join(lines[:-1]) + '[1, 2]\n')  # the last line whole, but not a record: cut short too
    assert runs.read_log(out) == [json.loads(line) for line in lines[:-1]]

    # the final record cut short: the finished run's resume computes it again, and says so once
    log = straight / 'log.jsonl'
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(''.join(lines[:-1]) + lines[-1][:-9])
    capfd.readouterr()
    train.main([f'--out_dir={straight}', '--init_from=resume'])
    assert capfd.readouterr().err.count(f"{log}: its last line ({len(lines)}) is cut short") == 1
    assert without_timing(read_log(straight)) == without_timing([json.loads(line) for line in lines])


def read_lines(stream):
    """A queue filled with stream's lines by a thread: a test can wait for one without blocking."""
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def wait_for_line(lines, text, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            assert proc.poll() is None, proc.returncode
            continue
        if text in line:
            return line
    raise AssertionError(f'no line with {text!r}')


@pytest.fixture
def started():
    """run_train(args), each process it started killed when the test ends: a run that did not stop
    must not outlive its test."""
    procs = []
    yield lambda args: procs.append(run_train(args)) or procs[-1]
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_signal_cuts_work_short_even_inside_code_that_catches_exception(capfd):
    """The first signal abandons cut_short's work wherever it lands, also inside a library's
    `except Exception` (tqdm's monitor thread start caught it once, and the evaluation of a
    million batches went on)."""
    def work():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, before the sleep returns
            time.sleep(5)
        except Exception:
            pass
        return 'finished'
    with runs.StopSignal() as stop:
        t0 = time.perf_counter()
        assert stop.cut_short('the evaluation at iteration 0', work) == (None, True)
        assert time.perf_counter() - t0 < 4 and stop.received == signal.SIGINT
    assert 'SIGINT: cutting the evaluation at iteration 0 short' in capfd.readouterr().err


def test_ctrl_c_during_an_evaluation_is_answered_and_cuts_it_short(toy_data, tmp_path, started):
    """A real Ctrl-C in an evaluation of a million batches: one line at once, then the checkpoint
    of the step before it, one line, exit 130, no traceback."""
    out = tmp_path / 'run'
    proc = started(toy_args(toy_data, out, eval_iters=10 ** 6))
    wait_for_line(read_lines(proc.stdout), 'evaluating at iteration 0: val loss over 1000000 batches', proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.splitlines() == [
        'SIGINT: cutting the evaluation at iteration 0 short, then saving and stopping (Ctrl-C again stops at once, '
        'without saving)',
        f"stopped by SIGINT during the evaluation at iteration 0: saved in {out / 'ckpt.pt'}, which resumes at "
        f"iteration 0; continue with: python train.py --init_from=resume --out_dir={out}"]
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 0


@pytest.mark.parametrize('how, code', [('SIGINT', 130), ('SIGTERM', 143)])  # docs/runs.md; batch schedulers read it
def test_a_second_signal_stops_at_once_without_saving_in_one_line(toy_data, tmp_path, started, how, code):
    """Ctrl-C (or SIGTERM) in a long training step: the step would finish and be saved; a second one
    ends the process at once, exit 130 (143 for SIGTERM), with one more line and no traceback, and the
    folder keeps the checkpoint written before that step."""
    out = tmp_path / 'run'
    proc = started(toy_args(toy_data, out, eval_iters=1, gradient_accumulation_steps=5000))
    wait_for_line(read_lines(proc.stdout), 'estimate:', proc)  # printed in the first evaluation's only batch
    time.sleep(1)  # the evaluation is over: step 0, 5000 micro-batches, runs
    errors = read_lines(proc.stderr)
    proc.send_signal(getattr(signal, how))
    wait_for_line(errors, f'{how}: finishing iteration 0, then saving and stopping', proc)
    time.sleep(runs.StopSignal.REPEAT_S)  # sooner, the same signal is the first one delivered twice
    proc.send_signal(getattr(signal, how))
    assert proc.wait(timeout=60) == code
    rest = []
    while True:
        try:
            rest.append(errors.get(timeout=2))
        except queue.Empty:
            break
    assert rest == [f'second {how}: stopped at once, without saving; the run folder keeps its last checkpoint\n']
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 0
    assert not (out / 'log.jsonl').exists() or not read_log(out)


# ---- progress: the estimate and the CPU warning --------------------------------------------------

def test_the_estimate_counts_the_steps_and_forward_batches_left(tmp_path, capsys, monkeypatch):
    """toy_args' schedule: 16 steps, 2 micro-batches each, evaluations of 2 batches at 0, 4, 8, 12,
    calibrate ('end': 8 + 8 batches) after step 3, final losses over a val split of 2,800 tokens:
    174 windows of 16, 44 batches of 4, twice. Worked by hand below."""
    (tmp_path / 'val.bin').write_bytes(b'\0\0' * 2800)
    cfg = train.load_config(toy_args(tmp_path, tmp_path / 'run'))
    monkeypatch.setattr(runs, 'CPU_LONG_S', 400)
    p = runs.Progress(cfg, SimpleNamespace(world=1, master=True, device_type='cpu'), str(tmp_path),
                      hint='; HINT')
    p.evaluation_batch(0, 2.0)  # a step taken as 3 × 2 batches: 12 s; batches left 4 × 2 − 1 + 16 + 88 = 111
    assert capsys.readouterr().out.splitlines() == [  # 16 × 12 + 111 × 2 = 414 s
        'estimate: 7 min left: 16 steps at 12 s and 111 forward batches (evaluations, calibration, final losses) '
        'at 2 s, from the first evaluation batch alone (a first-batch figure, often high; a second estimate follows '
        'after 3 steps)',
        'this run takes about 7 min on this CPU; HINT']
    p.evaluation_batch(4, 9.0)  # only the first batch timed counts
    for it, seconds in enumerate((100.0, 4.0, 6.0)):  # the first step is left out: (4 + 6) / 2 = 5 s
        p.step(it, seconds)
    assert capsys.readouterr().out.splitlines() == [  # 13 × 5 + (3 × 2 + 16 + 88) × 2 = 285 s, below 400: no warning
        'estimate: 5 min left: 13 steps at 5 s and 110 forward batches (evaluations, calibration, final losses) '
        'at 2 s, from iterations 1–2']
    resumed = runs.Progress(cfg, SimpleNamespace(world=1, master=True, device_type='cpu'), str(tmp_path))
    resumed.evaluation_batch(8, 2.0)  # a resume at 8, past the calibrate event: 2 × 2 − 1 + 88 = 91 batches
    assert capsys.readouterr().out.splitlines() == [  # 8 × 12 + 91 × 2 = 278 s
        'estimate: 5 min left: 8 steps at 12 s and 91 forward batches (evaluations, final losses) at 2 s, from the '
        'first evaluation batch alone (a first-batch figure, often high; a second estimate follows after 3 steps)']


def test_each_logged_step_says_the_share_done_the_time_elapsed_and_the_time_left(tmp_path, capsys):
    """Progress.status on the schedule of the test above, the process 125 s into the run. Worked by
    hand: the time left counts the steps at the mean of those after the first (or, before there is
    one, as the first estimate does, 3 × 2 forward batches) and the forward batches ahead at 2 s."""
    (tmp_path / 'val.bin').write_bytes(b'\0\0' * 2800)
    cfg = train.load_config(toy_args(tmp_path, tmp_path / 'run'))
    p = runs.Progress(cfg, SimpleNamespace(world=1, master=False, device_type='cpu'), str(tmp_path))
    p.start = time.perf_counter() - 125.2
    assert p.status(0) == '6% 2:05 elapsed'  # nothing timed yet: no time left
    p.evaluation_batch(0, 2.0)
    p.step(0, 100.0)  # left out: it builds the optimizer's state
    assert p.status(0) == '6% 2:05 elapsed, 6:40 left'  # 15 × 12 + (3 × 2 + 16 + 88) × 2 = 400 s
    p.step(1, 4.0)
    p.step(2, 6.0)
    assert p.status(2) == '18% 2:05 elapsed, 4:45 left'  # 3 of 16 done; 13 × 5 + 110 × 2 = 285 s
    for it in range(3, 16):
        p.step(it, 5.0)
    assert p.status(15) == '100% 2:05 elapsed, 2:56 left'  # the final losses: 88 × 2 s
    assert [runs.clock(s) for s in (7.4, 245, 3729)] == ['0:07', '4:05', '1:02:09']


@pytest.mark.parametrize('calibration', [None, 'end'])  # None: the default ('ema'), which toy_args overrides
def test_the_forward_batches_counted_ahead_are_those_the_run_makes(toy_data, tmp_path, monkeypatch, calibration):
    """Progress counts, before iteration 0, every forward pass of one batch the run will make without
    gradients (evaluations, the calibrate event, the final losses); counted here as the run makes them.
    Under the default calibration the calibrate event's branch-mismatch batches count too."""
    from model import GPT
    args = [a for a in toy_args(toy_data, tmp_path / 'run') if not a.startswith('--calibration=')]
    args += [f'--calibration={calibration}'] if calibration else []
    cfg = train.load_config(args)
    ahead = runs.Progress(cfg, SimpleNamespace(world=1, master=True, device_type='cpu'),
                          str(toy_data / 'toy')).forward_batches_left(0)
    made, forward = [], GPT.forward

    def counted(self, *a, **kw):
        if not torch.is_grad_enabled():  # a training forward needs gradients; these do not
            made.append(1)
        return forward(self, *a, **kw)

    monkeypatch.setattr(GPT, 'forward', counted)
    train.main(args)
    assert len(made) == ahead and cfg.calibration == (calibration or 'ema')


def test_a_long_run_on_a_cpu_says_so_in_its_first_evaluation_with_the_cpu_sized_command(toy_data, tmp_path, capsys,
                                                                                        monkeypatch):
    monkeypatch.setattr(runs, 'CPU_LONG_S', 0)  # every run is long: the toy run shows where the lines come
    train.main(toy_args(toy_data, tmp_path / 'run'))
    out = capsys.readouterr().out.splitlines()
    first = [next(i for i, line in enumerate(out) if line.startswith(text))
             for text in ('evaluating at iteration 0: val loss over 2 batches of 4 × 16 tokens', 'estimate: ',
                          'this run takes about ', 'iter      0 ')]
    assert first == sorted(first)  # all before the first step's record: during the first evaluation
    assert sum(line.startswith('this run takes about') for line in out) == 1
    hint = train.cpu_hint(['config/tinystories_all_taper.py', '--seed=2', '--max_iters=900', '--out_dir=mine'])
    # the overrides kept, but for the run's own folder and the keys an added overlay sets (max_iters)
    assert ': python train.py config/tinystories_all_taper.py config/cpu.py --seed=2;' in hint
    assert hint.endswith(': python train.py config/tinystories_all_taper.py config/cpu.py config/smoke.py --seed=2')
    assert train.cpu_hint(['config/tinystories_all_taper.py', 'config/cpu.py', '--dataset=kjv']).endswith(
        'config/cpu.py config/smoke.py --dataset=kjv')  # a key no added overlay sets
    # with config/smoke.py added, typed step counts go too: smoke scales them (--max_iters=20000: 2000
    # steps, the learning rate decayed after 150)
    hint = train.cpu_hint(['config/tinystories_all_taper.py', 'config/cpu.py', '--max_iters=20000', '--seed=2'])
    assert hint == '; every phase in 150 steps: python train.py config/tinystories_all_taper.py config/cpu.py ' \
                   'config/smoke.py --seed=2'
    assert train.load_config(hint.split(': python train.py ')[1].split()).max_iters == 150
    assert train.cpu_hint(['config/tinystories_all_taper.py', 'config/cpu.py']) == \
        '; every phase in 150 steps: python train.py config/tinystories_all_taper.py config/cpu.py config/smoke.py'
    assert train.cpu_hint(['config/tinystories_all_taper.py', 'config/cpu.py', 'config/smoke.py']) == ''
    monkeypatch.setattr(runs, 'CPU_LONG_S', 3600)
    train.main(toy_args(toy_data, tmp_path / 'short'))
    assert 'this run takes about' not in capsys.readouterr().out


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
    elif how == 'tokens':  # hand-made: a list, where data/common.py writes {split: count}
        meta = json.loads((folder / 'meta.json').read_text())
        (folder / 'meta.json').write_text(json.dumps({**meta, 'tokens': [10_000, 2_800]}))
    elif how == 'folder':
        (folder / 'train.bin').unlink()
        (folder / 'train.bin').mkdir()


def test_a_bin_file_that_cannot_be_read_is_one_line_naming_it(toy_data, monkeypatch):
    """As root, chmod 000 reads anyway: the refusal np.memmap meets (PermissionError) is simulated."""
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, 'Permission denied', str(path))

    monkeypatch.setattr(runs.np, 'memmap', refuse)
    with pytest.raises(SystemExit, match=r'train.bin cannot be read \(Permission denied\); fix its permissions'):
        runs.check_dataset(str(toy_data / 'toy'), 16, 'FIX')


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
    ('tokens', r'meta.json is not a readable dataset description \(JSON with an integer vocab_size, and integer '
               r'token counts if it has any\)'),  # an AttributeError traceback before
    ('folder', r'train.bin is not a file; prepare the dataset again'),  # np.memmap's IsADirectoryError before
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
    (random.Random(0).randbytes(4096), 'is not a readable checkpoint (truncated or corrupt)'),
    (None, 'is not a tapernorm checkpoint: it lacks model_args'),
    ({'h.1.w': [1.0, float('nan')], 'h.2.w': [float('-inf')], 'h.3.w': [1.0]},
     'its weights hold NaN or inf (h.1.w and 1 more), which no script can use'),
], ids=['empty', 'random bytes', 'no model_args', 'nan weights'])  # fixed ids: pytest-xdist's workers must collect the same tests
def test_one_checkpoint_loader_with_one_line_errors(tmp_path, content, message):
    path = tmp_path / 'ckpt.pt'
    if content is None:
        torch.save({'model': {}}, path)
    elif isinstance(content, dict):  # a state dict: name -> values
        torch.save({'model': {k: torch.tensor(v) for k, v in content.items()} | {'n': torch.tensor([7])},
                    'model_args': {}}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        load_checkpoint(str(path))
    assert message in str(e.value) and 'weights_only' not in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(SystemExit, match='is a run folder: pass its checkpoint'):
        load_checkpoint(str(tmp_path))
    with pytest.raises(SystemExit, match=message.replace('(', r'\(').replace(')', r'\)')):
        train.main([f'--out_dir={tmp_path}', '--init_from=resume'])


@pytest.mark.parametrize('error, message', [
    (PermissionError(errno.EACCES, 'Permission denied'), 'cannot read the checkpoint {}: Permission denied$'),
    (OSError(errno.EIO, 'Input/output error'), 'cannot read the checkpoint {}: Input/output error$'),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 100 bytes. Error code 12"),
     r'not enough memory to read the checkpoint {} \(0.0 GiB\): free memory, or load it on a machine with more$'),
    # a storage larger than the whole file can only be a damaged size field: corrupt, not short of memory
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes."),
     r'{} is not a readable checkpoint \(truncated or corrupt\)'),
], ids=['permissions', 'disk', 'memory', 'corrupt size'])
def test_a_whole_checkpoint_that_cannot_be_read_is_not_called_corrupt(tmp_path, monkeypatch, error, message):
    """A good file read by another user, from a failing disk or into too little memory was called
    "truncated or corrupt; use another copy or retrain": a user could delete a good run. An allocation
    larger than the whole file is still a corrupt one."""
    path = tmp_path / 'ckpt.pt'
    torch.save({'model': {}, 'model_args': {}}, path)

    def load(*args, **kwargs):
        raise error
    monkeypatch.setattr(torch, 'load', load)
    with pytest.raises(SystemExit, match='^' + message.format(re.escape(str(path)))):
        load_checkpoint(str(path))


def test_a_checkpoint_that_another_program_wrote_with_python_objects_names_them(tmp_path):
    """torch 2.6's weights_only default (nerfstudio#3702): a numpy scalar in a checkpoint's config is a
    global the safe loader refuses; the file is whole and was called corrupt."""
    path = tmp_path / 'ckpt.pt'
    torch.save({'model': {}, 'model_args': {}, 'config': {'learning_rate': np.float64(6e-4)}}, path)
    with pytest.raises(SystemExit) as e:
        load_checkpoint(str(path))
    assert re.fullmatch(rf"{re.escape(str(path))} holds a Python object of type numpy\.[\w.]*scalar, which "
                        r"torch\.load's safe mode \(weights_only=True\) does not load: train\.py and fold\.py save "
                        r"only tensors and plain Python values, so another program wrote it; save it with those alone",
                        str(e.value)), str(e.value)


def test_weights_saved_from_a_wrapped_model_load_and_weights_of_another_model_are_one_line(toy_data, tmp_path):
    """A state dict saved through torch.compile's or DDP's wrapper ('_orig_mod.', 'module.' before every
    name, either over the other) loads as the bare one; weights that do not fit model_args (another
    code's checkpoint) are one line naming the first two misfits and how many more, in every script."""
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    bare, _ = load_model(str(out / 'ckpt.pt'))
    idx = torch.tensor([[1, 2, 3, 4]])
    for prefix in ('_orig_mod.', 'module.', 'module._orig_mod.', '_orig_mod.module.'):
        torch.save({**ckpt, 'model': {prefix + k: v for k, v in ckpt['model'].items()}}, tmp_path / 'wrapped.pt')
        wrapped, _ = load_model(str(tmp_path / 'wrapped.pt'))
        assert torch.equal(wrapped(idx)[0], bare(idx)[0]), prefix
    fold.main([f'--ckpt={tmp_path / "wrapped.pt"}', f'--out={tmp_path / "folded.pt"}'])  # fold reads the names too
    assert torch.load(tmp_path / 'folded.pt', weights_only=True)['folded_norms']

    sd = dict(ckpt['model'])
    sd['transformer.h.0.ln_1.bias'] = torch.zeros(32)                          # unexpected
    del sd['transformer.h.1.mlp.c_fc.bias']                                    # missing
    sd['transformer.wpe.weight'] = torch.zeros(99, 32)                         # another shape
    torch.save({**ckpt, 'model': sd}, out / 'ckpt.pt')
    want = (f"{out / 'ckpt.pt'}: its weights do not fit the model its model_args describe (missing "
            "transformer.h.1.mlp.c_fc.bias; unexpected transformer.h.0.ln_1.bias, and 1 more): tapernorm loads the "
            "checkpoints its train.py and fold.py write (GPT-2's weights: train.py --init_from=gpt2)")
    log = out / 'log.jsonl'
    unfinished = ''.join(line for line in log.read_text().splitlines(True) if 'final_val_loss' not in line)
    resume = lambda: train.main([f'--out_dir={out}', '--init_from=resume'])

    def resume_unfinished():  # a run to continue, not a finished one to report
        log.write_text(unfinished)
        resume()
    for load in (lambda: load_model(str(out / 'ckpt.pt')), resume, resume_unfinished):
        with pytest.raises(SystemExit) as e:
            load()
        assert str(e.value) == want
    del sd['transformer.h.0.ln_1.bias'], sd['transformer.wpe.weight']
    sd['transformer.h.1.mlp.c_fc.bias'] = ckpt['model']['transformer.h.1.mlp.c_fc.bias']
    sd['transformer.wpe.weight'] = torch.zeros(99, 32)
    torch.save({**ckpt, 'model': sd}, out / 'ckpt.pt')
    with pytest.raises(SystemExit, match=r"\(transformer.wpe.weight is \(99, 32\), not \(16, 32\)\): "):
        load_model(str(out / 'ckpt.pt'))


def test_a_full_disk_during_a_checkpoint_says_so_in_one_line_and_keeps_the_old_one(tmp_path, monkeypatch):
    """A write that runs out of room (a stand-in raising ENOSPC mid-file; torch.save itself then
    reports 'unexpected pos') is one line saying the folder's filesystem is full and that an atomic
    save needs room for two checkpoints; the old checkpoint is whole and no temp file is left."""
    path = tmp_path / 'ckpt.pt'
    runs.save_checkpoint({'model': {'w': torch.arange(10.)}, 'model_args': {}}, str(path))
    real_open = open

    class Full(io.FileIO):  # the disk fills after 2,000 bytes
        error = errno.ENOSPC

        def write(self, b):
            if self.tell() + len(b) > 2000:
                raise OSError(self.error, os.strerror(self.error))
            return super().write(b)

    monkeypatch.setattr(runs, 'open', lambda f, mode='r', *a, **k: Full(f, mode) if str(f).endswith('.tmp')
                        else real_open(f, mode, *a, **k), raising=False)
    with pytest.raises(SystemExit) as e:
        runs.save_checkpoint({'model': {'w': torch.zeros(10_000)}, 'model_args': {}}, str(path))
    assert str(e.value) == (f"the filesystem of {tmp_path} is full (No space left on device) writing ckpt.pt: an "
                            "atomic save needs room for two checkpoints (the old file stays whole until the new one "
                            "is); free space there")
    assert torch.equal(torch.load(path, weights_only=True)['model']['w'], torch.arange(10.))
    assert os.listdir(tmp_path) == ['ckpt.pt']
    monkeypatch.setattr(Full, 'error', errno.EIO)
    with pytest.raises((RuntimeError, OSError)):  # any other failed write is not called a full disk
        runs.save_checkpoint({'model': {'w': torch.zeros(10_000)}, 'model_args': {}}, str(path))


@pytest.fixture
def read_only(monkeypatch):
    """read_only(folder): folder refuses every new file, as on a read-only filesystem; chmod where
    that binds, and where it does not (root) a stand-in for the two ways the code creates files."""
    made, real_open, real_temporary = [], builtins.open, tempfile.TemporaryFile

    def refused(path):
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(path) in map(str, made)

    def open_(file, mode='r', *args, **kw):
        if refused(os.path.dirname(os.path.abspath(file)) if isinstance(file, (str, os.PathLike)) else None) \
                and set(mode) & set('wax+'):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kw)

    def temporary(*args, dir=None, **kw):
        if refused(dir):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real_temporary(*args, dir=dir, **kw)

    monkeypatch.setattr(builtins, 'open', open_)
    monkeypatch.setattr(tempfile, 'TemporaryFile', temporary)
    yield lambda folder: (folder.chmod(0o555), made.append(folder))
    for folder in made:
        folder.chmod(0o755)


def test_a_read_only_out_dir_is_one_line_before_anything_runs(toy_data, tmp_path, read_only):
    out = tmp_path / 'run'
    out.mkdir()
    read_only(out)
    with pytest.raises(SystemExit) as e:
        train.main(toy_args(toy_data, out))
    assert str(e.value) in (f"cannot write in {out} ({os.strerror(n)}): choose another --out_dir"
                            for n in (errno.EROFS, errno.EACCES))  # the stand-in's, or chmod's
    assert os.listdir(out) == []


def test_a_checkpoint_from_a_newer_version_names_the_keys_this_code_does_not_know(toy_data, tmp_path):
    """A model_args key GPTConfig lacks (a newer version's or a fork's qk_norm), or a config key
    train.py lacks: one line from every script that loads it, naming the key, never a TypeError
    and never a guess at what it meant."""
    import bench
    import fold
    import sample
    out = tmp_path / 'run'
    train.main(toy_args(toy_data, out, max_iters=12))
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    newer = tmp_path / 'newer.pt'
    torch.save({**ckpt, 'model_args': {**ckpt['model_args'], 'qk_norm': True}}, newer)
    line = (r"has a key this code does not know \(qk_norm\): it was written by a newer or different version of "
            r"tapernorm; load it with that version$")
    for run in (lambda: load_model(str(newer)),
                lambda: sample.main([f'--ckpt={newer}', '--device=cpu']),
                lambda: fold.main([f'--ckpt={newer}', f'--out={tmp_path / "folded.pt"}', '--device=cpu']),
                lambda: bench.main([f'--ckpt={newer}', '--device=cpu', '--compile=eager'])):
        with pytest.raises(SystemExit, match=f'^{newer}: its model_args ' + line):
            run()
    with pytest.raises(SystemExit, match='^the checkpoint: its model_args ' + line):
        runs.model_from_state_dict(ckpt['model'], {**ckpt['model_args'], 'qk_norm': True})
    torch.save({**ckpt, 'model_args': {**ckpt['model_args'], 'qk_norm': True, 'rope': True}}, out / 'ckpt.pt')
    with pytest.raises(SystemExit, match=r"its model_args have keys this code does not know \(qk_norm, rope\)"):
        train.main([f'--out_dir={out}', '--init_from=resume'])
    torch.save({**ckpt, 'config': {**ckpt['config'], 'ema_decay': 0.99}}, out / 'ckpt.pt')  # a training key
    with pytest.raises(SystemExit, match=f"^{out / 'ckpt.pt'}: its config has a key this code does not know "
                                         r"\(ema_decay\): it was written by a newer"):
        train.main([f'--out_dir={out}', '--init_from=resume'])


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
    assert 'it needs a working C++ compiler' in proc.stderr and 'TORCHINDUCTOR_CACHE_DIR' not in proc.stderr


def test_compile_that_fails_at_its_cache_folder_names_the_folder_not_the_compiler(tmp_path):
    """pytorch#91005, #123054: a cache folder inductor cannot write (or a /tmp mounted noexec) was
    reported as a missing C++ compiler."""
    (tmp_path / 'a_file').write_text('')
    cache = tmp_path / 'a_file' / 'cache'  # a folder under a file: NotADirectoryError
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, '-c', 'import configurator; configurator.check_compiler("cpu")'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f'inductor writes its kernels to {cache} and loads them from there: set TORCHINDUCTOR_CACHE_DIR' \
        in proc.stderr and 'C++ compiler' not in proc.stderr


@pytest.mark.parametrize('script, args, off, builder', [
    ('train', ['--compile=True'], '--compile=False', 'train.build_model'),
    ('sample', ['--ckpt=nowhere.pt', '--compile=True', '--device=cpu'], '--compile=False', 'sample.load_model'),
    ('bench', ['--size=1M', '--device=cpu', '--compile=both'], '--compile=eager', 'bench.build_variants'),
    ('bench', ['--mode=train', '--size=1M', '--device=cpu', '--compile=compiled'], '--compile=eager',
     'bench_train.build_rows'),
])
def test_every_script_that_compiles_checks_the_compiler_before_its_first_model(toy_data, tmp_path, monkeypatch,
                                                                                script, args, off, builder):
    """A machine without a C++ compiler (a Mac without Xcode's tools) gets one line naming the setting that
    runs without compiling, from each script before it builds a model (`builder`): bench's eager rows
    included, which would otherwise run first and end in inductor's traceback."""
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx\n"
                           "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    monkeypatch.setattr(torch, 'compile', no_compiler)
    owner, name = builder.split('.')
    monkeypatch.setattr(__import__(owner), name, lambda *a, **k: pytest.fail(f'{builder} ran before the check'))
    if script == 'train':
        args = toy_args(toy_data, tmp_path / 'run') + args
    with pytest.raises(SystemExit) as e:
        __import__(script).main(args)
    assert str(e.value) == ("config error: torch.compile does not work on cpu here (InvalidCxxCompiler: No working "
                            "C++ compiler found in torch._inductor.config.cpp.cxx); inductor builds C++ on the CPU: it "
                            f"needs a working C++ compiler (g++, clang++ or $CXX); {off} runs without it")


@pytest.mark.parametrize('args, message', [
    (['config/cpu.py', 'config/tinystories_internal_taper.py'],
     'config/tinystories_internal_taper.py comes after the overlay config/cpu.py and would undo it'),
    (['-max_iters=60'], 'did you mean --max_iters=60?'),
    (['--dataset=austen', 'was'], "'was' is neither a config file nor --key=value; a value with spaces needs quotes"),
])
def test_misleading_inputs_get_the_message_the_user_needs(args, message):
    with pytest.raises(SystemExit, match=message.replace('?', r'\?').replace('.', r'\.')):
        train.load_config(args)


@pytest.mark.parametrize('given, key', [
    (['--max_iters=3000', '--calibration=end', 'config/tinystories_all_taper.py', 'config/cpu.py'], 'max_iters'),
    (['--init_from=resume', '--out_dir=mine', 'config/tinystories_internal_taper.py', 'config/cpu.py',
      'config/smoke.py'], 'out_dir'),  # the resume then looked for the smoke folder's checkpoint
])
def test_an_override_before_a_file_that_sets_its_key_again_is_refused_with_the_order_that_works(given, key):
    """An override before a config file was silently undone by it (the pattern of simc#182,
    mini-swe-agent#417): refused, with every argument in the order that keeps it."""
    with pytest.raises(SystemExit) as e:
        train.load_config(given)
    assert str(e.value).startswith(f"config error: --{key}=") and f"which sets {key} again and would undo it" in str(e.value)
    fixed = str(e.value).rsplit(': ', 1)[1].split()
    assert sorted(fixed) == sorted(given)
    cfg = train.load_config(fixed)  # the suggestion runs, and keeps what was typed
    assert all(str(getattr(cfg, a[2:].split('=')[0])) == a.split('=', 1)[1] for a in given if a.startswith('--'))
    # an override before a file that leaves its key alone, or sets the value it already has, keeps working
    assert train.load_config(['--calibration=end', 'config/tinystories_all_taper.py']).calibration == 'end'
    assert train.load_config(['config/tinystories_all_taper.py', '--dataset=austen', 'config/cpu.py']).dataset == 'austen'
    # nor one the user gives again after the file: the value typed last is the one that acts
    assert train.load_config(['--max_iters=100', 'config/tinystories_baseline.py', '--max_iters=200']).max_iters == 200


def test_a_config_file_named_without_its_folder_is_found_for_the_user(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        train.load_config(['smoke.py'])
    shipped = os.path.relpath(os.path.join(ROOT, 'config', 'smoke.py'))
    assert str(e.value) == (f"config error: config file 'smoke.py' not found (paths are relative to the current "
                            f"folder): did you mean {shipped}?")
    with pytest.raises(SystemExit) as e:
        train.load_config(['no_such_config.py'])
    assert 'did you mean' not in str(e.value)


def test_a_config_file_with_an_equals_sign_in_its_name_runs_and_takes_its_overlay_place(tmp_path, monkeypatch):
    """sweep/width=32.py (nanoGPT#362): it exists, so it is a config file, not a mistyped --width=32.py;
    and as a base config it may not come after config/cpu.py, as any other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'width=32.py').write_text('n_embd = 32\n')
    assert train.load_config(['width=32.py']).n_embd == 32
    cpu = os.path.join(ROOT, 'config', 'cpu.py')
    with pytest.raises(SystemExit, match='width=32.py comes after the overlay .*cpu.py and would undo it'):
        train.load_config([cpu, 'width=32.py'])
    with pytest.raises(SystemExit, match=r'did you mean --n_embd=32\?'):
        train.load_config(['n_embd=32'])  # no such file: the missing dashes


def test_every_shipped_config_reads_where_the_locale_is_not_utf8():
    """nanoGPT#429: a config that includes another with open() read it in the locale's encoding (GBK,
    cp932 on Windows; ASCII here), and the included files hold λ, ×, ²: README's first command failed."""
    configs = sorted(p for p in glob.glob(os.path.join(ROOT, 'config', '*.py'))
                     if not p.endswith('gpt2_proxy.py'))  # an overlay that names a folder study.py makes
    code = ('import locale, sys, train\nassert locale.getpreferredencoding(False) == "ANSI_X3.4-1968"\n'
            'for path in sys.argv[1:]:\n    train.load_config([path])\n')
    env = {**os.environ, 'LC_ALL': 'C', 'PYTHONUTF8': '0', 'PYTHONCOERCECLOCALE': '0'}  # plain ASCII
    run = subprocess.run([sys.executable, '-c', code, *configs], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for included in ('tinystories_baseline.py', 'finetune_gpt2_vanilla.py'):  # what the test is about
        assert not open(os.path.join(ROOT, 'config', included), encoding='utf-8').read().isascii()


def test_a_config_file_saved_with_a_byte_order_mark_runs_as_python_runs_it(tmp_path):
    path = tmp_path / 'notepad.py'
    path.write_bytes(b'\xef\xbb\xbfmax_iters = 17\n')  # UTF-8 with BOM: Windows Notepad's "UTF-8 with BOM"
    assert subprocess.run([sys.executable, str(path)]).returncode == 0  # Python itself runs it
    assert train.load_config([str(path)]).max_iters == 17


@pytest.mark.parametrize('source, line, error', [
    ('max_iters = 10\nn_layer = (4\n', 2, "SyntaxError: '(' was never closed"),
    ('max_iters = 10\n\nn_layer = four\n', 3, "NameError: name 'four' is not defined"),
    ('max_iters = 10\nn_layer = 4 // 0\n', 2, 'ZeroDivisionError: integer division or modulo by zero'),
])
def test_a_config_file_that_does_not_run_is_one_line_with_its_file_and_line(tmp_path, source, line, error):
    path = tmp_path / 'my_config.py'
    path.write_text(source)
    with pytest.raises(SystemExit) as e:
        train.load_config([str(path), '--seed=3'])
    assert str(e.value) == (f"config error: config file {path}, line {line}: {error} (config files run as Python: "
                            "correct the file)")


@pytest.mark.parametrize('given', [
    ['config/tinystories_all_taper.py', 'config/smoke.py', 'config/cpu.py'],
    ['config/smoke.py', 'config/tinystories_all_taper.py', 'config/cpu.py'],
    ['config/cpu.py', 'config/smoke.py', '--seed=3', 'config/tinystories_all_taper.py'],
])
def test_overlays_out_of_order_are_refused_with_every_argument_in_the_order_that_works(given):
    with pytest.raises(SystemExit, match=r'^config error: .*comes after (the overlay )?config/(cpu|smoke)\.py.*: '
                                         'give base configs first') as e:
        train.load_config(given)
    fixed = str(e.value).rsplit(': ', 1)[1].split()
    assert sorted(fixed) == sorted(given)  # every argument given, none dropped
    assert fixed[:3] == ['config/tinystories_all_taper.py', 'config/cpu.py', 'config/smoke.py']
    cfg = train.load_config(fixed)  # the suggestion runs: every phase in 150 steps, in the smoke folder
    assert (cfg.max_iters, cfg.gate_warmup_iters, cfg.taper_iters, cfg.out_dir) == \
        (150, 15, 75, 'out-smoke-austen-all-aux0.1')


def test_the_smoke_overlay_crosses_every_phase_and_no_example_keeps_a_longer_schedule():
    for base in ('baseline', 'internal_taper', 'all_taper', 'all_taper_noaux'):
        for overlays in (['cpu'], ['smoke'], ['cpu', 'smoke']):
            cfg = train.load_config([f'config/tinystories_{base}.py'] + [f'config/{o}.py' for o in overlays])
            assert cfg.lr_decay_iters == cfg.max_iters
            if overlays[-1] == 'smoke':
                assert cfg.max_iters == 150 and cfg.schedule_scale == 1.0  # resolved: the real step counts
            if cfg.taper != 'none':
                assert cfg.gate_warmup_iters + cfg.taper_iters < cfg.max_iters  # a linear phase too


def test_a_refused_schedule_says_which_argument_set_each_value_it_quotes_and_what_was_scaled():
    """config/cpu.py sets W = 150 and T = 750; after --max_iters=300, config/smoke.py's schedule_scale is
    150 / 300 = 0.5, so W = 75, T = 375, 450 steps in a run of 150: values nobody typed, so the line says
    where each came from and what schedule_scale made of it."""
    def refused(args):
        with pytest.raises(SystemExit) as e:
            train.load_config(args)
        assert '\n' not in str(e.value)
        return str(e.value)

    msg = refused(['config/tinystories_all_taper.py', 'config/cpu.py', '--max_iters=300', 'config/smoke.py'])
    assert msg.startswith('config error: gate_warmup_iters + taper_iters = 450 exceeds max_iters=150 '
                          '(schedule_scale=0.5 scaled gate_warmup_iters 150 → 75, taper_iters 750 → 375, '
                          'max_iters 300 → 150): ')
    assert msg.endswith('; set by config/cpu.py (gate_warmup_iters, taper_iters), --max_iters=300 (max_iters), '
                        'config/smoke.py (schedule_scale)')
    # a zero warmup or taper is refused scaled as unscaled: scaling made it 1 (a calibration at iteration 0)
    for key in ('gate_warmup_iters', 'taper_iters'):
        assert refused(['config/tinystories_all_taper.py', 'config/cpu.py', 'config/smoke.py', f'--{key}=0']).startswith(
            f'config error: {key}=0 must be >= 1')
    msg = refused(['config/tinystories_all_taper.py', 'config/cpu.py', '--max_iters=800'])  # 150 + 750 > 800, unscaled
    assert 'schedule_scale' not in msg and msg.endswith(
        '; set by config/cpu.py (gate_warmup_iters, taper_iters), --max_iters=800 (max_iters)')


def test_schedule_scale_scales_every_step_count_once_and_a_resume_keeps_them(toy_data, tmp_path):
    # config/cpu.py: 1500 steps, LR warmup 150, W 150, T 750, evaluations every 250; worked by hand at 0.1
    cfg = train.load_config(['config/tinystories_internal_taper.py', 'config/cpu.py', '--schedule_scale=0.1'])
    assert (cfg.max_iters, cfg.lr_decay_iters, cfg.warmup_iters, cfg.gate_warmup_iters, cfg.taper_iters,
            cfg.eval_interval, cfg.schedule_scale) == (150, 150, 15, 15, 75, 25, 1.0)
    import study  # the study's view of a cell is the resolved one too
    assert study.cell_config(['config/cpu.py', '--schedule_scale=2'])['max_iters'] == 3000
    with pytest.raises(SystemExit, match=r'schedule_scale=0.0 must be a finite number > 0'):
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
    # the free keys it leaves out stay as stored, as without the scale (not train.py's defaults),
    # and a step count left out is the default scaled once: 500 · 0.5
    short = [a for a in toy_args(toy_data, out, schedule_scale=0.5)
             if not a.startswith(('--device', '--log_interval', '--eval_interval'))]
    resumed = train.run_config(short + ['--init_from=resume'])[0]
    assert (resumed.device, resumed.log_interval, resumed.max_iters) == ('cpu', stored['log_interval'], 8)
    assert train.eval_interval == 500 and resumed.eval_interval == 250
    assert train.log_interval != stored['log_interval'] and train.device != 'cpu'  # else this proves nothing
    with pytest.raises(SystemExit, match=r' max_iters=4 \(stored: 8\).* would change the run') as e:
        train.main(toy_args(toy_data, out, schedule_scale=0.25) + ['--init_from=resume'])
    assert f'continue it as it was ({runs.resume_command(str(out), 1)})' in str(e.value)  # the one command, quoted


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


def test_a_bin_file_that_disagrees_with_meta_jsons_token_count_is_refused_naming_both(toy_data, tmp_path):
    """train.bin rewritten as uint32 holds the same ids, read as uint16 each followed by a 0: accepted
    before (every id below vocab_size, an even size), the run trained on ids interleaved with 0."""
    folder = toy_data / 'toy'
    meta = {**json.loads((folder / 'meta.json').read_text()), 'tokens': {'train': 10_000, 'val': 2_800}}  # conftest's
    (folder / 'meta.json').write_text(json.dumps(meta))
    assert runs.check_dataset(str(folder), 16, 'FIX') == meta  # counts that agree pass
    np.fromfile(folder / 'train.bin', dtype=np.uint16).astype(np.uint32).tofile(folder / 'train.bin')
    message = r"train.bin holds 20,000 uint16 tokens, but meta.json says 10,000 .*; prepare the dataset again: FIX$"
    with pytest.raises(SystemExit, match=message):
        runs.check_dataset(str(folder), 16, 'FIX')
    with pytest.raises(SystemExit, match=message.replace('FIX$', '')):
        train.main(toy_args(toy_data, tmp_path / 'run'))
    assert not (tmp_path / 'run').exists()


def test_a_resume_on_other_data_is_refused_naming_what_differs_and_the_folder_the_run_trained_on(toy_data, tmp_path,
                                                                                              monkeypatch):
    """Another corpus prepared at the same vocab_size gives the run's compact ids other GPT-2 tokens:
    the resume went on and replaced the checkpoint's meta. Refused before anything is written, unless
    meta.json less its sources is the checkpoint's: the same data prepared from another path resumes."""
    import re
    import shutil
    from test_train import interrupt_at
    folder, ids = toy_data / 'toy', list(range(1000, 1063))  # compact id -> GPT-2 id, <unk> (63) left out
    meta = dict(vocab_size=64, tokenizer='gpt2', gpt2_ids=ids, unk_id=63, eot_id=0,
                tokens={'train': 10_000, 'val': 2_800}, sources=['a.txt'])
    (folder / 'meta.json').write_text(json.dumps(meta))
    out = tmp_path / 'run'
    interrupt_at(6, toy_args(toy_data, out), monkeypatch)  # its checkpoint: iteration 4
    ckpt, log = (out / 'ckpt.pt').read_bytes(), (out / 'log.jsonl').read_text()

    def prepared(data_dir, **changes):
        shutil.copytree(folder, data_dir / 'toy')
        (data_dir / 'toy' / 'meta.json').write_text(json.dumps({**meta, **changes}))
        return [f'--out_dir={out}', '--init_from=resume', f'--data_dir={data_dir}']

    other = prepared(tmp_path / 'other', gpt2_ids=ids[:2] + [i + 5000 for i in ids[2:]])
    with pytest.raises(SystemExit, match=re.escape(
            f"--init_from=resume: {tmp_path / 'other' / 'toy'} is not the dataset the run trained on ({folder}): "
            "its meta.json differs in gpt2_ids (61 of 63 differ); resume on the run's data (--data_dir)")):
        train.main(other)
    other = prepared(tmp_path / 'other2', eot_id=5, unk_rate={'train': 0.01})
    with pytest.raises(SystemExit, match=re.escape("differs in eot_id (5 here, 0 in the run's); unk_rate "
                                                   "({'train': 0.01} here, absent in the run's); resume")):
        train.main(other)
    (folder / 'meta.json').write_text(json.dumps({**meta, 'skipped_empty_docs': 3}))
    with pytest.raises(SystemExit, match=re.escape(f"{folder} was prepared again since the run trained on it: its "
                                                   "meta.json differs in skipped_empty_docs (3 here, absent")):
        train.main([f'--out_dir={out}', '--init_from=resume'])
    assert (out / 'ckpt.pt').read_bytes() == ckpt and (out / 'log.jsonl').read_text() == log
    train.main(prepared(tmp_path / 'moved', sources=['elsewhere/a.txt']))  # the same text from another path
    assert read_log(out)[-1]['final_val_loss'] > 0


def test_a_resume_on_other_files_under_a_hand_made_meta_json_is_refused_by_their_token_counts(toy_data, tmp_path,
                                                                                            monkeypatch):
    """A meta.json written by hand (conftest's: vocab_size and tokenizer, no token counts) is the same
    for any files of that vocabulary, so a resume onto other .bin files under a copy of it went on
    unnoticed. The checkpoint keeps the counts measured from the files; a checkpoint that predates
    them resumes on its own data as before."""
    import shutil
    from test_train import interrupt_at
    folder, out = toy_data / 'toy', tmp_path / 'run'
    interrupt_at(6, toy_args(toy_data, out), monkeypatch)  # its checkpoint: iteration 4
    ckpt, log = (out / 'ckpt.pt').read_bytes(), (out / 'log.jsonl').read_text()
    other = tmp_path / 'other' / 'toy'
    shutil.copytree(folder, other)
    np.tile(np.fromfile(folder / 'train.bin', dtype=np.uint16)[::-1], 2).tofile(other / 'train.bin')  # other text
    with pytest.raises(SystemExit, match=re.escape(
            f"--init_from=resume: {other} is not the dataset the run trained on ({folder}): its meta.json differs "
            "in tokens ({'train': 20000, 'val': 2800} here, {'train': 10000, 'val': 2800} in the run's)")):
        train.main([f'--out_dir={out}', '--init_from=resume', f'--data_dir={tmp_path / "other"}'])
    assert (out / 'ckpt.pt').read_bytes() == ckpt and (out / 'log.jsonl').read_text() == log
    old = torch.load(out / 'ckpt.pt', weights_only=False)
    assert old['meta'] == {'vocab_size': 64, 'tokenizer': 'toy', 'tokens': {'train': 10_000, 'val': 2_800}}
    del old['meta']['tokens']  # as written before the counts were kept
    torch.save(old, out / 'ckpt.pt')
    train.main([f'--out_dir={out}', '--init_from=resume'])
    assert read_log(out)[-1]['final_val_loss'] > 0


@pytest.mark.parametrize('world, backend', [(1, 'gloo'), (2, 'gloo'), (2, 'nccl')])
def test_the_final_losses_read_the_device_once_and_sum_every_rank_in_float64_on_the_host(toy_data, monkeypatch,
                                                                                      world, backend):
    """runs.mean_ce keeps each batch's CE on the device, reads them back in one .cpu() and sums in float64
    on the host (MPS has none); under DDP (rank 0 of 2 here) it all-reduces [sum of CE over tokens, tokens],
    gloo on the host, NCCL a copy on the device (here the CPU stands in for it) that it reads back: the mean
    over both ranks' windows is the single process's."""
    from contextlib import nullcontext
    import torch.nn.functional as F
    from model import GPT, GPTConfig
    from test_train import HostReads
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=16))
    data = np.fromfile(toy_data / 'toy' / 'val.bin', dtype=np.uint16)
    starts = [16 * i for i in range(10)]  # batches of 4: 4, 4, 2 windows in one process; 4, 1 on rank 0 of 2

    def ce_sum(starts):  # float64 sum of the CE of every target token, from the logits
        x = torch.from_numpy(np.stack([data[s:s + 16] for s in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[s + 1:s + 17] for s in starts]).astype(np.int64))
        with torch.no_grad():
            logits = model(x, y)[0]
        return F.cross_entropy(logits.double().reshape(-1, 64), y.reshape(-1), reduction='sum').item()

    reduced, rank_1 = [], torch.tensor([ce_sum(starts[1::2]), 5 * 16], dtype=torch.float64)  # its 5 windows

    def all_reduce(tensor):  # rank 1's share of the sums, added as gloo would
        reduced.append((tensor.dtype, tensor.device.type))
        tensor += rank_1

    monkeypatch.setattr(torch.distributed, 'all_reduce', all_reduce)
    monkeypatch.setattr(torch.distributed, 'get_backend', lambda: backend)
    env = SimpleNamespace(rank=0, world=world, ddp=world > 1, dev='cpu', master=True, autocast=nullcontext())
    with HostReads() as reads:
        got = runs.mean_ce(model, data, starts, 4, 16, env)
    assert got == pytest.approx(ce_sum(starts) / (10 * 16), rel=1e-6)
    # one read of the batches, not one per batch (on a GPU each waits for the device); DDP: the reduced copy's
    assert reads.calls == ['cpu', 'item'] if world == 1 else ['cpu', 'cpu', 'item']
    assert reduced == ([(torch.float64, 'cpu')] if world > 1 else [])
