"""The GPU check's own machinery, on the CPU: .ci/gpu's `step` (its timeouts end every step and all
it started), each mode's bound against a 10-minute limit on one command, the environment step's
import check, and the compile count .ci/gpu_train.py states for its schedule."""

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bench
import configurator
import study
import train
from test_train import read_log

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / '.ci' / 'gpu'
MODES = ('quick', 'full', 'study', 'train', 'paper')
TEN_MINUTES = 600  # s: the limit on one command where the GPU runs (.ci/gpu's modes fit it)


def gpu_bash(script, tmp_path):
    """Run script in bash after sourcing .ci/gpu (its functions only), OUT=tmp_path, this Python
    first on PATH. Returns (CompletedProcess, seconds it took)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    t0 = time.monotonic()
    proc = subprocess.run(['bash', '-c', f'source {GPU} && OUT={tmp_path} && {script}'], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)
    return proc, time.monotonic() - t0


def gpu_variable(name):
    """A NAME=VALUE line's value in .ci/gpu (quotes dropped)."""
    return re.search(rf"^{name}=('?)([^'\n#]*)\1", GPU.read_text(), re.M).group(2).strip()


def mode_steps(mode):
    """[(name, timeout s)] of the steps `bash .ci/gpu MODE` runs: the steps before `case` (every
    mode's), then those of the mode's branch."""
    text = GPU.read_text()
    common, cases = text.split('\ncase $mode in\n')
    branch = re.search(rf'^{mode}\)\n(.*?)^    ;;', cases, re.M | re.S).group(1)
    return [(n, int(s)) for n, s in re.findall(r'^step (\S+) (\d+) ', common, re.M) +
            re.findall(r'^\s+step (\S+) (\d+) ', branch, re.M)]


def mode_commands(mode):
    """[(step name, argv)] of the commands the mode's own steps run (continued lines joined, the
    CPU pin "${pin[@]}" dropped): ['python3', 'bench.py', '--size=9M', ...]."""
    cases = GPU.read_text().replace('\\\n', ' ').split('\ncase $mode in\n')[1]
    branch = re.search(rf'^{mode}\)\n(.*?)^    ;;', cases, re.M | re.S).group(1)
    return [(n, [w for w in shlex.split(rest) if w != '${pin[@]}'])
            for n, rest in re.findall(r'^\s+step (\S+) \d+ (.*)$', branch, re.M)]

def running(pid):
    """Whether process pid runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def test_a_step_that_ignores_its_sigterm_is_killed_soon_after_its_timeout(tmp_path):
    """`timeout` alone sends one SIGTERM: a step that ignores it (pytest inside train.main, whose
    handler finishes the step and raises SystemExit that pytest records) ran on past its limit.
    The kill reaches the step's children too (the subprocesses pytest starts)."""
    kill_after = int(gpu_variable('KILL_AFTER'))
    assert 1 <= kill_after <= 30
    # ignores SIGTERM, and so does its child (an ignored signal stays ignored in children)
    stubborn = f'bash -c \'trap "" TERM; sleep 60 & echo $! > {tmp_path}/child.pid; wait\''
    proc, took = gpu_bash(f'step stubborn 2 {stubborn}; step quick 5 echo done; summary; '
                          f'echo "failed: ${{failed[*]}}"', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert 2 <= took < 2 + kill_after + 10, proc.stdout  # not the 60 s the command asked for
    lines = proc.stdout.splitlines()
    ended = next(line for line in lines if line.startswith('==== stubborn: exit'))
    assert ended.startswith(f'==== stubborn: exit 137 (timed out, killed {kill_after} s after the SIGTERM) after ')
    seconds = int(ended.split(' after ')[-1].split()[0])  # bash's whole seconds
    assert 2 + kill_after - 1 <= seconds <= 2 + kill_after + 2, ended
    if sys.platform == 'linux':
        assert not running(int((tmp_path / 'child.pid').read_text()))
    quick = next(line for line in lines if line.startswith('==== quick: exit'))
    assert re.fullmatch(r'==== quick: exit 0 after [01] s', quick)  # the next step runs as usual
    assert 'done' in lines and (tmp_path / 'quick.txt').read_text().endswith('\ndone\n')  # after the GPU's list
    quick_s = int(quick.split()[-2])
    assert lines[-2] == f'durations: stubborn {seconds} s, quick {quick_s} s | {seconds + quick_s} s in all'
    assert lines[-1] == 'failed: stubborn'


def test_a_step_that_ends_on_its_sigterm_says_it_timed_out(tmp_path):
    proc, took = gpu_bash('step polite 1 sleep 30', tmp_path)
    assert took < 10, proc.stdout
    assert any(re.fullmatch(r'==== polite: exit 124 \(timed out\) after [12] s', line)
               for line in proc.stdout.splitlines()), proc.stdout



@pytest.mark.skipif(sys.platform != 'linux', reason='a subreaper and /proc: Linux only')
def test_a_step_ends_every_process_it_started_in_a_session_of_its_own(tmp_path):
    """torchrun starts its workers with setsid, out of reach of a process group's signals: those of a
    step that timed out, and those still running when a step ended, kept the GPU's memory."""
    # a worker as torchrun starts one: a session of its own, deaf to SIGTERM; it writes "pid session"
    worker = tmp_path / 'worker.sh'
    worker.write_text('trap "" TERM\nread -a stat < /proc/$$/stat\necho "$$ ${stat[5]}" > "$1"\nexec sleep 60\n')
    def starts(name, then):  # a step command: start a worker, wait until it runs, then `then`
        pids = tmp_path / f'{name}.pid'
        return f'bash -c "setsid bash {worker} {pids} & until [ -s {pids} ]; do sleep 0.05; done; {then}"'
    proc, took = gpu_bash(f'KILL_AFTER=1; step hung 1 {starts("hung", "sleep 60")}; '
                          f'step ended 5 {starts("ended", "true")}', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert took < 10, proc.stdout
    lines = proc.stdout.splitlines()
    assert any(re.fullmatch(r'==== hung: exit 137 \(timed out, killed 1 s after the SIGTERM\) after [2-4] s', line)
               for line in lines), proc.stdout
    assert any(re.fullmatch(r'==== ended: exit 0 after [0-3] s', line) for line in lines), proc.stdout
    for name in ('hung', 'ended'):
        pid, session = map(int, (tmp_path / f'{name}.pid').read_text().split())
        assert pid == session != os.getsid(0)  # it did run in a session of its own
        assert not running(pid), name
        assert re.search(rf'^step: SIGKILL to (\d+ )*{pid}\b', (tmp_path / f'{name}.txt').read_text(), re.M)


def test_a_step_first_lists_the_gpus_compute_processes(tmp_path):
    """On screen and at the head of the step's output, so that what an earlier command left on the
    GPU shows beside the figures; an nvidia-smi that fails does not fail the step (nor does none)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    fake = bin_dir / 'nvidia-smi'
    fake.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/args"\n'
                    'echo "pid, process_name, used_gpu_memory [MiB]"\necho "4242, python3, 512 MiB"\nexit $FAKE_RC\n')
    fake.chmod(0o755)
    # 30 lines: more than the 25 a step shows of its output when it ends
    proc, _ = gpu_bash(f'export PATH={bin_dir}:$PATH FAKE_RC=0; step one 5 seq 30; '
                       f'export FAKE_RC=9; step two 5 echo more', tmp_path)
    assert proc.returncode == 0, proc.stderr
    listing = ['GPU compute processes before the step:', 'pid, process_name, used_gpu_memory [MiB]',
               '4242, python3, 512 MiB']
    lines = proc.stdout.splitlines()
    start = lines.index('==== one (timeout 5 s): seq 30')
    assert lines[start + 1:start + 4] == listing  # before the step's own output
    assert lines[start + 4:start + 29] == [str(i) for i in range(6, 31)]
    assert (tmp_path / 'one.txt').read_text().splitlines() == listing + [str(i) for i in range(1, 31)]
    assert (tmp_path / 'two.txt').read_text().splitlines()[2:] == ['4242, python3, 512 MiB (exit 9)', 'more']
    assert '==== two: exit 0 after 0 s' in lines or '==== two: exit 0 after 1 s' in lines
    assert (bin_dir / 'args').read_text().splitlines() == [
        '--query-compute-apps=pid,process_name,used_memory --format=csv'] * 2

@pytest.mark.parametrize('mode', MODES)
def test_each_mode_ends_within_ten_minutes_and_docs_give_its_timeouts(mode):
    """A mode's worst case: every step runs to its timeout and is then killed KILL_AFTER s later.
    docs/runs.md's table row for the mode lists the same timeouts and that bound."""
    steps, kill_after = mode_steps(mode), int(gpu_variable('KILL_AFTER'))
    assert steps[0][0] == 'environment' and len(steps) >= 2
    bound = sum(s for _, s in steps) + kill_after * len(steps)
    assert bound <= TEN_MINUTES - 10, (mode, steps)  # 10 s for the shell, the summary and the study's cell list
    assert re.search(rf'bash \.ci/gpu \[?{mode}\]?\s+# <= {bound} s \(', GPU.read_text()), 'its header line'
    rows = [line.split(' | ') for line in (ROOT / 'docs' / 'runs.md').read_text().splitlines()
            if line.startswith('| `bash .ci/gpu') and re.search(rf'\b{mode}\b', line.split(' | ')[0])]
    assert len(rows) == 1, mode
    _, what, at_most = rows[0]
    assert [int(s) for s in re.findall(r'\b(\d+) s\b', what)] == [s for _, s in steps], what
    assert at_most == f'{bound} s |'


def third_party_imports(entries):
    """The top-level names of the modules that the files `entries` import when they load, and the
    repository's modules they import in turn (module-level statements: what runs on import),
    leaving out the standard library and torch (the GPU image keeps its own)."""
    local = {p.stem: p for p in [*ROOT.glob('*.py'), *(ROOT / 'tests').glob('*.py')]}
    todo, seen, found = list(entries), set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top, file = name.split('.')[0], ROOT.joinpath(*name.split('.')).with_suffix('.py')
                if top in local:
                    todo.append(local[top])
                elif (ROOT / top).is_dir():  # a package of the repository (data.common): follow its module
                    todo.extend([file] if file.is_file() else [])
                elif top not in sys.stdlib_module_names and top != 'torch':
                    found.add(top)
    return found


@pytest.mark.parametrize('mode', MODES)
def test_each_modes_bench_and_study_commands_are_settings_the_script_accepts(mode):
    """A flag or combination a script refuses would spend a lent GPU's step on a config error: every
    `python3 bench.py ...` of the mode passes bench's own check (configure with bench.architecture),
    every `python3 study.py ...` study's parse (its shell variables as text)."""
    checked = 0
    for _, argv in mode_commands(mode):
        if argv[:2] == ['python3', 'bench.py']:
            configurator.configure(argv[2:], vars(bench), choices=bench.CHOICES, validate=bench.architecture)
            checked += 1
        elif argv[:2] == ['python3', 'study.py']:
            configurator.configure(argv[2:], study.DEFAULTS, choices={'matrix': tuple(study.MATRICES)})
            checked += 1
    assert checked  # every mode runs one of them: a command this test no longer recognizes fails it

def test_the_environment_step_checks_every_module_the_steps_import():
    """NEEDS names exactly the modules, besides torch, that the steps' scripts import when they
    load (a script missing one fails at once on a GPU machine that cannot install it)."""
    text = GPU.read_text()
    steps = [line for line in text.splitlines() if re.match(r'\s*(step |cells=)', line)]
    scripts = sorted({ROOT / m for line in steps for m in re.findall(r'[\w./]+\.py\b', line)})
    assert {p.relative_to(ROOT).as_posix() for p in scripts} == {
        'bench.py', '.ci/gpu_train.py', 'tests/test_cuda.py', 'study.py'}
    entries = [*scripts, ROOT / 'tests' / 'conftest.py']  # pytest loads the tests' conftest first
    run_as_modules = {m for line in steps for m in re.findall(r'python3 -m (\w+)', line)}  # pytest
    assert set(gpu_variable('NEEDS').split()) == third_party_imports(entries) | run_as_modules
    assert {'numpy', 'pytest', 'tqdm'} <= set(gpu_variable('NEEDS').split())


def test_missing_imports_names_every_missing_module_on_one_line(tmp_path):
    proc, _ = gpu_bash('missing_imports; NEEDS="numpy no_such_module_a tqdm no_such_module_b" missing_imports',
                       tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == '\nno_such_module_a no_such_module_b\n'  # all present here; then the two missing


def load_gpu_train():
    """.ci/gpu_train.py as a module (its runs start only as a script)."""
    spec = importlib.util.spec_from_file_location('gpu_train', ROOT / '.ci' / 'gpu_train.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('taper, versions', [
    # training in warmup, taper, linear (3); evaluation at iterations 0 (warmup) and 100 (taper:
    # 40-139) only (2); the calibrate event's 'mismatch' pass ('ema': no 'calibration' pass) (1)
    ('internal', 6),
    ('all', 6),
    ('none', 2),  # training and evaluation of the one baseline phase
])
def test_gpu_trains_schedule_compiles_the_versions_it_states(toy_data, tmp_path, monkeypatch, taper, versions):
    """.ci/gpu_train.py's 200-step run, its own arguments (schedule, default calibration) on the toy
    data and model, in fp32 on the CPU, counted with dynamo's eager backend."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    gpu_train = load_gpu_train()
    aux_weight = dict(gpu_train.KINDS)[taper]
    argv = gpu_train.run_args(toy_data, tmp_path / 'run', taper, aux_weight, 200)
    assert not any(a.startswith('--calibration=') for a in argv)  # train.py's default: 'ema'
    toy = dict(dataset='toy', device='cpu', dtype='float32', compile=True, n_layer=1, n_head=2, n_embd=16,
               block_size=8, batch_size=2, gradient_accumulation_steps=1, eval_iters=2, dropout=0.0)
    torch._dynamo.reset()
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model, **kw: real_compile(model, backend=counter, **kw))
    monkeypatch.setattr(train, 'check_compiler', lambda device: None)  # its probe would count too
    train.main(argv + [f'--{k}={v}' for k, v in toy.items()])  # the last value of a key wins
    log = read_log(tmp_path / 'run')
    assert [r['iter'] for r in log if 'val_loss' in r] == [0, 100]
    assert counter.frame_count == versions == gpu_train.EXPECTED_VERSIONS[taper]
    assert '6 for a tapered run, 2 for the baseline' in ' '.join(gpu_train.__doc__.split())
    torch._dynamo.reset()
