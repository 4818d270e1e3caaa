"""bench.py: end to end on a tiny model, its JSON record, the correctness gate, bad settings."""

import json

import pytest
import torch

import bench
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
    bench.main(TINY + [f'--ckpt={path}'])
    results = {r['variant']: r for r in last_json(capsys)['results']}
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
    (['--size=', '--n_layer=2', '--n_head=3', '--n_embd=32'], 'not divisible by n_head=3'),
    (['--ckpt_path=x.pt'], "unknown config key 'ckpt_path'; did you mean --ckpt"),
    (['--ckpt=nowhere.pt', '--size=1M', '--compile=eager'], 'not found'),
])
def test_bad_settings_name_the_fix(args, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(args)


def test_compiled_path_passes_its_gate_without_recompiling(monkeypatch, capsys):
    """The compiled code path, traced by dynamo (fullgraph) with the eager backend to stay fast."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, mode=None, **kw: real_compile(fn, backend=counter, **kw))
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
    model = bench.linear_phase_model(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, block_size=32),
                                     'all', 0)
    path = tmp_path / 'raw.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(path))
    bench.main(TINY + [f'--ckpt={path}'])
    out = capsys.readouterr().out
    assert 'phase=linear g=0 (timed unfused)' in out
    assert 'ckpt:raw.pt as trained vs ckpt:raw.pt unfused: max|Δ logit|' in out
    with pytest.raises(SystemExit, match="context is 32 tokens: lower --prompt_len"):
        bench.main(TINY + [f'--ckpt={path}', '--prompt_len=20', '--new_tokens=20'])
