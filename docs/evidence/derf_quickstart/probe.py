"""Derf on the quick start (its section in docs/results.md): train.py's own run, in process, with probes at a few steps:
tensors whose gradient is exactly zero (an optimizer step pre-hook, before the step zeroes them), and
the share of Derf entries with |α·h + s| > 3 (forward hooks). A probe kept as evidence, not part of the product.
It made the log.jsonl and output.txt beside it (2026-12-04, the code of that day):
    python docs/evidence/derf_quickstart/probe.py config/tinystories_baseline.py config/cpu.py \
        --norm=derf --learning_rate=4e-3 --out_dir=out-cpu-austen-derf"""
import json
import os
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..'))  # the repository
import torch
import train
from baselines import Derf, DyT

PROBE = {40, 60, 100, 250, 750, 1499}
state = {'it': -1, 'sat': {}}
real_configure = train.configure_optimizer


def configure(model, *a, **k):
    opt = real_configure(model, *a, **k)
    names = {id(p): n for n, p in model.named_parameters()}
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, (Derf, DyT))]

    def fwd_hook(mod, inp, out, name=None):
        if state['it'] + 1 in PROBE and mod.training:
            z = mod.alpha * inp[0].detach() + getattr(mod, 'shift', 0.0)
            state['sat'].setdefault(name, []).append((z.abs() > 3).float().mean().item())
    for n, m in norms:
        m.register_forward_hook(lambda mod, i, o, n=n: fwd_hook(mod, i, o, n))

    def pre(optimizer, args, kwargs):
        state['it'] += 1
        if state['it'] in PROBE:
            params = [p for g in optimizer.param_groups for p in g['params']]
            zero = [names[id(p)] for p in params if p.grad is None or not p.grad.any()]
            sat = {n: sum(v) / len(v) for n, v in state['sat'].items()}
            print(json.dumps({'probe_it': state['it'], 'zero_grad_tensors': len(zero), 'of': len(params),
                              'zero_grad_examples': zero[:4],
                              'sat_share_all': sum(sat.values()) / max(len(sat), 1),
                              'sat_share_ln_f': sat.get('transformer.ln_f')}), flush=True)
        state['sat'] = {}
    opt.register_step_pre_hook(pre)
    return opt


train.configure_optimizer = configure
train.main(sys.argv[1:])
