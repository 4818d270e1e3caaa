"""study.py: a resumable matrix of train.py runs, its results file and tables."""

import json
import os

import pytest

import study


@pytest.fixture
def tiny_matrix(toy_data, monkeypatch):
    cells = {n: a + [f'--data_dir={toy_data}'] for n, a in study.MATRICES['tiny'].items()}
    monkeypatch.setitem(study.MATRICES, 'tiny', cells)
    return cells


def test_two_cells_run_skip_resume_and_record_divergence(tiny_matrix, tmp_path, capsys):
    out = tmp_path / 'study'
    data = study.main(['--matrix=tiny', f'--study_dir={out}', '--jobs=2'])
    cells = data['cells']
    assert set(cells) == {'baseline-end-s1', 'all-end-s1'}
    for name, c in cells.items():
        assert c['status'] == 'finished' and c['threads'] == 1 and c['torch'] and 'git_commit' in c
        log = [json.loads(line) for line in open(out / name / 'log.jsonl')]
        assert c['final_val_loss'] == log[-1]['final_val_loss']
        assert c['final_train_loss'] == log[-1]['final_train_loss']
    assert set(cells['all-end-s1']['calibrate']['mismatch']) == {'h.0.ln_1', 'h.0.ln_2', 'ln_f'}
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

    with pytest.raises(SystemExit, match="only='nope': nope not in matrix 'tiny'"):
        study.main(['--matrix=tiny', f'--study_dir={out}', '--only=nope'])
    # a finished cell is skipped: nothing is appended to its log
    before = (out / 'all-end-s1' / 'log.jsonl').read_text()
    study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    assert (out / 'all-end-s1' / 'log.jsonl').read_text() == before

    # a half-finished cell (its final record gone, its checkpoint there) continues with resume
    lines = before.splitlines(keepends=True)
    (out / 'all-end-s1' / 'log.jsonl').write_text(''.join(lines[:-1]))
    os.remove(out / 'results.json')
    data = study.main(['--matrix=tiny', f'--study_dir={out}', '--table=False'])
    assert 'resuming' in (out / 'all-end-s1' / 'train.out').read_text()
    assert data['cells']['all-end-s1']['final_val_loss'] == pytest.approx(json.loads(lines[-1])['final_val_loss'])


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
