"""The GPU path, where users run it: bf16 autocast, torch.compile, CUDA graphs, NCCL.

Skipped without CUDA; `python -m pytest -q` runs it where CUDA is present (`bash .ci/gpu quick` on a
GPU machine). Needs only torch and numpy (it writes its own token files: no tiktoken, no network).
Its first run, on one H200 (2026-12-04, torch 2.11.0+cu130), passed 5 tests in 92 s with one deselected
(docs/gpu/2026-12-04_test_cuda_summary.txt). The CPU side of its CUDA branches is tests/test_devices.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402
import fold  # noqa: E402
import train  # noqa: E402
from model import unfused  # noqa: E402
from runs import load_checkpoint, load_model  # noqa: E402
from test_ddp import localhost_works  # noqa: E402


def write_stories(folder):
    """Write a TinyStories-shaped dataset into folder (a pathlib.Path, created): a 2,048-id
    vocabulary, stories of 100-300 tokens each ending in end-of-text, drawn from a few repeated
    templates so that the loss falls. Also .ci/gpu_train.py's data."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    V, eot = 2048, 0
    templates = [rng.integers(1, V, size=rng.integers(100, 300)) for _ in range(40)]
    docs = []
    for _ in range(3000):
        t = templates[rng.integers(len(templates))].copy()
        flip = rng.random(t.size) < 0.1
        t[flip] = rng.integers(1, V, size=flip.sum())
        docs.append(np.append(t, eot))
    stream = np.concatenate(docs).astype(np.uint16)
    cut = int(0.95 * len(stream))
    stream[:cut].tofile(folder / 'train.bin')
    stream[cut:].tofile(folder / 'val.bin')
    (folder / 'meta.json').write_text(json.dumps({'vocab_size': V, 'tokenizer': 'toy', 'eot_id': eot}))


@pytest.fixture(scope='module')
def stories(tmp_path_factory):
    """data_dir holding write_stories' dataset 'stories'."""
    root = tmp_path_factory.mktemp('cuda') / 'data'
    write_stories(root / 'stories')
    return root


def args(data_dir, out_dir, **overrides):
    """All four phases in 60 steps of a 4-layer model, with the GPU defaults: device, bf16
    autocast and torch.compile all 'auto', and the default calibration ('ema')."""
    cfg = dict(dataset='stories', data_dir=str(data_dir), out_dir=str(out_dir), n_layer=4, n_head=4, n_embd=128,
               block_size=256, batch_size=16, gradient_accumulation_steps=2, taper='all', aux_weight=0.1,
               max_iters=60, gate_warmup_iters=10, taper_iters=30, warmup_iters=5,
               lr_decay_iters=60, learning_rate=3e-3, min_lr=3e-4, eval_interval=20, eval_iters=4,
               log_interval=1)
    cfg.update(overrides)
    return [f'--{k}={v}' for k, v in cfg.items()]


def read_log(out):
    with open(os.path.join(out, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def trained(stories, tmp_path_factory):
    """One compiled bf16 run through warmup, calibrate, taper and linear. Returns (out_dir, model,
    versions of GPT.forward compiled (dynamo's CompileCounter, with inductor), dynamo's counters)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    counter, real_compile = CompileCounterWithBackend('inductor'), torch.compile

    def counted(fn, **kw):  # the model's compiles; check_compiler's probe (a lambda) compiles as it is
        return real_compile(fn, backend=counter, **kw) if isinstance(fn, torch.nn.Module) else real_compile(fn, **kw)

    out = tmp_path_factory.mktemp('run')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, 'compile', counted)
        model = train.main(args(stories, out))
    stats = {k: dict(v) for k, v in counters.items()}
    torch._dynamo.reset()
    return out, model, counter.frame_count, stats


@pytest.fixture
def exact_fp32():
    """fp32 matrix products without TF32 (train.py turns it on), for tests that compare greedy tokens."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_a_compiled_bf16_run_goes_through_all_four_phases(trained):
    out, model, versions, stats = trained
    log = read_log(out)
    steps = [r for r in log if 'loss' in r]
    assert {r['phase'] for r in steps} == {'warmup', 'taper', 'linear'}
    assert all(np.isfinite(r['loss']) and np.isfinite(r['grad_norm']) for r in steps)
    assert steps[-1]['loss'] < steps[0]['loss'] - 1.0  # it learned
    calibrate = [r for r in log if r.get('event') == 'calibrate']
    assert len(calibrate) == 1 and np.isfinite(calibrate[0]['s_tgt']) and all(c > 0 for c in calibrate[0]['c'].values())
    assert log[-1]['tf32'] is True and log[-1]['dtype'] == 'bfloat16'  # TF32 with bf16 autocast only
    assert np.isfinite(log[-1]['final_val_loss'])
    assert (model.phase, model.gate.item()) == ('linear', 0.0)
    # dynamo compiled each version of the forward once (training and evaluation in each of three
    # phases, the calibrate event's 'mismatch' pass: test_train's count for 'ema' on the CPU), broke no graph
    assert versions == 7
    assert not stats.get('graph_break'), stats.get('graph_break')


def test_sigterm_mid_taper_then_resume_finishes_the_run(stories, tmp_path):
    out = tmp_path / 'run'
    # output into files, not pipes: a pipe nobody reads fills at 64 KB (warnings) and blocks the run
    with open(tmp_path / 'stdout.txt', 'w') as so, open(tmp_path / 'stderr.txt', 'w') as se:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *args(stories, out)], cwd=ROOT,
                                stdout=so, stderr=se, text=True)
    stderr = lambda: (tmp_path / 'stderr.txt').read_text()[-3000:]
    t0 = time.time()
    in_taper = lambda: (out / 'log.jsonl').exists() and any(r.get('phase') == 'taper' and r['iter'] >= 15
                                                            for r in read_log(out))
    while not in_taper():
        assert proc.poll() is None, stderr()
        assert time.time() - t0 < 300, 'no taper step in 300 s'
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 143, stderr()
    stopped = load_checkpoint(str(out / 'ckpt.pt'))['iter_num']
    assert 15 < stopped < 60
    train.main([f'--out_dir={out}', '--init_from=resume'])
    log = read_log(out)
    assert sorted(r['iter'] for r in log if 'loss' in r) == list(range(60))
    assert np.isfinite(log[-1]['final_val_loss'])


def test_fold_and_sample_on_cuda(trained, tmp_path, exact_fp32):
    out = trained[0]
    folded_path = tmp_path / 'folded.pt'
    report = fold.main([f'--ckpt={out / "ckpt.pt"}', f'--out={folded_path}', '--device=cuda'])
    assert report['max_abs_logit_diff'] <= 1e-3 * report['max_abs_logit']
    # checked on the GPU, written with CPU tensors: a plain torch.load opens it on a machine without one
    saved = torch.load(folded_path, weights_only=True)['model']
    assert {t.device.type for t in saved.values()} == {'cpu'}
    unfolded, _ = load_model(str(out / 'ckpt.pt'), 'cuda')
    folded, _ = load_model(str(folded_path), 'cuda')
    prompt = torch.randint(1, 2048, (2, 8), device='cuda', generator=torch.Generator('cuda').manual_seed(0))
    a = unfolded.eval().generate(prompt, 24, temperature=0)
    b = folded.eval().generate(prompt, 24, temperature=0)
    assert a.device.type == 'cuda' and a.shape == (2, 32)
    assert (a[:, :12] == b[:, :12]).all()  # fp32: the same greedy tokens (ties aside, far later)
    sampled = folded.generate(prompt, 24, temperature=1.0, top_k=50,
                              generator=torch.Generator('cuda').manual_seed(1))
    assert sampled.shape == (2, 32) and int(sampled.max()) < 2048


def test_compiled_decode_with_cuda_graphs_gives_eager_greedy_tokens_in_fp32(trained, exact_fp32):
    out = trained[0]
    model, _ = load_model(str(out / 'ckpt.pt'), 'cuda')
    model = unfused(model.eval())
    prompt = torch.randint(1, 2048, (4, 32), device='cuda', generator=torch.Generator('cuda').manual_seed(2))
    runs = {}
    for compiled in (False, True):
        model.setup_caches(4, 96)
        steps = bench.make_steps(compiled, 'cuda')  # compiled: "reduce-overhead", CUDA graphs
        for _ in range(2 if compiled else 1):  # graphs record on a second call
            runs[compiled] = bench.run_decode(model, steps, prompt, 48, 'cuda')[2]
    assert torch.equal(runs[True], runs[False])


def test_bench_at_9m_compiled_passes_its_gate(capsys):
    record = bench.main(['--size=9M', '--compile=compiled', '--trials=2', '--prompt_len=64', '--new_tokens=64'])
    out = capsys.readouterr().out
    assert 'gate (bfloat16, compiled): prefill logits within' in out
    assert {r['variant'] for r in record['results']} == set(bench.VARIANTS)
    assert all(r['compiled'] and r['tokens_per_s'] > 0 for r in record['results'])


def test_profile_totals_see_the_device_kernels():
    """bench.py --profile=True (both modes) on a GPU: a step's kernels and their device time are counted."""
    import benchkit
    from torch.profiler import ProfilerActivity, profile
    a = torch.randn(512, 512, device='cuda')
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            a = a @ a / 512
        torch.cuda.synchronize()
    totals = benchkit.profile_totals(prof)
    assert totals['kernels'] >= 3 and totals['device_ms'] > 0 and totals['operators'] >= 6  # 3 mm and 3 div


@pytest.mark.skipif(not localhost_works(), reason='cannot open a TCP connection to localhost')
def test_torchrun_with_nccl_through_a_phase_change(stories, tmp_path):
    out = tmp_path / 'ddp'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1',
           os.path.join(ROOT, 'train.py'), *args(stories, out, backend='nccl', max_iters=24, gate_warmup_iters=6,
                                                 taper_iters=10, lr_decay_iters=24, compile=False)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'world=1' in proc.stdout
    assert '`broadcast_buffers` is deprecated' not in proc.stderr, proc.stderr[-3000:]
    assert 'No device id' not in proc.stderr, proc.stderr[-3000:]
    log = read_log(out)
    assert {r['phase'] for r in log if 'loss' in r} == {'warmup', 'taper', 'linear'}
    assert np.isfinite(log[-1]['final_val_loss'])
