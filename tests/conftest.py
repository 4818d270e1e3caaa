import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the tests' models are tiny: one thread is faster, and immune to a busy second core
torch.set_num_threads(1)

# tiktoken offline: TIKTOKEN_CACHE_DIR, set by whoever runs the tests (README, Install and test).
# Without it, offline, a test that needs the GPT-2 BPE is skipped with data.common.NO_BPE, the
# line the scripts end with, instead of failing (or erroring in a fixture) with a traceback.
import data.common  # noqa: E402

sys.modules.setdefault('common', data.common)  # data/*/prepare.py and some tests import it as `common`: one module


def _or_skip(get_encoder):
    def get_encoder_or_skip():
        try:
            return get_encoder()
        except SystemExit:  # a skip, unlike SystemExit, passes pytest.raises(SystemExit) and fixtures alike
            pytest.skip(data.common.NO_BPE)
    return get_encoder_or_skip


data.common.get_encoder = _or_skip(data.common.get_encoder)  # data.common's own callers look it up here too


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Those skips, wherever each was raised (a test, a fixture), as one line of -ra's summary."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(data.common.NO_BPE):
        report.longrepr = (__file__, _or_skip.__code__.co_firstlineno, report.longrepr[2])
    return report


@pytest.fixture
def toy_data(tmp_path):
    """A data_dir holding dataset 'toy': random uint16 streams over a 64-token vocabulary.

    Training mechanics (schedule, resume, DDP) need token streams, not language.
    Returns the data_dir path.
    """
    folder = tmp_path / 'data' / 'toy'
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    # a repeating pattern with noise, so the loss actually falls
    base = np.tile(np.arange(64, dtype=np.uint16), 200)
    noise = rng.integers(0, 64, size=base.size).astype(np.uint16)
    stream = np.where(rng.random(base.size) < 0.2, noise, base)
    stream[: 10_000].tofile(folder / 'train.bin')
    stream[10_000:].tofile(folder / 'val.bin')
    (folder / 'meta.json').write_text(json.dumps({'vocab_size': 64, 'tokenizer': 'toy'}))
    return tmp_path / 'data'
