"""Every script's CUDA setup, run on a CPU: torch.cuda's entry points are replaced by stand-ins that
check their device arguments the way torch does, and each script runs up to its first CUDA tensor.
The CUDA branches are otherwise skipped here (tests/test_cuda.py needs a GPU); this is where an
index-less device passed to a torch.cuda call, or TF32 left on for float32, shows on a CPU."""

import copy
import json
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
from test_train import read_log, toy_args


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


def test_nccl_off_cuda_is_one_line_before_any_process_group(monkeypatch):
    """torchrun on a CPU with --backend=nccl (pytorch#159742): every rank printed NCCL's 'Distributed
    package doesn't have NCCL built in' traceback; now one line, before init_process_group."""
    for key, value in {'RANK': '0', 'LOCAL_RANK': '0', 'WORLD_SIZE': '2'}.items():
        monkeypatch.setenv(key, value)
    cfg = SimpleNamespace(device='cpu', dtype='float32', backend='nccl', compile=False)
    with pytest.raises(SystemExit, match=r"^config error: backend='nccl' reduces CUDA tensors, but this run is on "
                                         r"cpu: use --backend=gloo"):
        setup(cfg)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize('env, missing', [({'RANK': '0', 'WORLD_SIZE': '1'}, 'LOCAL_RANK'),
                                          ({'RANK': '0'}, 'LOCAL_RANK and WORLD_SIZE')])
def test_rank_without_torchruns_other_variables_is_one_line(monkeypatch, env, missing):
    """A launcher or a leftover export that sets RANK but not LOCAL_RANK (Swin-Transformer#387): a
    KeyError from runs.setup before; now one line before any process group exists."""
    for key in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = SimpleNamespace(device='cpu', dtype='float32', backend='auto', compile=False)
    with pytest.raises(SystemExit) as e:
        setup(cfg)
    assert str(e.value) == (f"RANK=0 is set but {missing} not: a distributed run starts with torchrun (which sets "
                            "all three); for one process, unset RANK")
    assert not torch.distributed.is_initialized()


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
        no_kernel = ('aten::view', 'aten::view_as', 'aten::split_with_sizes', 'aten::select', 'aten::slice',
                     'aten::item')  # views (metadata) and the CPU's host check
        return [e.name for e in prof.events() if e.name.startswith('aten::') and e.cpu_parent is None
                and e.name not in no_kernel]

    assert ops(1) == ops(8) and len(ops(8)) <= 6, ops(8)


# ---- MPS (Apple silicon), which has no float64, on a CPU ------------------------------------------

MPS_NO_FLOAT64 = "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64"


class OnMPS(torch.Tensor):
    """A tensor on the stand-in MPS device: it computes on the CPU, its .device says 'mps', and every
    operation whose result is a float64 OnMPS raises MPS's TypeError (its creation, .double(),
    .to(torch.float64), a float64 model's forward). Results of operations on it are OnMPS
    (torch.Tensor's subclass rule)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        refuse_float64(out)
        return out

    @property
    def device(self):  # so that device=t.device makes a tensor on MPS, as it would there
        return torch.device('mps')

    def __deepcopy__(self, memo):  # torch's own asks new_empty for the subclass, which it cannot give here
        with torch.no_grad():
            new = self.as_subclass(torch.Tensor).clone().as_subclass(OnMPS)
        new.requires_grad_(self.requires_grad)
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))  # _is_param: a module's parameter
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):  # saved as a plain tensor, as torch.save saves a device's
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def refuse_float64(out):
    if any(isinstance(t, OnMPS) and t.dtype == torch.float64 for t in torch.utils._pytree.tree_flatten(out)[0]):
        raise TypeError(MPS_NO_FLOAT64)


def is_mps(device):
    return isinstance(device, (str, torch.device)) and torch.device(device).type == 'mps'


class MPSStandIn(torch.overrides.TorchFunctionMode):
    """Tensors made on 'mps' (device=...) or moved there (.to) become OnMPS; moved to 'cpu' (.to,
    .cpu()), plain copies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if 'device' in kwargs:
            to = kwargs['device']
        elif func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, torch.Tensor)):
            to = args[1].device if isinstance(args[1], torch.Tensor) else args[1]  # .to(device) or .to(other)
        else:
            to = 'cpu' if func is torch.Tensor.cpu else None
        if to is None:
            return func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        plain = lambda a: a.as_subclass(torch.Tensor) if isinstance(a, OnMPS) else 'cpu' if is_mps(a) else a
        out = func(*map(plain, args), **{k: plain(v) for k, v in kwargs.items()})
        if src is not None and isinstance(out, torch.Tensor) and out.data_ptr() == src.data_ptr() \
                and is_mps(to) != isinstance(src, OnMPS):
            out = out.clone()  # a move between devices copies
        if is_mps(to):
            out = out.as_subclass(OnMPS)
            refuse_float64(out)
        return out


@pytest.fixture
def stand_in_mps(monkeypatch):
    """An Apple-silicon machine without CUDA: torch.backends.mps.is_available() is True, 'mps' is the
    MPSStandIn device, torch.mps.synchronize() only counts its calls (the stand-in queues no work)
    and torch._assert_async refuses an MPS tensor, as torch releases before its MPS kernel did. A
    module moved there swaps its parameters for OnMPS ones (torch.__future__'s swap), as a GPU's
    would be. Yields the list of synchronize calls."""
    syncs, real_assert = [], torch._assert_async
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: True)
    monkeypatch.setattr(torch.mps, 'synchronize', lambda: syncs.append(None))

    def assert_async(cond, *args):
        if isinstance(cond, OnMPS):
            raise NotImplementedError("Could not run 'aten::_assert_async.msg' with arguments from the 'MPS' backend")
        return real_assert(cond, *args)
    monkeypatch.setattr(torch, '_assert_async', assert_async)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with MPSStandIn():
            yield syncs
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def test_the_mps_stand_in_refuses_float64_made_on_it_and_allows_it_on_the_cpu(stand_in_mps):
    """What the tests below rely on: each way of making a float64 tensor on MPS raises MPS's TypeError,
    a copy on the CPU is float64 as usual, and a model moved to 'mps' computes there."""
    from model import GPT, GPTConfig
    x = torch.arange(6.0).to('mps')
    assert x.device.type == 'mps' and isinstance(torch.ones(2, device=x.device), OnMPS)
    for make in (lambda: torch.zeros(2, device='mps', dtype=torch.float64), lambda: x.double(),
                 lambda: torch.zeros(2, device=x.device, dtype=torch.float64),
                 lambda: x.to(torch.float64), lambda: x.sum() * torch.ones((), dtype=torch.float64, device='mps'),
                 lambda: x.new_zeros(2, dtype=torch.float64)):
        with pytest.raises(TypeError, match='MPS'):
            make()
    assert type(x.cpu().double()) is torch.Tensor and x.cpu().double().sum().item() == 15.0
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=8)).to('mps')
    assert all(isinstance(p, OnMPS) for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the move
    with pytest.raises(TypeError, match='MPS'):
        copy.deepcopy(model).double()
    on_cpu = list(copy.deepcopy(model).to('cpu', torch.float64).parameters())
    assert all(not isinstance(p, OnMPS) and p.dtype == torch.float64 for p in on_cpu)


@pytest.mark.parametrize('calibration', ['end', 'ema'])
def test_a_run_on_mps_trains_to_its_end_and_its_final_losses_match_the_cpus(stand_in_mps, toy_data, tmp_path,
                                                                              calibration):
    """runs.mean_ce summed the final losses in float64 on the run's device: a run on a Mac trained to its
    last step, then raised MPS's TypeError (and again on every resume). 'ema' checked each warmup step
    with torch._assert_async, which older torch lacks on MPS. The stand-in computes on the CPU, so the
    same run on the CPU gives the same losses. Each timed step and the first evaluation batch wait for
    MPS's queue before the clock is read (they read a queued, not a finished, step before)."""
    model = train.main(toy_args(toy_data, tmp_path / 'mps', device='mps', calibration=calibration))
    assert all(isinstance(p, OnMPS) for p in model.parameters())  # it trained on the stand-in
    timed = [r for r in read_log(tmp_path / 'mps') if 'step_ms' in r]
    assert len(stand_in_mps) >= len(timed) + 1 and timed
    train.main(toy_args(toy_data, tmp_path / 'cpu', device='cpu', calibration=calibration))
    (on_mps,), (on_cpu,) = ([r for r in read_log(tmp_path / run) if 'final_val_loss' in r] for run in ('mps', 'cpu'))
    for key in ('final_val_loss', 'final_train_loss'):
        assert on_mps[key] == pytest.approx(on_cpu[key], rel=1e-6), key


def test_fold_and_bench_on_mps_check_against_an_fp64_copy_on_the_cpu(stand_in_mps, tmp_path, capsys):
    """fold.max_logit_error, fold.py's check and bench.py's gate, made its fp64 reference with
    .double() on the device: MPS's TypeError. Both now run on MPS and report what they report on the CPU."""
    model = bench.linear_phase_model(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16), 'all', 0)
    ckpt = tmp_path / 'linear.pt'
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config)}, str(ckpt))
    folded = {dev: fold.main([f'--ckpt={ckpt}', f'--out={tmp_path / dev}.pt', f'--device={dev}'])
              for dev in ('mps', 'cpu')}
    assert folded['mps'] == folded['cpu']
    gates, devices = {}, {}
    for dev in ('mps', 'cpu'):
        capsys.readouterr()
        bench.main(TINY[:-1] + [f'--device={dev}'])
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        gates[dev], devices[dev] = record['gate'], record['device']
    assert gates['mps'] == gates['cpu'] and len(gates['cpu']) == 2
    # the record says where it ran: a Mac's figures said 'cpu (N cores)'
    assert devices['mps'].startswith('mps (') and devices['cpu'].startswith('cpu (')
