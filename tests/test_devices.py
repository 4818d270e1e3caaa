"""Every script's CUDA setup, run on a CPU: torch.cuda's entry points are replaced by stand-ins that
check their device arguments the way torch does, and each script runs up to its first CUDA tensor.
The CUDA branches are otherwise skipped here (tests/test_cuda.py needs a GPU); this is where an
index-less device passed to a torch.cuda call, or TF32 left on for float32, shows on a CPU."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch._utils import _get_device_index

import bench
import configurator
import fold
import sample
import study
import train
from runs import save_checkpoint, setup
from test_bench import TINY
from test_train import toy_args


class FirstCudaTensor(Exception):
    """Raised where torch initializes CUDA for a tensor: the script's setup is over."""


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """torch.cuda as one bf16-capable device would look. An entry point that takes a device refuses
    one without an index, as torch.cuda.set_device does (torch._utils._get_device_index(device,
    optional=False) raises ValueError for 'cuda'); one left out means the current device. Creating a
    CUDA tensor raises FirstCudaTensor. Returns the calls made, [(name, device)]."""
    calls = []

    def takes_device(name, result):
        def stand_in(device=None, *args, **kwargs):
            if device is not None or name == 'set_device':
                _get_device_index(device, optional=False)
            calls.append((name, device))
            return result
        return stand_in

    for name, result in [('set_device', None), ('synchronize', None), ('get_device_name', 'Stand-in GPU'),
                         ('reset_peak_memory_stats', None), ('memory_allocated', 0), ('max_memory_allocated', 0),
                         ('get_device_capability', (9, 0))]:
        monkeypatch.setattr(torch.cuda, name, takes_device(name, result))
    for name, result in [('is_available', True), ('device_count', 1), ('current_device', 0),
                         ('is_bf16_supported', True)]:
        monkeypatch.setattr(torch.cuda, name, lambda *a, result=result, **k: result)

    def first_tensor():  # torch calls torch.cuda._lazy_init before the first CUDA tensor
        raise FirstCudaTensor

    monkeypatch.setattr(torch.cuda, '_lazy_init', first_tensor)
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield calls
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@pytest.mark.parametrize('device', ['auto', 'cuda', 'cuda:0'])
def test_every_script_sets_up_cuda_with_an_indexed_device(device, stand_in_cuda, toy_data, tmp_path):
    model = bench.linear_phase_model(dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64, block_size=16), 'all', 0)
    ckpt = tmp_path / 'linear.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(ckpt))
    scripts = {
        'train': lambda: train.main(toy_args(toy_data, tmp_path / 'run', device=device)),
        'sample': lambda: sample.main([f'--ckpt={ckpt}', f'--device={device}']),
        'fold': lambda: fold.main([f'--ckpt={ckpt}', f'--out={tmp_path / "folded.pt"}', f'--device={device}']),
        'bench': lambda: bench.main(TINY[:-1] + [f'--device={device}']),
        'bench --mode=train': lambda: bench.main(TINY[:-1] + ['--mode=train', f'--device={device}']),
    }
    for name, run in scripts.items():
        stand_in_cuda.clear()
        with pytest.raises(FirstCudaTensor):  # not ValueError: Expected a torch.device with a specified index
            run()
        if name in ('train', 'bench', 'bench --mode=train'):  # they make the device current: synchronize() and NCCL then use it
            assert stand_in_cuda == [('get_device_capability', 'cuda:0'), ('set_device', 'cuda:0')], name
    # the study records where each cell ran, resolving the cell's device as train.py does
    record = study.provenance({'wall_s': 1.0}, 1, ['--dataset=toy', f'--device={device}', '--dtype=float32'])
    assert (record['device'], record['dtype'], record['tf32']) == ('cuda:0: Stand-in GPU', 'float32', False)


@pytest.mark.parametrize('device', ['cuda:0', 'cuda', 'auto'])
def test_under_ddp_every_rank_takes_the_device_of_its_local_rank(device, stand_in_cuda, monkeypatch):
    """torchrun on a machine with two GPUs: rank 1 is on cuda:1 whatever --device names, an explicit
    cuda:0 included (else every rank would share GPU 0)."""
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    assert configurator.resolve_device(device, 'auto', local_rank=1) == ('cuda:1', 'bfloat16')
    assert configurator.resolve_device(device, 'auto', local_rank=0) == ('cuda:0', 'bfloat16')
    assert configurator.resolve_device('cuda:1') == ('cuda:1', 'bfloat16')  # without DDP, the index given


def test_auto_dtype_is_bf16_only_on_a_gpu_that_has_it_natively_asking_that_gpu(stand_in_cuda, monkeypatch):
    """dtype='auto': bf16 from compute capability 8.0 (Ampere) on, float32 on a V100 (7.0) or T4
    (7.5), which emulate bf16; the capability asked is the resolved device's (rank 1: cuda:1)."""
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    for capability, dtype in (((7, 0), 'float32'), ((7, 5), 'float32'), ((8, 0), 'bfloat16')):
        monkeypatch.setattr(torch.cuda, 'get_device_capability',
                            lambda device=None, c=capability: stand_in_cuda.append(('capability', device)) or c)
        assert configurator.resolve_device('cuda', 'auto', local_rank=1) == ('cuda:1', dtype)
    assert stand_in_cuda[-1] == ('capability', 'cuda:1')


def test_a_cuda_index_the_machine_lacks_is_refused_in_one_line_naming_the_devices(stand_in_cuda, monkeypatch):
    """One GPU (the stand-ins' device_count() = 1): cuda:3, or torchrun's LOCAL_RANK=1, is refused before
    torch.cuda.set_device would raise its 'invalid device ordinal' traceback."""
    cfg = SimpleNamespace(device='cuda:3', dtype='auto', backend='auto', compile='auto')
    with pytest.raises(SystemExit, match=r"^config error: device='cuda:3': this machine has 1 CUDA device, cuda:0; "
                                         r"use one of those$"):
        setup(cfg)
    for name, value in (('RANK', '1'), ('LOCAL_RANK', '1'), ('WORLD_SIZE', '2')):  # torchrun's second process
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=r"^config error: LOCAL_RANK=1 \(torchrun\) but this machine has 1 CUDA "
                                         r"device, cuda:0: start at most 1 process per machine "
                                         r"\(torchrun --nproc_per_node=1\)$"):
        setup(SimpleNamespace(**{**vars(cfg), 'device': 'cuda'}))
    assert stand_in_cuda == []  # nothing reached torch.cuda.set_device
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 3)
    with pytest.raises(SystemExit, match=r"this machine has 3 CUDA devices, cuda:0 to cuda:2; use one of those"):
        configurator.resolve_device('cuda:3')


@pytest.mark.parametrize('dtype, tf32', [('float32', False), ('bfloat16', True)])
def test_tf32_follows_the_dtype(dtype, tf32, stand_in_cuda):
    cfg = SimpleNamespace(device='cuda', dtype=dtype, backend='auto', compile='auto')
    for before in (True, False):  # whatever an earlier run in the process left
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = before
        env = setup(cfg)
        assert env.tf32 is tf32
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert setup(SimpleNamespace(**{**vars(cfg), 'device': 'cpu'})).tf32 is False  # no TF32 on a CPU


@pytest.mark.parametrize('device, backend', [('cuda', 'nccl'), ('cpu', 'gloo')])
def test_a_ddp_process_group_waits_30_minutes_in_a_collective(device, backend, stand_in_cuda, monkeypatch):
    """NCCL's default is 10 minutes, which rank 0's first evaluation after a cold compile can near
    while the other ranks wait in the first all-reduce: the group is made with 30 (runs.DDP_TIMEOUT)."""
    calls = []
    monkeypatch.setattr(torch.distributed, 'init_process_group', lambda *a, **kw: calls.append((a, kw)))
    for key, value in dict(RANK='0', LOCAL_RANK='0', WORLD_SIZE='2').items():  # as torchrun starts a rank
        monkeypatch.setenv(key, value)
    env = setup(SimpleNamespace(device=device, dtype='float32', backend='auto', compile='auto'))
    assert env.ddp and calls == [((), {'backend': backend, 'timeout': timedelta(minutes=30)})]


def test_the_warmup_ema_update_is_a_few_ops_for_the_whole_model():
    """calibration='ema' updates its EMAs after every warmup step: on a GPU each op is a kernel launch,
    so their number must not grow with the depth (it was 4 per statistic: 143 at 8 layers)."""
    from torch.profiler import ProfilerActivity, profile
    from model import GPT, GPTConfig

    def ops(n_layer):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=64, block_size=8, taper='all'))
        model.set_collect('calibration')
        x = torch.randint(0, 64, (2, 8))
        model(x, x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.calibration_step()
        no_kernel = ('aten::view', 'aten::view_as', 'aten::split_with_sizes', 'aten::item')  # metadata, host
        return [e.name for e in prof.events() if e.name.startswith('aten::') and e.cpu_parent is None
                and e.name not in no_kernel]

    assert ops(1) == ops(8) and len(ops(8)) <= 6, ops(8)
