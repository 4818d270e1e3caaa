"""DDP through torchrun: 2 CPU processes with gloo, warmup → calibrate → taper → linear."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from test_train import read_log, toy_args


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


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost: no loopback networking')
def test_a_compiled_two_process_run_keeps_the_ranks_identical(toy_data, tmp_path):
    """DDP of the compiled model (runs.wrap_ddp): dynamo's DDPOptimizer runs inside DDP's forward; the
    replicas stay identical and each version of the forward compiles once on each rank."""
    out = tmp_path / 'ddp'
    worker = os.path.join(os.path.dirname(__file__), 'ddp_worker.py')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', worker,
           *toy_args(toy_data, out, backend='gloo', max_iters=10, gate_warmup_iters=3, taper_iters=4,
                     eval_interval=5, compile=True, dropout=0.0)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert ranks[0]['phase'] == 'linear' and ranks[0]['state'] == ranks[1]['state']
    # a version of the forward per phase in training (3) and in the calibrate event (2), each compiled
    # once; rank 0 also evaluates (warmup, taper): far below the recompile limit
    assert [r['compiled_graphs'] for r in ranks] == [7, 5]
