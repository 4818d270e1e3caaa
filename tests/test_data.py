"""Tests for data/common.py and the prepare scripts: tiny corpora written to tmp_path, CPU only.

    python -m pytest tests/test_data.py -q
"""

import errno
import importlib.util
import json
import io
import os
import shutil
import re
import ssl
import subprocess
import sys
import types
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "data"))
import common  # noqa: E402

EOT_TEXT = "<|endoftext|>"


def load_script(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


text_prepare = load_script("text_prepare", REPO / "data" / "text" / "prepare.py")
ts_prepare = load_script("tinystories_prepare", REPO / "data" / "tinystories" / "prepare.py")


@pytest.fixture
def enc():
    return common.get_encoder()


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


def make_corpus(n_lines=120, seed=0):
    """ASCII prose-like lines with a skewed word distribution, varied whitespace and blank lines."""
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "away", "quickly",
             "Elizabeth", "Darcy", "said", "very", "much", "indeed", "42", "1813", "!", "?", ","]
    p = 1.0 / np.arange(1, len(words) + 1)
    lines = []
    for i in range(n_lines):
        line = " ".join(rng.choice(words, size=rng.integers(3, 12), p=p / p.sum()))
        lines.append(line + ("  " if i % 7 == 0 else "") + ("\n" if i % 5 else "\n\n"))
    return "".join(lines)


def stories(n, seed=0):
    rng = np.random.default_rng(seed)
    names = ["Lily", "Tom", "Sue", "Max", "Ben"]
    return [f"Once upon a time, {rng.choice(names)} found {int(rng.integers(2, 99))} red balls.\n\n"
            f"{rng.choice(names)} said: \"Story {i} ends here.\"" for i in range(n)]


def write_tinystories_txt(path, items):
    # the TinyStoriesV2 layout: each story followed by a line holding only the marker
    path.write_text("".join(f"{s}\n{EOT_TEXT}\n" for s in items))
    return path


# ------------------------------------------------------------------------------------------------
# vocabulary

def test_build_vocab_orders_by_count_then_id_and_always_keeps_eot():
    counts = np.zeros(common.GPT2_VOCAB_SIZE, dtype=np.int64)
    counts[[7, 3, 100, 5, 9]] = [50, 50, 80, 10, 10]  # ties 3/7 and 5/9
    counts[common.GPT2_EOT] = 1
    gpt2_ids = common.build_vocab(counts, 5)  # 4 kept tokens + <unk>
    # eot (count 1) displaces 5 or 9; the others by count, ties by id
    assert gpt2_ids.tolist() == [100, 3, 7, common.GPT2_EOT]
    assert common.build_vocab(counts, 7).tolist() == [100, 3, 7, 5, 9, common.GPT2_EOT]
    assert common.build_vocab(counts, 2).tolist() == [common.GPT2_EOT]
    # tokens never seen fill any places left, by id
    assert common.build_vocab(counts, 9).tolist()[-2:] == [0, 1]
    assert np.array_equal(common.build_vocab(counts, 0), np.arange(common.GPT2_VOCAB_SIZE))
    kept = common.build_vocab(counts, common.GPT2_VOCAB_SIZE)
    assert len(kept) == common.GPT2_VOCAB_SIZE - 1 and len(set(kept.tolist())) == len(kept)


def test_lookup_table_maps_everything_else_to_unk():
    lut = common.lookup_table([100, 3, common.GPT2_EOT], unk_id=3)
    assert lut[[100, 3, common.GPT2_EOT]].tolist() == [0, 1, 2]
    others = np.setdiff1d(np.arange(common.GPT2_VOCAB_SIZE), [100, 3, common.GPT2_EOT])
    assert set(lut[others].tolist()) == {3}


@pytest.mark.parametrize("k", [1, -1, common.GPT2_VOCAB_SIZE + 1])
def test_bad_vocab_size_is_rejected(k, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(make_corpus())
    with pytest.raises(SystemExit, match="vocab_size"):
        text_prepare.main([f"--input={f}", f"--vocab_size={k}", f"--out_dir={tmp_path / 'o'}"])


# ------------------------------------------------------------------------------------------------
# encoding

def test_split_exact_pieces_encode_like_the_whole_text(enc):
    text = (make_corpus(400) + " trailing words\n\n\n  indented 12 line\n'tis a contraction\n"
            "caf\u00e9 \u00a0nbsp\t\ttabs\r\n\x0cform feed\x1c\nsep \u3000ideographic 7 8 9\n")
    pieces = common.split_exact(text, piece_chars=7)
    assert len(pieces) > 100 and "".join(pieces) == text
    assert sum((enc.encode_ordinary(p) for p in pieces), []) == enc.encode_ordinary(text)
    uncuttable = "no_place_to_cut_here" * 10
    assert common.split_exact(uncuttable, piece_chars=5) == [uncuttable]


def test_encode_documents_pool_matches_serial(tmp_path, enc):
    docs = [make_corpus(30, seed=i) for i in range(12)]
    a, b = tmp_path / "a.tmp", tmp_path / "b.tmp"
    ends_a, skipped_a = common.encode_documents(iter(docs), str(a), num_proc=1)
    ends_b, skipped_b = common.encode_documents(iter(docs), str(b), num_proc=2, batch_chars=500)
    assert skipped_a == skipped_b == 0
    ids = read_bin(a)
    assert np.array_equal(ids, read_bin(b)) and np.array_equal(ends_a, ends_b)
    expected = sum((enc.encode_ordinary(d) + [common.GPT2_EOT] for d in docs), [])
    assert ids.tolist() == expected
    assert ends_a.tolist() == (np.flatnonzero(ids == common.GPT2_EOT) + 1).tolist()


# ------------------------------------------------------------------------------------------------
# data/text/prepare.py

def test_text_full_vocab_round_trips_and_val_is_the_last_5_percent_at_a_line(tmp_path):
    text = make_corpus(300)
    f = tmp_path / "corpus.txt"
    f.write_text(text)
    out = tmp_path / "out"
    meta = text_prepare.main([f"--input={f}", "--vocab_size=0", f"--out_dir={out}"])
    assert meta == common.load_meta(out)
    assert meta["vocab_size"] == common.GPT2_VOCAB_SIZE and meta["unk_id"] is None
    assert meta["gpt2_ids"] == list(range(common.GPT2_VOCAB_SIZE))
    assert meta["eot_id"] == common.GPT2_EOT and meta["tokenizer"] == "gpt2"
    assert meta["unk_rate"] == {"train": 0.0, "val": 0.0} and meta["sources"] == [str(f)]
    train, val = (common.decode(read_bin(out / f"{s}.bin"), meta) for s in ("train", "val"))
    assert train.endswith(EOT_TEXT) and val.endswith(EOT_TEXT)
    train, val = train[:-len(EOT_TEXT)], val[:-len(EOT_TEXT)]
    assert train + val == text  # nothing lost, nothing in both
    assert train.endswith("\n")  # cut at a line break
    assert 0.02 < len(val) / len(text) < 0.08
    assert meta["tokens"] == {s: len(read_bin(out / f"{s}.bin")) for s in ("train", "val")}
    assert not list(out.glob("*.tmp"))


def test_text_compact_vocab_counts_train_only_and_maps_the_rest_to_unk(tmp_path, enc):
    text = make_corpus(300)
    f = tmp_path / "corpus.txt"
    f.write_text(text)
    k = 12
    meta = text_prepare.main([f"--input={f}", f"--vocab_size={k}", f"--out_dir={tmp_path}"])
    train_text, val_text = text_prepare.split_at_line(text)
    counts = Counter(enc.encode_ordinary(train_text) + [common.GPT2_EOT])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    assert common.GPT2_EOT not in ranked[:k - 1]  # so the test sees eot being kept anyway
    expected = ranked[:k - 2] + [common.GPT2_EOT]  # eot has the lowest count of the kept
    assert meta["gpt2_ids"] == expected and len(meta["gpt2_ids"]) == k - 1
    assert meta["unk_id"] == k - 1 and meta["vocab_size"] == k
    assert meta["gpt2_ids"][meta["eot_id"]] == common.GPT2_EOT

    for split, part in (("train", train_text), ("val", val_text)):
        ids = read_bin(tmp_path / f"{split}.bin")
        assert ids.max() < k
        gpt2 = enc.encode_ordinary(part) + [common.GPT2_EOT]
        # ASCII text, so every GPT-2 token decodes on its own
        want = "".join(enc.decode([t]) if t in expected else "<unk>" for t in gpt2)
        assert common.decode(ids, meta) == want
        n_unk = sum(t not in expected for t in gpt2)
        assert meta["unk_rate"][split] == pytest.approx(n_unk / len(gpt2))
    assert meta["unk_rate"]["train"] > 0
    assert common.encode(val_text, meta) == read_bin(tmp_path / "val.bin").tolist()[:-1]


def test_text_several_files_each_split_at_its_own_end(tmp_path, enc):
    texts = [make_corpus(100, seed=1), make_corpus(200, seed=2)]
    paths = []
    for i, t in enumerate(texts):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(t)
    meta = text_prepare.main([f"--input={p}" for p in paths] + ["--vocab_size=0",
                                                                 f"--out_dir={tmp_path}"])
    for split, i in (("train", 0), ("val", 1)):
        docs = common.decode(read_bin(tmp_path / f"{split}.bin"), meta).split(EOT_TEXT)
        assert docs[-1] == "" and docs[:-1] == [text_prepare.split_at_line(t)[i] for t in texts]


def test_text_form_feed_lines_make_documents_and_val_is_cut_between_them(tmp_path):
    # a manual's layout (a text dump of man pages): each page, then a line holding only \f
    pages = [make_corpus(30, seed=i) for i in range(21)]  # 21 pages of about equal size
    f = tmp_path / "manual.txt"
    f.write_text("".join(p + "\f\n" for p in pages))
    meta = text_prepare.main([f"--input={f}", "--vocab_size=0", f"--out_dir={tmp_path}"])
    train, val = (common.decode(read_bin(tmp_path / f"{s}.bin"), meta).split(EOT_TEXT) for s in ("train", "val"))
    assert train[-1] == val[-1] == ""  # every document, the last one too, ends with end-of-text
    assert train[:-1] + val[:-1] == pages  # whole pages, in order, none in both splits, no \f left
    # the cut is the page boundary nearest to 95 % of the characters (worked out here by hand)
    total, ends = sum(map(len, pages)), np.cumsum([len(p) for p in pages])
    k = 1 + int(np.argmin(np.abs(ends[:-1] - 0.95 * total)))
    assert len(train) - 1 == k and ends[k - 1] > 0.95 * total  # nearest here is after 95 %, not before
    # a form feed inside a line is text; without a line holding only \f a file is one document
    g = tmp_path / "one.txt"
    g.write_text("".join(p + "a\f\n" for p in pages))
    assert [len(part) for part in text_prepare.read_split(g)] == [1, 1]


def test_text_default_out_dir_is_data_name(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    f = tmp_path / "c.txt"
    f.write_text(make_corpus())
    text_prepare.main(["--name=mini", f"--input={f}"])
    assert {p.name for p in (tmp_path / "mini").iterdir()} == {"train.bin", "val.bin",
                                                                 "meta.json"}


def offline_env(cache):
    """os.environ as on a machine without a network or tiktoken's files: an empty TIKTOKEN_CACHE_DIR and
    a proxy that refuses every connection."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "all_proxy")}
    return dict(env, TIKTOKEN_CACHE_DIR=str(cache), HTTPS_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
                HTTP_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")


@pytest.mark.parametrize("before, says", [
    ({"train.bin": b"\1\0", "val.bin": b"\1\0", "meta.json": b"{}"}, "a dataset already there is whole"),
    ({"train.bin": b"\1\0"}, "o holds no whole dataset (no meta.json): prepare it again"),  # pass 2 had begun
    ({}, "no dataset was written")])
def test_ctrl_c_while_preparing_is_one_line_saying_what_it_left(tmp_path, monkeypatch, capsys, before, says):
    """Ctrl-C inside scratch_files (a KeyboardInterrupt): exit 130 and one line saying what the
    folder holds, not a traceback; the scratch files go, and a folder it made is removed."""
    monkeypatch.chdir(tmp_path)
    if before:
        (tmp_path / "o").mkdir()
        for name, data in before.items():
            (tmp_path / "o" / name).write_bytes(data)
    with pytest.raises(SystemExit) as e, common.scratch_files("o", "train", "val") as tmp:
        open(tmp["train"], "wb").close()
        raise KeyboardInterrupt
    assert e.value.code == 130 and capsys.readouterr().err == f"stopped by SIGINT preparing the dataset: {says}\n"
    assert sorted(os.listdir("o")) == sorted(before) if before else not os.path.exists("o")


@pytest.mark.parametrize("script, argv, name", [("tinystories", [], "TinyStories"), ("text", ["--name=austen"], "austen")])
def test_ctrl_c_during_a_download_is_one_line(tmp_path, monkeypatch, capsys, script, argv, name):
    """The download runs before scratch_files: Ctrl-C there printed a KeyboardInterrupt traceback
    (huggingface_hub#3648), in the 2 GB TinyStories download too."""
    module = ts_prepare if script == "tinystories" else text_prepare

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "download" if script == "tinystories" else "download_corpus", interrupted)
    with pytest.raises(SystemExit) as e:
        module.main(argv + [f"--out_dir={tmp_path / 'o'}"])
    assert e.value.code == 130 and capsys.readouterr().err == (
        f"stopped by SIGINT downloading {name}: no dataset was written; the same command downloads again\n")
    assert not (tmp_path / "o").exists()


def test_two_prepares_into_one_folder_at_once_both_finish_whole(tmp_path, monkeypatch):
    """With fixed scratch names (NAME.gpt2.tmp, train.bin.tmp), the second prepare wrote over and then
    removed the files the first was writing: FileNotFoundError, or a false 'split is empty'.
    Here a whole second prepare runs while the first is in pass 2."""
    f = tmp_path / "in.txt"
    f.write_text(make_corpus(300))
    args = [f"--input={f}", "--vocab_size=64"]
    alone = text_prepare.main(args + [f"--out_dir={tmp_path / 'alone'}"])
    remap, nested = common._remap, []

    def remap_with_a_second_prepare(*a):
        if not nested:  # the first call, of the first prepare
            nested.append(None)
            nested[0] = text_prepare.main(args + [f"--out_dir={tmp_path / 'both'}"])
        return remap(*a)

    monkeypatch.setattr(common, "_remap", remap_with_a_second_prepare)
    first = text_prepare.main(args + [f"--out_dir={tmp_path / 'both'}"])
    assert first == nested[0] == alone and sorted(os.listdir(tmp_path / "both")) == ["meta.json", "train.bin", "val.bin"]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "both" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
        # as open() makes a file: mkstemp's 0600 passed to the dataset, unreadable to anyone else
        assert (tmp_path / "both" / name).stat().st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_killed_prepares_scratch_files_go_and_a_live_ones_stay(tmp_path):
    """temporary_name's files carry their writer's pid: kill -9 left gigabytes that no later run removed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now (reused within this test: unlikely)
    out = tmp_path / "o"
    out.mkdir()
    for name in (f"{dead.pid}-0.train.gpt2.tmp", f"{os.getppid()}-0.val.gpt2.tmp", "notes.tmp", "train.bin"):
        (out / name).write_bytes(b"x")
    with common.scratch_files(str(out), "train") as tmp:
        assert os.path.basename(tmp["train"]) == f"{os.getpid()}-0.train.gpt2.tmp"
    assert sorted(os.listdir(out)) == sorted([f"{os.getppid()}-0.val.gpt2.tmp", "notes.tmp", "train.bin"])


def test_the_encoder_workers_leave_ctrl_c_to_the_main_process():
    """The terminal sends SIGINT to every process of its group; a worker that took it printed a
    'Process ForkPoolWorker-2:' traceback of its own."""
    import signal
    # Python's own handler, as in a terminal (a runner started in the background, or under nohup's
    # shell, inherits SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with common.encoder_pool(2) as pool:
            assert pool.map(signal.getsignal, [signal.SIGINT] * 2) == [signal.SIG_IGN] * 2
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process keeps its own
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_offline_without_tiktokens_files_a_script_says_so_in_one_line_and_the_tests_needing_them_skip(tmp_path):
    """A script stops with common.NO_BPE and the cause in one line; the test suite skips the tests that need
    the BPE (one through a fixture, one inside pytest.raises(SystemExit)) under that line, once, and runs
    the rest."""
    (tmp_path / "c.txt").write_text(make_corpus())
    r = subprocess.run([sys.executable, str(REPO / "data" / "text" / "prepare.py"), "--name=x", "--input=c.txt",
                        "--out_dir=o"], cwd=tmp_path, env=offline_env(tmp_path / "cache"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith(common.NO_BPE + " (") and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"; TIKTOKEN_CACHE_DIR={tmp_path / 'cache'} is set, but lacks them or holds one that failed" in r.stderr
    tests = ["test_split_exact_pieces_encode_like_the_whole_text",
             "test_text_bad_inputs_give_clear_errors[args4-too short]",
             "test_build_vocab_orders_by_count_then_id_and_always_keeps_eot"]  # the last needs no BPE
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *[f"tests/test_data.py::{t}" for t in tests]], cwd=REPO, env=offline_env(tmp_path / "cache"),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 passed, 2 skipped" in r.stdout.splitlines()[-1], out  # plugins may warn on stderr
    assert [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("SKIPPED")] == [common.NO_BPE]
    assert out.count("SKIPPED [2] ") == 1 and "Traceback" not in out and "Error" not in out, out


def test_text_script_runs_from_another_cwd(tmp_path, enc):  # enc: a subprocess needs the BPE too: skip without
    f = tmp_path / "c.txt"
    f.write_text(make_corpus())
    env = dict(os.environ)  # offline: TIKTOKEN_CACHE_DIR, as the test run has it
    r = subprocess.run([sys.executable, str(REPO / "data" / "text" / "prepare.py"), "--input",
                        "c.txt", "--out_dir=o", "--vocab_size=100"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "meta.json").read_text())["vocab_size"] == 100


@pytest.mark.parametrize("args, message", [
    (["--name=x"], "--input"),
    (["--name=x", "--input=/nonexistent/file.txt"], "/nonexistent/file.txt"),
    (["--input=EXISTING"], "--name"),
    (["--name=a/b", "--input=EXISTING"], "--name"),
    (["--name=x", "--input=EMPTY"], "too short"),
    (["--name=x", "--input=ONELINE"], "too short"),
])
def test_text_bad_inputs_give_clear_errors(tmp_path, monkeypatch, args, message):
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    files = {"EXISTING": make_corpus(), "EMPTY": "", "ONELINE": "no line break at all"}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    args = [a.replace("--input=", f"--input={tmp_path}/") if a.split("=")[1] in files else a
            for a in args]
    with pytest.raises(SystemExit) as e:
        text_prepare.main(args)
    assert message in str(e.value)
    assert not list(tmp_path.glob("*/*.tmp")) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("script", ["text", "tinystories"])
def test_an_empty_out_dir_is_refused_not_taken_as_the_default(tmp_path, monkeypatch, capsys, script):
    """--out_dir= (a variable that was not set): text's wrote into data/NAME/ as if none were given."""
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text(make_corpus())
    prepare = {"text": text_prepare, "tinystories": ts_prepare}[script]
    with pytest.raises(SystemExit) as e:
        prepare.main(["--name=x", "--input=c.txt", "--out_dir="] if script == "text" else
                     ["--input=c.txt", "--out_dir="])
    assert e.value.code == 2 and "argument --out_dir: empty: name a folder, or leave --out_dir out for the " \
                                 "default" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


# ------------------------------------------------------------------------------------------------
# data/tinystories/prepare.py

def test_tinystories_txt_splits_on_the_marker_and_picks_val_by_name(tmp_path, enc):
    train, val = stories(40, seed=1), stories(6, seed=2)
    ts_prepare.READ_BYTES = 64  # markers and UTF-8 cut by block ends
    try:
        files = [write_tinystories_txt(tmp_path / "TinyStoriesV2-GPT4-valid.txt", val),
                 write_tinystories_txt(tmp_path / "TinyStoriesV2-GPT4-train.txt", train)]
        meta = ts_prepare.main([f"--input={p}" for p in files] +
                               ["--vocab_size=0", f"--out_dir={tmp_path / 'o'}"])
    finally:
        ts_prepare.READ_BYTES = 1 << 23
    for split, items in (("train", train), ("val", val)):
        ids = read_bin(tmp_path / "o" / f"{split}.bin")
        assert np.count_nonzero(ids == common.GPT2_EOT) == len(items)
        marker_as_text = enc.encode_ordinary(EOT_TEXT)
        assert not any(ids[i:i + 2].tolist() == marker_as_text[:2] for i in range(len(ids)))
        assert common.decode(ids, meta) == "".join(s + EOT_TEXT for s in items)
    assert meta["tokens"]["val"] == len(read_bin(tmp_path / "o" / "val.bin"))


@pytest.mark.parametrize("script", ["text", "tinystories"])
def test_a_leading_tilde_in_input_and_out_dir_is_the_home_folder(tmp_path, monkeypatch, script):
    """--input=~/... and --out_dir=~/... reach argparse unexpanded (a shell expands ~ only at a word's
    start): they mean the home folder, not a folder named '~' in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    if script == "text":
        (tmp_path / "in.txt").write_text(make_corpus(300))
    else:
        write_tinystories_txt(tmp_path / "in.txt", stories(300))
    prepare = text_prepare if script == "text" else ts_prepare
    meta = prepare.main(["--input=~/in.txt", "--vocab_size=0", "--out_dir=~/out"])
    assert meta == common.load_meta(tmp_path / "out") and meta["sources"] == [str(tmp_path / "in.txt")]
    assert not (tmp_path / "~").exists()

def test_a_full_disk_while_preparing_is_one_line_and_leaves_no_dataset_behind(tmp_path, monkeypatch):
    """Writes that meet a full disk (Linux's /dev/full, in place of the file being written): in pass 1
    (a folder this call made is removed) or in pass 2 over a prepared dataset (its meta.json goes
    first, so the folder no longer reads as a dataset): one line, no temp file left. numpy's tofile
    raised an OSError without errno there, which read as some other error."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    f = tmp_path / "in.txt"
    f.write_text(make_corpus(300))
    out = tmp_path / "out"
    want = (f"the filesystem of {out} is full (No space left on device) preparing the dataset, which needs about 4 "
            "bytes a token while it runs (2 in the end); free space there, or pass --out_dir on a disk with room")
    real_open = open

    def full(suffix):  # open: a file being written whose name ends with suffix goes to /dev/full
        return lambda path, mode="r", *a, **k: real_open("/dev/full" if str(path).endswith(suffix) and "w" in mode
                                                         else path, mode, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(common, "open", full(".gpt2.tmp"), raising=False)
        with pytest.raises(SystemExit) as e:
            text_prepare.main([f"--input={f}", f"--out_dir={out}"])
    assert str(e.value) == want and not out.exists()

    text_prepare.main([f"--input={f}", f"--out_dir={out}"])
    monkeypatch.setattr(common, "open", full("val.bin.tmp"), raising=False)
    with pytest.raises(SystemExit) as e:
        text_prepare.main([f"--input={f}", f"--out_dir={out}"])
    assert str(e.value) == want and sorted(os.listdir(out)) == ["train.bin", "val.bin"]  # no meta.json, no .tmp
    with pytest.raises(SystemExit, match="meta.json not found: prepare the dataset first"):
        common.load_meta(out)

def test_an_out_dir_that_is_a_file_or_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """makedirs' FileExistsError / NotADirectoryError and a write's PermissionError were tracebacks.
    As root, permission bits do not refuse: the refused write is simulated."""
    f = tmp_path / "in.txt"
    f.write_text(make_corpus(300))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=r"^--out_dir=\S+afile names a file: pass --out_dir a folder you can write to$"):
        text_prepare.main([f"--input={f}", f"--out_dir={tmp_path / 'afile'}"])
    with pytest.raises(SystemExit, match=r"afile/sub cannot be made \(Not a directory\): pass --out_dir a folder"):
        text_prepare.main([f"--input={f}", f"--out_dir={tmp_path / 'afile' / 'sub'}"])
    real_open = open

    def denied(path, mode="r", *a, **k):
        if "w" in mode:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(common, "open", denied, raising=False)
    with pytest.raises(SystemExit, match=rf"^cannot write in {tmp_path / 'out'} \(Permission denied\) preparing the "
                                         r"dataset: pass --out_dir a folder you can write to$"):
        text_prepare.main([f"--input={f}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()

def test_a_pipe_or_a_folder_as_input_is_named_for_what_it_is(tmp_path):
    """--input=<(zcat x.jsonl.gz) gives /dev/fd/N, a pipe: it was 'input file not found'."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit, match=rf"^input {fifo} is not a regular file \(a pipe\?\): prepare reads its "
                                         r"inputs from files \(save a pipe's output to one first\)\. FIX$"):
        common.check_inputs([str(fifo)], "FIX")
    with pytest.raises(SystemExit, match=rf"^input {tmp_path} is a folder: "):
        common.check_inputs([str(tmp_path)], "FIX")


def test_a_missing_mix7_text_names_the_script_that_downloads_it(tmp_path, monkeypatch):
    """mix7's texts come from data/mix7/build_corpora.py: a prepare command copied from the docs before
    running it names that script, from the repository's root; another missing file does not."""
    monkeypatch.chdir(os.path.dirname(common.DATA_DIR))
    with pytest.raises(SystemExit, match=r"^input file not found: data/downloads/mix7/nowhere.txt \(python "
                                         r"data/mix7/build_corpora.py downloads that folder's texts\)\. "):
        common.check_inputs(["data/downloads/mix7/nowhere.txt"], "FIX")
    with pytest.raises(SystemExit, match=rf"^input file not found: {tmp_path}/austen.txt\. FIX$"):
        common.check_inputs([str(tmp_path / "austen.txt")], "FIX")

def test_tinystories_without_val_file_uses_the_last_1_percent(tmp_path):
    items = stories(300)
    f = write_tinystories_txt(tmp_path / "train.txt", items)
    meta = ts_prepare.main([f"--input={f}", "--vocab_size=0", f"--out_dir={tmp_path}"])
    split = {s: common.decode(read_bin(tmp_path / f"{s}.bin"), meta).split(EOT_TEXT)[:-1]
             for s in ("train", "val")}
    assert split["val"] == items[-3:] and split["train"] == items[:-3]


def test_tinystories_compact_vocab_comes_from_train_only(tmp_path, enc):
    train = ["a a a a b b c"] * 3
    val = ["zebra zebra zebra zebra zebra"]
    files = [write_tinystories_txt(tmp_path / "x-train.txt", train),
             write_tinystories_txt(tmp_path / "x-validation.txt", val)]
    meta = ts_prepare.main([f"--input={p}" for p in files] + ["--vocab_size=4",
                                                              f"--out_dir={tmp_path}"])
    zebra = set(enc.encode_ordinary(" zebra") + enc.encode_ordinary("zebra"))
    assert not zebra & set(meta["gpt2_ids"])
    assert meta["unk_rate"]["val"] > 0.5 and meta["eot_id"] in range(3)


def test_tinystories_jsonl_with_text_column(tmp_path):
    train, val = stories(20, seed=3), stories(3, seed=4)
    for name, items in (("train.jsonl", train), ("validation.jsonl", val)):
        (tmp_path / name).write_text(
            "".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(items)))
    meta = ts_prepare.main([f"--input={tmp_path / n}" for n in ("train.jsonl", "validation.jsonl")]
                           + ["--vocab_size=0", f"--out_dir={tmp_path}"])
    for split, items in (("train", train), ("val", val)):
        assert common.decode(read_bin(tmp_path / f"{split}.bin"), meta) == \
            "".join(s + EOT_TEXT for s in items)


def test_tinystories_jsonl_without_text_is_an_error(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"story": "x"}) + "\n")
    with pytest.raises(SystemExit, match="text"):
        ts_prepare.main([f"--input={f}", f"--out_dir={tmp_path}"])
    f.write_text(json.dumps({"text": "a story"}) + "\n" + json.dumps({"text": 5}) + "\n")
    with pytest.raises(SystemExit, match=f'{f}:2: its "text" is a JSON int, not a string'):
        list(ts_prepare.read_jsonl(f))


def test_tinystories_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    train, val = stories(25, seed=5), stories(4, seed=6)
    for name, items in (("train-00000-of-00001.parquet", train),
                        ("validation-00000-of-00001.parquet", val)):
        pq.write_table(pa.table({"text": items}), tmp_path / name, row_group_size=7)
    meta = ts_prepare.main([f"--input={p}" for p in sorted(tmp_path.glob("*.parquet"))] +
                           ["--vocab_size=0", f"--out_dir={tmp_path}"])
    for split, items in (("train", train), ("val", val)):
        assert common.decode(read_bin(tmp_path / f"{split}.bin"), meta) == \
            "".join(s + EOT_TEXT for s in items)


def test_tinystories_offline_says_how_to_pass_local_files(tmp_path, monkeypatch):
    def offline(**kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(hf_hub_download=offline))
    with pytest.raises(SystemExit) as e:
        ts_prepare.main([f"--out_dir={tmp_path}"])
    msg = str(e.value)
    assert "--input=" in msg and ts_prepare.HF_URL in msg and "valid.txt" in msg

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed: import fails
    with pytest.raises(SystemExit) as e:
        ts_prepare.main([f"--out_dir={tmp_path}"])
    assert "huggingface_hub" in str(e.value) and "--input=" in str(e.value)


def fake_hub(monkeypatch, answers, cached=None, offline_env=False):
    """huggingface_hub stand-in: its session's HEAD succeeds when `answers` (else the ConnectionError
    of a machine offline); hf_hub_download returns `cached`'s path for a file with local_files_only,
    or fails as the real one does when the file is not cached. Returns (probes, downloads) lists."""
    probes, downloads = [], []

    class Session:
        def head(self, url, timeout):
            probes.append((url, timeout))
            if not answers:
                raise ConnectionError("Failed to resolve 'huggingface.co'")

    def hf_hub_download(repo_id, repo_type, filename, local_files_only):
        downloads.append((filename, local_files_only))
        if cached and filename in cached:
            return cached[filename]
        raise OSError("cannot find the requested files in the local cache" if local_files_only else "download fails")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(
        hf_hub_download=hf_hub_download, get_session=Session,
        constants=types.SimpleNamespace(HF_HUB_OFFLINE=offline_env, ENDPOINT="https://huggingface.co")))
    return probes, downloads


def test_tinystories_with_the_hub_out_of_reach_probes_once_and_reads_only_the_local_cache(tmp_path, monkeypatch):
    """Offline, huggingface_hub retried each file five times (~25 s) before the offline message: now one
    HEAD probe decides, and the files come from the local cache (local_files_only) or the message comes
    at once."""
    probes, downloads = fake_hub(monkeypatch, answers=False)
    with pytest.raises(SystemExit) as e:
        ts_prepare.main([f"--out_dir={tmp_path}"])
    assert probes == [("https://huggingface.co", common.HUB_PROBE_S)]
    assert downloads == [(ts_prepare.HF_FILES[0], True)]  # the first miss ends it
    assert str(e.value).startswith("could not download TinyStories from the Hugging Face hub (the hub is out of "
                                   "reach (no answer, or HF_HUB_OFFLINE=1), and the files are not in the local cache).\n")
    assert ts_prepare.OFFLINE_HELP in str(e.value)

    # the files in the cache: prepared from there, offline
    cached = {}
    for name, n in zip(ts_prepare.HF_FILES, (30, 5)):
        cached[name] = str(tmp_path / name)
        (tmp_path / name).write_text("".join(s + "\n<|endoftext|>\n" for s in stories(n, seed=n)))
    probes, downloads = fake_hub(monkeypatch, answers=False, cached=cached)
    meta = ts_prepare.main([f"--out_dir={tmp_path / 'out'}", "--vocab_size=0"])
    assert downloads == [(name, True) for name in ts_prepare.HF_FILES] and meta["tokens"]["train"] > meta["tokens"]["val"] > 0

    # the hub answers: downloaded as before; HF_HUB_OFFLINE=1: no probe, the cache alone
    probes, downloads = fake_hub(monkeypatch, answers=True, cached=cached)
    ts_prepare.main([f"--out_dir={tmp_path / 'out2'}", "--vocab_size=0"])
    assert len(probes) == 1 and downloads == [(name, False) for name in ts_prepare.HF_FILES]
    probes, downloads = fake_hub(monkeypatch, answers=True, offline_env=True)
    with pytest.raises(SystemExit, match="out of reach"):
        ts_prepare.main([f"--out_dir={tmp_path / 'out3'}"])
    assert probes == [] and downloads == [(ts_prepare.HF_FILES[0], True)]


def test_a_hub_stream_with_the_hub_out_of_reach_fails_before_streaming(tmp_path, monkeypatch):
    owt = load_script("owt_prepare_offline", REPO / "data" / "openwebtext" / "prepare.py")
    streamed = []
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: streamed.append(a)))
    probes, _ = fake_hub(monkeypatch, answers=False)
    with pytest.raises(SystemExit) as e:
        owt.main([f"--out_dir={tmp_path}"])
    assert len(probes) == 1 and streamed == []
    assert str(e.value).startswith("cannot stream Skylion007/openwebtext: the Hugging Face hub is out of reach (no "
                                   "answer, or HF_HUB_OFFLINE=1). Offline, pass local files: python "
                                   "data/openwebtext/prepare.py --input=")


@pytest.mark.parametrize("name", ["stories-valid.txt", "stories-valid.jsonl"])
def test_a_utf16_tinystories_input_is_refused_before_any_input_is_read(tmp_path, monkeypatch, name):
    """read_text's check (the text prepare) now guards every --input (the TinyStories readers, and the hub
    corpora's, which read through them): UTF-16 was read as garbage, or a jsonl raised UnicodeDecodeError.
    A bad validation file given after a good training file is refused before the training split is encoded."""
    rows = stories(20, seed=2)
    text = ("".join(s + "\n<|endoftext|>\n" for s in rows) if name.endswith(".txt")
            else "".join(json.dumps({"text": s}) + "\n" for s in rows))
    (tmp_path / name).write_bytes(text.encode("utf-16"))
    (tmp_path / "train.txt").write_text("".join(s + "\n<|endoftext|>\n" for s in stories(30, seed=3)))
    encoded = []
    monkeypatch.setattr(common, "encode_documents", lambda *a, **k: encoded.append(a))
    with pytest.raises(SystemExit) as e:
        ts_prepare.main([f"--input={tmp_path / 'train.txt'}", f"--input={tmp_path / name}",
                         f"--out_dir={tmp_path / 'out'}"])
    assert str(e.value) == (f"{tmp_path / name} starts with a UTF-16 byte-order mark, and prepare reads UTF-8: convert "
                            f"it to UTF-8 first: iconv -f UTF-16 -t UTF-8 {tmp_path / name} > {tmp_path / name}.utf8.txt")
    assert encoded == [] and not (tmp_path / "out").exists()


def test_a_stray_bad_byte_in_a_jsonl_input_is_replaced_as_in_a_txt_one(tmp_path):
    rows = stories(30, seed=4)
    lines = [json.dumps({"text": s}).encode() for s in rows]
    lines[3] = lines[3].replace(b'"text": "', b'"text": "\xe9', 1)  # one Latin-1 byte: under the 1 % refusal
    (tmp_path / "s.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert list(ts_prepare.read_jsonl(tmp_path / "s.jsonl")) == [("\ufffd" if i == 3 else "") + s
                                                               for i, s in enumerate(rows)]


@pytest.mark.parametrize("case, message", [
    ("missing", "not found"), ("empty", "need at least two"), ("only_val", "validation"),
    ("one_story", "need at least two"),
])
def test_tinystories_bad_inputs_give_clear_errors(tmp_path, case, message):
    paths = {
        "missing": [tmp_path / "nope-train.txt"],
        "empty": [write_tinystories_txt(tmp_path / "train.txt", [])],
        "only_val": [write_tinystories_txt(tmp_path / "valid.txt", stories(3))],
        "one_story": [write_tinystories_txt(tmp_path / "train.txt", stories(1))],
    }[case]
    with pytest.raises(SystemExit) as e:
        ts_prepare.main([f"--input={p}" for p in paths] + [f"--out_dir={tmp_path / 'o'}"])
    assert message in str(e.value)
    assert not (tmp_path / "o").exists()  # no pass-1 files, and no empty folder a later run would trip on


def test_a_failed_prepare_keeps_an_empty_folder_the_user_made(tmp_path, monkeypatch):
    """Only a folder the failed prepare created is removed: an empty data/NAME/ made beforehand (a
    mount point, a folder with its own permissions) is the user's, and stays."""
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    (tmp_path / "x").mkdir()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match="too short"):
        text_prepare.main(["--name=x", f"--input={tmp_path / 'empty.txt'}"])
    assert (tmp_path / "x").is_dir() and not list((tmp_path / "x").iterdir())


def test_load_meta_missing_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="prepare"):
        common.load_meta(tmp_path)


# ------------------------------------------------------------------------------------------------
# line endings and empty documents (both scripts, through common.encode_documents)

def test_encode_documents_normalizes_line_endings_and_skips_empty_documents(tmp_path, enc):
    docs = ["one\r\ntwo\rthree\n", "", "  \r\n\t", "four"]
    ends, skipped = common.encode_documents(iter(docs), str(tmp_path / "a.tmp"))
    assert skipped == 2 and len(ends) == 2
    expected = enc.encode_ordinary("one\ntwo\nthree\n") + [common.GPT2_EOT] + \
        enc.encode_ordinary("four") + [common.GPT2_EOT]
    assert read_bin(tmp_path / "a.tmp").tolist() == expected


def test_text_crlf_and_lf_files_give_the_same_ids(tmp_path):
    text = make_corpus(200)
    (tmp_path / "lf.txt").write_bytes(text.encode())
    (tmp_path / "crlf.txt").write_bytes(text.replace("\n", "\r\n").encode())
    (tmp_path / "cr.txt").write_bytes(text.replace("\n", "\r").encode())
    for name in ("lf", "crlf", "cr"):
        text_prepare.main([f"--input={tmp_path / name}.txt", "--vocab_size=0",
                           f"--out_dir={tmp_path / name}"])
    for split in ("train", "val"):
        lf = read_bin(tmp_path / "lf" / f"{split}.bin")
        assert np.array_equal(lf, read_bin(tmp_path / "crlf" / f"{split}.bin"))
        assert np.array_equal(lf, read_bin(tmp_path / "cr" / f"{split}.bin"))


def test_a_utf8_byte_order_mark_is_not_read_as_text(tmp_path):
    """Notepad's 'UTF-8 with BOM' and many Gutenberg files start with EF BB BF (datasets#8241):
    the same text with and without it gives the same ids, and a JSONL file with it is read."""
    text = make_corpus(200)
    (tmp_path / "plain.txt").write_bytes(text.encode())
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    for name in ("plain", "bom"):
        text_prepare.main([f"--input={tmp_path / name}.txt", "--vocab_size=0", f"--out_dir={tmp_path / name}"])
    for split in ("train", "val"):
        assert np.array_equal(read_bin(tmp_path / "plain" / f"{split}.bin"), read_bin(tmp_path / "bom" / f"{split}.bin"))
    train, val = stories(10, seed=5), stories(3, seed=6)
    for name, items in (("a-train", train), ("a-valid", val)):
        write_tinystories_txt(tmp_path / f"{name}.txt", items)
        raw = (tmp_path / f"{name}.txt").read_bytes()
        (tmp_path / f"{name}.txt").write_bytes(b"\xef\xbb\xbf" + raw)
        assert list(ts_prepare.read_txt(tmp_path / f"{name}.txt")) == items  # not "\ufeff" + the first story
        rows = b"".join(json.dumps({"text": s}).encode() + b"\n" for s in items)
        (tmp_path / f"{name}.jsonl").write_bytes(b"\xef\xbb\xbf" + rows)
        assert list(ts_prepare.read_jsonl(tmp_path / f"{name}.jsonl")) == items  # refused as not JSON before


def test_tinystories_crlf_val_file_holds_no_carriage_returns(tmp_path, enc):
    train, val = stories(20, seed=7), stories(4, seed=8)
    write_tinystories_txt(tmp_path / "a-train.txt", train)
    crlf = "".join(f"{s}\n{EOT_TEXT}\n" for s in val).replace("\n", "\r\n")
    (tmp_path / "a-valid.txt").write_bytes(crlf.encode())
    (tmp_path / "lf").mkdir()
    write_tinystories_txt(tmp_path / "lf" / "a-valid.txt", val)
    for out, val_file in (("o_crlf", tmp_path / "a-valid.txt"),
                          ("o_lf", tmp_path / "lf" / "a-valid.txt")):
        ts_prepare.main([f"--input={tmp_path / 'a-train.txt'}", f"--input={val_file}",
                         "--vocab_size=0", f"--out_dir={tmp_path / out}"])
    ids = read_bin(tmp_path / "o_crlf" / "val.bin")
    assert np.array_equal(ids, read_bin(tmp_path / "o_lf" / "val.bin"))
    carriage_returns = {t for t in range(common.GPT2_EOT) if "\r" in enc.decode([t])}
    assert not carriage_returns & set(ids.tolist())


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_tinystories_empty_stories_are_skipped_and_counted(tmp_path, fmt):
    items = stories(10, seed=9)
    rows = items[:3] + ["", "   \n "] + items[3:6] + [None] + items[6:]  # 3 empty ones
    if fmt == "txt":
        # "" and whitespace between two markers; a txt story cannot be null
        rows = [r for r in rows if r is not None]
        (tmp_path / "s-train.txt").write_text("".join(f"{s}\n{EOT_TEXT}\n" for s in rows))
        n_empty = 2
    elif fmt == "jsonl":
        (tmp_path / "s-train.jsonl").write_text(
            "".join(json.dumps({"text": s}) + "\n" for s in rows))
        n_empty = 3
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": rows}), tmp_path / "s-train.parquet")
        n_empty = 3
    meta = ts_prepare.main([f"--input={tmp_path}/s-train.{fmt}", "--vocab_size=0",
                            f"--out_dir={tmp_path / 'o'}"])
    assert meta["skipped_empty_docs"] == n_empty
    ids = np.concatenate([read_bin(tmp_path / "o" / f"{s}.bin") for s in ("train", "val")])
    # an end-of-text after every document that is in the stream, and none for the skipped
    assert np.count_nonzero(ids == common.GPT2_EOT) == len(items)
    assert common.decode(ids, meta) == "".join(s + EOT_TEXT for s in items)


def test_text_meta_records_no_skipped_documents(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(make_corpus())
    meta = text_prepare.main([f"--input={f}", "--vocab_size=50", f"--out_dir={tmp_path}"])
    assert meta["skipped_empty_docs"] == 0


# ------------------------------------------------------------------------------------------------
# prompts

@pytest.fixture(scope="module")
def compact_meta(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompt")
    f = tmp / "c.txt"
    f.write_text("Once upon a time there was a cat.\n" * 30 + "Once the cat sat.\n" * 5)
    return text_prepare.main([f"--input={f}", "--vocab_size=20", f"--out_dir={tmp}"])


def test_encode_prompt_maps_the_end_of_text_literal_to_the_eot_id(compact_meta):
    meta = compact_meta
    ids, unk_rate = common.encode_prompt(EOT_TEXT + "Once", meta)
    assert ids[0] == meta["eot_id"] and len(ids) == 2 and unk_rate == 0.0
    for text in (EOT_TEXT + "Once upon a time", "Once the cat sat.\n" + EOT_TEXT + "Once",
                 "Once upon a time"):
        assert common.decode(common.encode_prompt(text, meta).ids, meta) == text
    # training documents keep the literal as ordinary text, as before
    assert meta["eot_id"] not in common.encode(EOT_TEXT + "Once", meta)
    assert len(common.encode(EOT_TEXT, meta)) == 7


def test_encode_prompt_full_vocab_and_unk_rate(compact_meta, enc):
    full = {"gpt2_ids": list(range(common.GPT2_VOCAB_SIZE)), "unk_id": None,
            "eot_id": common.GPT2_EOT}
    p = common.encode_prompt(EOT_TEXT + "Zebras\r\n", full)
    assert p.ids == [common.GPT2_EOT] + enc.encode_ordinary("Zebras\n") and p.unk_rate == 0.0
    meta = compact_meta
    p = common.encode_prompt("Once zebras quarrelled", meta)
    n_unk = p.ids.count(meta["unk_id"])
    assert n_unk > 0 and p.unk_rate == pytest.approx(n_unk / len(p.ids))
    assert common.encode_prompt("", meta) == ([], 0.0)


# ------------------------------------------------------------------------------------------------
# downloads: data/text/prepare.py --name=austen without --input

def gutenberg_page(title, body, old_style=False):
    """A Project Gutenberg plain-text file as served: BOM, CRLF, header, licence."""
    this = "THIS" if old_style else "THE"
    closing = f"\nEnd of the Project Gutenberg EBook of {title}\n\n" if old_style else ""
    page = (f"\ufeffThe Project Gutenberg eBook of {title}\n\nThis ebook is for the use of anyone "
            f"anywhere in the United States.\n\nTitle: {title}\n\n"
            f"*** START OF {this} PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n\n"
            f"{body}\n{closing}\n*** END OF {this} PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n"
            "Section 1. General Terms of Use and Redistributing Project Gutenberg electronic "
            "works\n")
    return page.replace("\n", "\r\n").encode("utf-8")


@pytest.fixture
def fake_gutenberg(tmp_path, monkeypatch):
    """urllib.request.urlopen serving small fake Gutenberg files for PUBLIC_CORPORA['austen'];
    downloads go under tmp_path. Returns (bodies by url, list of fetched urls)."""
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    corpus = text_prepare.PUBLIC_CORPORA["austen"]
    bodies = {url: make_corpus(40, seed=i).strip() + "\n" for i, (_, url) in enumerate(corpus)}
    pages = {url: gutenberg_page(title, bodies[url], old_style=i % 2 == 1)
             for i, (title, url) in enumerate(corpus)}
    fetched = []

    def urlopen(request, timeout=None):
        fetched.append(request.full_url)
        assert timeout and request.get_header("User-agent")
        return io.BytesIO(pages[request.full_url])

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return bodies, fetched


def test_text_downloads_austen_strips_gutenberg_and_reuses_the_files(tmp_path, monkeypatch,
                                                                     fake_gutenberg):
    bodies, fetched = fake_gutenberg
    urls = [url for _, url in text_prepare.PUBLIC_CORPORA["austen"]]
    assert len(urls) == 6 and all(u.startswith("https://www.gutenberg.org/") for u in urls)
    meta = text_prepare.main(["--name=austen", "--vocab_size=0"])
    assert fetched == urls and meta["sources"] == urls
    assert common.load_meta(tmp_path / "austen") == meta
    for url in urls:  # the kept files hold the text only, with "\n" line endings
        kept = tmp_path / "downloads" / "austen" / url.rsplit("/", 1)[1]
        assert kept.read_bytes().decode() == bodies[url]
    for split, i in (("train", 0), ("val", 1)):  # one document per novel
        docs = common.decode(read_bin(tmp_path / "austen" / f"{split}.bin"), meta).split(EOT_TEXT)
        assert docs[:-1] == [text_prepare.split_at_line(bodies[u])[i] for u in urls]
        assert "Gutenberg" not in "".join(docs) and "\r" not in "".join(docs)

    def offline(*args, **kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    assert text_prepare.main(["--name=austen", "--vocab_size=0"]) == meta


def test_text_download_offline_says_how_to_pass_local_files(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))

    def offline(*args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit) as e:
        text_prepare.main(["--name=austen"])
    msg = str(e.value)
    assert msg.startswith("cannot download https://www.gutenberg.org/") and "\n" not in msg
    assert msg.endswith("offline? pass local files: "
                        "python data/text/prepare.py --name=austen --input=PATH/TO/austen.txt")
    assert not (tmp_path / "austen").exists() and not list(tmp_path.glob("downloads/*/*"))

    def no_certificates(*args, **kwargs):  # python.org's macOS Python before Install Certificates.command
        raise urllib.error.URLError(ssl.SSLCertVerificationError(
            1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate"))

    monkeypatch.setattr(urllib.request, "urlopen", no_certificates)
    with pytest.raises(SystemExit) as e:  # online: "offline?" sent the user the wrong way
        text_prepare.main(["--name=austen"])
    assert "offline?" not in str(e.value) and str(e.value).endswith(
        "this Python cannot verify the server's certificate. On python.org's macOS Python run its 'Install "
        "Certificates.command'; elsewhere (a proxy with its own certificate) set SSL_CERT_FILE to your CA bundle; "
        "or pass local files: python data/text/prepare.py --name=austen --input=PATH/TO/austen.txt")

    # --input works as before, with no download
    f = tmp_path / "austen.txt"
    f.write_text(make_corpus())
    meta = text_prepare.main(["--name=austen", f"--input={f}"])
    assert meta["sources"] == [str(f)] and (tmp_path / "austen" / "train.bin").is_file()


def test_strip_gutenberg_needs_both_marker_lines():
    body = "It is a truth universally acknowledged.\n\nThe end.\n"
    page = gutenberg_page("Pride and Prejudice", body).decode("utf-8-sig").replace("\r\n", "\n")
    assert text_prepare.strip_gutenberg(page, "x") == body
    for marker in ("*** START OF", "*** END OF"):
        with pytest.raises(SystemExit, match="Project Gutenberg"):
            text_prepare.strip_gutenberg(page.replace(marker, "START"), "x")


def test_text_unknown_name_without_input_names_the_downloadable_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        text_prepare.main(["--name=nosuchcorpus"])
    assert "--input" in str(e.value) and "austen" in str(e.value)


# ------------------------------------------------------------------------------------------------
# paths: the scripts write into the repository's data/ folder from any working directory

def test_text_default_out_dir_is_the_repos_data_folder_from_another_cwd(tmp_path, enc):  # enc: skip without
    name = f"_test_cwd_{uuid.uuid4().hex[:12]}"
    out = REPO / "data" / name
    (tmp_path / "c.txt").write_text(make_corpus())
    env = dict(os.environ)  # offline: TIKTOKEN_CACHE_DIR, as the test run has it
    try:
        r = subprocess.run([sys.executable, str(REPO / "data" / "text" / "prepare.py"),
                            f"--name={name}", "--input=c.txt", "--vocab_size=100"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert {p.name for p in out.iterdir()} == {"train.bin", "val.bin", "meta.json"}
        assert json.loads((out / "meta.json").read_text())["sources"] == ["c.txt"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # nothing written here
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert Path(common.DATA_DIR) == REPO / "data"
    assert Path(ts_prepare.OUT_DIR) == REPO / "data" / "tinystories"


mix7_build = load_script("mix7_build", REPO / "data" / "mix7" / "build_corpora.py")


def test_the_r_reader_of_the_austen_recipe_reads_a_character_vector_with_names():
    # R's XDR serialization, written here by hand: version 2 header, then a character vector
    # of three strings (UTF-8, Latin-1, NA) whose attributes (a pairlist) give it names
    import struct
    i = lambda *v: struct.pack(f">{len(v)}i", *v)
    utf8, latin1 = 9 | (8 << 12), 9 | (4 << 12)
    s = lambda flags, b: i(flags, len(b)) + b
    names = i(16, 3) + s(utf8, b"a") + s(utf8, b"b") + s(utf8, b"c")
    attributes = i(2 | 1024) + i(1) + s(utf8, b"names") + names + i(254)  # (tag 'names', value) then NULL
    data = b"X\n" + i(2, 0x40000, 0x20300) + i(16 | 512, 3) + s(utf8, "Émma".encode()) + \
        s(latin1, "Ä".encode("latin-1")) + i(9, -1) + attributes
    assert mix7_build.r_unserialize(data) == {"a": "Émma", "b": "Ä", "c": None}
    with pytest.raises(ValueError, match="not R's XDR"):
        mix7_build.r_unserialize(b"RDX2\n")


def test_the_corpus_recipe_downloads_the_package_versions_its_readme_names(monkeypatch, tmp_path):
    """Unpinned, apt took its newest candidate: a point release (linux-doc-6.12 6.12.118) changed
    docs_linux.txt and every count measured on mix7."""
    table = (REPO / "data" / "mix7" / "README.md").read_text()
    named = dict(re.findall(r"\| Debian `([^`]+)` (\S+)", table))  # | ... | Debian `pkg` version ... |
    calls = []

    def run(cmd, *args, **kwargs):  # records the commands, and stops at the download
        calls.append(cmd)
        if cmd[:2] == ["apt-get", "download"]:
            raise SystemExit("stopped at apt-get download")

    monkeypatch.setattr(mix7_build, "run", run)
    with pytest.raises(SystemExit, match="stopped at apt-get download"):
        mix7_build.download(str(tmp_path / "work"))
    packages = [a for a in calls[-1][2:] if not a.startswith(("-o", "Dir::"))]
    assert len(named) == 6 and sorted(packages) == sorted(f"{p}={v}" for p, v in named.items())


def test_a_pinned_version_gone_from_the_archive_says_so(monkeypatch):
    def gone(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 100, "", "E: Version '6.12.117-1~deb12u1' for 'linux-doc-6.12' was "
                                                         "not found")
    monkeypatch.setattr(mix7_build.subprocess, "run", gone)
    with pytest.raises(SystemExit, match=r"\(E: Version .* was not found\): a pinned version has left Debian's "
                                         r"archive \(snapshot.debian.org keeps every one; .*\), or pass existing "
                                         r"files instead: python data/text/prepare.py --name=mix7"):
        mix7_build.run(["apt-get", "download"], "apt-get download", download=True)


def test_the_corpus_recipe_offline_says_how_to_pass_local_files(monkeypatch):
    def offline(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 100, "", "E: Failed to fetch http://deb.debian.org/... Temporary failure")
    monkeypatch.setattr(mix7_build.subprocess, "run", offline)
    with pytest.raises(SystemExit, match=r"cannot run apt-get update \(E: Failed to fetch .*\): offline\? pass "
                                         r"existing files instead: python data/text/prepare.py --name=mix7 "
                                         r"--input=DIR/austen.txt"):
        mix7_build.run(["apt-get", "update"], "run apt-get update", download=True)


def test_a_vocabulary_larger_than_the_corpus_holds_is_warned_about(tmp_path, capsys):
    f = tmp_path / "tiny.txt"
    f.write_text("the cat sat on the mat\n" * 30 + "and then it ran away\n" * 3)
    text_prepare.main([f"--input={f}", "--vocab_size=10000", f"--out_dir={tmp_path / 'a'}"])
    train = read_bin(tmp_path / "a" / "train.bin")
    distinct = len(set(train.tolist()))  # compact ids: one per distinct GPT-2 token, end-of-text included
    out = capsys.readouterr().out
    assert f"holds {distinct:,} distinct GPT-2 tokens, fewer than the 9,999" in out
    assert f"--vocab_size={distinct + 1} fits this corpus" in out
    text_prepare.main([f"--input={f}", f"--vocab_size={distinct + 1}", f"--out_dir={tmp_path / 'b'}"])
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("encoding, message", [
    ("utf-16", "starts with a UTF-16 byte-order mark, and prepare reads UTF-8: convert it to UTF-8 first: "
               "iconv -f UTF-16 -t UTF-8"),
    ("utf-32", "starts with a UTF-32 byte-order mark"),
    # no mark: each of the n ASCII characters followed by a NUL
    ("utf-16-le", "is not UTF-8 text: {n:,} of its {twice:,} characters (50%) are NUL or undecodable bytes; "
                  "convert it to UTF-8 first: iconv -f UTF-16 -t UTF-8"),
])
def test_a_utf16_or_utf32_corpus_is_refused_in_one_line_with_the_command_that_converts_it(tmp_path, monkeypatch,
                                                                                         encoding, message):
    """Read as UTF-8 (errors="replace"), UTF-16 text was prepared silently into garbage tokens."""
    monkeypatch.setattr(common, "DATA_DIR", str(tmp_path))
    text = make_corpus()
    (tmp_path / "c.txt").write_bytes(text.encode(encoding))
    with pytest.raises(SystemExit) as e:
        text_prepare.main(["--name=x", f"--input={tmp_path / 'c.txt'}"])
    assert text.isascii() and message.format(n=len(text), twice=2 * len(text)) in str(e.value)
    assert "iconv -f UTF-" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
    (tmp_path / "c.txt").write_bytes(text.encode(encoding).decode(encoding).encode("utf-8"))  # what iconv writes
    assert common.read_text(tmp_path / "c.txt") == text


def test_a_stray_bad_byte_is_replaced_but_a_high_share_of_them_is_not_utf8(tmp_path):
    """One undecodable byte in 200 characters becomes U+FFFD (a long download with a bad byte still
    prepares); one in 50 (2 %, above NOT_TEXT_SHARE) is another encoding, refused."""
    for every, refused in ((200, False), (50, True)):
        (tmp_path / "c.txt").write_bytes(b"".join(b"a" * (every - 1) + b"\xe9" for _ in range(20)))
        if refused:
            with pytest.raises(SystemExit, match=r"c.txt is not UTF-8 text: 20 of its 1,000 characters \(2%\) are "
                                                 r"NUL or undecodable bytes; convert it"):
                common.read_text(tmp_path / "c.txt")
        else:
            assert common.read_text(tmp_path / "c.txt") == ("a" * (every - 1) + "\ufffd") * 20
