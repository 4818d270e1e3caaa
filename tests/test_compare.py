"""compare.py reads finished runs and compares them on the taper iterations."""

import json

import pytest

import compare


def write_run(folder, final, step_ms, tapered):
    folder.mkdir()
    records = []
    for it in range(10):
        phase = ('warmup' if it < 2 else 'taper' if it < 6 else 'linear') if tapered else 'baseline'
        r = dict(iter=it, phase=phase, loss=1.0, hidden_rms=0.5 + it, logit_rms=2.0 + it, step_ms=step_ms(it))
        if it == 4:
            r['val_loss'] = 1.0  # an evaluation step: its time is excluded
        records.append(r)
    records.append({'iter': 10, 'final_val_loss': final})
    (folder / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(folder)


def test_compare_relative_loss_and_taper_step_time(tmp_path, capsys):
    base = write_run(tmp_path / 'base', 4.0, lambda it: 100.0 if it != 4 else 1e6, tapered=False)
    tap = write_run(tmp_path / 'tap', 4.1, lambda it: 10.0 * it if it != 4 else 1e6, tapered=True)
    compare.main([base, tap])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])['runs']
    assert rows[1]['rel_diff'] == pytest.approx(0.025)
    assert rows[1]['median_taper_step_ms'] == 30.0  # iterations 2, 3, 5 (4 is an eval step)
    assert rows[1]['step_time_ratio'] == pytest.approx(0.3)
    assert rows[0]['hidden_rms'] == 9.5 and rows[1]['logit_rms'] == 11.0  # the last logged step


def test_compare_refuses_an_unfinished_run(tmp_path):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'log.jsonl').write_text(json.dumps({'iter': 0, 'loss': 1.0}) + '\n')
    with pytest.raises(SystemExit, match='not finished'):
        compare.main([str(tmp_path / 'run'), str(tmp_path / 'run')])
