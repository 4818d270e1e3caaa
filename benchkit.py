"""
What bench.py's two modes (decode, train) share, each in one place: random tokens, a TaperNorm model
calibrated through the model's own path, interleaved trials after warm-up calls (runs.sync waits for the device),
the peak memory of a call (CUDA), and the conditions a timing ran under (threads, CPU, its kernel
ISA, the load average) with the rule that calls a machine too busy for a ratio to mean anything.

Busy rule: ratios are unreliable when the 1-minute load average, read as the benchmark starts,
exceeds half a core per thread in use (load₁ > BUSY_LOAD_PER_THREAD · torch.get_num_threads()).
The other runnable processes then take cores from torch's threads, and contention inflates every
small op (a norm's kernels more than a matrix product), so the ratios grow with the noise: the same
decode bench gave 1.05× on an idle 2-core machine and 1.96× under load. A process pinned to some of
the machine's cores (taskset) shares them with few of the others: there the rule counts every core
of the machine in place of the threads (a pinned 1-thread run on 16 cores after boot was 'busy').
"""

import math
import os
import platform
import random

import torch

from model import GPT, GPTConfig

BUSY_LOAD_PER_THREAD = 0.5  # the busy rule's threshold: 1-minute load average per torch thread
# timed trials when --trials=0 (the default): on CUDA a trial costs milliseconds and the minutes go to
# compiling, so more trials cost little and narrow the intervals; a CPU trial of a large model costs seconds
DEFAULT_TRIALS = {'cuda': 15}
DEFAULT_TRIALS_ELSEWHERE = 5
CONFIDENCE = 0.95  # of the paired-ratio intervals


def random_tokens(vocab_size, shape, seed):
    """int64 ids (shape) below vocab_size, from a CPU torch.Generator seeded with seed."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def calibrated_model(model_args, seed):
    """GPT(GPTConfig(**model_args)), a tapered one (taper 'internal' or 'all'), after its calibrate
    event on random tokens through the model's own path: one forward of 4 random sequences under
    set_collect('calibration'), then calibrate('end') (c and s_tgt measured, γ̃ ← γ). Its weights
    come from torch.manual_seed(seed), so a baseline built after the same seed shares its matrices.
    Left in the warmup phase (set_phase takes it on), collect off, in train mode, on the CPU.
    Raises ValueError for model_args GPTConfig refuses, RuntimeError for taper='none'."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**model_args))
    x = random_tokens(model_args['vocab_size'], (4, min(64, model_args['block_size'])), seed + 1)
    model.set_collect('calibration')
    model(x, x)  # the calibration statistics of one batch
    model.set_collect(None)
    model.calibrate('end')
    return model


def round_orders(names, rounds, seed=0):
    """The order in which each of `rounds` rounds calls names (a list): a fresh shuffle per round
    from random.Random(seed), so the same seed gives the same rounds. Not a rotation (A B C D,
    B C D A, ...): that keeps who follows whom, so whatever a run leaves behind (warm caches, the
    allocator's free blocks, the clocks) would fall on the same next run in all but one round in
    len(names), always the baseline's in bench.py --mode=train (google/benchmark#1051 shuffles its
    repetitions for the same reason)."""
    rng = random.Random(seed)
    return [rng.sample(names, len(names)) for _ in range(rounds)]


def interleaved(runs, trials, warm_ups, after_warm_up=None):
    """Call each run of `runs` ({name: run() -> result}) warm_ups times, name after name (the first
    calls absorb compilation, recompilation and CUDA-graph recording), then after_warm_up(warm) when
    given, then `trials` rounds that each call every run once, so that a drift of the machine hits
    every run alike, in the orders of round_orders. Returns (warm, timed): {name: [results]}."""
    warm = {n: [run() for _ in range(warm_ups)] for n, run in runs.items()}
    if after_warm_up is not None:
        after_warm_up(warm)
    timed = {n: [] for n in runs}
    for order in round_orders(list(runs), trials):
        for n in order:
            timed[n].append(runs[n]())
    return warm, timed


def default_trials(trials, device_type):
    """--trials as given, or for 0 the default of the device type (DEFAULT_TRIALS)."""
    return trials or DEFAULT_TRIALS.get(device_type, DEFAULT_TRIALS_ELSEWHERE)


def median_ratio_interval(numerators, denominators, confidence=CONFIDENCE):
    """A distribution-free interval for the median of the paired ratios r_k = numerators[k] / denominators[k]
    (k: a round of `interleaved`, whose two runs met the same state of the machine), as the sign test
    gives it: the order statistics (r_(j), r_(n+1−j)) for the largest j whose coverage
    1 − 2 · P(Binomial(n, ½) < j) is at least `confidence`. No assumption about the noise's shape:
    timings have heavy right tails (a preempted trial). Below 6 pairs no j reaches 95 %: then
    (min, max), with its lower coverage (5 pairs: 93.75 %). Returns (lo, hi, coverage)."""
    r = sorted(a / b for a, b in zip(numerators, denominators, strict=True))
    n = len(r)

    def coverage(j):
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n

    j = 1
    while j < n // 2 and coverage(j + 1) >= confidence:
        j += 1
    return r[j - 1], r[n - j], coverage(j)


def profiled(run, device_type):
    """A finished torch.profiler run of run() (host events; on CUDA its kernels too), profiled twice
    and the first thrown away: a process's first profiler session pays the profiler's start-up
    (kineto#328), which made the first row profiled, always the baseline, look slower than itself."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == 'cuda' else [])
    for _ in range(2):
        with profile(activities=activities) as prof:
            run()
    return prof


# CUDA runtime calls in which the host waits for the device: their time is the device's, not launch work
HOST_WAITS = ('cudaDeviceSynchronize', 'cudaStreamSynchronize', 'cudaEventSynchronize')


def profile_totals(prof):
    """{'operators': calls of torch operators (aten:: and the compiled graph's; an operator another
    calls is counted too, as the profiler's table counts it), 'host_ms': the host events' self time
    but for HOST_WAITS, 'wait_ms': theirs, 'kernels': device kernels launched, 'device_ms': their
    time} of a finished torch.profiler run. On a GPU a step whose host_ms exceeds its device_ms is
    launch-bound: there an extra kernel costs its launch, whatever it computes. The device side
    leaves out user annotations (the compiled region's, the optimizer step's: spans over kernels
    counted already, pytorch#130730)."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, 'is_user_annotation', False)]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    waits = [e for e in host if e.name in HOST_WAITS]
    return {'operators': sum(1 for e in host if e.name.startswith(('aten::', 'CompiledFunction', 'Torch-Compiled'))),
            'host_ms': sum(e.self_cpu_time_total for e in host if e.name not in HOST_WAITS) / 1e3,
            'wait_ms': sum(e.self_cpu_time_total for e in waits) / 1e3,
            'kernels': len(kernels), 'device_ms': sum(e.device_time_total for e in kernels) / 1e3}


def print_profile(prof, title, device_type, row_limit):
    """A finished torch.profiler run's table (operators by self time on the device, else the CPU),
    under `title`, then one line of its totals (profile_totals)."""
    print(f"---- profile: {title} ----")
    print(prof.key_averages().table(sort_by=f"self_{'device' if device_type == 'cuda' else 'cpu'}_time_total",
                                    row_limit=row_limit))
    totals = profile_totals(prof)
    print(f"one step: {totals['operators']} operator calls, {totals['host_ms']:.2f} ms of them on the host" +
          (f" (+ {totals['wait_ms']:.2f} ms waiting for the device); {totals['kernels']} device kernels, "
           f"{totals['device_ms']:.2f} ms on the device" if device_type == 'cuda' else ''))


def with_peak(run, device_type):
    """run wrapped to return (its result, the most bytes it allocated on top of what was allocated
    when it started: torch.cuda.max_memory_allocated() − memory_allocated(); None off CUDA, where
    torch keeps no such statistic)."""
    if device_type != 'cuda':
        return lambda: (run(), None)

    def measured():
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        result = run()
        return result, torch.cuda.max_memory_allocated() - resident
    return measured


def cpu_model():
    """The CPU's model name: /proc/cpuinfo's first 'model name' (Linux), else platform.processor(),
    else platform.machine() ('' when none says)."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.partition(':')[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(dev):
    """What a timing ran on, for its record: the GPU's name on CUDA, 'mps (N CPU cores)' on MPS,
    'cpu (N cores)' on the CPU, so that no Mac GPU's figures read as a CPU's."""
    kind = torch.device(dev).type
    if kind == 'cuda':
        return torch.cuda.get_device_name(dev)
    return f"mps ({os.cpu_count()} CPU cores)" if kind == 'mps' else f'cpu ({os.cpu_count()} cores)'


def conditions():
    """The conditions of a timing, read now: {threads: torch.get_num_threads(), cores: those this
    process may run on (fewer than machine_cores: pinned, taskset), machine_cores, cpu: cpu_model(),
    cpu_capability: the ISA torch's CPU kernels dispatch to (torch.backends.cpu.get_cpu_capability():
    'AVX512', 'AVX2', 'DEFAULT', ...), load: os.getloadavg()'s 1, 5 and 15-minute averages (None where
    the OS has none), busy: the busy rule (module docstring) holds (False when load is None)}."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # Windows has no load average
        load = None
    threads, machine = torch.get_num_threads(), os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else machine  # < machine: pinned
    return dict(threads=threads, cores=cores, machine_cores=machine, cpu=cpu_model(),
                cpu_capability=torch.backends.cpu.get_cpu_capability(), load=load,
                busy=load is not None and load[0] > BUSY_LOAD_PER_THREAD * (machine if cores < machine else threads))


def print_conditions(c):
    """The header line of conditions() `c`, and when the machine is busy the one line saying that its
    ratios are unreliable."""
    load = 'n/a' if c['load'] is None else ' '.join(f'{x:.2f}' for x in c['load'])
    pinned = c['cores'] < c['machine_cores']
    print(f"  threads={c['threads']} cores={c['cores']} of {c['machine_cores']}{' (pinned)' * pinned} "
          f"cpu={c['cpu'] or '?'} isa={c['cpu_capability']} load average (1, 5, 15 min)={load}")
    if c['busy']:
        print(f"  warning: the machine is busy (1-minute load {c['load'][0]:.2f} > {BUSY_LOAD_PER_THREAD} × "
              f"{c['machine_cores'] if pinned else c['threads']} {'cores' if pinned else 'threads'}): ratios are "
              "unreliable; time on an idle machine (the average trails: a job that ended within the last minute "
              "still counts in it)")
