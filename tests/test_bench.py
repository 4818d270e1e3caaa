"""bench.py: end to end on a tiny model, its JSON record, the correctness gate, bad settings."""

import json
import re

import pytest
import torch

import bench
import bench_train
import benchkit
import fold
from runs import save_checkpoint

TINY = ['--size=', '--n_layer=2', '--n_embd=32', '--n_head=2', '--vocab_size=128', '--block_size=64',
        '--prompt_len=8', '--new_tokens=8', '--trials=2', '--compile=eager', '--device=cpu']
FIELDS = {'variant', 'compiled', 'ms_per_step', 'tokens_per_s', 'tokens_per_s_per_seq', 'ttft_ms',
          'speedup_vs_baseline', 'gbps'}


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_runs_end_to_end_and_ends_with_one_json_line(capsys):
    bench.main(TINY)
    record = last_json(capsys)
    assert set(record) >= {'device', 'torch', 'config', 'results'}
    assert record['config'] == dict(size='', n_layer=2, n_head=2, n_embd=32, vocab_size=128, block_size=64,
                                    batch_size=1, prompt_len=8, new_tokens=8, dtype='float32', tf32=False, trials=2,
                                    seed=1337, mode='decode', compile='eager', ckpt='')
    assert [r['variant'] for r in record['results']] == list(bench.VARIANTS)
    for r in record['results']:
        assert FIELDS <= set(r) and r['compiled'] is False
        assert r['tokens_per_s'] == pytest.approx(1000 / r['ms_per_step'])  # batch_size 1
        assert not any('per_token' in key for key in r)
        assert r['ttft_ms'] > 0 and r['gbps'] > 0
    assert record['results'][0]['speedup_vs_baseline'] == 1.0


def test_every_row_keeps_its_trials_and_the_speedup_its_paired_interval(capsys):
    """ms_range is [min, max] of the row's trials; speedup_interval, with 3 rounds, the [min, max] of the
    per-round ratios baseline ÷ variant (sign test: fewer than 6 pairs reach no 95 %), worked here from
    the trials; the table prints it beside the speed-up."""
    bench.main(TINY + ['--trials=3'])
    out = capsys.readouterr().out
    rows = {r['variant']: r for r in json.loads(out.strip().splitlines()[-1])['results']}
    base = rows['baseline']['ms_per_step_trials']
    assert 'speedup_interval' not in rows['baseline']
    for name, r in rows.items():
        assert len(r['ms_per_step_trials']) == 3 and r['ms_range'] == [min(r['ms_per_step_trials']),
                                                                        max(r['ms_per_step_trials'])]
        assert r['ms_per_step'] == sorted(r['ms_per_step_trials'])[1]
        if name != 'baseline':
            ratios = [b / v for b, v in zip(base, r['ms_per_step_trials'])]
            assert r['speedup_interval'] == [min(ratios), max(ratios)] and r['speedup_coverage'] == 1 - 2 / 8
            assert f"[{min(ratios):.3f}, {max(ratios):.3f}]" in out


@pytest.mark.parametrize('n, j, coverage', [
    (5, 1, 1 - 2 / 32),                                # too few for 95 %: [min, max]
    (6, 1, 1 - 2 / 64),
    (9, 2, 1 - 2 * (1 + 9) / 512),                     # j = 3 would cover 1 − 2·46/512 = 82 %
    (15, 4, 1 - 2 * (1 + 15 + 105 + 455) / 2 ** 15),   # j = 5: 1 − 2·1941/2^15 = 88 %
    (25, 8, 1 - 2 * sum(map(__import__('math').comb, [25] * 8, range(8))) / 2 ** 25),
])
def test_the_paired_ratio_interval_is_the_sign_tests(n, j, coverage):
    """benchkit.median_ratio_interval against order statistics and binomial sums worked by hand:
    the ratios 1/n, 2/n, ... shuffled, so the j-th smallest is j/n."""
    import benchkit
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
    numerators = [float(k + 1) for k in order]
    lo, hi, got = benchkit.median_ratio_interval(numerators, [float(n)] * n)
    assert (lo, hi) == (j / n, (n + 1 - j) / n) and got == pytest.approx(coverage)
    assert (got >= 0.95) == (n >= 6)


def test_each_round_calls_every_run_once_in_an_order_that_changes_who_follows_whom():
    """A rotation (A B C D, B C D A, ...) calls every run once a round, but D precedes A in all rounds but
    one: whatever D leaves behind always lands on A. interleaved's rounds: each a permutation, the same
    for the same seed, and over 40 rounds every run is first at times and follows each other run."""
    names = ['A', 'B', 'C', 'D']
    orders = benchkit.round_orders(names, 40)
    assert all(sorted(o) == names for o in orders) and orders == benchkit.round_orders(names, 40)
    assert benchkit.round_orders(names, 40, seed=1) != orders
    assert {o[0] for o in orders} == set(names)
    for n in names:
        assert {o[o.index(n) - 1] for o in orders if o.index(n)} == set(names) - {n}
    calls = []
    warm, timed = benchkit.interleaved({n: lambda n=n: calls.append(n) or len(calls) for n in names}, 40, 2)
    assert calls == [n for n in names for _ in range(2)] + [n for o in orders for n in o]
    assert timed == {n: [8 + 4 * k + o.index(n) + 1 for k, o in enumerate(orders)] for n in names}


def test_tokens_per_s_counts_every_sequence_of_the_batch(capsys):
    bench.main(TINY + ['--batch_size=3'])
    for r in last_json(capsys)['results']:
        assert r['tokens_per_s'] == pytest.approx(3 * 1000 / r['ms_per_step'])  # B tokens per step
        assert r['tokens_per_s_per_seq'] == pytest.approx(1000 / r['ms_per_step'])


def test_bench_decodes_through_the_generate_path():
    """run_decode (model.py's prefill + decode_n_tokens) gives the greedy tokens of a plain
    full-recompute loop and of GPT.generate."""
    models, _ = bench.build_variants(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, block_size=64), 0)
    prompt = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    for model in models.values():
        idx = prompt
        with torch.no_grad():
            for _ in range(13):  # the reference: the whole sequence every step, no cache
                idx = torch.cat([idx, model(idx)[0][:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        model.setup_caches(2, 9 + 12)
        _, _, tokens = bench.run_decode(model, bench.make_steps(False, 'cpu'), prompt, 12, 'cpu')
        assert torch.equal(tokens, idx[:, 9:])
        assert torch.equal(model.generate(prompt, 13, temperature=0), idx)


def test_the_gate_trips_on_corrupted_folded_weights(monkeypatch, capsys):
    fold_properly = bench.fold_model

    def corrupted(model):
        folded = fold_properly(model)
        with torch.no_grad():  # as if one γ̃ entry had been folded twice
            folded.transformer.h[1].mlp.c_fc.weight[:, 3] *= 1.5
        return folded

    monkeypatch.setattr(bench, 'fold_model', corrupted)
    with pytest.raises(SystemExit, match='correctness gate failed.*internal_unfused vs internal_folded'):
        bench.main(TINY)
    assert 'tokens/s' not in capsys.readouterr().out  # no speed reported


def test_the_gate_compares_greedy_tokens_too(monkeypatch):
    fold_properly = bench.fold_model

    def corrupted(model):
        folded = fold_properly(model)
        with torch.no_grad():
            folded.lm_head.weight.mul_(-1)  # the argmax moves; the logits check is switched off below
        return folded

    monkeypatch.setattr(bench, 'fold_model', corrupted)
    monkeypatch.setattr(fold, 'LOGIT_FLOOR', float('inf'))  # the one tolerance, fold.py's
    with pytest.raises(SystemExit, match='internal_folded .eager.: greedy tokens differ from token'):
        bench.main(TINY)


def test_the_variants_share_the_baselines_weights():
    models, all_taper = bench.build_variants(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, block_size=64), 0)
    base = dict(models['baseline'].named_parameters())
    for model in (models['internal_unfused'], all_taper):
        shared = [n for n, p in model.named_parameters() if n in base]
        assert len(shared) > 10 and all(torch.equal(base[n], model.get_parameter(n)) for n in shared)


def test_step_bytes_count_the_head_once_and_embedding_rows(capsys):
    models, _ = bench.build_variants(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, block_size=64), 0)
    B, L, d, V = 3, 20, 32, 128
    kv = 2 * 2 * B * L * d * 4
    tied, untied = models['internal_folded'], models['all_folded']
    blocks = sum(p.numel() for p in tied.transformer.h.parameters())
    ln_f = sum(p.numel() for p in tied.transformer.ln_f.parameters())
    assert bench.memory_bytes(tied, B, L)[2] == 4 * (blocks + ln_f + V * d + 2 * B * d) + kv
    head = untied.lm_head.weight.numel() + untied.lm_head.bias.numel() if untied.lm_head.bias is not None \
        else untied.lm_head.weight.numel()
    blocks = sum(p.numel() for p in untied.transformer.h.parameters())
    assert bench.memory_bytes(untied, B, L)[2] == 4 * (blocks + head + 2 * B * d) + kv


def test_a_checkpoint_is_timed_next_to_a_baseline_of_its_shape(tmp_path, capsys):
    models, _ = bench.build_variants(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, block_size=32), 0)
    folded = models['internal_folded']
    path = tmp_path / 'folded.pt'
    save_checkpoint({'model': folded.state_dict(), 'model_args': vars(folded.config)}, str(path))
    bench.main(TINY + ['--size=1M', f'--ckpt={path}'])  # --size is not used: the record says no size
    record = last_json(capsys)
    results = {r['variant']: r for r in record['results']}
    assert record['config']['size'] == '' and record['config']['n_layer'] == 2  # its shape, not --size's name
    assert results['ckpt_baseline']['speedup_vs_baseline'] == 1.0
    mine, base = results['ckpt:folded.pt'], results['ckpt_baseline']
    assert mine['speedup_vs_baseline'] == pytest.approx(mine['tokens_per_s'] / base['tokens_per_s'])
    assert mine['kv_mb'] == base['kv_mb']
    # the checkpoint's shape (vocabulary 100, context 32), not the --size one; the fold drops 2·2·32 gains
    assert base['weight_mb'] * 1e6 - mine['weight_mb'] * 1e6 == 4 * (2 * 2 * 32)
    assert base['weight_mb'] == results['baseline']['weight_mb']  # every variant takes the checkpoint's shape


@pytest.mark.parametrize('norm, why', [('dyt', r"DyT model \(norm='dyt'\).*tanh\(α·h\) does not fold"),
                                       ('derf', r"Derf model \(norm='derf'\).*erf\(α·h \+ s\) does not fold")])
def test_a_norm_free_checkpoint_is_refused_with_the_reason(tmp_path, norm, why):
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=32, vocab_size=100, n_layer=1, n_head=1, n_embd=16, norm=norm))
    path = tmp_path / f'{norm}.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(path))
    with pytest.raises(SystemExit, match=why):
        bench.main(TINY + [f'--ckpt={path}'])


@pytest.mark.parametrize('args, message', [
    (['--size=7M'], "choose one of"),
    (['--prompt_len=500', '--new_tokens=100'], 'exceeds block_size 512'),
    (['--compile=yes'], "choose one of 'both', 'eager', 'compiled'"),
    (['--batch_size=0'], 'batch_size=0 must be >= 1'),
    (['--size=', '--n_layer=2'], "--size='' needs --n_head, --n_embd"),
    (['--size=1M', '--n_layer=-4'], 'n_layer=-4 must be >= 0'),
    (['--size=', '--n_layer=2', '--n_head=3', '--n_embd=32'], 'not divisible by n_head=3'),
    (['--ckpt_path=x.pt'], "unknown config key 'ckpt_path'; did you mean --ckpt"),
    (['--ckpt=nowhere.pt', '--size=1M', '--compile=eager'], 'not found'),
    (['--mode=train', '--dtype=float16'], 'choose --dtype=bfloat16 or float32'),
])
def test_bad_settings_name_the_fix(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)


@pytest.mark.parametrize('error', [
    RuntimeError('[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can\'t allocate memory: you '
                 'tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)'),
    torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total capacity of 79.1 GiB'),
])
def test_a_batch_whose_kv_caches_do_not_fit_names_the_flag_to_lower(monkeypatch, error):
    """The allocator's error (a stand-in: the third model's KV caches) ends bench.py in one line
    that says what did not fit and which flag to lower; any other error is not called that."""
    calls, real = [], bench.GPT.setup_caches

    def setup_caches(self, *args):
        calls.append(args)
        if len(calls) == 3:
            raise error
        return real(self, *args)

    monkeypatch.setattr(bench.GPT, 'setup_caches', setup_caches)
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ['--batch_size=3'])
    assert str(e.value) == ("the 5 models and their KV caches (batch_size 3 × 16 positions each) do not fit in cpu's "
                            "memory: lower --batch_size (or --prompt_len + --new_tokens, or --size)")
    calls.clear()
    error = RuntimeError('something else')
    with pytest.raises(RuntimeError, match='something else'):
        bench.main(TINY)


@pytest.mark.parametrize('error', [
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes."),
    torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 64.00 GiB.'),
])
def test_a_training_step_that_does_not_fit_names_the_flag_to_lower(monkeypatch, error):
    """--mode=train: the allocator's error in a timed step (a stand-in: the fourth row's warm-up step)
    ends in one line naming the flag; any other error is not called that."""
    calls, real = [], bench_train.train.train_step

    def train_step(*args):
        calls.append(args)
        if len(calls) == 4:
            raise error
        return real(*args)

    monkeypatch.setattr(bench_train.train, 'train_step', train_step)
    with pytest.raises(SystemExit) as e:
        bench.main(TRAIN + ['--compile=eager'])
    assert str(e.value) == ("the 5 variants' models (one a phase, each with its AdamW state) and a training step of "
                            "batch_size 2 × block_size 16 do not fit in cpu's memory: lower --batch_size (or "
                            "--block_size, or --size)")
    calls.clear()
    error = ValueError('something else')
    with pytest.raises(ValueError, match='something else'):
        bench.main(TRAIN + ['--compile=eager'])


def test_compiled_path_passes_its_gate_without_recompiling(monkeypatch, capsys):
    """The compiled code path, traced by dynamo (fullgraph) with the eager backend to stay fast."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, mode=None, **kw: real_compile(fn, backend=counter, **kw))
    monkeypatch.setattr(bench, 'check_compiler', lambda *a: None)  # its one-line graph is not the bench's
    bench.main(TINY[:-2] + ['--compile=compiled', '--device=cpu'])
    out = capsys.readouterr().out
    assert "every variant's greedy tokens equal its eager ones" in out
    record = json.loads(out.strip().splitlines()[-1])
    assert all(r['compiled'] and r['compile_s'] > 0 for r in record['results'])
    assert counter.frame_count == 2 * len(bench.VARIANTS)  # a prefill and a decode graph each, no more
    torch._dynamo.reset()


def eager_backend(monkeypatch):
    real_compile = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, mode=None, **kw: real_compile(fn, backend='eager', **kw))


def test_the_compiled_bf16_run_is_gated_against_bf16_eager(monkeypatch, capsys):
    import torch._dynamo
    torch._dynamo.reset()
    eager_backend(monkeypatch)
    bench.main(TINY[:-2] + ['--compile=compiled', '--device=cpu', '--dtype=bfloat16'])
    assert 'gate (bfloat16, compiled): prefill logits within' in capsys.readouterr().out
    # a compiled decode step that picks another token than the argmax fails it: no speed reported
    real_steps = bench.make_steps

    def off_by_one(compiled, device_type, functions=(bench.prefill, bench.decode_one_token)):
        steps = real_steps(compiled, device_type, functions)
        if not compiled or len(steps) != 2:
            return steps
        return steps[0], lambda model, tok, pos, *a: (steps[1](model, tok, pos, *a) + 1) % model.config.vocab_size

    monkeypatch.setattr(bench, 'make_steps', off_by_one)
    with pytest.raises(SystemExit, match=r'greedy tokens differ from token 1 on, where the eager top-2 margin .* is no near-tie'):
        bench.main(TINY[:-2] + ['--compile=compiled', '--device=cpu', '--dtype=bfloat16'])
    torch._dynamo.reset()


def test_a_greedy_token_may_flip_only_at_a_near_tie():
    V = 5
    def model_with(last):  # teacher-forced logits whose last position is `last` (B, V)
        return lambda seq, targets: (torch.cat([torch.zeros(seq.size(0), seq.size(1) - 1, V),
                                                last[:, None]], dim=1), None)
    prompt, want = torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 2, 3], [1, 2, 3]])
    got = torch.tensor([[1, 4, 0], [1, 2, 3]])  # row 0 flips at token 1 (and goes its own way after)
    tie = torch.tensor([[0.0, 0.0, 10.0, 0.0, 9.9], [0.0] * 5])  # 2 vs 4: margin 0.1 < 0.02 · 10
    note = bench.same_tokens_up_to_a_near_tie('x', model_with(tie), prompt, got, want, 0.02)
    assert note == 'x: a near-tie at token 1 (margin 0.1 < 0.2)'
    clear = torch.tensor([[0.0, 0.0, 10.0, 0.0, 9.0], [0.0] * 5])  # margin 1 is no tie
    with pytest.raises(SystemExit, match='token 1 on, where the eager top-2 margin 1 is no near-tie'):
        bench.same_tokens_up_to_a_near_tie('x', model_with(clear), prompt, got, want, 0.02)
    assert bench.same_tokens_up_to_a_near_tie('x', None, prompt, want, want, 0.02) == ''


def test_a_raw_linear_phase_checkpoint_is_gated_against_its_tapernorm_form(tmp_path, capsys):
    """...and its context is the checkpoint's (96 here), not --block_size's (TINY's 64): 40 + 40 positions
    were refused as exceeding block_size 64."""
    model = bench.linear_phase_model(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, block_size=96),
                                     'all', 0)
    path = tmp_path / 'raw.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(path))
    bench.main(TINY + [f'--ckpt={path}', '--prompt_len=40', '--new_tokens=40'])
    out = capsys.readouterr().out
    assert 'phase=linear g=0 (timed unfused)' in out
    assert 'ckpt:raw.pt as trained vs ckpt:raw.pt unfused: max|Δ logit|' in out
    with pytest.raises(SystemExit, match="context is 96 tokens: lower --prompt_len"):
        bench.main(TINY + [f'--ckpt={path}', '--prompt_len=50', '--new_tokens=50'])


# ---- --mode=train (bench_train.py) -----------------------------------------------------------

TRAIN = ['--mode=train', '--size=', '--n_layer=1', '--n_embd=16', '--n_head=2', '--vocab_size=64', '--block_size=16',
         '--batch_size=2', '--trials=2', '--device=cpu']
PHASES_OF = {'baseline': ['baseline'], 'internal': ['warmup', 'taper', 'linear'],
             'all': ['warmup', 'taper', 'linear'], 'dyt': ['baseline'], 'control': ['baseline']}
GATE_OF = {'baseline': 1.0, 'warmup': 1.0, 'taper': 0.5, 'linear': 0.0}  # bench_train.GATES: taper timed at g = 0.5
VARIANT_OF = {('none', 'rmsnorm'): 'baseline', ('internal', 'rmsnorm'): 'internal', ('all', 'rmsnorm'): 'all',
              ('none', 'dyt'): 'dyt'}  # (taper, norm) of a model -> the variant it must be
SAME_AS = {'control': 'baseline'}  # the A/A row: the baseline's config on a model of its own


def test_train_mode_json_holds_every_variant_phase_and_mode(monkeypatch, capsys):
    import torch._dynamo
    torch._dynamo.reset()
    eager_backend(monkeypatch)  # the compiled path traced by dynamo, without inductor's minutes
    record = bench.main(TRAIN + ['--compile=both'])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == record and record['mode'] == 'train'
    rows = record['train']
    want = {(v, p, c) for v, ps in PHASES_OF.items() for p in ps for c in (False, True)}
    assert sorted((r['variant'], r['phase'], r['compiled']) for r in rows) == sorted(want)  # each once
    for compiled in (False, True):
        mine = {(r['variant'], r['phase']): r for r in rows if r['compiled'] is compiled}
        base = mine['baseline', 'baseline']
        assert base['vs_baseline'] == 1.0
        for r in mine.values():
            assert {'ms_per_step', 'tokens_per_s', 'vs_baseline', 'gate', 'peak_mb'} <= set(r)
            assert r['ms_per_step'] > 0 and r['gate'] == GATE_OF[r['phase']]
            assert r['vs_baseline'] == pytest.approx(r['ms_per_step'] / base['ms_per_step'], rel=1e-12)
            # its trials, in round order, and the paired ratio's interval (2 trials: [min, max] of the 2 ratios)
            assert len(r['ms_per_step_trials']) == 2 and r['ms_per_step'] == pytest.approx(
                (r['ms_per_step_trials'][0] + r['ms_per_step_trials'][1]) / 2)
            if r is not base:
                ratios = sorted(a / b for a, b in zip(r['ms_per_step_trials'], base['ms_per_step_trials']))
                assert r['vs_baseline_interval'] == pytest.approx(ratios) and r['vs_baseline_coverage'] == 0.5
            else:
                assert 'vs_baseline_interval' not in r
            assert r['tokens_per_s'] == pytest.approx(2 * 16 * 1000 / r['ms_per_step'])  # batch 2 × 16 tokens a step
            assert r['peak_mb'] is None  # a CPU
            assert (r['compile_s'] is not None) is compiled
    assert set(record['projected_run']) == set(PHASES_OF)
    assert all(set(modes) == {'eager', 'compiled'} for modes in record['projected_run'].values())
    assert 'peak MB: not measured' in out
    assert "a TinyStories run of All-Taper costs" in out
    torch._dynamo.reset()


def test_each_row_times_train_pys_own_step_in_the_phase_it_names(monkeypatch, capsys):
    """A spy on train.train_step and GPT.calibration_step records the model each timed step trains:
    its variant (taper, norm, λ), phase, gate and collect mode, in the order the steps ran. The rows'
    order in the JSON, WARM_UPS warm-up steps each, then the trials interleaved, must name them."""
    import torch._dynamo
    import train
    from model import GPT
    torch._dynamo.reset()
    eager_backend(monkeypatch)
    events, real_step, real_calibration_step = [], train.train_step, GPT.calibration_step
    lam = {v: train.load_config([f'config/tinystories_{f}.py']).aux_weight
           for v, f in (('internal', 'internal_taper'), ('all', 'all_taper'))}

    def step(train_model, raw_model, *args, **kwargs):
        c, compiled = raw_model.config, getattr(train_model, '_orig_mod', None) is raw_model  # runs.compile_model's
        events.append(dict(variant=VARIANT_OF[c.taper, c.norm], aux_weight=c.aux_weight, phase=raw_model.phase,
                           gate=raw_model.gate.item(), collect=raw_model.collect, model=id(raw_model),
                           compiled=compiled and train_model is not raw_model))
        return real_step(train_model, raw_model, *args, **kwargs)

    def calibration_step(model):
        events.append(dict(calibration_step=id(model)))
        return real_calibration_step(model)

    monkeypatch.setattr(train, 'train_step', step)
    monkeypatch.setattr(GPT, 'calibration_step', calibration_step)
    trials = 2
    rows = bench.main(TRAIN + ['--compile=both', f'--trials={trials}'])['train']
    steps = [e for e in events if 'phase' in e]
    expected = []
    for compiled in (False, True):
        mine = [r for r in rows if r['compiled'] is compiled]
        rounds = [mine[j] for order in benchkit.round_orders(list(range(len(mine))), trials) for j in order]
        expected += [r for r in mine for _ in range(bench_train.WARM_UPS)] + rounds  # A A A B B B ..., then rounds
    assert len(steps) == len(expected)
    models = {}
    for e, r in zip(steps, expected):
        assert (e['variant'], e['phase'], e['gate'], e['compiled']) == (SAME_AS.get(r['variant'], r['variant']),
                                                                         r['phase'], GATE_OF[r['phase']], r['compiled'])
        assert e['collect'] == ('calibration' if r['phase'] == 'warmup' else None)  # calibration='ema'
        assert e['aux_weight'] == lam.get(r['variant'], 0.0)
        assert models.setdefault((r['variant'], r['phase']), e['model']) == e['model']  # one model per row
    assert len(set(models.values())) == len(models)
    for k, e in enumerate(events):  # calibration_step after each warmup step, on its model, and nowhere else
        after = events[k + 1] if k + 1 < len(events) else {}
        if 'phase' in e:
            assert after.get('calibration_step') == (e['model'] if e['phase'] == 'warmup' else None)
    torch._dynamo.reset()


def test_the_control_row_is_the_baselines_model_again_with_its_own_state():
    """The A/A row: the baseline's configuration and initial weights, but its own tensors and optimizer,
    so that its ratio measures only the noise between two identical rows."""
    from types import SimpleNamespace
    rows = {r.variant: r for r in bench_train.build_rows(dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                block_size=16), 1337, SimpleNamespace(dev='cpu',
                                                                                                      device_type='cpu'))}
    base, control = rows['baseline'], rows['control']
    assert (control.phase, control.model.config) == (base.phase, base.model.config)
    theirs, mine = base.model.state_dict(), control.model.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    assert all(p is not q for p, q in zip(base.model.parameters(), control.model.parameters()))
    assert control.optimizer is not base.optimizer


def test_the_timed_steps_do_adamws_work_but_leave_the_weights_where_they_started():
    """TIMED_LR: however many trials, no row's weights move (so none can diverge), while AdamW still
    keeps its moments of every trained tensor."""
    from types import SimpleNamespace
    from runs import setup
    env = setup(SimpleNamespace(device='cpu', dtype='float32', backend='auto', compile=False))  # as bench_train.main
    arch = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64, block_size=16)
    rows = bench_train.build_rows(arch, 1337, env)
    batches = bench_train.RandomBatches(64, 2, 16, 'cpu', 1)
    for row in rows:
        before = {k: p.detach().clone() for k, p in row.model.named_parameters()}  # the EMAs of 'ema' may move
        run = bench_train.step_run(row, row.model, batches, env)
        for _ in range(3):
            run()
        trained = [p for p in row.model.parameters() if p.requires_grad]
        assert all(torch.equal(p, before[k]) for k, p in row.model.named_parameters()), (row.variant, row.phase)
        assert sum(len(row.optimizer.state[p]) > 0 for p in trained) == len(trained), row.variant  # exp_avg, exp_avg_sq


def test_the_warm_up_steps_absorb_every_compile(monkeypatch):
    """No compile or recompile of any row's model during its timed steps (dynamo with a counting backend)."""
    import torch._dynamo
    import train
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter, counts, real_compile, real_step = CompileCounter(), [], torch.compile, train.train_step
    monkeypatch.setattr(torch, 'compile', lambda fn, mode=None, **kw: real_compile(fn, backend=counter, **kw))

    def step(*args, **kwargs):
        stats = real_step(*args, **kwargs)
        counts.append(counter.frame_count)
        return stats

    monkeypatch.setattr(train, 'train_step', step)
    rows = bench.main(TRAIN + ['--compile=compiled', '--trials=3'])['train']
    warm_ups = len(rows) * bench_train.WARM_UPS
    assert len(counts) == warm_ups + 3 * len(rows) and counts[0] > 0
    assert set(counts[warm_ups - 1:]) == {counts[warm_ups - 1]}  # nothing compiled after the warm-ups
    torch._dynamo.reset()


def test_the_projected_run_is_the_schedules_steps_times_the_rows_medians(capsys):
    record = bench.main(TRAIN + ['--compile=eager', "--schedule=", '--gate_warmup_iters=3', '--taper_iters=5',
                                 '--max_iters=20'])
    assert {k: record['config']['schedule'][k] for k in ('gate_warmup_iters', 'taper_iters', 'max_iters')} == \
        dict(gate_warmup_iters=3, taper_iters=5, max_iters=20)
    ms = {(r['variant'], r['phase']): r['ms_per_step'] for r in record['train']}
    base = 20 * ms['baseline', 'baseline']
    by_hand = {'baseline': 1.0, 'dyt': 20 * ms['dyt', 'baseline'] / base, 'control': 20 * ms['control', 'baseline'] / base}
    for v in ('internal', 'all'):  # 3 warmup, 5 taper, 20 − 3 − 5 = 12 linear steps
        by_hand[v] = (3 * ms[v, 'warmup'] + 5 * ms[v, 'taper'] + 12 * ms[v, 'linear']) / base
    got = {v: modes['eager'] for v, modes in record['projected_run'].items()}
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert got['baseline'] == 1.0
    out = capsys.readouterr().out
    assert f"run of All-Taper costs {by_hand['all']:.3f} × the baseline's training time (eager; W=3, T=5" in out


def test_the_profile_counts_each_rows_operators_and_the_ema_statistics_among_them(capsys):
    """--profile=True: one table and one totals line per row. The control is the baseline's model
    again, so its operator calls are the baseline's to the one; the warmup's with 'ema' statistics
    are more, and the totals are the profiler's own (Self CPU time total)."""
    bench.main(TRAIN + ['--compile=eager', '--profile=True'])
    out = capsys.readouterr().out
    heads = re.findall(r'---- profile: one training step of (\w+), phase (\w+) \(eager\) ----', out)
    assert heads == [(v, p) for v, ps in PHASES_OF.items() for p in ps]
    totals = re.findall(r'Self CPU time total: ([\d.]+)(m?s)\n\none step: (\d+) operator calls, ([\d.]+) ms of them on '
                        r'the host\n', out)
    assert len(totals) == len(heads)
    for total, unit, _, host_ms in totals:
        assert float(host_ms) == pytest.approx(float(total) * (1 if unit == 'ms' else 1000), abs=0.006)
    calls = {row: int(t[2]) for row, t in zip(heads, totals)}
    assert calls['control', 'baseline'] == calls['baseline', 'baseline']
    json_before_and_after_the_profiles(out)
    assert calls['internal', 'warmup'] > calls['baseline', 'baseline']  # + TaperNorm.observe's ops in each norm


def test_profile_totals_count_kernels_once_and_the_hosts_waits_apart():
    """On CUDA a step's host events include its syncs (waits for the device, as long as the step), and
    its device events the compiled region's and the optimizer's annotations (spans over kernels
    counted already): both made every row read launch-bound. Stand-in events, totals by hand."""
    from types import SimpleNamespace
    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ev = lambda name, kind, us, note=False: SimpleNamespace(name=name, device_type=kind, self_cpu_time_total=us,
                                                            device_time_total=us, is_user_annotation=note)
    events = [ev('aten::mm', CPU, 30), ev('cudaLaunchKernel', CPU, 20), ev('cudaDeviceSynchronize', CPU, 900),
              ev('cudaStreamSynchronize', CPU, 100), ev('Torch-Compiled Region', CPU, 10),
              ev('sm90_gemm', CUDA, 400), ev('triton_poi_fused', CUDA, 200),
              ev('Torch-Compiled Region', CUDA, 600, note=True), ev('Optimizer.step#AdamW.step', CUDA, 50, note=True)]
    totals = benchkit.profile_totals(SimpleNamespace(events=lambda: events))
    assert totals == {'operators': 2, 'host_ms': 0.06, 'wait_ms': 1.0, 'kernels': 2, 'device_ms': 0.6}


def json_before_and_after_the_profiles(out):
    """The record comes before the first profile (a step cut short by .ci/gpu's time limit while profiling
    lost every figure) and again as the last line."""
    lines = out.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith('---- profile: '))
    assert json.loads(lines[first - 1]) == json.loads(lines[-1])


def test_the_decode_profile_comes_after_the_record(capsys):
    bench.main(TINY + ['--profile=True'])
    json_before_and_after_the_profiles(capsys.readouterr().out)


def test_no_rows_profile_is_the_profilers_first_session(monkeypatch):
    """kineto#328: a process's first profiler session pays the profiler's start-up, and the first
    row profiled, always the baseline, showed about twice its host time. Every row's printed
    profile now comes after a session thrown away, in both modes."""
    import torch.profiler
    real, sessions, printed = torch.profiler.profile, [], []

    def profile(*args, **kwargs):
        sessions.append(real(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(torch.profiler, 'profile', profile)
    for script in (bench, bench_train):
        monkeypatch.setattr(script, 'print_profile', lambda prof, title, *a, **k: printed.append((sessions.index(prof), title)))
    for args, rows in ((TINY + ['--profile=True'], 4), (TRAIN + ['--compile=eager', '--profile=True'],
                                                       sum(map(len, PHASES_OF.values())))):
        sessions.clear(), printed.clear()  # each mode as a process of its own, as a user runs it
        bench.main(args)
        assert len(printed) == rows and 0 not in [i for i, _ in printed], printed  # every row, none the first


def test_the_schedule_is_read_from_train_configs_as_train_py_runs_them():
    """The default schedule is the All-Taper TinyStories config's, and config/cpu.py overlays it;
    the reference values come from executing the config files here, not through train.py."""
    from types import SimpleNamespace

    def executed(*files):
        ns = {}
        for f in files:
            path = str(bench_train.ROOT) + '/' + f
            ns['__file__'] = path
            exec(open(path).read(), ns)
        return {k: ns[k] for k in bench_train.SCHEDULE_KEYS}

    for files in (['config/tinystories_all_taper.py'], ['config/tinystories_all_taper.py', 'config/cpu.py']):
        cfg = SimpleNamespace(schedule=','.join(files), gate_warmup_iters=0, taper_iters=0, max_iters=0)
        got = bench_train.schedule(cfg)
        assert {k: got[k] for k in bench_train.SCHEDULE_KEYS} == executed(*files)
    assert executed('config/tinystories_all_taper.py') == dict(gate_warmup_iters=500, taper_iters=2500, max_iters=5000)
    cfg = SimpleNamespace(schedule='config/tinystories_all_taper.py', gate_warmup_iters=0, taper_iters=1000,
                          max_iters=0)
    assert bench_train.schedule(cfg)['taper_iters'] == 1000  # a key > 0 overrides the file


def test_train_mode_takes_cpu_pys_batch_and_context_unless_given(monkeypatch):
    shapes = []
    monkeypatch.setattr(bench_train, 'main',
                        lambda cfg, arch, flags: shapes.append((cfg.batch_size, arch['block_size'])))
    base = [a for a in TRAIN if not a.startswith(('--batch_size', '--block_size'))]
    bench.main(base)
    bench.main(base + ['--batch_size=1', '--block_size=512'])  # given, even at decode's defaults: kept
    assert shapes == [(16, 128), (1, 512)]  # config/cpu.py's batch_size and block_size


@pytest.mark.parametrize('args, message', [
    (['--ckpt=x.pt'], 'drop it with --mode=train'),
    (['--schedule=nowhere.py'], "no file nowhere.py here or in .*--schedule=''"),
    (["--schedule=", '--gate_warmup_iters=10', '--taper_iters=20', '--max_iters=25'], 'exceeds max_iters=25'),
    (['--mode=fast'], "choose one of 'decode', 'train'"),
])
def test_bad_train_settings_name_the_fix(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(TRAIN + args)


@pytest.mark.parametrize('per_thread, busy', [(0.4, False), (0.6, True)])
def test_the_header_and_json_state_the_conditions_and_a_busy_machine(monkeypatch, capsys, per_thread, busy):
    threads = torch.get_num_threads()
    monkeypatch.setattr(bench.os, 'getloadavg', lambda: (per_thread * threads, 0.1, 0.2))
    bench.main(TINY)
    out = capsys.readouterr().out
    c = json.loads(out.strip().splitlines()[-1])['conditions']
    assert c['threads'] == threads and c['cpu_capability'] == torch.backends.cpu.get_cpu_capability()
    assert c['load'] == [round(per_thread * threads, 2), 0.1, 0.2] and c['busy'] is busy and c['cpu']
    assert f'threads={threads} ' in out and f"isa={c['cpu_capability']}" in out
    assert ('ratios are unreliable' in out) is busy  # load₁ > 0.5 core per thread in use


def test_a_pinned_run_counts_the_machines_cores_in_the_busy_rule(monkeypatch, capsys):
    """taskset -c 2 on a 16-core GPU host: 1 core, 1 thread, and a load of 1.2 just after boot was
    'busy', though the other runnable processes have 15 other cores."""
    monkeypatch.setattr(benchkit.os, 'sched_getaffinity', lambda pid: {2}, raising=False)
    monkeypatch.setattr(benchkit.os, 'cpu_count', lambda: 16)
    monkeypatch.setattr(benchkit.os, 'getloadavg', lambda: (1.2, 1.0, 0.9))
    c = benchkit.conditions()
    assert (c['cores'], c['machine_cores'], c['busy']) == (1, 16, False)
    monkeypatch.setattr(benchkit.os, 'getloadavg', lambda: (8.1, 1.0, 0.9))  # > 0.5 × 16
    benchkit.print_conditions(c := benchkit.conditions())
    assert c['busy'] and 'cores=1 of 16 (pinned)' in capsys.readouterr().out


def test_decode_mode_never_loads_train_py():
    """bench.py is an inference script (tests/test_inference.py): only --mode=train imports train.py."""
    import os
    import subprocess
    import sys
    code = "import sys, bench; bench.main(sys.argv[1:]); print('train' in sys.modules)"
    out = subprocess.run([sys.executable, '-c', code, *TINY], cwd=bench_train.ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == 'False'


def test_the_warm_ups_end_with_every_micro_batch_run_once_after_each_rows_one_time_costs(monkeypatch):
    """WARM_UPS' rule (its comment): a row's first step compiles and builds AdamW's state, and the
    warm-ups then run each of RandomBatches' micro-batches once more, so that the timed steps repeat
    only steps already run in their final state. Counted per row (dynamo with a counting backend)."""
    import torch._dynamo
    import train
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter, real_compile, real_step, real_get = CompileCounter(), torch.compile, train.train_step, \
        bench_train.RandomBatches.get
    monkeypatch.setattr(torch, 'compile', lambda fn, mode=None, **kw: real_compile(fn, backend=counter, **kw))
    got, steps, micro_batches = [], {}, set()

    def get(self, it, micro):
        got.append(it % len(self.batches))
        micro_batches.update(range(len(self.batches)))
        return real_get(self, it, micro)

    def step(train_model, raw_model, optimizer, *args, **kwargs):
        before, got[:] = (counter.frame_count, len(optimizer.state)), []
        stats = real_step(train_model, raw_model, optimizer, *args, **kwargs)
        steps.setdefault(id(raw_model), []).append((before != (counter.frame_count, len(optimizer.state)), got[0]))
        return stats

    monkeypatch.setattr(bench_train.RandomBatches, 'get', get)
    monkeypatch.setattr(train, 'train_step', step)
    bench.main(TRAIN + ['--compile=compiled', '--trials=1'])
    assert len(steps) == 9 and micro_batches == {0, 1}  # every variant and phase, each its own model
    for row in steps.values():
        last = max(k for k, (one_time, _) in enumerate(row) if one_time)
        assert last == 0  # the first step: compile and AdamW's state, nothing after it
        assert {m for _, m in row[last + 1:bench_train.WARM_UPS]} == micro_batches, row
    torch._dynamo.reset()


def test_with_peak_on_cuda_is_the_most_a_call_allocated_above_what_was_resident(monkeypatch):
    """benchkit.with_peak with stand-ins for torch.cuda's allocator statistics: 1 MB resident, a call
    that allocates 300 bytes and frees them, an older peak of 5 MB still recorded. Its peak is 300
    bytes: not the absolute peak (1,000,300), nor the older one."""
    import benchkit
    memory = {'allocated': 1_000_000, 'peak': 5_000_000}
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats',
                        lambda device=None: memory.update(peak=memory['allocated']))
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda device=None: memory['allocated'])
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: memory['peak'])

    def run():
        memory['peak'] = max(memory['peak'], memory['allocated'] + 300)
        return 'its result'

    assert benchkit.with_peak(run, 'cuda')() == ('its result', 300)
    assert benchkit.with_peak(run, 'cpu')() == ('its result', None)  # torch keeps no such statistic off CUDA


@pytest.mark.parametrize('terminal', [False, True])
def test_train_mode_shows_its_progress_over_the_rows_steps_on_stderr(monkeypatch, capsys, terminal):
    """9 rows of 3 warm-up + 2 timed steps: where stderr is a terminal a tqdm bar counts the 45 steps,
    else one short line per row's worth of them; stdout (the table, the JSON) is unchanged."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stderr = Terminal()
    if terminal:
        monkeypatch.setattr(sys, 'stderr', stderr)
    bench.main(TRAIN + ['--compile=eager', '--trials=2'])
    captured = capsys.readouterr()
    if terminal:
        bar = stderr.getvalue()
        assert bar.startswith('\reager steps:   0%|') and '| 0/45 [' in bar and '  eager: ' not in bar
        assert bar.endswith('\r')  # closed: leave=False clears its line for the table
    else:
        lines = captured.err.splitlines()
        assert [re.fullmatch(r'  eager: (\d+)/45 steps, \d+ s', line).group(1) for line in lines] == \
            [str(5 * k) for k in range(1, 10)]
    assert 'steps, ' not in captured.out


def test_a_rows_compile_s_is_never_negative(monkeypatch):
    """compile_s is the first warm-up step's time above the median: a row that compiles nothing (the
    control reuses the baseline's graph) and whose first step happens to be the fastest gets 0, not a
    negative time. Step times are stand-ins: first steps of 2 s (baseline) and 1 ms (the others), then 10 ms."""
    from types import SimpleNamespace

    def step_run(row, train_model, batches, env):
        first = 2.0 if row.variant == 'baseline' else 0.001
        times = iter([first] + [0.010] * 10)
        return lambda: (next(times), None)

    monkeypatch.setattr(bench_train, 'step_run', step_run)
    arch = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64, block_size=16)
    env = SimpleNamespace(dev='cpu', device_type='cpu')
    rows = bench_train.build_rows(arch, 1337, env)
    results, _ = bench_train.time_rows(rows, True, None, env, 2, 32)
    compile_s = {(x['variant'], x['phase']): x['compile_s'] for x in results}
    assert compile_s.pop(('baseline', 'baseline')) == pytest.approx(1.99)
    assert set(compile_s.values()) == {0.0}
    assert all(x['compile_s'] is None for x in bench_train.time_rows(rows, False, None, env, 2, 32)[0])
