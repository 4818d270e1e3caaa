"""runs.Run's contract, point by point, without train.py: a loop of stand-in steps drives a Run
as train.main does, a signal is sent at one point, and what the run saves, says and exits with is
checked against the contract in Run's docstring. DDP is rank 0's view (env.ddp, world 2): the
step's all-reduce is stood in for by the flag passed to end_iteration, and Run's own
collectives (the agreement after the last step, the processes' end) by recorders (collectives)."""

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 8


def make_run(tmp_path, ddp=False, iter_num=0):
    """A Run over 8 iterations, evaluations at 0 and 4, in tmp_path/run (val split: 2 windows),
    starting at iter_num."""
    for split in ('train', 'val'):  # a run holds both open (runs.read_dataset)
        (tmp_path / f'{split}.bin').write_bytes(b'\0\0' * 33)
    cfg = SimpleNamespace(out_dir=str(tmp_path / 'run'), init_from='scratch', overwrite=False, max_iters=ITERS,
                          eval_interval=4, eval_iters=2, batch_size=2, block_size=16, gradient_accumulation_steps=1,
                          taper='all', gate_warmup_iters=2, calib_batches=1, calibration='ema', norm_removal='none')
    env = SimpleNamespace(master=True, rank=0, world=2 if ddp else 1, ddp=ddp, device_type='cpu', dev='cpu',
                          dtype='float32', tf32=False)
    return runs.Run(cfg, env, str(tmp_path), iter_num, lambda: {'model': {}, 'marker': 'state'})


def test_a_run_that_fails_to_start_or_ends_holds_no_dataset_file(tmp_path, monkeypatch):
    """Run holds train.bin and val.bin open while it lasts (runs.read_dataset); after it, or when
    installing its signal handlers fails, nothing is left open for runs.tokens to map."""
    with make_run(tmp_path):
        assert set(runs._OPEN_SPLITS) == {str(tmp_path / 'train.bin'), str(tmp_path / 'val.bin')}
    assert runs._OPEN_SPLITS == {}

    def fails(self):
        raise ValueError('signal only works in main thread')
    monkeypatch.setattr(runs.StopSignal, '__enter__', fails)
    (tmp_path / 'again').mkdir()
    with pytest.raises(ValueError), make_run(tmp_path / 'again'):
        pass
    assert runs._OPEN_SPLITS == {}


@pytest.fixture(autouse=True)
def collectives(monkeypatch):
    """The collectives Run makes, recorded by name, with no process group. all_reduce adds
    `others` (what the other rank's flag would add), 0 unless a test sets it."""
    made = SimpleNamespace(calls=[], others=0.0)

    def all_reduce(tensor):
        made.calls.append('all_reduce')
        tensor += made.others

    def barrier(async_op=False, **kw):
        made.calls.append('barrier')
        made.work = SimpleNamespace(wait=lambda: made.calls.append('wait')) if async_op else None
        return made.work

    monkeypatch.setattr(torch.distributed, 'all_reduce', all_reduce)
    monkeypatch.setattr(torch.distributed, 'barrier', barrier)
    monkeypatch.setattr(torch.distributed, 'destroy_process_group', lambda: made.calls.append('destroy'))
    return made


def send(signum=signal.SIGTERM):
    os.kill(os.getpid(), signum)  # its handler runs before the next line


def loop(run, at=None, signum=signal.SIGTERM, ddp_flag=None, ran=None):
    """train.main's loop with stand-ins; `at` names where a signal is sent: 'evaluation',
    'step', 'after step' (after stop_asked), 'calibrate' (iteration 1's event), 'final losses'.
    ddp_flag(it): the flag the step's all-reduce would carry (DDP); default: this process's own.
    Returns (and appends to `ran`) what ran: ('eval', it), ('step', it), ('final', …)."""
    ran = [] if ran is None else ran

    def estimate(first_batch):
        ran.append(('eval', run.iter_num))
        if at == 'evaluation' and run.iter_num == 4:
            send(signum)
            ran.append(('eval went on', run.iter_num))
        first_batch(0.01)
        return 3.0

    def final_losses():
        ran.append(('final', run.iter_num))
        if at == 'final losses':
            send(signum)
            ran.append(('final went on', run.iter_num))
        return 2.0, 1.0

    with run:
        while run.iter_num < ITERS:
            it = run.iter_num
            record = run.evaluate(it, estimate)
            if at == 'step' and it == 5:
                send(signum)
            asked = run.stop_asked()
            ran.append(('step', it))
            if at == 'after step' and it == 5:
                send(signum)
            run.step_took(it, 0.0, synchronize=True)
            run.log({'iter': it, 'loss': 1.0, 'phase': 'x', 'gate': 1.0, 'ce': 1.0, 'aux': 0.0, 'hidden_rms': 1.0,
                     'logit_rms': 1.0, 'lr': 1e-3, 'step_ms': 1.0, 'tokens_per_s': 1.0, **record})
            if it == 1:
                with run.during(f'the calibrate event after iteration {it}'):
                    if at == 'calibrate':
                        send(signum)
                    ran.append(('calibrate', it))
            run.end_iteration(it, ddp_flag(it) if ddp_flag else asked)
        run.finish('linear', final_losses)
    return ran


def checkpoint(tmp_path):
    return torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)


def logged(tmp_path):
    path = tmp_path / 'run' / 'log.jsonl'
    return [line for line in path.read_text().splitlines()] if path.exists() else []


def stops(tmp_path, capfd, code, at, signum=signal.SIGTERM, ddp=False, ddp_flag=None, ran=None):
    """Run the loop to its stop: (stderr lines, the checkpoint's iter_num)."""
    run = make_run(tmp_path, ddp)
    with pytest.raises(SystemExit) as e:
        loop(run, at, signum, ddp_flag, ran)
    assert e.value.code == code
    return capfd.readouterr().err.splitlines(), checkpoint(tmp_path)['iter_num']


def test_an_undisturbed_run_saves_at_each_evaluation_and_at_the_end(tmp_path):
    run = make_run(tmp_path)
    ran = loop(run)
    assert ran == [('eval', 0), ('step', 0), ('step', 1), ('calibrate', 1), ('step', 2), ('step', 3), ('eval', 4),
                   ('step', 4), ('step', 5), ('step', 6), ('step', 7), ('final', 8)]
    ckpt = checkpoint(tmp_path)
    assert ckpt['iter_num'] == 8 and ckpt['marker'] == 'state' and ckpt['world'] == 1
    assert '"final_val_loss": 2.0' in logged(tmp_path)[-1]


def test_before_the_loop_the_first_evaluation_is_cut_at_once(tmp_path, capfd):
    run = make_run(tmp_path)
    with run:
        send(signal.SIGINT)
        with pytest.raises(SystemExit) as e:
            run.evaluate(0, lambda first_batch: pytest.fail('the evaluation ran'))
    assert e.value.code == 130 and checkpoint(tmp_path)['iter_num'] == 0
    assert 'stopped by SIGINT during the evaluation at iteration 0' in capfd.readouterr().err


def test_during_an_evaluation_one_process_cuts_it_and_stops_before_its_step(tmp_path, capfd):
    ran = []
    err, saved = stops(tmp_path, capfd, 130, 'evaluation', signal.SIGINT, ran=ran)
    assert ran[-1] == ('eval', 4) and saved == 4  # cut at once; its step did not run
    assert err[0] == ('SIGINT: cutting the evaluation at iteration 4 short, then saving and stopping (Ctrl-C again '
                      'stops at once, without saving)')
    assert err[1].startswith(f"stopped by SIGINT during the evaluation at iteration 4: saved in "
                             f"{tmp_path / 'run' / 'ckpt.pt'}, which resumes at iteration 4; continue with: "
                             f"python train.py --init_from=resume")
    assert len(err) == 2 and all('"iter": 4' not in line for line in logged(tmp_path))


def test_during_an_evaluation_under_ddp_rank_0_meets_the_iteration_then_stops_keeping_its_checkpoint(tmp_path,
                                                                                                      capfd):
    ran = []
    err, saved = stops(tmp_path, capfd, 130, 'evaluation', signal.SIGINT, ddp=True, ddp_flag=lambda it: it >= 4,
                       ran=ran)
    assert ran[-2:] == [('eval', 4), ('step', 4)]  # cut at once, then its step (the other ranks' all-reduce)
    assert saved == 4  # the step of iteration 4 ran (its all-reduce), its save did not
    assert err[1].startswith('stopped by SIGINT during the evaluation at iteration 4: saved in ')
    assert 'continue with: torchrun --standalone --nproc_per_node=2 train.py --init_from=resume' in err[1]
    assert all('"iter": 4' not in line for line in logged(tmp_path))  # nothing of iteration 4 is logged


def test_during_a_step_the_iteration_finishes_and_is_saved(tmp_path, capfd):
    err, saved = stops(tmp_path, capfd, 143, 'step')
    assert saved == 6
    assert err[0].startswith('SIGTERM: finishing iteration 5, then saving and stopping')
    assert err[1].startswith('stopped by SIGTERM after iteration 5: ') and 'resumes at iteration 6' in err[1]
    assert '"iter": 5' in logged(tmp_path)[-1]


def test_after_the_steps_all_reduce_under_ddp_the_next_step_is_the_last(tmp_path, capfd):
    """A signal after the step read the flag: the first line names the next iteration, and the
    run stops when the next all-reduce carries it."""
    err, saved = stops(tmp_path, capfd, 143, 'after step', ddp=True, ddp_flag=lambda it: it >= 6)
    assert err[0].startswith('SIGTERM: finishing iteration 6, then saving')
    assert saved == 7 and err[1].startswith('stopped by SIGTERM after iteration 6: ')


def test_one_process_stops_after_a_signal_that_lands_after_its_step(tmp_path, capfd):
    err, saved = stops(tmp_path, capfd, 143, 'after step')
    assert err[0].startswith('SIGTERM: finishing iteration 5, then saving') and saved == 6


@pytest.mark.parametrize('ddp, named', [(False, 'the calibrate event after iteration 1'), (True, 'iteration 2')])
def test_during_the_calibrate_event_it_finishes_then_the_run_stops(tmp_path, capfd, ddp, named):
    err, saved = stops(tmp_path, capfd, 143, 'calibrate', ddp=ddp, ddp_flag=(lambda it: it >= 2) if ddp else None)
    assert err[0].startswith(f'SIGTERM: finishing {named}, then saving')
    assert saved == (3 if ddp else 2)


def test_after_the_last_step_the_final_checkpoint_is_written_then_the_run_stops(tmp_path, capfd):
    run = make_run(tmp_path)
    with run:
        run.iter_num = ITERS
        send()
        with pytest.raises(SystemExit) as e:
            run.finish('linear', lambda: pytest.fail('the final losses ran'))
    assert e.value.code == 143 and checkpoint(tmp_path)['iter_num'] == ITERS
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith('SIGTERM: finishing the final checkpoint')
    assert err[1].startswith('stopped by SIGTERM after the last iteration: ')


@pytest.mark.parametrize('ddp', [False, True])
def test_during_the_final_losses_one_process_cuts_them_and_ddp_completes_the_run(tmp_path, capfd, ddp):
    run = make_run(tmp_path, ddp)
    with pytest.raises(SystemExit) as e:
        loop(run, 'final losses', ddp_flag=(lambda it: False) if ddp else None)
    assert e.value.code == 143 and checkpoint(tmp_path)['iter_num'] == ITERS
    err = capfd.readouterr().err.splitlines()
    final = [line for line in logged(tmp_path) if 'final_val_loss' in line]
    if ddp:
        assert err[0].startswith('SIGTERM: finishing the final losses')
        assert err[1] == f"stopped by SIGTERM after the final losses: the run in {tmp_path / 'run'} is complete"
        assert len(final) == 1
    else:
        assert err[0].startswith('SIGTERM: cutting the final losses short')
        assert err[1].startswith('stopped by SIGTERM during the final losses: ') and 'resumes at iteration 8' in err[1]
        assert final == []


def test_one_signal_delivered_twice_at_once_is_one_and_a_closed_output_is_no_first_signal(tmp_path, capfd,
                                                                                          monkeypatch):
    """SIGTERM from a tool that signals every process and again from study.py, which passes it on,
    within REPEAT_S: the run saves and stops as for one. After a closed output (its stop under way),
    a signal is the first one: its own line, its exit code."""
    def exit_at_once(code):
        raise AssertionError(f'the process would have ended at once, without saving (exit {code})')

    monkeypatch.setattr(runs.os, '_exit', exit_at_once)
    run = make_run(tmp_path)
    with pytest.raises(SystemExit) as e:
        with run:
            run.evaluate(0, lambda first_batch: 3.0)
            send()
            send()
            run.end_iteration(0, False)
    assert e.value.code == 143 and checkpoint(tmp_path)['iter_num'] == 1
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith('SIGTERM: finishing iteration 0')
    assert err[1] == 'SIGTERM again within 1 s: taken as the same one (once more stops at once)'
    assert err[2].startswith('stopped by SIGTERM after iteration 0: ')

    (tmp_path / 'closed').mkdir()
    run = make_run(tmp_path / 'closed')
    with pytest.raises(SystemExit) as e:
        with run:
            run.evaluate(0, lambda first_batch: 3.0)
            run.signals.output_closed()
            send(signal.SIGINT)
            run.end_iteration(0, False)
    assert e.value.code == 130 and checkpoint(tmp_path / 'closed')['iter_num'] == 1
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("the output's reader has ended") and err[1].startswith('SIGINT: finishing iteration 0')
    assert err[2].startswith('stopped by SIGINT after iteration 0: ')


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason="Linux's /dev/full: every write fails with ENOSPC")
def test_the_stop_line_comes_after_the_step_lines_in_a_file_and_a_full_disk_names_the_stream(tmp_path):
    """stdout and stderr into one file (study.py's train.out): the step lines, block-buffered, are
    written before the stop line, which is the file's last. A full disk under a redirect is an
    OSError naming the stream, for Run's one line (not taken for a reader gone)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); sys.path.insert(0, {ROOT!r})
        from pathlib import Path
        import test_run_contract as t
        t.loop(t.make_run(Path({str(tmp_path)!r})), 'step')
        """)
    with open(tmp_path / 'train.out', 'w') as out:
        code = subprocess.run([sys.executable, '-c', script], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}).returncode
    lines = (tmp_path / 'train.out').read_text().splitlines()
    assert code == 143 and lines[-1].startswith('stopped by SIGTERM after iteration 5: ')
    assert any(line.startswith('iter      5 ') for line in lines)

    with open('/dev/full', 'w') as full, pytest.raises(OSError) as e:
        guard = runs.OutputGuard(full, lambda: pytest.fail('a full disk taken for a closed output'))
        guard.write('x' * 100_000)
        guard.flush()
    assert e.value.errno == errno.ENOSPC and e.value.filename == '/dev/full'


@pytest.mark.parametrize('signum, code', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_ends_the_process_at_once_with_its_code_and_the_last_checkpoint_whole(tmp_path, signum,
                                                                                               code):
    """In a subprocess: the second signal arrives while the run finishes its step (before its
    save); the process ends at once and the folder keeps the checkpoint of the evaluation."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); sys.path.insert(0, {ROOT!r})
        from pathlib import Path
        import test_run_contract as t
        import runs, time
        run = t.make_run(Path({str(tmp_path)!r}))
        with run:
            run.evaluate(0, lambda first_batch: 3.0)
            os.kill(os.getpid(), {int(signum)})
            time.sleep(runs.StopSignal.REPEAT_S)  # sooner, it would be the first one delivered twice
            os.kill(os.getpid(), {int(signum)})
            print('went on', flush=True)
        """)
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == code and 'went on' not in proc.stdout
    assert proc.stderr.splitlines()[-1] == (f'second {name}: stopped at once, without saving; the run folder keeps '
                                            'its last checkpoint')
    assert checkpoint(tmp_path)['iter_num'] == 0 and not list((tmp_path / 'run').glob('*.tmp'))


def test_a_closed_terminal_sighup_stops_the_run_as_sigterm_does_unless_nohup_ignores_it(tmp_path, capfd):
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal leaves it (the runner may be under nohup)
    try:
        err, saved = stops(tmp_path, capfd, 129, 'step', signum=signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, inherited)
    assert err[0].startswith('SIGHUP: finishing iteration 5, then saving and stopping')
    assert err[1].startswith('stopped by SIGHUP after iteration 5: ') and saved == 6

    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    try:
        (tmp_path / 'nohup').mkdir()
        ran = loop(make_run(tmp_path / 'nohup'), 'step', signal.SIGHUP)
        assert ('final', ITERS) in ran and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, ignored)


@pytest.mark.parametrize('stderr', ['its own', 'the same pipe'])
def test_when_the_reader_of_its_output_ends_the_run_saves_and_stops_as_at_a_signal(tmp_path, stderr):
    """`python train.py ... | head`, or the tee of a dropped ssh session: the run's next print finds
    a broken pipe. The iteration it was in finishes and is saved, the run says so on stderr where
    that still has a reader, and exits 141 (SIGPIPE's), with no BrokenPipeError traceback; with
    stderr on the same pipe (2>&1 |), quietly."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); sys.path.insert(0, {ROOT!r})
        from pathlib import Path
        import test_run_contract as t
        print('ready', flush=True)
        sys.stdin.read()  # until the test has closed the reading end of stdout
        t.loop(t.make_run(Path({str(tmp_path)!r})))
        """)
    proc = subprocess.Popen([sys.executable, '-c', script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if stderr == 'the same pipe' else subprocess.PIPE, text=True)
    assert proc.stdout.readline() == 'ready\n'
    proc.stdout.close()
    proc.stdin.close()
    said = proc.stderr.read() if proc.stderr else ''
    assert proc.wait(120) == 141
    if stderr == 'its own':
        first, stopped = said.splitlines()
        assert first == ("the output's reader has ended (a broken pipe, a closed terminal): finishing the evaluation "
                         "at iteration 0, then saving and stopping")
        assert stopped.startswith('stopped by SIGPIPE after iteration 0: ') and 'resumes at iteration 1' in stopped
    assert checkpoint(tmp_path)['iter_num'] == 1
    assert '"iter": 0' in logged(tmp_path)[-1]  # the log, a file, holds the iteration the pipe never showed


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason="Linux's /dev/full: every write fails with ENOSPC")
def test_a_full_disk_mid_run_is_one_line_naming_the_file_and_the_resume_command(tmp_path):
    """log.jsonl's append on a full filesystem (stood in for by /dev/full) ends the run in one line
    with what to do, not an OSError traceback; the last checkpoint is untouched."""
    run = make_run(tmp_path)
    log = tmp_path / 'run' / 'log.jsonl'
    with pytest.raises(SystemExit) as e:
        with run:
            run.evaluate(0, lambda first_batch: 3.0)  # saves the checkpoint of iteration 0
            log.unlink(missing_ok=True)
            log.symlink_to('/dev/full')
            run.log({'iter': 0, 'loss': 1.0, 'phase': 'x', 'gate': 1.0, 'ce': 1.0, 'aux': 0.0, 'hidden_rms': 1.0,
                     'logit_rms': 1.0, 'lr': 1e-3, 'step_ms': 1.0, 'tokens_per_s': 1.0})
    assert str(e.value) == (f"a filesystem is full (No space left on device) writing {log} during iteration 0: "
                            f"{tmp_path / 'run' / 'ckpt.pt'} (the last checkpoint) is whole; free space, then "
                            f"continue with: python train.py --init_from=resume --out_dir={tmp_path / 'run'}")
    assert checkpoint(tmp_path)['iter_num'] == 0


def test_the_first_evaluations_line_is_printed_where_a_signal_cuts_it_short(tmp_path, capfd, monkeypatch):
    """A signal right after "evaluating at iteration 0" (what a user sees before pressing Ctrl-C)
    cuts that evaluation short, never 'finishes iteration 0' first."""
    import builtins
    real = builtins.print

    def send_after_the_line(*args, **kw):
        real(*args, **kw)
        if args and str(args[0]).startswith('evaluating at iteration 0'):
            send(signal.SIGINT)

    run = make_run(tmp_path)
    monkeypatch.setattr(builtins, 'print', send_after_the_line)
    with run, pytest.raises(SystemExit) as e:
        run.evaluate(0, lambda first_batch: pytest.fail('the evaluation went on'))
    monkeypatch.undo()
    assert e.value.code == 130
    assert capfd.readouterr().err.startswith('SIGINT: cutting the evaluation at iteration 0 short')


@pytest.mark.parametrize('at, flag', [(None, lambda it: False), ('evaluation', lambda it: it >= 4),
                                      ('after step', lambda it: it >= 6), ('final losses', lambda it: False)])
@pytest.mark.parametrize('ddp', [False, True])
def test_every_end_under_ddp_ends_the_processes_together_once(tmp_path, capfd, collectives, ddp, at, flag):
    """An undisturbed run and each stop: under DDP the ranks meet a barrier, then the process
    group goes, once, as the run leaves its context (a rank left with its process group alive
    aborted at exit now and then); one process makes no collective."""
    run = make_run(tmp_path, ddp)
    assert collectives.calls == (['all_reduce'] if ddp else [])  # the ranks agree on rank 0's claim of out_dir
    collectives.calls.clear()
    if at is None:
        loop(run, ddp_flag=flag if ddp else None)
    else:
        with pytest.raises(SystemExit):
            loop(run, at, signal.SIGINT, ddp_flag=flag if ddp else None)
    evaluations = ['all_reduce'] * 2  # iterations 0 and 4: rank 0's verdict on each loss (finite or not)
    after_finish = ['all_reduce'] if at in (None, 'final losses') else []  # the agreement after the last step
    assert collectives.calls == (evaluations + after_finish + ['barrier', 'wait', 'destroy'] if ddp else [])
    if ddp:  # its Work outlives the group: freed by gloo's thread, it deadlocked with the group's teardown
        assert runs.FINAL_BARRIERS[-1] is collectives.work


@pytest.mark.parametrize('rank', [0, 1, None])  # None: one process
def test_a_non_finite_validation_loss_stops_every_rank_there_keeping_the_last_checkpoint(tmp_path, collectives, rank):
    """Rank 0's evaluation at iteration 4 gives NaN (the step before it diverged with a finite loss):
    rank 0 does not save, and the other rank, which evaluates nothing, stops at the same point, told
    by the all-reduce; one process stops alike with no collective."""
    run = make_run(tmp_path, ddp=rank is not None)
    with pytest.raises(runs.Stopped, match=r'non-finite loss or gradient at iteration 4 \(the validation loss is not '
                                           rf'finite.*: {re.escape(str(tmp_path))}/run/ckpt.pt keeps the last good'):
        with run:
            run.evaluate(0, lambda first_batch: 3.0)  # rank 0: the checkpoint of iteration 0
            run.env.master, run.env.rank = rank in (0, None), rank or 0
            collectives.calls.clear()
            collectives.others = float(rank == 1)  # rank 0's flag, seen from rank 1
            run.evaluate(4, lambda first_batch: float('nan') if rank != 1 else pytest.fail('rank 1 evaluated'))
    assert checkpoint(tmp_path)['iter_num'] == 0
    assert collectives.calls[:1] == (['all_reduce'] if rank is not None else [])


def test_after_the_last_step_under_ddp_a_signal_on_another_rank_stops_this_one_too(tmp_path, capfd, collectives):
    """Rank 0 received nothing, another rank did: their agreement stops rank 0 before the final
    losses, which it would otherwise enter alone."""
    run = make_run(tmp_path, ddp=True)
    collectives.calls.clear()  # the claim's agreement (above)
    collectives.others = 1.0
    with pytest.raises(SystemExit) as e:
        with run:
            run.iter_num = ITERS
            run.finish('linear', lambda: pytest.fail('the final losses ran'))
    assert e.value.code == 143 and checkpoint(tmp_path)['iter_num'] == ITERS
    assert collectives.calls == ['all_reduce', 'barrier', 'wait', 'destroy']


def test_an_error_under_ddp_propagates_without_a_collective(tmp_path, collectives):
    """A rank that fails alone must not wait in a barrier the others never reach."""
    run = make_run(tmp_path, ddp=True)
    collectives.calls.clear()  # the claim's agreement, made by every rank as its Run is built
    with pytest.raises(RuntimeError, match='a failing step'):
        with run:
            raise RuntimeError('a failing step')
    assert collectives.calls == [] and signal.getsignal(signal.SIGTERM) != run.signals.handle


def test_each_step_reaches_the_estimate_and_only_the_steps_asked_wait_for_cuda(tmp_path, capsys, monkeypatch):
    """Run.step_took on a CUDA run (a stand-in torch.cuda.synchronize that counts its calls): each
    step's seconds reach Progress, whose second estimate comes from iterations 1-2 (the first step
    builds the optimizer's state); the device is waited for only on the steps asked to (train.py: the
    logged ones), since a sync on every step stalls the GPU's queue."""
    run = make_run(tmp_path)
    run.env.device_type = 'cuda'
    synced = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: synced.append(device))
    asked = {0, 4}
    for it in range(6):
        run.step_took(it, time.perf_counter() - 0.25, synchronize=it in asked)
    assert len(synced) == len(asked)
    estimates = [line for line in capsys.readouterr().out.splitlines() if line.startswith('estimate: ')]
    assert len(estimates) == 1 and ' 5 steps at 0.25 s ' in estimates[0]  # iterations 3-7 left
    assert estimates[0].endswith('from iterations 1–2')


@pytest.mark.parametrize('how', ['linear', 'baseline', 'fakeln', 'resumed'])
def test_a_finished_run_ends_with_its_time_and_the_commands_that_come_next(tmp_path, capsys, monkeypatch, how):
    """Each logged step's line ends with the share done and the time elapsed and left; the run's last
    two lines give its time (this process's: a resumed run says so) and README's next commands: fold.py
    then sample.py on the folded file where the norms fold (TaperNorm in the linear phase, FakeLN),
    else sample.py on the checkpoint. runs' clock is a stand-in: each step takes 1 s."""
    now = [1000.0]
    monkeypatch.setattr(runs, 'time', SimpleNamespace(perf_counter=lambda: now[0]))
    run = make_run(tmp_path, iter_num=4 if how == 'resumed' else 0)
    if how == 'fakeln':
        run.cfg.taper, run.cfg.norm_removal = 'none', 'fakeln'
    with run:
        while run.iter_num < ITERS:
            it, t0 = run.iter_num, now[0]
            now[0] += 1.0
            run.log({'iter': it, 'loss': 1.0, 'phase': 'x', 'gate': 1.0, 'ce': 1.0, 'aux': 0.0, 'hidden_rms': 1.0,
                     'logit_rms': 1.0, 'lr': 1e-3, 'step_ms': 1.0, 'tokens_per_s': 1.0,
                     'step_s': run.step_took(it, t0, synchronize=True)})
            run.end_iteration(it, False)
        run.finish('baseline' if how in ('baseline', 'fakeln') else 'linear', lambda: (2.0, 1.0))
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith('iter ')]
    took = 4 if how == 'resumed' else 8
    assert steps[0].endswith(' tok/s | 62% 0:01 elapsed' if how == 'resumed' else ' tok/s | 12% 0:01 elapsed')
    assert steps[-1].endswith(f' tok/s | 100% 0:0{took} elapsed, 0:01 left')  # final losses: 2 batches at 1/3 s
    ckpt, folded = tmp_path / 'run' / 'ckpt.pt', tmp_path / 'run' / 'folded.pt'
    ran = 'iterations 4–7 (resumed)' if how == 'resumed' else '8 iterations'  # 4, 5, 6, 7 ran here
    assert out[-2] == f'done: {ran}, 0:0{took} elapsed; the trained model is {ckpt}'
    assert out[-1] == (f'next, fold it, then sample: python fold.py --ckpt={ckpt} --out={folded} && '
                       f'python sample.py --ckpt={folded}' if how != 'baseline' else
                       f'next, sample: python sample.py --ckpt={ckpt}')
