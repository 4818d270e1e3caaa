"""study.py: a resumable matrix of train.py runs, its results file and tables."""

import errno
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import configurator
import study


@pytest.fixture
def tiny_matrix(toy_data, monkeypatch):
    cells = {n: a + [f'--data_dir={toy_data}'] for n, a in study.MATRICES['tiny'].items()}
    monkeypatch.setitem(study.MATRICES, 'tiny', cells)
    return cells


def toy_data_dir(cells):
    data_dir = next(a for a in next(iter(cells.values())) if a.startswith('--data_dir='))
    return Path(data_dir.split('=', 1)[1]) / 'toy'


def test_a_matrix_edited_under_a_finished_cell_is_refused_naming_the_keys(tiny_matrix, tmp_path, monkeypatch):
    """A finished cell whose matrix entry changes (transformers#18070's case, for a study): its record
    keeps the configuration that acts (not a key this run does not use, nor one a resume may change,
    as out_dir or eval_interval), so the next
    study.py, running or only tabulating, refuses before any cell runs and names each key, old → new,
    instead of skipping the cell and tabulating its old result as the new arguments'. A change to a
    key that does not act, and a record from before the key, pass."""
    out, cell = tmp_path / 'study', 'all-end-s1'
    data = study.main(['--matrix=tiny', f'--study_dir={out}', f'--only={cell}'])
    config = data['cells'][cell]['config']
    assert (config['taper_iters'], config['n_embd'], config['calibration']) == (4, 16, 'end')
    assert 'fakeln_interval' not in config  # no FakeLN here: it does not act
    assert not {'out_dir', 'device', 'eval_interval'} & set(config)  # train.RESUME_FREE: no result depends on them
    edit = lambda extra: {n: a + (extra if n == cell else []) for n, a in tiny_matrix.items()}
    monkeypatch.setitem(study.MATRICES, 'tiny', edit(['--taper_iters=6', '--fakeln_interval=7']))
    for run in ('True', 'False'):
        with pytest.raises(SystemExit, match=rf"^the matrix changed under 1 recorded cell\(s\): {cell} "
                                             r"\(taper_iters: 4 → 6\)\. Their records hold the old"):
            study.main(['--matrix=tiny', f'--study_dir={out}', f'--run={run}', f'--only={cell}'])
    monkeypatch.setitem(study.MATRICES, 'tiny', edit(['--fakeln_interval=7', '--eval_interval=3']))
    study.main(['--matrix=tiny', f'--study_dir={out}', f'--only={cell}'])  # the same run
    results = json.loads((out / 'results.json').read_text())
    del results['cells'][cell]['config']
    (out / 'results.json').write_text(json.dumps(results))
    monkeypatch.setitem(study.MATRICES, 'tiny', edit(['--taper_iters=6']))
    study.main(['--matrix=tiny', f'--study_dir={out}', '--run=False', f'--only={cell}'])  # older: not checked


def test_two_cells_run_skip_resume_and_record_divergence(tiny_matrix, tmp_path, capsys):
    out = tmp_path / 'study'
    data = study.main(['--matrix=tiny', f'--study_dir={out}', '--jobs=2'])
    cells = data['cells']
    assert set(cells) == {'baseline-end-s1', 'all-end-s1'}
    for name, c in cells.items():
        assert c['status'] == 'finished' and c['threads'] == 1 and c['torch'] and 'git_commit' in c
        assert (c['device'], c['dtype']) == ('cpu', 'float32')  # the tiny matrix's --device=cpu, resolved
        # rounding can differ by host: study.cpu_isa's default pins the kernels (x86-64) or names them
        assert c['cpu_capability'] == ('AVX2' if study.cpu_pins('avx2') else torch.backends.cpu.get_cpu_capability())
        log = [json.loads(line) for line in open(out / name / 'log.jsonl')]
        assert c['final_val_loss'] == log[-1]['final_val_loss']
        assert c['final_train_loss'] == log[-1]['final_train_loss']
    assert set(cells['all-end-s1']['calibrate']['mismatch']) == {'h.0.ln_1', 'h.0.ln_2', 'ln_f'}
    # each record names its data: the toy fixture's 10,000 / 2,800 tokens and its meta.json's hash
    # (the fixture's meta.json has no 'sources': the hash is of its sorted JSON)
    meta = json.loads((toy_data_dir(tiny_matrix) / 'meta.json').read_text())
    for c in cells.values():
        assert c['data'] == dict(dataset='toy', tokens={'train': 10_000, 'val': 2_800},
                                 meta_sha256=hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest())
    steps = study.tables(cells, ('steps',)).splitlines()  # W = 3, T = 4: phases from iterations 0, 3, 7
    assert steps[0].startswith('| variant | warmup step (vs baseline) | taper step') and len(steps) == 4
    assert next(row for row in steps if row.startswith('| baseline-end | ')).count('(1.000×)') == 3
    table = capsys.readouterr().out
    assert '| all-end |' in table and '| baseline-end |' in table
    readme = tmp_path / 'README.md'
    readme.write_text('intro\n<!-- study:tiny -->\nold\n<!-- /study:tiny -->\nafter\n')
    study.main(['--matrix=tiny', f'--study_dir={out}', '--run=False', f'--readme={readme}'])
    text = readme.read_text()
    assert text.startswith('intro\n<!-- study:tiny -->\n| variant |') and text.endswith('<!-- /study:tiny -->\nafter\n')
    assert 'old' not in text and '| all-end |' in text
    with pytest.raises(SystemExit, match=f"no cell of matrix 'tiny' has finished in .*: {readme}'s tables are kept"):
        study.main(['--matrix=tiny', f'--study_dir={tmp_path / "elsewhere"}', '--run=False', f'--readme={readme}'])
    assert readme.read_text() == text  # was emptied tables, status 0
    for bad, says in ((tmp_path / 'READEM.md', 'No such file or directory'), (tmp_path, 'Is a directory'),
                      (tmp_path / 'intro.md', 'has no <!-- study:tiny --> ... <!-- /study:tiny --> block')):
        (tmp_path / 'intro.md').write_text('intro\n')  # srinivasayush/docrunner#14: a traceback after every cell ran
        with pytest.raises(SystemExit, match=re.escape(says)):
            study.main(['--matrix=tiny', f'--study_dir={tmp_path / "fresh"}', f'--readme={bad}'])
        assert not (tmp_path / 'fresh').exists()  # refused before a cell ran, or a folder was made

    with pytest.raises(SystemExit, match="only='nope': nope not in matrix 'tiny'"):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--only=nope'])
    for bad in ('--jobs=0', '--threads=0'):  # a ValueError from the executor, or cells with OMP_NUM_THREADS=0
        with pytest.raises(SystemExit) as e:
            study.main(['--matrix=tiny', f'--study_dir={out}', bad])
        assert str(e.value) == f'config error: {bad[2:]} must be >= 1; set by {bad} ({bad[2:].split("=")[0]})'
    # a finished cell is skipped: nothing is appended to its log
    before = (out / 'all-end-s1' / 'log.jsonl').read_text()
    study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    assert (out / 'all-end-s1' / 'log.jsonl').read_text() == before

    # a half-finished cell (its final record gone, its checkpoint there) continues with resume, and
    # its wall time covers every run: here a first one of 100 s, and one whose driver was stopped
    # (no end written) after its last output at 2050 s, 50 s after it started
    cell_dir = out / 'all-end-s1'
    lines = before.splitlines(keepends=True)
    (cell_dir / 'log.jsonl').write_text(''.join(lines[:-1]))
    (cell_dir / 'segments.json').write_text(json.dumps([[1000.0, 1100.0], [2000.0, None]]))
    for f in ('train.out', 'log.jsonl'):
        os.utime(cell_dir / f, (2050.0, 2050.0))
    os.remove(out / 'results.json')
    t0 = time.time()
    data = study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    took = time.time() - t0
    assert 'resuming' in (cell_dir / 'train.out').read_text()
    c = data['cells']['all-end-s1']
    assert c['final_val_loss'] == pytest.approx(json.loads(lines[-1])['final_val_loss'])
    assert 150 < c['wall_s'] <= 150 + took and c['segments'] == 3 and 'wall_s_partial' not in c
    assert json.loads((cell_dir / 'segments.json').read_text())[1] == [2000.0, 2050.0]
    # a cell resumed from a checkpoint older than its wall-time account: the first run is unknown
    (cell_dir / 'log.jsonl').write_text(''.join(lines[:-1]))
    os.remove(cell_dir / 'segments.json')
    c = study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])['cells']['all-end-s1']
    assert (c['segments'], c['wall_s_partial']) == (2, True) and 0 < c['wall_s'] <= time.time() - t0


def test_on_windows_the_driver_says_it_runs_no_cell_before_starting_one_and_still_tabulates(tiny_matrix, tmp_path,
                                                                                           monkeypatch):
    """Windows has no fcntl: `import study` failed with ModuleNotFoundError; now the tables print and
    a run is refused in one line before any cell starts."""
    monkeypatch.setattr(study, 'fcntl', None)
    monkeypatch.setattr(study, 'run_cell', lambda *a: pytest.fail('a cell started'))
    out = tmp_path / 'study'
    with pytest.raises(SystemExit, match=r'^study.py runs cells on Linux and macOS only: .*under WSL\); --run=False'):
        study.main(['--matrix=tiny', f'--study_dir={out}'])
    assert study.main(['--matrix=tiny', f'--study_dir={out}', '--run=False']) == {'cells': {}}
    no_fcntl = "import sys; sys.modules['fcntl'] = None; import study; assert study.fcntl is None"
    root = Path(study.__file__).parent
    assert subprocess.run([sys.executable, '-c', no_fcntl], cwd=root, capture_output=True).returncode == 0


def test_a_diverged_cell_is_recorded_with_its_iteration_and_not_retried(tiny_matrix, tmp_path, monkeypatch):
    cells = {'all-end-s1': tiny_matrix['all-end-s1'] + ['--learning_rate=1e30', '--grad_clip=0.0']}
    monkeypatch.setitem(study.MATRICES, 'tiny', cells)
    out = tmp_path / 'study'
    c = study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])['cells']['all-end-s1']
    assert c['status'] == 'diverged' and isinstance(c['diverged_at'], int)
    size = (out / 'all-end-s1' / 'train.out').stat().st_size
    study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    assert (out / 'all-end-s1' / 'train.out').stat().st_size == size  # not retried


def test_plot_draws_the_runs_of_a_study(tiny_matrix, tmp_path):
    pytest.importorskip('matplotlib')
    import plot
    out = tmp_path / 'study'
    study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    png = tmp_path / 'p.png'
    plot.main([f'--runs={out}/baseline-end-s1,{out}/all-end-s1', f'--out={png}'])
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match='log.jsonl not found'):
        plot.main([f'--runs={tmp_path}/none', f'--out={png}'])
    for bad, says in ((tmp_path, f'names a folder: --out is the image to write, e.g. --out={tmp_path}/plot.png'),
                      (tmp_path / 'p', f'has no format suffix: name the image with one, e.g. --out={tmp_path}/p.png'),
                      (tmp_path / 'lr_v1.2', ': matplotlib writes no .2 images (what follows the name\'s last dot is its '
                                             'format): end it with one of .'),
                      (tmp_path / 'p.txt', ': matplotlib writes no .txt images')):
        with pytest.raises(SystemExit) as e:  # matplotlib wrote BAD.png while plot.py said it wrote BAD
            plot.main([f'--runs={out}/baseline-end-s1', f'--out={bad}'])
        assert str(e.value).startswith(f'config error: --out={bad}{says}' if says[0] == ':' else
                                       f'config error: --out={bad} {says}')
        assert says[0] != ':' or ('.png, ' in str(e.value) and str(e.value).endswith(f'e.g. --out={bad}.png'))
    for bad, says in (('--smooth=0', 'smooth=0 must be >= 1'), ('--shock_steps=-1', 'shock_steps=-1 must be >= 1'),
                      ('--ce_span=-1.0', 'ce_span=-1.0 must be >= 0'), ('--ce_span=1e400', 'ce_span=inf: give a finite'),
                      ('--max_iter=-1', 'max_iter=-1 must be >= 0')):  # a ZeroDivisionError, or empty panels
        with pytest.raises(SystemExit, match=f'config error: {re.escape(says)}'):
            plot.main([f'--runs={out}/baseline-end-s1', f'--out={png}', bad])
    assert not (tmp_path / 'p').exists() and not os.path.exists(f'{tmp_path}.png')
    # a window of the first steps (a spike, drawn whole with ce_span=0)
    assert [r['iter'] for r in plot.read_run(out / 'all-end-s1', 5)[0]] == [0, 1, 2, 3, 4, 5]
    plot.main([f'--runs={out}/all-end-s1', f'--out={png}', '--max_iter=6', '--ce_span=0', '--smooth=1'])
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_two_drivers_sharing_a_results_file_keep_each_others_cells(tmp_path):
    path = str(tmp_path / 'results.json')
    first, second = study.Results(path), study.Results(path)  # both read the file before either writes
    first.put('a-s1', {'status': 'finished'})
    second.put('b-s1', {'status': 'diverged'})
    first.put('c-s1', {'status': 'finished'})
    assert json.load(open(path))['cells'] == {'a-s1': {'status': 'finished'}, 'b-s1': {'status': 'diverged'},
                                              'c-s1': {'status': 'finished'}}


def test_a_results_file_on_a_filesystem_without_locks_is_still_written(tmp_path, monkeypatch, capfd):
    """NFS without its lock daemon: Results.put's flock raised ENOLCK after the first cell had trained."""
    def flock(f, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(study.fcntl, 'flock', flock)
    monkeypatch.setattr(study.runs, '_unlocked', set())
    results = study.Results(str(tmp_path / 'results.json'))
    results.put('a-s1', {'status': 'finished'})
    results.put('b-s1', {'status': 'finished'})
    assert list(json.load(open(tmp_path / 'results.json'))['cells']) == ['a-s1', 'b-s1']
    assert capfd.readouterr().err.count('cannot lock files (No locks available)') == 1


class Ran:
    """What a stand-in train.py run gives study.Stop in place of a Popen: its exit code, and the signals
    passed to it."""

    def __init__(self, code, until_signalled=False):
        self.code, self.signals, self.signalled = code, [], threading.Event()
        if not until_signalled:
            self.signalled.set()

    def wait(self):
        assert self.signalled.wait(60), "the driver's signal never reached the run"
        return self.code

    def send_signal(self, signum):
        self.signals.append(signum)
        self.signalled.set()


class Started(list):
    """fake_train's cells run, in order, with .procs: the Ran of each."""

    def __init__(self):
        super().__init__()
        self.procs = []


def fake_train(monkeypatch, hold=lambda out_dir: None, until_signalled=False):
    """study.py's train.py runs replaced by a stand-in (study.start_train): a line in the cell's
    train.out, then hold(out_dir) (a test's way to keep a run going), then a finished log, or where
    hold returns an exit code, the stop line of a run stopped by a signal (runs.Run.stop) and that
    code (until_signalled: once the driver has passed the run a signal). Returns the cells run, in
    order (each named '... without its lock' where the run did not inherit the cell's lock), with
    the Ran of each."""
    ran = Started()
    procs = ran.procs

    def start(cmd, stdout=None, **kw):
        out_dir = Path(next(a for a in cmd if a.startswith('--out_dir=')).split('=', 1)[1])
        # train.py inherits the cell's lock: a driver killed mid-run leaves the cell held until train.py ends
        inherits = [os.fstat(fd).st_ino for fd in kw.get('pass_fds', ())] == [(out_dir / study.CELL_LOCK).stat().st_ino]
        ran.append(out_dir.name if inherits else f'{out_dir.name} without its lock')
        stdout.write(f"stand-in train.py run {len(ran)}{' --init_from=resume' * ('--init_from=resume' in cmd)}\n")
        stdout.flush()
        code = hold(out_dir)
        if code is not None and code > 0:  # below 0: killed by the signal before its handlers, no line
            name = {130: 'SIGINT', 143: 'SIGTERM'}[code]
            stdout.write(f"stopped by {name} after iteration 3: saved in {out_dir}/ckpt.pt, which resumes at "
                         f"iteration 4; continue with: python train.py --out_dir={out_dir} --init_from=resume\n"
                         "iter 3 ... (a step line train.py's buffered stdout wrote at exit)\n")
        elif code is None:
            (out_dir / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in FINISHED_LOG))
        procs.append(Ran(code or 0, until_signalled and code is not None))
        return procs[-1]

    monkeypatch.setattr(study, 'start_train', start)
    return ran


def test_a_cells_log_cut_short_resumes_a_damaged_one_fails_only_its_cell_and_a_bad_results_file_is_one_line(
        tiny_matrix, tmp_path, monkeypatch, capfd):
    """A full disk or a power loss mid-append tears a cell's last log line: the cell is read
    without it and resumes; a cell whose log is damaged elsewhere fails alone, naming the file
    and line, while the others run; a results.json that is not one stops study.py in one line
    that says how to recover."""
    import plot
    ran = fake_train(monkeypatch)
    out = tmp_path / 'study'
    torn, damaged = out / 'baseline-end-s1', out / 'all-end-s1'
    for cell in (torn, damaged):
        cell.mkdir(parents=True)
        (cell / 'ckpt.pt').write_bytes(b'')  # a run stopped before its end
    lines = [json.dumps(r) + '\n' for r in FINISHED_LOG]
    (torn / 'log.jsonl').write_text(''.join(lines[:-1]) + lines[-1][:20])  # its final record cut mid-write
    (damaged / 'log.jsonl').write_text(lines[0] + lines[1][:20] + '\n' + lines[1])
    steps, _ = plot.read_run(torn)
    assert [r['iter'] for r in steps] == [0, 1] and study.read_log(torn) == FINISHED_LOG[:-1]
    with pytest.raises(SystemExit, match=r'^1 cell\(s\) failed: fix them; then rerun the same command$'):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False', '--jobs=1'])
    said = capfd.readouterr()
    assert said.err.count(f"{torn / 'log.jsonl'}: its last line (3) is cut short") == 1  # once, however often read
    assert f"all-end-s1: {damaged / 'log.jsonl'}, line 2: not a log record (" in said.out
    assert ran == ['baseline-end-s1'] and 'resuming' in said.out  # the torn cell resumed; the damaged one waits
    record = json.loads((out / 'results.json').read_text())['cells']['baseline-end-s1']
    assert record['status'] == 'finished' and record['final_val_loss'] == FINISHED_LOG[-1]['final_val_loss']

    (out / 'results.json').write_text('{"cells": {"baseline-end-s1": {"status": "fin')
    with pytest.raises(SystemExit) as e:
        study.main(['--matrix=tiny', f'--study_dir={out}', '--run=False'])
    assert str(e.value).startswith(f"{out / 'results.json'} is not a study's results file (Unterminated string")
    assert str(e.value).endswith("restore it (from git, or a backup), or move it away and rerun study.py, which "
                                 "rebuilds each finished cell's record from its log.jsonl (without its wall time; a "
                                 "diverged cell runs again)")
    (out / 'results.json').write_text('[]')
    with pytest.raises(SystemExit, match="is not a study's results file"):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--run=False'])
    for missing in (tmp_path / 'none.json', tmp_path):  # plot.py --fit/--gap/--ladder: a FileNotFoundError before
        with pytest.raises(SystemExit, match=f"cannot read {missing}: (No such file or directory|Is a directory)"):
            study.read_results(str(missing))
    with pytest.raises(SystemExit, match="is not a study's results file"):  # plot's reader is study's
        plot.best_points(out / 'results.json')


def test_a_signal_stops_the_driver_in_one_line_once_its_cells_saved_and_begins_no_other(tiny_matrix, tmp_path,
                                                                                         monkeypatch, capfd):
    """Each cell's train.py runs in a session of its own, and the driver passes it its SIGINT or
    SIGTERM once (Ctrl-C to the group, or kill PID alone), also where the shell that started the
    driver in the background ignores SIGINT: the run saves and says where it stopped, the driver
    repeats that line (not train.out's tail, as for a failure), begins no cell still queued, and
    exits 128 + the signal in one line, without a traceback. A run stopped by a signal of its own
    (143) is 'stopped', not 'failed', and the others go on."""
    import signal
    out = tmp_path / 'study'

    def signal_the_driver(signum):
        def hold(out_dir):
            signal.pthread_kill(threading.main_thread().ident, signum)
            return {signal.SIGINT: 130, signal.SIGTERM: 143}[signum]  # as the run does once it has the signal
        return hold

    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)  # `study.py ... &` in a script
    try:
        for signum, cell in ((signal.SIGINT, 'baseline-end-s1'), (signal.SIGTERM, 'baseline-end-s1')):
            ran = fake_train(monkeypatch, signal_the_driver(signum), until_signalled=True)
            with pytest.raises(SystemExit) as e:
                study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False', '--jobs=1'])
            assert e.value.code == 128 + signum and ran == [cell]  # all-end-s1, queued, never began
            assert [p.signals for p in ran.procs] == [[signum]]  # once
            said = capfd.readouterr()
            assert (f"{cell}: stopped by {signum.name} after iteration 3: saved in {out}/{cell}/ckpt.pt, which "
                    f"resumes at iteration 4; the same study.py command continues it\n") in said.out
            assert 'failed' not in said.out and 'stand-in' not in said.out  # no tail of train.out
            assert said.err == (f"study.py: {signum.name} passed to 1 running cell(s), which save and stop; no other "
                                "cell begins (again: they stop at once, without saving)\n"
                                f"study.py stopped by {signum.name}: each running cell said above where it stopped; "
                                "the same command continues them\n")
            assert not (out / 'results.json').exists()  # a stopped cell is not recorded
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the driver's handlers were for its run only
    finally:
        signal.signal(signal.SIGINT, inherited)

    ran = fake_train(monkeypatch, lambda out_dir: 143 if out_dir.name == 'baseline-end-s1' else None)
    with pytest.raises(SystemExit, match=r"^1 cell\(s\) stopped by a signal, saved; then rerun the same command$"):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False', '--jobs=2'])
    assert sorted(ran) == ['all-end-s1', 'baseline-end-s1']
    assert "baseline-end-s1: stopped by SIGTERM after iteration 3" in capfd.readouterr().out
    assert set(json.loads((out / 'results.json').read_text())['cells']) == {'all-end-s1'}

    # killed by SIGTERM before its handlers (no line of its own): train.out's earlier stop lines are not its
    ran = fake_train(monkeypatch, lambda out_dir: -signal.SIGTERM)
    with pytest.raises(SystemExit, match=r"^1 cell\(s\) stopped by a signal"):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    said = capfd.readouterr().out
    assert ("baseline-end-s1: stopped by SIGTERM while starting; the same study.py command continues it" in said
            and 'after iteration 3' not in said)


def test_the_driver_passes_a_signal_on_once_and_a_cell_it_stopped_before_its_start_leaves_no_account(
        tiny_matrix, tmp_path, monkeypatch, capfd):
    """The same signal twice within REPEAT_S (to the process group, and to the driver) is passed on
    once, a later one again. A signal between a cell's check and its start: the cell does not begin
    and its wall-time account gains no segment."""
    import signal
    stop, cell = study.Stop(), Ran(0, until_signalled=True)
    stop.running.add(cell)
    stop.handle(signal.SIGTERM, None)
    stop.handle(signal.SIGTERM, None)
    assert cell.signals == [signal.SIGTERM]
    stop.first_at -= study.runs.StopSignal.REPEAT_S
    stop.handle(signal.SIGTERM, None)
    assert cell.signals == [signal.SIGTERM] * 2
    assert capfd.readouterr().err.splitlines() == [
        'study.py: SIGTERM passed to 1 running cell(s), which save and stop; no other cell begins (again: they '
        'stop at once, without saving)', 'study.py: SIGTERM passed to 1 running cell(s), which stop at once, without saving']

    ran, stop, real_open = fake_train(monkeypatch), study.Stop(), study.open_segment

    def open_then_signal(out_dir):
        real_open(out_dir)
        stop.received = signal.SIGTERM  # the driver's handler, run just here

    monkeypatch.setattr(study, 'open_segment', open_then_signal)
    out_dir = tmp_path / 'baseline-end-s1'
    status = study.run_cell('baseline-end-s1', tiny_matrix['baseline-end-s1'], str(out_dir),
                            study.Results(str(tmp_path / 'results.json')), 1, '', stop)
    assert status == 'not begun' and ran == [] and json.loads((out_dir / 'segments.json').read_text()) == []
    assert 'baseline-end-s1: not begun after all: the driver is stopping' in capfd.readouterr().out


def test_a_driver_whose_output_has_no_reader_any_more_runs_its_cells_quietly(tiny_matrix, tmp_path, monkeypatch):
    """`study.py ... | tee` whose tee ended: the driver's progress lines fail with EPIPE; it goes on
    without them (its records go to results.json), not with a BrokenPipeError from a cell's thread."""
    import io

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, 'Broken pipe')

    ran = fake_train(monkeypatch)
    monkeypatch.setattr(sys, 'stdout', Gone())
    data = study.main(['--matrix=tiny', f'--study_dir={tmp_path / "study"}', '--table=False', '--jobs=2'])
    assert sorted(ran) == ['all-end-s1', 'baseline-end-s1'] and set(data['cells']) == set(ran)


def test_a_second_driver_skips_the_cell_the_first_runs_and_leaves_its_account_and_output(tiny_matrix, tmp_path,
                                                                                         monkeypatch, capsys):
    """Two study.py drivers on one study_dir: while the first runs a cell, the second skips it,
    saying it runs elsewhere, and runs the others; it neither opens a wall-time segment in the
    cell's segments.json nor writes to its train.out, and it exits 0."""
    out = tmp_path / 'study'
    started, release = threading.Event(), threading.Event()

    def hold(out_dir):
        if out_dir.name == 'all-end-s1' and not started.is_set():
            started.set()
            assert release.wait(120)

    ran = fake_train(monkeypatch, hold)
    first = threading.Thread(target=study.main, args=(['--matrix=tiny', '--only=all-end-s1', f'--study_dir={out}',
                                                       '--table=False'],))
    first.start()
    try:
        assert started.wait(120)
        cell = out / 'all-end-s1'
        account, output = (cell / 'segments.json').read_text(), (cell / 'train.out').read_text()
        data = study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False', '--jobs=2'])  # returns: exit 0
        assert (cell / 'segments.json').read_text() == account and (cell / 'train.out').read_text() == output
        assert ran == ['all-end-s1', 'baseline-end-s1'] and set(data['cells']) == {'baseline-end-s1'}
        said = capsys.readouterr().out
        assert f"all-end-s1: skipped, it runs elsewhere (another study.py holds {cell / study.CELL_LOCK})" in said
        assert f"1 cell(s) skipped: another study.py runs them and records them in {out / 'results.json'}" in said
    finally:
        release.set()
        first.join(120)
    c = json.loads((out / 'results.json').read_text())['cells']
    assert c['all-end-s1']['segments'] == 1 and c['all-end-s1']['final_val_loss'] == FINISHED_LOG[-1]['final_val_loss']
    assert set(c) == {'all-end-s1', 'baseline-end-s1'}
    study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])  # once it has ended, the cell is free
    assert ran == ['all-end-s1', 'baseline-end-s1'] and 'skipped' not in capsys.readouterr().out


@pytest.mark.parametrize('ending', ['finished', 'diverged'])
def test_a_driver_that_reaches_a_cell_another_has_ended_since_it_began_keeps_that_record(tiny_matrix, tmp_path,
                                                                                       monkeypatch, ending):
    """A second driver decided from the results it read when it began: a cell the first finished
    meanwhile lost its record's config, data and wall time to a rebuilt one, and a cell that
    diverged meanwhile was trained again (ctcache#46's stale read outside the lock)."""
    out, name = tmp_path / 'study', 'all-end-s1'
    later = study.Results(str(out / 'results.json'))  # the second driver, begun before the first ended the cell
    args = tiny_matrix[name]
    if ending == 'diverged':  # a real tiny run, as test_a_diverged_cell_is_recorded_... makes one
        args = args + ['--learning_rate=1e30', '--grad_clip=0.0']
        monkeypatch.setitem(study.MATRICES, 'tiny', {name: args})
    else:
        fake_train(monkeypatch)
    study.main(['--matrix=tiny', f'--only={name}', f'--study_dir={out}', '--table=False'])
    first = json.loads((out / 'results.json').read_text())['cells'][name]
    output = (out / name / 'train.out').read_text()
    assert first['status'] == ending and first['config'] and first.get('wall_s') is not None
    assert study.run_cell(name, args, out / name, later, 1) == ending
    assert json.loads((out / 'results.json').read_text())['cells'][name] == first  # not rebuilt without them
    assert (out / name / 'train.out').read_text() == output  # not run again


def test_a_record_rebuilt_from_a_finished_log_claims_no_pins(tiny_matrix, tmp_path):
    """A driver stopped between train.py's end and the record: the record rebuilt from the log
    gave this host's unpinned kernels as cpu_capability (AVX512 on such a host) for a cell that
    may have run pinned to AVX2; how it ran is unknown, so it says neither that nor its pins."""
    out, name = tmp_path / 'study', 'all-end-s1'
    (out / name).mkdir(parents=True)
    (out / name / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in FINISHED_LOG))
    results = study.Results(str(out / 'results.json'))
    assert study.run_cell(name, tiny_matrix[name], out / name, results, 1, 'avx2') == 'finished'
    record = json.loads((out / 'results.json').read_text())['cells'][name]
    assert record['final_val_loss'] == FINISHED_LOG[-1]['final_val_loss'] and record['wall_s'] is None
    assert 'cpu_capability' not in record and 'cpu_pins' not in record
    assert record['host_capability'] == torch.backends.cpu.get_cpu_capability()


def test_a_file_named_like_a_fixed_temp_name_survives_a_table_write(tmp_path):
    """study's atomic writes go through a temp file of their own: README.md.tmp (anyone's) is kept."""
    (tmp_path / 'README.md.tmp').write_text('notes')
    study.atomic_write('table', str(tmp_path / 'README.md'))
    assert (tmp_path / 'README.md').read_text() == 'table' and (tmp_path / 'README.md.tmp').read_text() == 'notes'
    assert sorted(os.listdir(tmp_path)) == ['README.md', 'README.md.tmp']


def step(it, loss, phase='warmup'):
    return {'iter': it, 'loss': loss, 'phase': phase, 'hidden_rms': 1.0, 'logit_rms': 2.0, 'radial_cos': -0.01,
            'step_ms': 5.0}


# a finished run's log as the stand-in train.py writes it (fake_train)
FINISHED_LOG = [step(0, 9.0), step(1, 8.0), {'iter': 2, 'phase': 'warmup', 'final_val_loss': 7.5,
                                             'final_train_loss': 7.4}]


def test_the_summary_finds_the_tapers_spike_after_the_calibration():
    records = [step(0, 9.0), step(10, 6.0), {'event': 'calibrate', 'iter': 19, 's_tgt': 1.0, 'c': {}},
               step(20, 5.5, 'taper'), step(30, 40.0, 'taper'), step(40, 5.0, 'linear'),
               {'iter': 40, 'final_val_loss': 5.1, 'final_train_loss': 4.9}]
    s = study.summarize(records)
    # the largest loss overall is step 30's, and the spike is measured from the last loss before W
    assert s['max_loss'] == 40.0 and s['spike'] == {'loss_at_W': 6.0, 'peak': 40.0, 'peak_iter': 30}
    records[4]['loss'] = 5.2  # no spike: the largest loss after W is the first one
    assert study.summarize(records)['spike'] == {'loss_at_W': 6.0, 'peak': 5.5, 'peak_iter': 20}


def test_lr_table_compares_each_variant_at_its_own_best_learning_rate():
    losses = {('baseline', 1e-3): 5.30, ('baseline', 2e-3): 5.10, ('baseline', 4e-3): 5.20,
              ('internal', 1e-3): 5.25, ('internal', 2e-3): 5.15, ('internal', 4e-3): 5.05}
    cells, args = {}, {}
    for (v, lr), loss in losses.items():
        cells[f'{v}-lr{lr:g}-s1'] = {'status': 'finished', 'final_val_loss': loss}
        args[f'{v}-lr{lr:g}-s1'] = ['--taper=x', f'--learning_rate={lr:g}']
    cells['internal-lr0.008-s1'] = {'status': 'diverged', 'diverged_at': 77}
    args['internal-lr0.008-s1'] = ['--learning_rate=0.008']
    args['baseline-lr0.008-s1'] = ['--learning_rate=0.008']  # a cell of the matrix that has not run yet
    rows = {r.split(' |')[0][2:]: r for r in study.tables(cells, ('lr',), args).splitlines()[2:]}
    assert rows['baseline'] == '| baseline | 5.3000 | 5.1000 | 5.2000 | — | 0.002 (so far) | — |'
    # internal's best is 4e-3: 5.05 / 5.10 - 1 = -0.98 %
    assert rows['internal'] == '| internal | 5.2500 | 5.1500 | 5.0500 | diverged at 77 | 0.004 | -0.98 % |'


def test_where_every_rate_diverged_no_rate_is_called_best():
    """min() over cells that all count as infinite returned the first rate: the tables named it best
    ('0.008 (bracketed)', '0.004 | +inf %')."""
    cells = {'baseline-1M-t9M-lr0.004-s1': {'status': 'finished', 'final_val_loss': 4.1},
             'baseline-1M-t9M-lr0.008-s1': {'status': 'finished', 'final_val_loss': 4.0},
             'baseline-1M-t9M-lr0.016-s1': {'status': 'finished', 'final_val_loss': 4.05}}
    cells |= {f'dyt-1M-t9M-lr{lr}-s1': {'status': 'diverged', 'diverged_at': 50} for lr in ('0.004', '0.008', '0.016')}
    best = study.ladder_best(cells, {n: [] for n in cells})['1M', '9M']
    assert best['baseline'][2] == '' and best['dyt'][2] == 'all diverged'
    assert study.rate_label(best['dyt'][0], 'all diverged', 3) == 'none (all diverged)'
    assert study.rate_label(best['baseline'][0], '', 3) == '0.008'
    flat = {n.replace('-1M-t9M', ''): c for n, c in cells.items()}
    args = {n: [f"--learning_rate={n.split('-lr')[1].split('-')[0]}"] for n in flat}
    rows = {r.split(' |')[0][2:]: r for r in study.tables(flat, ('lr',), args).splitlines()[2:]}
    assert rows['dyt'].endswith('| none (all diverged) | — |')
    assert rows['baseline'].endswith('| 0.008 | — |')


def test_a_segment_left_open_never_ends_before_it_began(tmp_path):
    """A machine lost right after open_segment, before the run wrote anything: the outputs' mtimes
    are the previous run's, and closing the segment there gave it a negative length (equinor/ert#8171)."""
    day = 86400
    (tmp_path / 'train.out').write_text('the previous run')
    (tmp_path / 'ckpt.pt').write_bytes(b'')
    t1 = time.time() - day
    os.utime(tmp_path / 'train.out', (t1, t1))
    (tmp_path / 'segments.json').write_text(json.dumps([[t1 - 600, t1]]))
    study.open_segment(str(tmp_path))  # the run that was lost
    start = json.loads((tmp_path / 'segments.json').read_text())[-1][0]
    study.open_segment(str(tmp_path))  # the driver again
    wall = study.close_segment(str(tmp_path))
    segments = json.loads((tmp_path / 'segments.json').read_text())
    assert segments[1] == [start, start] and wall['segments'] == 3
    assert 600 <= wall['wall_s'] < 660


def test_a_cells_configuration_is_resolved_as_train_py_resolves_it():
    # values read off train.py's defaults and the two config files by hand
    cfg = study.cell_config(['config/tinystories_baseline.py', 'config/cpu.py', '--learning_rate=0.008'])
    assert (cfg['learning_rate'], cfg['gate_warmup_iters'], cfg['n_embd'], cfg['beta2']) == (0.008, 150, 64, 0.95)
    cfg = study.cell_config(['config/tinystories_baseline.py', '--taper_iters=50'])
    assert (cfg['learning_rate'], cfg['gate_warmup_iters'], cfg['taper_iters']) == (1e-3, 500, 50)


def test_chasing_table_marks_a_spike_its_recovery_and_the_same_lr_baseline():
    base = {'baseline-end-s1': {'status': 'finished', 'final_val_loss': 5.0},
            'baseline-lr0.008-s1': {'status': 'finished', 'final_val_loss': 4.0}}
    cell = lambda peak, train: {'status': 'finished', 'final_val_loss': 5.2, 'final_train_loss': train,
                                'hidden_rms_max': 4.0, 'logit_rms_max': 3.0, 'radial_cos_max': 0.05,
                                'spike': {'loss_at_W': 6.0, 'peak': peak, 'peak_iter': 33}}
    cells = {'all-short-s1': cell(400.0, 5.0), 'all-lr0.008-s1': cell(6.5, 6.1),
             'all_noaux-short-s1': {'status': 'diverged', 'diverged_at': 41}}
    # W, T and lr not given come from config/cpu.py (150, 750, 2e-3), as in train.py
    args = {'all-short-s1': ['config/cpu.py', '--aux_weight=0.1', '--gate_warmup_iters=20', '--taper_iters=50'],
            'all-lr0.008-s1': ['config/cpu.py', '--aux_weight=0.0', '--learning_rate=0.008'],
            'all_noaux-short-s1': ['config/cpu.py', '--aux_weight=0.0', '--gate_warmup_iters=20', '--taper_iters=50']}
    rows = study.tables(cells, ('chasing',), args, {**base, **cells}).splitlines()[2:]
    spiked_again = dict(cell(400.0, 6.5), status='finished')  # spiked, and the final train loss is above the loss at W
    assert '| yes, no |' in study.tables({'all-short-s1': spiked_again}, ('chasing',), args, base)
    assert rows[0] == ('| all-short-s1 | 0.1 | 20 / 50 | 0.002 | 6.00 → 400.00 (33) | yes, yes | 4.00 | 3.00 | '
                       '0.05 | 5.2000 | +4.00 % |')  # 5.2 / 5.0 - 1
    # 6.5 is not 10 % above 6.0: no spike (and so no recovery to speak of); 5.2 / 4.0 - 1 = +30 %
    assert rows[1] == ('| all-lr0.008-s1 | 0 | 150 / 750 | 0.008 | 6.00 → 6.50 (33) | no | 4.00 | 3.00 | '
                       '0.05 | 5.2000 | +30.00 % |')
    assert rows[2].startswith('| all_noaux-short-s1 | 0 | 20 / 50 | 0.002 | diverged at 41 |')


def test_a_cell_name_shared_by_two_matrices_is_one_configuration():
    # matrices reuse each other's runs by name (the lr matrix's 2e-3 cells are the main
    # matrix's, the 3M_lr matrix's are the 3M matrix's): the name must mean the same run
    # ('tiny', the tests' toy matrix, runs into a study folder of its own)
    seen, shared = {}, 0
    for matrix, cells in study.MATRICES.items():
        if matrix == 'tiny':
            continue
        for name, args in cells.items():
            cfg = study.cell_config(args)
            if name in seen:
                shared += 1
                assert cfg == seen[name][1], f"{name}: {seen[name][0]} and {matrix} train different runs"
            seen.setdefault(name, (matrix, cfg))
    assert shared >= 8  # main ↔ lr (2), main ↔ chasing (2), lr ↔ tuned (2), 3M ↔ 3M_lr (2)


def test_a_cells_name_tells_its_seed_learning_rate_and_size():
    # the tables group and pair cells by name, so the name must match the run it declares
    for matrix in ('main', 'lr', 'tuned', 'chasing', '3M', '3M_lr', '3M_tuned', 'austen'):
        for name, args in study.MATRICES[matrix].items():
            cfg = study.cell_config(args)
            rest, seed = name.rsplit('-s', 1)
            assert cfg['seed'] == int(seed), name
            lr = next((p[2:] for p in rest.split('-') if p.startswith('lr')), None)
            assert cfg['learning_rate'] == (float(lr) if lr else 2e-3), name  # 2e-3: config/cpu.py's
            assert cfg['min_lr'] == pytest.approx(cfg['learning_rate'] / 10), name  # cpu.py: 2e-3 → 2e-4
            assert cfg['n_embd'] == (128 if '-3M' in rest else 64), name


def test_the_data_hash_ignores_where_the_inputs_were_and_sees_what_they_held(tmp_path):
    def prepare(folder, **meta):
        (folder / 'mix7').mkdir(parents=True)
        for split, n in (('train', 100), ('val', 10)):
            np.zeros(n, np.uint16).tofile(folder / 'mix7' / f'{split}.bin')
        (folder / 'mix7' / 'meta.json').write_text(json.dumps({'vocab_size': 4, 'gpt2_ids': [5, 6, 7], **meta}))
        return study.data_of(['--dataset=mix7', f'--data_dir={folder}'])

    here = prepare(tmp_path / 'a', sources=['../shared/corpora/austen.txt'])
    assert here['tokens'] == {'train': 100, 'val': 10}
    # the same text prepared from another folder (data/mix7/README's data/downloads/mix7/) matches
    assert prepare(tmp_path / 'b', sources=['data/downloads/mix7/austen.txt']) == here
    # another vocabulary does not
    assert prepare(tmp_path / 'c', sources=['../shared/corpora/austen.txt'], gpt2_ids=[5, 6, 8]) != here


def test_a_table_refuses_cells_of_two_datasets_two_preparations_or_two_devices():
    args = {'a-s1': ['--dataset=mix7'], 'b-s1': ['--dataset=mix7'], 'c-s1': ['--dataset=mix']}
    same = {'a-s1': {'data': {'meta_sha256': 'x'}}, 'b-s1': {'data': {'meta_sha256': 'x'}, 'device': 'cpu'}}
    study.check_comparable(same, args)  # a record without a device ran on the CPU
    with pytest.raises(SystemExit, match='different data'):
        study.check_comparable({**same, 'b-s1': {'data': {'meta_sha256': 'y'}}}, args)  # prepared twice
    with pytest.raises(SystemExit, match=r'different data \(mix, mix7'):
        study.check_comparable({**same, 'c-s1': {}}, args)  # an older record: its name is enough
    with pytest.raises(SystemExit, match=r'different devices \(cpu, cuda: NVIDIA H200\)'):
        study.check_comparable({**same, 'b-s1': {'data': {'meta_sha256': 'x'}, 'device': 'cuda: NVIDIA H200'}}, args)


def test_study_on_a_gpu_moves_every_cell_there_in_float32_into_its_own_folder():
    cells = {'a-s1': ['config/cpu.py', '--seed=1']}
    moved = study.on_device(cells, 'cuda', 'study_cuda')
    assert moved == {'a-s1': ['config/cpu.py', '--seed=1', '--device=cuda', '--dtype=float32']}
    cfg = study.cell_config(moved['a-s1'])  # the last override wins over config/cpu.py's device
    assert (cfg['device'], cfg['dtype']) == ('cuda', 'float32')
    with pytest.raises(SystemExit, match=r"device='cuda': its cells go in their own folder.*--study_dir=study_cuda"):
        study.main(['--matrix=tiny', '--device=cuda', '--run=False', '--table=False'])


@pytest.mark.skipif(torch.cuda.is_available(), reason='a machine without CUDA')
def test_study_on_a_gpu_the_machine_lacks_is_one_line_before_any_cell(tmp_path):
    """--device=cuda without a GPU: every cell started and failed on its own ('2 cell(s) failed')."""
    with pytest.raises(SystemExit, match=r"^config error: device='cuda': this machine has no CUDA device: leave "
                                         r"--device out to run the cells on this CPU$"):
        study.main(['--matrix=tiny', '--device=cuda', f'--study_dir={tmp_path / "study_cuda"}'])
    assert not (tmp_path / 'study_cuda').exists()


def test_a_study_without_its_dataset_stops_before_any_cell_with_the_recipe(tmp_path, monkeypatch, tiny_matrix):
    """Each cell's train.py failed on its own, all with a command that prepared mix7 from one file
    (a different validation split from the recipe's seven, cut per file)."""
    cells = {n: a + [f'--data_dir={tmp_path / "data"}', '--dataset=mix7'] for n, a in study.MATRICES['tiny'].items()}
    monkeypatch.setitem(study.MATRICES, 'tiny', cells)
    with pytest.raises(SystemExit) as e:
        study.main(['--matrix=tiny', f'--study_dir={tmp_path / "study"}'])
    recipe = re.search(r'python data/text/prepare.py --name=mix7 (.*?)\n```',
                       open(os.path.join(study.ROOT, 'data', 'mix7', 'README.md')).read(), re.S).group(1)
    inputs = recipe.replace('\\\n', ' ').split()  # the README's command, its lines joined
    assert str(e.value) == (
        f"{len(cells)} cell(s) train on {tmp_path}/data/mix7, which is not prepared (no train.bin, val.bin and "
        f"meta.json); prepare it first:\n    python data/mix7/build_corpora.py && python data/text/prepare.py "
        f"--name=mix7 {' '.join(inputs)} --out_dir={tmp_path}/data/mix7")
    assert not any(p.name != 'results.json' for p in (tmp_path / 'study').iterdir())  # no cell started
    first = next(iter(cells))  # a cell with a record (finished, or diverged) is not run again: not counted
    with pytest.raises(SystemExit, match=rf"^{len(cells) - 1} cell\(s\) train on "):
        study.check_data(cells, {first: {'status': 'finished'}})
    study.check_data({first: cells[first]}, {first: {'status': 'finished'}})  # nothing left to run: no refusal


def test_ladder_cells_are_named_after_their_size_budget_and_rate_and_read_mix7_once():
    tokens_per_step = 16 * 128  # config/cpu.py: batch 16 × context 128, one process
    cells = study.MATRICES['ladder']
    part4 = study.part4_blocks(study.LADDER_BEST, study.EMA_BEST, study.DYT_BEST)  # block 3's midpoints
    full = {n for n in cells if n.split('-')[1:3] in (['1M', 't18M'], ['3M', 't18M'])}  # part 6
    block1 = [n for n in cells if n.split('-')[0] in ('baseline', 'internal') and n.endswith('-s1') and n not in part4
              and n.split('-')[1] != '3M' and n not in full]
    assert len(block1) == 2 * (4 * 3 + 2)  # two variants × four points × three rates, two points a fourth
    for name, args in cells.items():
        cfg = study.cell_config(args)
        v, size, budget, lr, seed = name.split('-')
        assert (cfg['dataset'], cfg['sampler'], cfg['seed']) == ('mix7', 'epoch', int(seed[1:])), name
        assert (cfg['n_embd'], cfg['n_head'], cfg['n_layer'], cfg['block_size']) == \
            {'0.4M': (32, 1, 8, 128), '1M': (64, 2, 8, 128), '3M': (128, 4, 8, 128)}[size], name
        n = cfg['max_iters']
        assert abs(n * tokens_per_step / {'t3M': 3e6, 't9M': 9e6, 't18M': 18e6}[budget] - 1) < 0.03, name
        # config/cpu.py's proportions: W and the LR warmup 10 %, T 50 %, decay to the end, min_lr = lr / 10
        # (part 5's _w25 variants: W 25 %)
        assert (cfg['gate_warmup_iters'], cfg['warmup_iters'], cfg['taper_iters'], cfg['lr_decay_iters']) == \
            (n // (4 if v.endswith('_w25') else 10), n // 10, n // 2, n), name
        assert cfg['learning_rate'] == float(lr[2:]) and cfg['min_lr'] == pytest.approx(cfg['learning_rate'] / 10)
        assert (cfg['taper'], cfg['aux_weight'], cfg['norm'], cfg['calibration'], cfg['aux_form']) == {
            'baseline': ('none', 0.0, 'rmsnorm', 'end', 'absolute'), 'internal': ('internal', 0.1, 'rmsnorm', 'end', 'absolute'),
            'all': ('all', 0.1, 'rmsnorm', 'end', 'absolute'), 'internal_ema': ('internal', 0.1, 'rmsnorm', 'ema', 'absolute'),
            'internal_rel': ('internal', 0.1, 'rmsnorm', 'end', 'relative'), 'dyt': ('none', 0.0, 'dyt', 'end', 'absolute'),
            'dyt_noemb': ('none', 0.0, 'dyt', 'end', 'absolute'), 'all_ema': ('all', 0.1, 'rmsnorm', 'ema', 'absolute'),
            'dyt_a2': ('none', 0.0, 'dyt', 'end', 'absolute'), 'derf': ('none', 0.0, 'derf', 'end', 'absolute'),
            'internal_w25': ('internal', 0.1, 'rmsnorm', 'end', 'absolute'),
            'internal_ema_w25': ('internal', 0.1, 'rmsnorm', 'ema', 'absolute')}[v]
        assert cfg['dyt_embed_scale'] == (v != 'dyt_noemb'), name  # the embedding scalar: named in each DyT, Derf cell
        assert cfg['dyt_alpha0_scale'] == (2.0 if v == 'dyt_a2' else 1.0), name
    # block 7, the 3M rung: two variants at 2e-3-1.6e-2 (3M tokens) and 2e-3-8e-3 (9M), seed 1; part 5's seeds
    # 2 and 3 at 3M tokens at both variants' best 4e-3; the baseline's grid at 9M tokens up to 1.6e-2
    # (it was best at 8e-3, the edge); seeds 2 and 3 at 9M tokens at the bracketed bests (8e-3, 4e-3); nothing else
    rung = {n for n in cells if n.split('-')[1] == '3M'} - full
    assert rung == {f'{v}-3M-{t}-lr{lr}-s1' for v in ('baseline', 'internal_ema')
                    for t, lrs in (('t3M', ('0.002', '0.004', '0.008', '0.016')), ('t9M', ('0.002', '0.004', '0.008')))
                    for lr in lrs} | {f'{v}-3M-t3M-lr0.004-s{s}' for v in ('baseline', 'internal_ema') for s in (2, 3)} \
        | {'baseline-3M-t9M-lr0.016-s1'} \
        | {f'{v}-3M-t9M-lr{lr}-s{s}' for v, lr in (('baseline', '0.008'), ('internal_ema', '0.004')) for s in (2, 3)}
    # part 6, one full pass: both variants on a three-rate grid (seed 1) at each size's 9M-token bests,
    # halved and doubled (1M: 8e-3 for both; 3M: 8e-3 and 4e-3, so 2e-3-8e-3 covers both); the 3M
    # baseline one rate up, since it ended best at 8e-3, the grid's top; then seeds 2 and 3 at each
    # bracketed best (the baselines' 8e-3, the 'ema' 8e-3 at 1M and 4e-3 at 3M), and at the 1M model the √2
    # midpoints beside them, and All-Taper 'ema' at Internal-Taper's best rate, seeds 1-3
    assert full == {f'{v}-{size}-t18M-lr{lr}-s1' for v in ('baseline', 'internal_ema')
                    for size, lrs in (('1M', ('0.004', '0.008', '0.016')), ('3M', ('0.002', '0.004', '0.008')))
                    for lr in lrs} | {'baseline-3M-t18M-lr0.016-s1'} \
        | {f'{v}-{size}-t18M-lr0.008-s{s}' for v, size in (('baseline', '1M'), ('baseline', '3M'),
                                                           ('internal_ema', '1M')) for s in (2, 3)} \
        | {f'internal_ema-3M-t18M-lr0.004-s{s}' for s in (2, 3)} \
        | {f'{v}-1M-t18M-lr{lr}-s1' for v in ('baseline', 'internal_ema') for lr in ('0.00566', '0.0113')} \
        | {f'all_ema-1M-t18M-lr0.008-s{s}' for s in (1, 2, 3)}
    # the longest run still fits in one pass of mix7's 18,508,995 training tokens (the refusal is train.py's)
    assert max(study.cell_config(a)['max_iters'] for a in cells.values()) * 16 <= (18_508_995 - 1) // 128


def test_blocks_2_to_6_run_at_block_1s_best_rates_in_the_order_of_priority():
    best = {('0.4M', '3M'): {'baseline': 0.03, 'internal': 0.02}, ('1M', '9M'): {'baseline': 0.01, 'internal': 0.005},
            ('0.4M', '18M'): {'baseline': 0.04, 'internal': 0.04}}
    names = list(study.ladder_blocks(best))
    assert names == [
        'baseline-1M-t9M-lr0.01-s2', 'baseline-1M-t9M-lr0.01-s3', 'internal-1M-t9M-lr0.005-s2', 'internal-1M-t9M-lr0.005-s3',
        'baseline-0.4M-t18M-lr0.04-s2', 'baseline-0.4M-t18M-lr0.04-s3',
        'internal-0.4M-t18M-lr0.04-s2', 'internal-0.4M-t18M-lr0.04-s3',                                     # block 2
        'internal_ema-1M-t9M-lr0.005-s1', 'internal_ema-1M-t9M-lr0.005-s2', 'internal_ema-1M-t9M-lr0.005-s3',  # 3
        'all-0.4M-t3M-lr0.02-s1', 'all-1M-t9M-lr0.005-s1', 'all-0.4M-t18M-lr0.04-s1',                           # 4
        'dyt-1M-t9M-lr0.002-s1', 'dyt-1M-t9M-lr0.004-s1', 'dyt-1M-t9M-lr0.008-s1', 'dyt-1M-t9M-lr0.016-s1',  # 5: DYT_LRS
        'dyt-0.4M-t18M-lr0.004-s1', 'dyt-0.4M-t18M-lr0.008-s1', 'dyt-0.4M-t18M-lr0.016-s1',
        'dyt_noemb-1M-t9M-lr0.004-s1', 'dyt_noemb-1M-t9M-lr0.008-s1', 'dyt_noemb-0.4M-t18M-lr0.016-s1',     # the ablation
        'internal_rel-1M-t9M-lr0.01-s1', 'internal_rel-1M-t9M-lr0.01-s2',
        'internal-1M-t9M-lr0.01-s1', 'internal-1M-t9M-lr0.01-s2']                                              # 6
    assert list(study.ladder_blocks({})) == []  # nothing runs before its point's best rates are known
    # both best at the same rate: block 6 adds twice it, where the absolute anchor falls off
    assert list(study.ladder_blocks({('1M', '9M'): {'baseline': 0.008, 'internal': 0.008}}))[-5:] == [
        'internal_rel-1M-t9M-lr0.008-s1', 'internal_rel-1M-t9M-lr0.008-s2', 'internal_rel-1M-t9M-lr0.016-s1',
        'internal-1M-t9M-lr0.008-s1', 'internal-1M-t9M-lr0.016-s1']


def test_the_declared_best_rates_are_block_1s_bracketed_best():
    with open(os.path.join(study.ROOT, 'study', 'results.json')) as f:
        cells = json.load(f)['cells']
    grid = {n: a for p in study.LADDER_POINTS  # block 1: seed 1 of both
            for n, a in study.ladder_cells(('baseline', 'internal'), *p, study.LADDER_LRS[p]).items()}
    measured = study.ladder_best({n: c for n, c in cells.items() if n in grid}, grid)
    for point, rates in study.LADDER_BEST.items():
        for v, lr in rates.items():
            best, _, note = measured[point][v]
            assert (best, note) == (lr, ''), (point, v)  # '' : bracketed, and its grid has finished


def test_ladder_best_chooses_on_seed_1_and_marks_only_its_grid():
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss}
    cells = {'baseline-1M-t9M-lr0.004-s1': cell(4.16), 'baseline-1M-t9M-lr0.008-s1': cell(4.099),
             'baseline-1M-t9M-lr0.016-s1': cell(4.1005),
             # seeds 2 and 3 at the best rate end higher: their mean (4.1020) must not hand the best to 1.6e-2
             'baseline-1M-t9M-lr0.008-s2': cell(4.104), 'baseline-1M-t9M-lr0.008-s3': cell(4.103),
             'internal_rel-1M-t9M-lr0.008-s1': cell(4.09), 'internal_rel-1M-t9M-lr0.016-s1': cell(4.2)}
    pending = ['internal_rel-1M-t9M-lr0.008-s2']  # a seed still to run is no grid cell still to run
    best = study.ladder_best(cells, {n: [] for n in [*cells, *pending]})['1M', '9M']
    lr, by_seed, note = best['baseline']
    assert (lr, sorted(by_seed), note) == (0.008, [1, 2, 3], '')
    assert best['internal_rel'][0::2] == (0.008, '')  # two rates are no grid: no 'edge'
    # a seed-1 cell of the grid still to run: the best so far
    assert study.ladder_best(cells, {n: [] for n in [*cells, 'baseline-1M-t9M-lr0.032-s1']})['1M', '9M']['baseline'][2] \
        == '(so far)'
    # a variant with seeds 2-3 and no seed-1 cell (running elsewhere, or left out by --only): no best yet,
    # where min() of nothing crashed every table and plot.py --fit
    seeds = {n: c for n, c in cells.items() if not n.startswith('internal_rel')} | {'internal_rel-1M-t9M-lr0.008-s2': cell(4.1)}
    assert set(study.ladder_best(seeds, {n: [] for n in seeds})['1M', '9M']) == {'baseline'}


def test_t_quantile_matches_the_t_table():
    # two-sided 95 %: the printed t table (e.g. Fisher & Yates), and two closed forms worked by hand:
    # 1 df is the Cauchy distribution, t = tan(pi (p − 1/2)); with 2 df, P(|T| <= t) = t / sqrt(t² + 2)
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 30: 2.042}
    for df, t in table.items():
        assert study.t_quantile(0.975, df) == pytest.approx(t, abs=6e-4), df
    assert study.t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)
    assert study.t_quantile(0.975, 2) == pytest.approx(math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2)), rel=1e-9)
    assert study.t_quantile(0.95, 2) == pytest.approx(2.920, abs=6e-4)  # one-sided 95 %, 2 df
    # a whole number given as a float, as the docstring allows: the same quantiles
    assert study.t_quantile(0.975, 3.0) == pytest.approx(table[3], abs=6e-4)
    assert study.t_quantile(0.975, 2.0) == pytest.approx(math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2)), rel=1e-9)
    for p, df in ((0.4, 2), (1.0, 2), (0.975, 0), (0.975, 2.5)):
        with pytest.raises(ValueError, match='needs 0.5 < p < 1 and a whole df'):
            study.t_quantile(p, df)


def test_the_interval_of_a_mean_is_t_based_on_n_minus_1_df():
    m, sd, lo, hi = study.mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1: 2 ± t / sqrt(3), t = 4.3027 (2 df)
    half = math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2)) / math.sqrt(3)  # the 2-df closed form above: 2.4841
    assert (m, sd) == (2.0, 1.0) and (lo, hi) == (pytest.approx(2 - half), pytest.approx(2 + half))
    assert math.isnan(study.mean_interval([0.5])[2])  # one value: no interval
    assert study.fmt_gap([1.0, 2.0, 3.0]) == '+2.00 ± 1.00 % [-0.48, +4.48]'
    assert study.fmt_gap([-0.52]) == '-0.52 % (one seed: no interval)'


def test_paired_gaps_pair_cells_by_seed_whatever_their_order_and_with_a_seed_missing():
    """A variant's seeds stored 3 before 1, its seed 2 missing; the baseline's stored 2, 1, 3. Worked by
    hand: 4.04 / 4.0 − 1 = +1 %, 4.326 / 4.2 − 1 = +3 % (by position, 4.326 would meet 4.1)."""
    cell = lambda loss, status='finished': {'status': status, 'final_val_loss': loss}
    base = {2: cell(4.1), 1: cell(4.0), 3: cell(4.2)}
    assert study.paired_gap({3: cell(4.326), 1: cell(4.04)}, base) == pytest.approx({1: 1.0, 3: 3.0})
    # a seed the baseline lacks or did not finish pairs with nothing
    assert study.paired_gap({1: cell(4.04), 4: cell(4.0), 2: cell(4.3)}, {1: cell(4.0), 2: cell(9, 'diverged')}) \
        == pytest.approx({1: 1.0})


def test_a_gap_over_fewer_seeds_than_the_mean_beside_it_names_its_seeds():
    """Internal-Taper's mean over seeds 1-3 beside a gap that pairs only seeds 1-2 (the baseline's third seed
    is missing): the gap says over which. Gaps +1, +2 %: mean 1.5, sd 0.71, t = tan(0.475 π) = 12.706 (1 df),
    1.5 ± 12.706 · 0.7071 / √2 = [−4.85, +7.85]; All-Taper pairs seed 2 alone: 4.141 / 4.1 − 1 = +1 %."""
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss, 'final_train_loss': loss - 0.2}
    cells = {'baseline-s1': cell(4.0), 'baseline-s2': cell(4.1), 'internal-s1': cell(4.04), 'internal-s2': cell(4.182),
             'internal-s3': cell(4.3), 'all-s2': cell(4.141), 'all-s3': cell(4.2),
             'baseline_ema-s1': cell(4.0), 'internal_ema-s1': cell(4.04)}
    rows = {r.split(' | ')[0][2:]: r.split(' | ') for r in study.tables(cells, ('losses',)).splitlines()[2:]}
    assert rows['internal'][1:4] == ['1,2,3', '4.1740 ± 0.1302', '+1.50 ± 0.71 % [-4.85, +7.85] over s1–2']
    assert rows['all'][3] == '+1.00 % (one seed, s2: no interval)'
    assert rows['internal_ema'][3] == '+1.00 % (one seed: no interval)'  # its one seed is the mean's: no label
    # part 3's tables the same way: the 3M model's mean over three seeds, its gap over the two the baseline ran
    ladder = {f'{n}-3M-t3M-lr0.004-s{s}': cells[f'{n}-s{s}'] for n in ('baseline', 'internal') for s in (1, 2, 3)
              if f'{n}-s{s}' in cells}
    text = study.ladder_sizes(ladder, {n: [] for n in ladder})
    assert "(lr 0.004, only rate run, s1–3): +1.50 ± 0.71 % [-4.85, +7.85] over s1–2 |" in text
    row = study.ladder_table(ladder, {n: [] for n in ladder}).splitlines()[3]
    assert '| 4.1740 ± 0.1302 (1,2,3) | +1.50 ± 0.71 % [-4.85, +7.85] over s1–2 |' in row


def test_ladder_table_pairs_each_variant_at_its_best_rate_with_the_baselines():
    cell = lambda loss, train=4.5: {'status': 'finished', 'final_val_loss': loss, 'final_train_loss': train}
    cells = {'baseline-1M-t3M-lr0.004-s1': cell(5.0), 'baseline-1M-t3M-lr0.008-s1': cell(4.8, 4.55),
             'baseline-1M-t3M-lr0.008-s2': cell(4.9, 4.6), 'baseline-1M-t3M-lr0.016-s1': cell(4.9),
             'internal-1M-t3M-lr0.004-s1': cell(4.7, 4.6), 'internal-1M-t3M-lr0.008-s1': cell(4.75),
             'internal-1M-t3M-lr0.016-s1': {'status': 'diverged', 'diverged_at': 300},
             'internal_rel-1M-t3M-lr0.008-s1': cell(4.8), 'internal_rel-1M-t3M-lr0.016-s1': cell(4.85),
             # a record names the arguments it ran with: its calibration is read from them
             'internal_ema-1M-t3M-lr0.008-s1': dict(cell(4.704), args=['--taper=internal', '--calibration=ema']),
             'internal_ema-1M-t3M-lr0.008-s2': dict(cell(4.802), args=['--taper=internal', '--calibration=ema'])}
    rows = study.ladder_table(cells, {n: [] for n in cells}).splitlines()[2:]
    # the best rate's two seeds: val − train 0.25 and 0.30, mean 0.275 (the other rates' do not count)
    assert rows[0] == ('| 1M | 3M | baseline | — | 0.004: 5.0000, 0.008: 4.8000, 0.016: 4.9000 | 0.008 | '
                       '4.8500 ± 0.0707 (1,2) | — | 0.275 |')
    # best at the grid's edge is marked; paired on seed 1 only: 4.7 / 4.8 − 1 = −2.08 %, no interval
    assert rows[1] == ('| 1M | 3M | internal | end | 0.004: 4.7000, 0.008: 4.7500, 0.016: diverged at 300 | 0.004 (edge) | '
                       '4.7000 (1) | -2.08 % (one seed: no interval) | 0.100 |')
    # two rates are no bracketed best; 4.8 / 4.8 − 1 = 0
    assert rows[2] == ('| 1M | 3M | internal_rel | end | 0.008: 4.8000, 0.016: 4.8500 | 0.008 (better of two) | '
                       '4.8000 (1) | +0.00 % (one seed: no interval) | 0.300 |')
    # one rate: 4.704 / 4.8 − 1 = −2.00 %, 4.802 / 4.9 − 1 = −2.00 %: sd 0, so the interval is the point
    assert rows[3].startswith('| 1M | 3M | internal_ema | ema | 0.008: 4.7040 | 0.008 (only rate run) | ')
    assert rows[3].endswith(' | -2.00 ± 0.00 % [-2.00, -2.00] | 0.253 |')


def test_ladder_sizes_gives_each_variant_at_its_best_rate_per_budget_with_seed_spread():
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss}
    cells = {'baseline-0.4M-t18M-lr0.008-s1': cell(4.0), 'baseline-0.4M-t18M-lr0.016-s1': cell(3.9),
             'baseline-0.4M-t18M-lr0.016-s2': cell(3.8), 'baseline-0.4M-t18M-lr0.016-s3': cell(3.85),
             'baseline-0.4M-t18M-lr0.032-s1': cell(4.2),
             'internal-0.4M-t18M-lr0.016-s1': cell(3.939), 'internal-0.4M-t18M-lr0.016-s2': cell(3.876),
             'internal-0.4M-t18M-lr0.016-s3': cell(3.9655),
             'baseline-0.4M-t3M-lr0.016-s1': cell(5.0), 'dyt-0.4M-t3M-lr0.016-s1': cell(5.1),
             'baseline-1M-t3M-lr0.008-s1': cell(4.5)}
    text = study.ladder_sizes(cells, {n: [] for n in cells})
    small, big = text.split('\n\n**1M model**')
    internal = [3.939, 3.876, 3.9655]
    assert small.splitlines()[2:] == [
        '| variant (calibration) | 3M tokens | 18M tokens |', '|---|---|---|',
        # 18M: the baseline's best is 1.6e-2, mean (3.9, 3.8, 3.85) = 3.85, sd 0.05; internal's per-seed
        # gaps 3.939/3.9 − 1 = +1 %, 3.876/3.8 − 1 = +2 %, 3.9655/3.85 − 1 = +3 %: mean 2, sd 1, and the
        # 95 % interval 2 ± 4.303 · 1 / sqrt(3) = [−0.48, +4.48] (t, 2 df); one rate run at 18M, one at 3M
        '| baseline | 5.0000 (lr 0.016, only rate run, s1) | 3.8500 ± 0.0500 (lr 0.016, s1–3) |',
        f"| internal ('end') | — | {np.mean(internal):.4f} ± {np.std(internal, ddof=1):.4f} "
        "(lr 0.016, only rate run, s1–3): +2.00 ± 1.00 % [-0.48, +4.48] |",
        '| dyt | 5.1000 (lr 0.016, only rate run, s1): +2.00 % (one seed: no interval) | — |']  # VARIANTS7's order
    assert big.splitlines()[2:] == ['| variant (calibration) | 3M tokens |', '|---|---|',
                                    '| baseline | 4.5000 (lr 0.008, only rate run, s1) |']


def summary_cells():
    """A results file's part-3 cells for the summary table: two sizes, the longer budget of each with
    seeds, Internal-Taper with both calibrations at the 1M model's long point, 'end' only at 0.4M;
    All-Taper with both at 0.4M, its 'ema' variant one that VARIANTS7 does not name (its record does)."""
    cell = lambda loss, cal='end', taper='internal': {'status': 'finished', 'final_val_loss': loss,
                                                      'final_train_loss': loss - 0.25,
                                                      'args': [f'--taper={taper}', f'--calibration={cal}']}
    base = lambda loss: {'status': 'finished', 'final_val_loss': loss, 'final_train_loss': loss - 0.25,
                         'args': ['--taper=none', '--calibration=end']}
    return {'baseline-1M-t3M-lr0.016-s1': base(4.5), 'internal-1M-t3M-lr0.008-s1': cell(4.4),  # not the longest
            'baseline-1M-t9M-lr0.004-s1': base(4.2), 'baseline-1M-t9M-lr0.008-s1': base(4.0),
            'baseline-1M-t9M-lr0.016-s1': base(4.1), 'baseline-1M-t9M-lr0.008-s2': base(4.1),
            'baseline-1M-t9M-lr0.008-s3': base(4.2),
            'internal-1M-t9M-lr0.004-s1': cell(4.3), 'internal-1M-t9M-lr0.008-s1': cell(4.01),
            'internal-1M-t9M-lr0.016-s1': cell(4.4),
            'internal_ema-1M-t9M-lr0.008-s1': cell(4.04, 'ema'), 'internal_ema-1M-t9M-lr0.008-s2': cell(4.182, 'ema'),
            'internal_ema-1M-t9M-lr0.008-s3': cell(4.326, 'ema'),
            'baseline-0.4M-t18M-lr0.016-s1': base(4.4), 'internal-0.4M-t18M-lr0.016-s1': cell(4.378),
            'all-0.4M-t18M-lr0.016-s1': cell(4.39, 'end', 'all'), 'all_ema-0.4M-t18M-lr0.016-s1': cell(4.356, 'ema', 'all')}


def test_the_summary_table_gives_each_method_at_the_longest_budget_with_its_interval():
    cells = summary_cells()
    rows = study.ladder_summary(cells, {n: [] for n in cells}).splitlines()
    assert rows[0].startswith('| variant | calibration | model size · tokens of mix7 (read once) | lr | seeds |')
    # per-seed gaps of the EMA cells: 4.04/4.0, 4.182/4.1, 4.326/4.2 − 1 = +1, +2, +3 %: 2 ± 4.303/sqrt(3)
    assert rows[2:] == [
        '| baseline (RMSNorm) | — | 1M params · 9M tokens | 0.008 (bracketed) | s1–3 | 4.1000 ± 0.1000 | — | — |',
        '| baseline (RMSNorm) | — | 0.4M params · 18M tokens | 0.016 (only rate run) | s1 | 4.4000 | — | — |',
        '| Internal-Taper | ema | 1M params · 9M tokens | 0.008 (only rate run) | s1–3 | 4.1827 ± 0.1430 | '
        '+2.00 ± 1.00 % [-0.48, +4.48] | +0.7 to +1.5 % |',
        '| Internal-Taper | end | 1M params · 9M tokens | 0.008 (bracketed) | s1 | 4.0100 | +0.25 % (one seed: no interval) | '
        '+0.7 to +1.5 % |',  # both calibrations of Internal-Taper where both ran: 4.01 / 4.0 − 1
        '| Internal-Taper | end | 0.4M params · 18M tokens | 0.016 (only rate run) | s1 | 4.3780 | -0.50 % (one seed: no interval) | '
        '+0.7 to +1.5 % |',  # 4.378 / 4.4 − 1
        '| All-Taper | ema | 0.4M params · 18M tokens | 0.016 (only rate run) | s1 | 4.3560 | -1.00 % (one seed: no interval) | '
        '+0.8 to +1.8 % |']  # 'ema' before 'end': 4.356 / 4.4 − 1; no DyT cells: no row
    # a longer budget whose baseline grid still has a cell to run ('(so far)') stays out of the summary while a
    # shorter one is done; once its grid is done, the methods that ran there move to it, and those that did not
    # stay at the shorter budget, beside its baseline
    longer = {'baseline-1M-t18M-lr0.008-s1': dict(cells['baseline-1M-t9M-lr0.008-s1'], final_val_loss=3.9),
              'internal_ema-1M-t18M-lr0.008-s1': dict(cells['internal_ema-1M-t9M-lr0.008-s1'], final_val_loss=3.91)}
    args = {n: [] for n in [*cells, *longer, 'baseline-1M-t18M-lr0.004-s1']}  # the last: declared, not yet run
    assert study.ladder_summary({**cells, **longer}, args).splitlines()[2:] == rows[2:]
    del args['baseline-1M-t18M-lr0.004-s1']
    assert study.ladder_summary({**cells, **longer}, args).splitlines()[2:] == [
        '| baseline (RMSNorm) | — | 1M params · 18M tokens | 0.008 (only rate run) | s1 | 3.9000 | — | — |',
        rows[2], rows[3],  # the 1M baseline at 9M, beside 'end' below; the 0.4M baseline
        '| Internal-Taper | ema | 1M params · 18M tokens | 0.008 (only rate run) | s1 | 3.9100 | '
        '+0.26 % (one seed: no interval) | +0.7 to +1.5 % |',  # 3.91 / 3.9 − 1
        *rows[5:]]  # 'end' (1M, 9M: no 18M cell) and the 0.4M rows unchanged


def test_the_readme_summary_regenerates_from_the_results_file(tmp_path):
    out = tmp_path / 'study'
    out.mkdir()
    cells = summary_cells()
    (out / 'results.json').write_text(json.dumps({'cells': cells}))
    readme = tmp_path / 'README.md'
    readme.write_text('# x\n<!-- study:ladder:summary -->\nold\n<!-- /study:ladder:summary -->\nrest\n')
    study.main(['--matrix=ladder', f'--study_dir={out}', '--run=False', f'--readme={readme}'])
    text = readme.read_text()
    assert text.startswith('# x\n<!-- study:ladder:summary -->\n| variant | calibration |') and text.endswith('rest\n')
    # the ladder plans 'ema' at three rates per point (study.ema_grid): with one run, its best is '(so far)'
    assert '| Internal-Taper | ema | 1M params · 9M tokens | 0.008 (so far) | s1–3 |' in text and 'old' not in text
    assert '**1M model**' not in text  # the full tables go only where their own block is
    cells['internal_ema-1M-t9M-lr0.008-s3']['final_val_loss'] = 4.284  # the results change: so does the table
    (out / 'results.json').write_text(json.dumps({'cells': cells}))
    study.main(['--matrix=ladder', f'--study_dir={out}', '--run=False', f'--readme={readme}'])
    assert '+1.67 ± 0.58 % [' in readme.read_text()  # gaps +1, +2, +2 %
    # docs/results.md holds both blocks: each gets its own tables
    docs = tmp_path / 'results.md'
    docs.write_text('<!-- study:ladder:summary -->\n<!-- /study:ladder:summary -->\nnotes\n<!-- study:ladder -->\n'
                    '<!-- /study:ladder -->\n')
    study.main(['--matrix=ladder', f'--study_dir={out}', '--run=False', f'--readme={docs}'])
    summary, full = docs.read_text().split('notes\n')
    assert '| Internal-Taper | ema | 1M params · 9M tokens |' in summary and '**1M model**' not in summary
    assert '**1M model**' in full and '| 1M | 9M | internal_ema | ema | 0.008: 4.0400 |' in full
    readme.write_text('no markers\n')
    with pytest.raises(SystemExit, match='no <!-- study:ladder --> ... <!-- /study:ladder --> or'):
        study.main(['--matrix=ladder', f'--study_dir={out}', '--run=False', f'--readme={readme}'])


def test_two_drivers_filling_one_markdown_file_at_once_keep_both_blocks(tmp_path, monkeypatch):
    """--readme reads the file, fills its blocks and replaces it: a second driver that read it
    meanwhile wrote back the first one's blocks as they were, its update lost. Here driver A (matrix
    ladder) pauses between its read and its write while driver B (a second matrix) fills its own
    block: both blocks end filled."""
    out = tmp_path / 'study'
    out.mkdir()
    (out / 'results.json').write_text(json.dumps({'cells': summary_cells()}))
    monkeypatch.setitem(study.MATRICES, 'copy', study.MATRICES['ladder'])
    monkeypatch.setitem(study.TABLES, 'copy', study.TABLES['ladder'])
    monkeypatch.setitem(study.TABLES, 'copy:summary', ('ladder_summary',))
    docs = tmp_path / 'results.md'
    docs.write_text('<!-- study:ladder:summary -->\nold\n<!-- /study:ladder:summary -->\n'
                    '<!-- study:copy:summary -->\nold\n<!-- /study:copy:summary -->\n')
    real, a_read = study.marked_blocks, threading.Event()

    def slow_for_a(path, names):
        read = real(path, names)
        if threading.current_thread().name == 'A' and all(type(t) is str for t in names.values()):  # its write
            a_read.set()  # A has the file's text: B runs now, and A writes 0.5 s later
            time.sleep(0.5)
        return read

    monkeypatch.setattr(study, 'marked_blocks', slow_for_a)
    a = threading.Thread(name='A', target=study.main,
                         args=(['--matrix=ladder', f'--study_dir={out}', '--run=False', f'--readme={docs}'],))
    a.start()
    assert a_read.wait(30)
    study.main(['--matrix=copy', f'--study_dir={out}', '--run=False', f'--readme={docs}'])
    a.join()
    first, second = docs.read_text().split('<!-- study:copy:summary -->')
    assert 'old' not in first and 'old' not in second
    assert first.count('| Internal-Taper | ema |') == second.count('| Internal-Taper | ema |') > 0


def test_every_cell_of_every_matrix_names_its_calibration():
    # the default calibration changed from 'end' to the paper's 'ema' (part 3, block 3); pinned, a committed
    # cell keeps the configuration it ran with whatever the default (untapered cells too: their records)
    import train
    defaults = configurator.defaults_of(vars(train))
    for matrix, cells in study.MATRICES.items():
        for name, args in cells.items():
            argv = [a if a.startswith('--') else os.path.join(study.ROOT, a) for a in args]
            assert configurator.keys_set(argv, defaults, ('calibration',)) == {'calibration'}, (matrix, name)


def test_plot_draws_one_gate_curve_per_schedule(tmp_path):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot

    def fake_run(name, W, T, n=40):  # the log records plot.py reads, with the gate of schedule (W, T)
        d = tmp_path / name
        d.mkdir()
        gate = lambda it: 1.0 if it < W else 0.0 if it >= W + T else 0.5 * (1 + math.cos(math.pi * (it - W) / T))
        phase = lambda it: 'warmup' if it < W else 'taper' if it < W + T else 'linear'
        recs = [dict(iter=it, phase=phase(it), gate=gate(it), loss=5.0, ce=5.0, hidden_rms=1.0, logit_rms=1.0,
                     radial_cos=0.0) for it in range(n)]
        recs.insert(W, {'event': 'calibrate', 'iter': W - 1, 's_tgt': 1.0})
        (d / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in recs))
        return str(d)

    runs = [fake_run('a', 4, 10), fake_run('b', 4, 10), fake_run('c', 8, 20)]  # two schedules
    plot.main([f'--runs={",".join(runs)}', f'--out={tmp_path / "p.png"}'])
    twins = [ax for ax in plt.gcf().axes if ax.get_ylabel().startswith('gate g')]
    assert len(twins) == 4 and all(len(ax.lines) == 2 for ax in twins)  # one curve per schedule, per panel
    assert twins[0].get_ylabel() == 'gate g (2 schedules)'
    c = twins[0].lines[1]  # run c's schedule: 1 until 8, 0 from 28
    assert list(c.get_ydata()[[7, 18, 28]]) == [1.0, pytest.approx(0.5), 0.0]
    plt.close('all')


def test_the_ladder_plot_draws_each_variants_paired_gap_against_tokens(tmp_path, monkeypatch):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot
    monkeypatch.setitem(study.MATRICES, 'ladder',  # the plot draws the cells of its matrix
                        {**study.ladder_cells(('baseline', 'internal'), '1M', '3M', (4e-3, 8e-3, 1.6e-2), (1, 2)),
                         **study.ladder_cells(('dyt_noemb',), '1M', '3M', (8e-3,))})
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss}
    cells = {'dyt_noemb-1M-t3M-lr0.008-s1': cell(5.0),  # an ablation: tabulated, never plotted
             'baseline-1M-t3M-lr0.004-s1': cell(5.0), 'baseline-1M-t3M-lr0.008-s1': cell(4.8),
             'baseline-1M-t3M-lr0.016-s1': cell(4.9), 'internal-1M-t3M-lr0.004-s1': cell(4.7),
             'internal-1M-t3M-lr0.008-s1': cell(4.75),
             'internal-1M-t3M-lr0.016-s1': {'status': 'diverged', 'diverged_at': 300},
             'baseline-1M-t3M-lr0.008-s2': cell(4.8), 'internal-1M-t3M-lr0.004-s2': cell(4.75)}
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--ladder={tmp_path / "results.json"}', f'--out={tmp_path / "l.png"}'])
    handles, labels = plt.gcf().axes[0].get_legend_handles_labels()
    bars = handles[labels.index('internal, 1M model')]
    assert labels[1:] == ['internal, 1M model']  # after the paper's band; the ablation (+4.2 %) is not drawn
    line = bars.lines[0]
    assert list(line.get_xdata()) == [1500 * 16 * 128]  # the 3M point: 1500 steps of 2,048 tokens
    gaps = [100 * (4.7 / 4.8 - 1), 100 * (4.75 / 4.8 - 1)]  # each at its best rate, paired by seed
    assert list(line.get_ydata()) == [pytest.approx(np.mean(gaps))]
    (lo, hi), = [seg[:, 1] for seg in bars.lines[2][0].get_segments()]  # the error bar: ± sd over the seeds
    assert (hi - lo) / 2 == pytest.approx(np.std(gaps, ddof=1))
    # Internal-Taper's best is the grid's smallest rate: the point is drawn hollow, and the plot says why
    ax = plt.gcf().axes[0]
    hollow = [ln for ln in ax.lines if ln.get_markerfacecolor() == 'white']
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in hollow] == [([1500 * 16 * 128], list(line.get_ydata()))]
    assert any('at its edge' in t.get_text() for t in ax.texts)
    assert ax.get_yscale() == 'linear' and 'log' not in ax.get_ylabel()  # gaps of 1-2 %
    plt.close('all')
    # a gap of +25 % (DyT's kind) puts the axis on a symmetric log scale, linear within ±2 %
    cells['internal-1M-t3M-lr0.004-s1'], cells['internal-1M-t3M-lr0.008-s1'] = cell(6.0), cell(6.1)
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--ladder={tmp_path / "results.json"}', f'--out={tmp_path / "l.png"}'])
    ax = plt.gcf().axes[0]
    assert ax.get_yscale() == 'symlog' and ax.yaxis.get_transform().linthresh == 2
    assert 20 in ax.get_yticks() and 0 in ax.get_yticks() and 'log beyond ±2 %' in ax.get_ylabel()
    plt.close('all')


def test_the_ladder_plot_gives_each_model_size_its_own_marker_and_line_style(tmp_path, monkeypatch):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot
    sizes = ('3M', '0.4M', '1M')  # given out of order: the plot orders them itself
    monkeypatch.setitem(study.MATRICES, 'ladder', {n: a for size in sizes for n, a in study.ladder_cells(
        ('baseline', 'internal'), size, '3M', (8e-3,)).items()})
    cells = {n: {'status': 'finished', 'final_val_loss': 4.8 if n.startswith('baseline') else 4.7}
             for n in study.MATRICES['ladder']}
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--ladder={tmp_path / "results.json"}', f'--out={tmp_path / "l.png"}'])
    handles, labels = plt.gcf().axes[0].get_legend_handles_labels()
    style = {lab: (h.lines[0].get_marker(), h.lines[0].get_linestyle()) for h, lab in zip(handles[1:], labels[1:])}
    assert sorted(style) == ['internal, 0.4M model', 'internal, 1M model', 'internal, 3M model']
    assert all(len({st[k] for st in style.values()}) == 3 for k in (0, 1))  # three markers, three line styles
    assert style['internal, 1M model'][1] == '-'  # the 1M model: solid, as before
    plt.close('all')


def test_the_ladder_plots_labels_of_one_budget_never_overlap(tmp_path):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    ax.set_ylim(0, 1)  # 0.001 apart is a small fraction of a point
    plot.label_points(ax, [(1, 0.5, 'a', 'C0'), (1, 0.501, 'b', 'C1'), (1, 0.1, 'c', 'C2'), (2, 0.5, 'd', 'C3')])
    offset = {t.get_text(): t.xyann[1] for t in ax.texts}  # points above the labelled point
    assert offset['b'] == pytest.approx(4) and offset['d'] == pytest.approx(4) and offset['c'] == pytest.approx(4)
    points_per_unit = ax.transData.transform((0, 1))[1] - ax.transData.transform((0, 0))[1]  # pixels = points at dpi 72
    points_per_unit *= 72 / fig.dpi
    # 'a' sits 0.001 below 'b': its label goes 9 points below b's, measured from its own point
    assert offset['a'] == pytest.approx(4 - 9 + 0.001 * points_per_unit)
    plt.close('all')


def test_the_shock_plot_takes_the_logged_loss_apart_into_cross_entropy_and_l_aux(tmp_path):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot

    def fake_run(name, ce, aux=None, W=None):  # log records every 10th step
        d = tmp_path / name
        d.mkdir()
        recs = [dict(iter=it, phase='warmup', gate=1.0, loss=ce(it) + (aux(it) if aux else 0.0), ce=ce(it),
                     aux=aux(it) if aux else 0.0, hidden_rms=1.0, logit_rms=1.0, radial_cos=0.0)
                for it in range(0, 200, 10)]
        if W is not None:
            recs.insert(W // 10, {'event': 'calibrate', 'iter': W - 1, 's_tgt': 1.0})
        (d / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in recs))
        return str(d)

    base = fake_run('base', lambda it: 6.0 - it / 100)
    # the tapered run: equal until the event (step 100 is the first after it), then CE 0.5 above; L_aux 4 / (1 + step)
    run = fake_run('run', lambda it: 6.0 - it / 100 + (0.5 if it >= 100 else 0.0),
                   lambda it: 4.0 / (1 + it - 100) if it >= 100 else 0.0, W=100)
    plot.main([f'--shock={base}:{run}', f'--out={tmp_path / "s.png"}', '--smooth=1', '--shock_steps=50'])
    ax_ce, ax_aux = plt.gcf().axes
    (ce,), (aux,) = ax_ce.get_lines()[:1], ax_aux.get_lines()[:1]
    assert list(ce.get_xdata()) == [-50, -40, -30, -20, -10, 0, 10, 20, 30, 40, 50]  # from the first step after the event
    assert list(ce.get_ydata()) == pytest.approx([0.0] * 5 + [0.5] * 6)
    assert list(aux.get_xdata()) == [0, 10, 20, 30, 40, 50]
    assert list(aux.get_ydata()) == pytest.approx([4.0, 4 / 11, 4 / 21, 4 / 31, 4 / 41, 4 / 51])
    assert ax_aux.get_yscale() == 'log'
    plt.close('all')
    with pytest.raises(SystemExit, match='has no calibrate event'):
        plot.main([f'--shock={run}:{base}', f'--out={tmp_path / "s.png"}'])
    with pytest.raises(SystemExit, match='BASELINE_DIR:RUN_DIR pairs'):
        plot.main([f'--shock={base}', f'--out={tmp_path / "s.png"}'])


@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'), reason='AVX2 is an x86-64 instruction set')
def test_cpu_isa_pins_every_cells_kernels_and_the_record_says_so(tiny_matrix, tmp_path, monkeypatch):
    """--cpu_isa=avx2: each cell's train.py runs with torch's, MKL's and oneDNN's kernels pinned to
    AVX2 (the environment variables those libraries read), and its record names the pins."""
    envs, real_start = [], study.start_train
    monkeypatch.setattr(study, 'start_train', lambda cmd, **kw: (envs.append(kw.get('env')), real_start(cmd, **kw))[1])
    data = study.main(['--matrix=tiny', '--only=baseline-end-s1', f'--study_dir={tmp_path / "s"}', '--jobs=1',
                       '--cpu_isa=avx2', '--table=False'])
    pins = dict(ATEN_CPU_CAPABILITY='avx2', MKL_CBWR='AVX2', ONEDNN_MAX_CPU_ISA='AVX2')
    (train_env,) = envs
    assert {k: train_env.get(k) for k in pins} == pins
    record = data['cells']['baseline-end-s1']
    assert record['cpu_capability'] == 'AVX2' and record['cpu_pins'] == pins
    # and the host it ran on, unpinned: this process's own kernels, and the model name /proc/cpuinfo gives
    assert record['host_capability'] == torch.backends.cpu.get_cpu_capability()
    if os.path.exists('/proc/cpuinfo'):
        names = [ln.split(':')[1].strip() for ln in open('/proc/cpuinfo') if ln.startswith('model name')]
        assert record['host_cpu'] == names[0] != ''
    with pytest.raises(ValueError, match="cpu_isa='avx512'"):
        study.cpu_pins('avx512')
    with pytest.raises(SystemExit, match="config error: --cpu_isa=avx512: cpu_isa='avx512': choose one of 'avx2', ''"):  # at once, not in a cell's thread
        study.main(['--matrix=tiny', f'--study_dir={tmp_path / "isa"}', '--cpu_isa=avx512'])
    assert not (tmp_path / 'isa').exists()
    assert study.cpu_pins('') == {}  # unpinned: the machine's own kernels


@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'), reason='AVX2 is an x86-64 instruction set')
def test_the_pins_reach_torchs_kernel_dispatch():
    """The pins are what torch reads: a process started with them dispatches to AVX2 kernels
    (on an AVX512 host, not its own best)."""
    code = 'import torch; print(torch.backends.cpu.get_cpu_capability())'
    out = subprocess.run([sys.executable, '-c', code], env=dict(os.environ, **study.cpu_pins('avx2')),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == 'AVX2'


def test_part_4s_ema_grid_brackets_the_rate_tuned_with_end_at_every_point():
    best = {('0.4M', '3M'): {'baseline': 0.03, 'internal': 0.02}, ('1M', '9M'): {'baseline': 0.01, 'internal': 0.005}}
    cells = study.ema_grid(best)
    assert list(cells) == ['internal_ema-0.4M-t3M-lr0.01-s1', 'internal_ema-0.4M-t3M-lr0.02-s1', 'internal_ema-0.4M-t3M-lr0.04-s1',
                           'internal_ema-1M-t9M-lr0.0025-s1', 'internal_ema-1M-t9M-lr0.005-s1', 'internal_ema-1M-t9M-lr0.01-s1']
    cfg = study.cell_config(cells['internal_ema-1M-t9M-lr0.0025-s1'])
    assert (cfg['calibration'], cfg['taper'], cfg['learning_rate'], cfg['max_iters']) == ('ema', 'internal', 0.0025, 4500)
    # the ladder matrix holds the grid at the declared best rates; the cell part 3 ran is one of them
    assert set(study.ema_grid(study.LADDER_BEST)) <= set(study.MATRICES['ladder'])
    assert 'internal_ema-1M-t9M-lr0.008-s1' in study.ema_grid(study.LADDER_BEST)


def test_part_4s_blocks_3_to_6_run_at_the_declared_rates():
    best = {('1M', '3M'): {'baseline': 0.016, 'internal': 0.008}, ('1M', '9M'): {'baseline': 0.008, 'internal': 0.008}}
    cells = study.part4_blocks(best, {('1M', '9M'): 0.004}, {('1M', '9M'): 0.004})
    assert list(cells) == [
        'baseline-1M-t9M-lr0.00566-s1', 'baseline-1M-t9M-lr0.0113-s1',            # 3: 0.008 / √2, 0.008 · √2
        'internal_ema-1M-t9M-lr0.00283-s1', 'internal_ema-1M-t9M-lr0.00566-s1',   # 3: around 'ema''s own best
        'baseline-1M-t3M-lr0.016-s2', 'baseline-1M-t3M-lr0.016-s3',               # 4: seeds at every point
        'baseline-1M-t9M-lr0.008-s2', 'baseline-1M-t9M-lr0.008-s3',
        'internal_ema-1M-t9M-lr0.004-s2', 'internal_ema-1M-t9M-lr0.004-s3',
        'all_ema-1M-t9M-lr0.004-s1', 'all_ema-1M-t9M-lr0.004-s2', 'all_ema-1M-t9M-lr0.004-s3',  # 5
        'dyt-1M-t9M-lr0.004-s2', 'dyt-1M-t9M-lr0.004-s3', 'dyt_a2-1M-t9M-lr0.004-s1']            # 6
    cfg = study.cell_config(cells['all_ema-1M-t9M-lr0.004-s2'])
    assert (cfg['taper'], cfg['calibration'], cfg['aux_weight'], cfg['seed'], cfg['max_iters']) == ('all', 'ema', 0.1, 2, 4500)
    cfg = study.cell_config(cells['dyt_a2-1M-t9M-lr0.004-s1'])
    assert (cfg['norm'], cfg['dyt_alpha0_scale'], cfg['dyt_embed_scale'], cfg['learning_rate']) == ('dyt', 2.0, True, 0.004)
    assert study.cell_config(cells['baseline-1M-t9M-lr0.0113-s1'])['min_lr'] == pytest.approx(0.00113)
    assert study.part4_blocks({}, {}, {}) == {}  # nothing runs before its rates are known
    assert set(study.part4_blocks(study.LADDER_BEST, study.EMA_BEST, study.DYT_BEST)) <= set(study.MATRICES['ladder'])


def test_the_declared_part_4_rates_are_bracketed_bests():
    with open(os.path.join(study.ROOT, 'study', 'results.json')) as f:
        cells = json.load(f)['cells']
    # each best on the grid it was found on (block 3's midpoints, still to run, may move it later)
    grids = {'internal_ema': study.ema_grid(study.LADDER_BEST),
             **{v: {n: a for p, lrs in grid.items() for n, a in study.ladder_cells((v,), *p, lrs).items()}
                for v, grid in (('dyt', study.DYT_LRS), ('derf', study.DERF_LRS))}}
    for v, declared in (('internal_ema', study.EMA_BEST), ('dyt', study.DYT_BEST), ('derf', study.DERF_BEST)):
        for point, lr in declared.items():
            grid = {n: [] for n in grids[v] if n.startswith(f'{v}-{point[0]}-t{point[1]}-')}
            best, _, note = study.ladder_best({n: c for n, c in cells.items() if n in grid}, grid)[point][v]
            assert (best, note) == (lr, ''), (v, point)  # '': bracketed by a finished grid of three or more



def test_the_declared_3m_rung_rates_are_bracketed_bests():
    """RUNG_BEST, where part 5's seeds run, is each variant's bracketed best of seed 1 on its RUNG_LRS grid."""
    with open(os.path.join(study.ROOT, 'study', 'results.json')) as f:
        cells = json.load(f)['cells']
    for point, rates in study.RUNG_BEST.items():
        grid = study.rung_cells(point)
        found = study.ladder_best({n: c for n, c in cells.items() if n in grid}, grid)[point]
        for v, lr in rates.items():
            assert found[v][0] == lr and found[v][2] == '', (v, point)
    assert set(study.best_seeds(study.RUNG_BEST)) == {f'{v}-3M-t{t}-lr{lr}-s{s}' for t, v, lr in (
        ('3M', 'baseline', '0.004'), ('3M', 'internal_ema', '0.004'), ('9M', 'baseline', '0.008'),
        ('9M', 'internal_ema', '0.004')) for s in (2, 3)}


def test_the_gap_plot_draws_each_gap_with_its_95_interval_against_tokens_per_non_embedding_parameter(tmp_path,
                                                                                                   monkeypatch):
    pytest.importorskip('matplotlib')
    import matplotlib.pyplot as plt
    import plot
    monkeypatch.setitem(study.MATRICES, 'ladder', {
        **study.ladder_cells(('baseline', 'internal_ema'), '1M', '3M', (8e-3,), (1, 2)),
        **study.ladder_cells(('baseline', 'dyt'), '0.4M', '3M', (8e-3,)),
        **study.ladder_cells(('internal',), '1M', '3M', (8e-3,))})  # 'end': not on this figure
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss}
    cells = {'baseline-1M-t3M-lr0.008-s1': cell(4.8), 'baseline-1M-t3M-lr0.008-s2': cell(4.9),
             'internal_ema-1M-t3M-lr0.008-s1': cell(4.7), 'internal_ema-1M-t3M-lr0.008-s2': cell(4.85),
             'internal-1M-t3M-lr0.008-s1': cell(4.6),
             'baseline-0.4M-t3M-lr0.008-s1': cell(5.0), 'dyt-0.4M-t3M-lr0.008-s1': cell(5.1)}
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--gap={tmp_path / "results.json"}', f'--out={tmp_path / "g.png"}'])
    ax, ax_free = plt.gcf().axes  # TaperNorm above, the norm-free baselines on an axis of their own
    handles, labels = ax.get_legend_handles_labels()
    free_handles, free_labels = ax_free.get_legend_handles_labels()
    assert labels[1:] == ['Internal-Taper, ema, 1M model'] and free_labels == ['DyT, 0.4M model']  # README's names
    # non-embedding parameters by hand: per block 12 d² (attention 4 d², MLP 8 d²) + 9 d (the linear layers'
    # biases) + 2 d (ln_1, ln_2's γ), eight blocks, and ln_f's γ
    per_param = {d: 8 * (12 * d * d + 11 * d) + d for d in (32, 64)}
    tokens = 1500 * 16 * 128
    ema = handles[1]
    x, = ema.lines[0].get_xdata()
    assert x / plot.side_by_side(plot.GAP_ORDER.index('internal_ema')) == pytest.approx(tokens / per_param[64])
    gaps = np.array([100 * (4.7 / 4.8 - 1), 100 * (4.85 / 4.9 - 1)])
    y, = ema.lines[0].get_ydata()
    assert y == pytest.approx(gaps.mean())
    (lo, hi), = [seg[:, 1] for seg in ema.lines[2][0].get_segments()]
    assert (hi - lo) / 2 == pytest.approx(12.7062047 * gaps.std(ddof=1) / np.sqrt(2), rel=1e-6)  # t(0.975, 1 df)
    dyt = free_handles[0]
    assert dyt.lines[0].get_xdata()[0] / plot.side_by_side(plot.GAP_ORDER.index('dyt')) == \
        pytest.approx(tokens / per_param[32])
    assert not dyt.lines[2] and dyt.lines[0].get_markerfacecolor() == 'white'  # one seed: hollow, no interval
    assert any('one seed' in t.get_text() for t in ax_free.texts) and ax.get_xscale() == 'log'
    # the interval (−8.3, +5.2 %: t on 1 df) reaches over 3 points past the means, zero and the band: the axis
    # holds those, and each end leaves it with an arrow and its value
    assert ax.get_ylim()[0] > -8 and ax.get_ylim()[1] < 3
    assert sorted(t.get_text() for t in ax.texts if t.arrow_patch) == sorted(f'{e:+.1f} %' for e in (lo, hi))
    plt.close('all')


def test_the_line_fit_of_the_gap_against_log_tokens_per_parameter_crosses_where_worked_by_hand():
    import plot
    # two points, given out of order: gap = −3 + log10(x), so 0 % at x = 1000 and +0.7 % at 10^3.7
    fit = plot.line_fit([(100, -1.0, 0.2), (10, -2.0, 0.1)])
    assert fit['slope'] == pytest.approx(1 / math.log(10)) and fit['intercept'] == pytest.approx(-3)
    assert fit['crossings'] == {0.0: pytest.approx(1000), 0.7: pytest.approx(10 ** 3.7)}
    # at x = 1000 the line is −1 × the first gap + 2 × the second: se = sqrt(0.1² + (2 · 0.2)²)
    assert plot.fit_at(fit, 1000) == (pytest.approx(0), pytest.approx(math.sqrt(0.17)))
    assert plot.fit_at(fit, 10) == (pytest.approx(-2), pytest.approx(0.1))  # at a point: that point
    # three points at ln x = 0, 1, 2 with gaps 0, 1, 5: least squares, slope 2.5 (Sxy 5 / Sxx 2), intercept
    # 2 − 2.5 = −0.5: 0 % at ln x = 0.2, +0.7 % at 0.48; a one-seed point (se nan) leaves no se
    fit = plot.line_fit([(1, 0.0, 0.1), (math.e, 1.0, float('nan')), (math.e ** 2, 5.0, 0.1)])
    assert (fit['slope'], fit['intercept']) == (pytest.approx(2.5), pytest.approx(-0.5))
    assert fit['crossings'] == {0.0: pytest.approx(math.exp(0.2)), 0.7: pytest.approx(math.exp(0.48))}
    assert math.isnan(plot.fit_at(fit, 1)[1])
    # a flat line never gets there; one past a float's range gets there at infinity
    assert plot.line_fit([(1, -1.0, 0.1), (2, -1.0, 0.1)])['crossings'] == {0.0: None, 0.7: None}
    assert plot.line_fit([(1, -1.0, 0.1), (math.e, -1 + 1e-6, 0.1)], (0.0,))['crossings'] == {0.0: math.inf}
    for bad in ([(10, -1.0, 0.1)], [(10, -1.0, 0.1), (10, -2.0, 0.1)], [(0, -1.0, 0.1), (10, -2.0, 0.1)]):
        with pytest.raises(ValueError, match='two or more distinct x > 0'):
            plot.line_fit(bad)
    with pytest.raises(ValueError, match='x must be > 0'):
        plot.fit_at(plot.line_fit([(1, 0.0, 0.1), (2, 1.0, 0.1)]), 0)


def test_gap_fits_reads_each_sizes_gaps_from_the_results_and_predicts_the_full_pass(tmp_path, monkeypatch, capsys):
    import plot
    monkeypatch.setitem(study.MATRICES, 'ladder', {  # 18M declared, not run: the full pass the line predicts
        n: a for b in ('3M', '9M', '18M') for n, a in study.ladder_cells(('baseline', 'internal_ema'), '1M', b, (8e-3,),
                                                                        (1, 2)).items()})
    cell = lambda loss: {'status': 'finished', 'final_val_loss': loss}
    cells = {**{f'baseline-1M-t{b}-lr0.008-s{s}': cell(4.0) for b in ('3M', '9M') for s in (1, 2)},
             'internal_ema-1M-t3M-lr0.008-s1': cell(3.92), 'internal_ema-1M-t3M-lr0.008-s2': cell(3.96),  # −2, −1 %
             'internal_ema-1M-t9M-lr0.008-s1': cell(3.98), 'internal_ema-1M-t9M-lr0.008-s2': cell(3.99)}  # −0.5, −0.25 %
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    f = plot.gap_fits(tmp_path / 'results.json')['1M']
    params, step = 8 * (12 * 64 * 64 + 11 * 64) + 64, 16 * 128  # non-embedding parameters; tokens a step
    assert f['params'] == params and [p['budget'] for p in f['points']] == ['3M', '9M']
    assert [p['per_param'] for p in f['points']] == [pytest.approx(n * step / params) for n in (1500, 4500)]
    assert [p['mean'] for p in f['points']] == [pytest.approx(-1.5), pytest.approx(-0.375)]
    assert f['points'][0]['high'] == pytest.approx(-1.5 + 12.7062047 * 0.5, rel=1e-6)  # t(0.975, 1 df) · sd / √2
    assert (f['rising'], f['toward_zero'], f['overlap']) == (True, True, [True])
    # slope 1.125 / ln 3 per e-fold: zero 0.375 / slope = ln 3 / 3 e-folds past 9M tokens, at 3^(1/3) × its x
    slope = 1.125 / math.log(3)
    assert f['fit']['slope'] == pytest.approx(slope)
    assert f['fit']['crossings'][0.0] == pytest.approx(4500 * step / params * 3 ** (1 / 3))
    assert f['full'] == (9000 * step, pytest.approx(9000 * step / params))
    assert plot.fit_at(f['fit'], f['full'][1])[0] == pytest.approx(-0.375 + slope * math.log(2))  # twice 9M's tokens
    assert plot.gap_fits(tmp_path / 'results.json', budgets=['3M'])['1M']['fit'] is None  # one budget: no line
    plot.main([f'--fit={tmp_path / "results.json"}'])
    out = capsys.readouterr().out
    assert '1M model (398,912 non-embedding parameters)' in out and 'monotonically toward zero: yes' in out
    assert f"at one full pass (18.4M tokens, x = 46.2): {-0.375 + slope * math.log(2):+.2f} %" in out
    assert 'reaches +0.0 % at x = 33.3, 13.3M tokens (an extrapolation)' in out
    # the full pass lands (0 and −0.1 %): the line through 3M and 9M stays the prediction it is checked against
    cells.update({f'baseline-1M-t18M-lr0.008-s{s}': cell(4.0) for s in (1, 2)})
    cells.update({'internal_ema-1M-t18M-lr0.008-s1': cell(4.0), 'internal_ema-1M-t18M-lr0.008-s2': cell(3.996)})
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    f = plot.gap_fits(tmp_path / 'results.json')['1M']
    assert [p['budget'] for p in f['points']] == ['3M', '9M', '18M'] and f['fit']['slope'] != pytest.approx(slope)
    plot.main([f'--fit={tmp_path / "results.json"}'])
    out = capsys.readouterr().out
    predicted = -0.375 + slope * math.log(2)
    assert '  line through 3M, 9M, 18M: ' in out and '  pre-stated line through 3M, 9M: ' in out
    assert f"{predicted:+.2f} % ± " in out and f"measured there: {study.fmt_gap([0.0, -0.1])}, " in out
    assert f"{-0.05 - predicted:+.2f} points from the prediction, " in out
    # one seed at the full pass (as the first part-6 pair landed): the line through it has no standard error there
    for name in ('baseline-1M-t18M-lr0.008-s2', 'internal_ema-1M-t18M-lr0.008-s2'):
        del cells[name]
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--fit={tmp_path / "results.json"}'])
    out = capsys.readouterr().out
    assert '(no standard error: a point of one seed)' in out and 'nan' not in out
    # seeds whose gaps agree exactly at every budget: standard errors of 0, where the miss divided by zero
    for b, loss in (('3M', 4.08), ('9M', 4.04), ('18M', 4.02)):
        cells.update({f'baseline-1M-t{b}-lr0.008-s{s}': cell(4.0) for s in (1, 2)})
        cells.update({f'internal_ema-1M-t{b}-lr0.008-s{s}': cell(loss) for s in (1, 2)})
    (tmp_path / 'results.json').write_text(json.dumps({'cells': cells}))
    plot.main([f'--fit={tmp_path / "results.json"}'])
    out = capsys.readouterr().out
    assert ' points from the prediction' in out
    assert 'standard errors (the seeds' not in out


def test_part_5s_derf_cells_run_on_dyts_grid_moved_up_where_its_edge_won_and_seeds_2_3_at_a_declared_best():
    derf = {n for n in study.MATRICES['ladder'] if n.startswith('derf-')}
    assert derf == ({f'derf-1M-t9M-lr{lr:g}-s1' for lr in study.DYT_LRS['1M', '9M']} |
                    {f'derf-0.4M-t18M-lr{lr:g}-s1' for lr in (0.008, 0.016, 0.032)} |  # 1.6e-2 beat 8e-3
                    {f'derf-{size}-t{budget}-lr{lr:g}-s{s}' for (size, budget), lr in study.DERF_BEST.items() for s in (2, 3)} |
                    {'derf-1M-t9M-lr0.004-s2', 'derf-1M-t9M-lr0.004-s3'})  # part 6's loose end: the rate below
    assert 'derf-1M-t9M-lr0.008-s3' in derf
    assert study.cell_config(study.MATRICES['ladder']['derf-1M-t9M-lr0.004-s1'])['norm'] == 'derf'



def test_part_5s_warmup_cells_differ_from_the_ladders_only_in_the_gate_warmup():
    """The W = 25 % cells: both calibrations at (1M, 9M), 8e-3, seed 1, W = 4500 // 4 = 1125 steps (T and the
    rest as the ladder's: 2250 taper steps, linear from step 3375), and nothing else changed."""
    ladder = study.MATRICES['ladder']
    for v in ('internal', 'internal_ema'):
        mine, theirs = (study.cell_config(ladder[f'{name}-1M-t9M-lr0.008-s1']) for name in (f'{v}_w25', v))
        assert (mine['gate_warmup_iters'], mine['taper_iters'], theirs['gate_warmup_iters']) == (1125, 2250, 450)
        assert {k for k in mine if mine[k] != theirs[k]} == {'gate_warmup_iters'}
    assert {n for n in ladder if '_w25-' in n} == {f'{v}_w25-1M-t9M-lr0.008-s{s}'
                                                   for v in ('internal', 'internal_ema') for s in (1, 2, 3)}
    for v in ('internal_w25', 'internal_ema_w25', 'derf'):  # part 6's seeds 2-3: only the seed differs
        lr = 0.004 if v == 'derf' else 0.008
        one, *more = (study.cell_config(ladder[f'{v}-1M-t9M-lr{lr:g}-s{s}']) for s in (1, 2, 3))
        assert all({k for k in c if c[k] != one[k]} == {'seed'} for c in more) and [c['seed'] for c in more] == [2, 3]
