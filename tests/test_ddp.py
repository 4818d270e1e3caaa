"""DDP through torchrun: 2 CPU processes with gloo, warmup → calibrate → taper → linear."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from test_runs import read_lines, wait_for_line
from test_train import flat, read_log, toy_args

ROOT = Path(__file__).resolve().parents[1]


def localhost_works():
    """torchrun's rendezvous needs a TCP socket on localhost; sandboxes without networking lack it."""
    try:
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            s.listen(1)
            with socket.create_connection(s.getsockname(), timeout=2):
                return True
    except OSError:
        return False


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost: no loopback networking')
def test_two_process_gloo_run_agrees_on_c(toy_data, tmp_path):
    out = tmp_path / 'ddp'
    worker = os.path.join(os.path.dirname(__file__), 'ddp_worker.py')
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    args = toy_args(toy_data, out, backend='gloo', max_iters=12, gate_warmup_iters=3, taper_iters=5)
    cmd = [*torchrun, worker, *args]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f'torchrun did not finish in {e.timeout} s: {(e.stderr or b"")[-2000:]!r}')
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '`broadcast_buffers` is deprecated' not in proc.stderr  # kept False on purpose, its warning silenced
    ranks = [json.loads((out / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert ranks[0]['phase'] == ranks[1]['phase'] == 'linear'
    assert ranks[0]['c'] == ranks[1]['c'] and ranks[0]['s_tgt'] == ranks[1]['s_tgt']
    # c is the closed form over BOTH ranks' calibration tokens (docs/method.md §3), not rank 0's
    for name, c in ranks[0]['c'].items():
        (n0, d0, _, g), (n1, d1, _, _) = ranks[0]['stats'][name], ranks[1]['stats'][name]
        g2 = np.square(g)
        both = (g2 @ (np.add(n0, n1))) / (g2 @ np.add(d0, d1))
        alone = (g2 @ np.asarray(n0)) / (g2 @ np.asarray(d0))
        assert c == pytest.approx(both, rel=1e-5) and abs(alone / both - 1) > 1e-4, name
    assert ranks[0]['lm_head_sum'] == ranks[1]['lm_head_sum']  # the replicas stayed in sync
    log = read_log(out)
    assert {r['phase'] for r in log if 'loss' in r} == {'warmup', 'taper', 'linear'}
    calib = [r for r in log if r.get('event') == 'calibrate']
    assert len(calib) == 1 and calib[0]['c'] == ranks[0]['c']
    # 4 sequences × 16 tokens × 2 micro-steps × 2 ranks per step
    assert 'world=2' in proc.stdout and '256 tokens/iter' in proc.stdout
    # resumed after its end, the run says so once (rank 0) and every rank leaves cleanly
    train_py = os.path.join(os.path.dirname(os.path.dirname(worker)), 'train.py')
    again = subprocess.run([*torchrun, train_py, *args, '--init_from=resume'],
                           capture_output=True, text=True, timeout=180, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('is a finished run (12 of 12 steps') == 1, again.stdout
    # started again into its folder by mistake: every rank stops before the model is wrapped in DDP, rank 0
    # in one line; rank 1 went on alone into DDP's first collective and failed there in a traceback
    mistake = subprocess.run([*torchrun, train_py, *args], capture_output=True, text=True, timeout=180, env=env)
    report = re.search(r'^[EWI]\d{4} ', mistake.stderr, re.M)  # torchrun's own lines, after the ranks'
    ranks_said = mistake.stderr[:report.start() if report else None]
    assert ranks_said.splitlines() == [f'{out} already holds a run (ckpt.pt, log.jsonl): continue it with --init_from='
                                       'resume, choose another --out_dir, or replace it with --overwrite=True']
    assert mistake.returncode == 1 and 'SIGABRT' not in mistake.stderr  # no rank aborted at its exit


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost: no loopback networking')
# 0.41M parameters, 1.55 MiB of gradients: DDP's first bucket (1 MiB) and a second, so DDPOptimizer
# splits each of the 3 training versions in two pieces, each compiled through AOT autograd. (A model
# whose gradients fill one bucket, a graph per version, is the unsplit case of the same path: its own
# two torchruns took 29 s of CI for nothing this one does not check.)
@pytest.mark.parametrize('backend, n_embd, pieces', [('aot_eager', 128, [10, 8])])
def test_a_compiled_two_process_run_keeps_the_ranks_identical(toy_data, tmp_path, backend, n_embd, pieces):
    """DDP of the compiled model (runs.wrap_ddp): dynamo's DDPOptimizer runs inside DDP's forward; the
    replicas stay identical, each version of the forward compiles once on each rank, and the run
    computes what the uncompiled one does (the same log, the same final weights). 'aot_eager' takes
    the path inductor takes on a GPU (AOT autograd, functionalization) through DDP's graph split."""
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                os.path.join(os.path.dirname(__file__), 'ddp_worker.py')]
    env = dict(os.environ, OMP_NUM_THREADS='1', DDP_WORKER_BACKEND=backend)
    runs = {}
    for compiled in (True, False):
        out = tmp_path / ('compiled' if compiled else 'uncompiled')
        args = toy_args(toy_data, out, backend='gloo', max_iters=10, gate_warmup_iters=3, taper_iters=4,
                        eval_interval=5, compile=compiled, dropout=0.0, n_embd=n_embd)
        try:
            proc = subprocess.run([*torchrun, *args], capture_output=True, text=True, timeout=300, env=env)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f'torchrun (compile={compiled}) did not finish in {e.timeout} s: {(e.stdout or b"")[-1500:]!r} '
                        f'{(e.stderr or b"")[-3000:]!r}')
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[compiled] = [json.loads((out / f'rank{r}.json').read_text()) for r in (0, 1)], read_log(out)
    ranks, log = runs[True]
    assert ranks[0]['phase'] == 'linear' and ranks[0]['state'] == ranks[1]['state']
    # a version of the forward per phase in training (3) and in the calibrate event (2), each compiled
    # once; rank 0 also evaluates (warmup, taper): far below the recompile limit
    assert [r['versions'] for r in ranks] == [7, 5]
    assert [r['compiled_graphs'] for r in ranks] == pieces  # the backend's calls, one per piece
    (want_ranks, want_log) = runs[False]
    assert ranks[0]['state'] == pytest.approx(want_ranks[0]['state'], rel=1e-5, abs=1e-6)
    got, want = [flat(r) for r in log], [flat(r) for r in want_log]
    assert [r.keys() for r in got] == [r.keys() for r in want]
    for a, b in zip(got, want):
        assert a == {k: pytest.approx(v, rel=1e-5, abs=1e-7) if isinstance(v, float) else v for k, v in b.items()}


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost: no loopback networking')
@pytest.mark.parametrize('calibration', ['ema', 'end'])
def test_ctrl_c_during_rank_0s_evaluation_ends_every_rank_in_one_line(toy_data, tmp_path, calibration):
    """Ctrl-C under torchrun (its agent sends SIGINT to each rank) while rank 0 evaluates and
    rank 1 waits in the first step's all-reduce: rank 0 cuts the evaluation and still meets every
    collective of the iteration, the warmup's statistics ('ema', every warmup step) and the
    calibrate event (here right after iteration 0), so every rank ends with exit 130 and no
    traceback; rank 0 keeps the checkpoint written before iteration 0 and says so in one line.
    The ranks are started as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*)."""
    out = tmp_path / 'ddp'
    args = toy_args(toy_data, out, backend='gloo', taper='internal', calibration=calibration, gate_warmup_iters=1,
                    eval_iters=10 ** 6)
    port, procs = free_port(), []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS='1', RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2',
                   LOCAL_WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / 'train.py'), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        lines = read_lines(procs[0].stdout)
        wait_for_line(lines, 'evaluating at iteration 0', procs[0])
        time.sleep(1)  # inside the evaluation; rank 1 waits in the step's all-reduce
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        ends = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, ends):
        assert proc.returncode == 130 and 'Traceback' not in err, err
    assert ends[0][1].splitlines() == [
        'SIGINT: cutting the evaluation at iteration 0 short, then saving and stopping (Ctrl-C again stops at once, '
        'without saving)',
        f"stopped by SIGINT during the evaluation at iteration 0: saved in {out / 'ckpt.pt'}, which resumes at "
        f"iteration 0; continue with: torchrun --standalone --nproc_per_node=2 train.py --init_from=resume "
        f"--out_dir={out}"]
    assert ends[1][1] == ''  # rank 1 says nothing: rank 0 speaks for the run
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 0
    assert not (out / 'log.jsonl').exists() or read_log(out) == []  # nothing of iteration 0 is logged


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost: no loopback networking')
def test_a_config_error_after_the_process_group_exists_leaves_no_gloo_group_alive_at_exit(toy_data, tmp_path):
    """sampler='epoch' with more steps than one pass holds fails after setup() made the gloo group
    and before `with run`, which ends the group only for a run's own end. A rank that exits with
    the group alive aborts now and then (SIGABRT) as gloo's threads outlive the interpreter, so the
    group must be gone by then: a handler registered before train.py's runs last (atexit is last
    in, first out) and reports what it sees. One process with WORLD_SIZE=1, as torchrun starts it."""
    args = toy_args(toy_data, tmp_path / 'out', backend='gloo', sampler='epoch', max_iters=10 ** 6)
    probe = ("import atexit, runpy, sys, torch; "
             "atexit.register(lambda: print('group alive at exit:', torch.distributed.is_initialized())); "
             f"sys.argv = [{str(ROOT / 'train.py')!r}, *sys.argv[1:]]; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, OMP_NUM_THREADS='1', RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', LOCAL_WORLD_SIZE='1',
               MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, '-c', probe, *args], env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("sampler='epoch': max_iters=1000000 steps"), proc.stderr
    assert proc.stdout.splitlines()[-1] == 'group alive at exit: False'


def test_only_a_gloo_group_is_ended_at_exit(monkeypatch):
    """NCCL's teardown flushes with the other ranks, a hang when one has gone: runs.leave_gloo_group,
    which may run on a rank that is alone, leaves an NCCL group to PyTorch's own exit."""
    import runs
    ended = []
    monkeypatch.setattr(torch.distributed, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.distributed, 'destroy_process_group', lambda: ended.append(backend))
    for backend in ('gloo', 'nccl'):
        monkeypatch.setattr(torch.distributed, 'get_backend', lambda: backend)
        runs.leave_gloo_group()
    assert ended == ['gloo']
