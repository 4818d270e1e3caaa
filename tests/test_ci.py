"""The GPU check's own machinery, on the CPU: .ci/gpu's `step` (its timeouts end every step),
each mode's bound against the device tool's 10 minutes and the environment step's import check."""

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / '.ci' / 'gpu'
MODES = ('quick', 'full', 'study')
TEN_MINUTES = 600  # s: the device tool's limit on one command


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
    assert 'done' in lines and (tmp_path / 'quick.txt').read_text() == 'done\n'
    quick_s = int(quick.split()[-2])
    assert lines[-2] == f'durations: stubborn {seconds} s, quick {quick_s} s | {seconds + quick_s} s in all'
    assert lines[-1] == 'failed: stubborn'


def test_a_step_that_ends_on_its_sigterm_says_it_timed_out(tmp_path):
    proc, took = gpu_bash('step polite 1 sleep 30', tmp_path)
    assert took < 10, proc.stdout
    assert any(re.fullmatch(r'==== polite: exit 124 \(timed out\) after [12] s', line)
               for line in proc.stdout.splitlines()), proc.stdout


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
            for top in {n.split('.')[0] for n in names}:
                if top in local:
                    todo.append(local[top])
                elif top not in sys.stdlib_module_names and top != 'torch':
                    found.add(top)
    return found


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
