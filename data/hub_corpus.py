"""
Prepare a web corpus streamed from the Hugging Face hub, in the full GPT-2 vocabulary (50257 ids),
as data/NAME/{train.bin,val.bin,meta.json}. data/openwebtext/prepare.py and data/pile/prepare.py
are this module with a hub dataset name each:

    python data/openwebtext/prepare.py                        # streams Skylion007/openwebtext
    python data/pile/prepare.py --max_tokens=500000000        # streams monology/pile-uncopyrighted
    python data/openwebtext/prepare.py --input=owt-00.jsonl --input=owt-01.jsonl   # local files, no network

Documents are read in the order the stream (or the --input files) gives them and encoded as they
come (data/common.py: GPT-2 BPE, end-of-text after every document, a bounded number of documents
in memory). The first documents, up to the first document end at or past --val_tokens tokens, are
the validation split; the documents after them, up to the last document end within the first
val_tokens + max_tokens tokens, are the training split (at most --max_tokens tokens). Reading stops
there, so the splits depend on the documents alone, not on how they were batched.

Streaming needs the `datasets` package (pip install datasets; The Pile's .jsonl.zst files also
zstandard), imported only there. Offline,
--input takes local files, in order: .jsonl / .json / .parquet with a `text` column, one document
per row, or .txt files (documents separated by <|endoftext|> lines; without one, the whole file is
one document); a .zst file must be decompressed first (zstd -d FILE).
"""

import argparse
import os
import re
import time

import numpy as np

import common
from tinystories.prepare import read_stories  # the readers of .txt / .jsonl / .parquet inputs

MAX_TOKENS = 200_000_000  # training tokens: above the GPT-2 fine-tuning budget of config/finetune_gpt2_*.py (157M)
VAL_TOKENS = 4_500_000    # validation tokens: about the 4.5M-token OpenWebText validation set of Baroni et al. (2025)
BATCH_CHARS = common.BATCH_CHARS  # characters per encoding task (the tests use smaller ones)


def local_files(name):
    """The command that prepares data/NAME from local files instead of the hub."""
    return (f"python data/{name}/prepare.py --input=PATH/TO/{name}.jsonl "
            "(.jsonl / .parquet with a `text` column, or .txt)")


def offline_help(name):
    return f"Offline, pass local files: {local_files(name)}"


def hub_documents(repo, name, packages=("datasets",)):
    """The `text` of every row of the hub dataset's train split, streamed (datasets,
    streaming=True): nothing is downloaded ahead. SystemExit with one line saying how to pass
    local files when one of `packages` is missing (The Pile's .jsonl.zst files need zstandard,
    which datasets does not bring: without it its stream fails with "Compression type zstd not
    supported", datasets#5388), the hub does not answer (common.hub_offline) or the stream fails."""
    for package in packages:
        try:
            __import__(package)
        except ImportError:
            raise SystemExit(f"streaming {repo} needs the {package} package (pip install {' '.join(packages)}). "
                             f"{offline_help(name)}") from None
    import datasets
    if common.hub_offline():  # a stream has no local cache to fall back on; fail now, not after the retries
        raise SystemExit(f"cannot stream {repo}: the Hugging Face hub is out of reach (no answer, or HF_HUB_OFFLINE=1). "
                         f"{offline_help(name)}")
    # datasets 2.16-3.x runs a repo's loading script (Skylion007/openwebtext's) only when told to trust it where
    # its default is not to (3.x raises without it; nanoGPT#614). The repo is the one this script names;
    # datasets 4 runs no script (below) and 2.15 has no such key.
    version = tuple(map(int, re.match(r"(\d+)\.(\d+)", datasets.__version__).groups()))
    trust = {"trust_remote_code": True} if (2, 16) <= version < (4, 0) else {}
    try:
        for row in datasets.load_dataset(repo, split="train", streaming=True, **trust):
            yield row["text"] or ""
    except Exception as e:  # offline, DNS, HF_HUB_OFFLINE=1, a moved dataset: all mean "use local files"
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if "Dataset scripts are no longer supported" in str(e):  # nanoGPT#633: a repo that still loads by script
            raise SystemExit(f"cannot stream {repo}: it loads through a script, which datasets >= 4 no longer "
                             f"runs ({reason}). pip install 'datasets<4' runs it; or pass local files: "
                             f"{local_files(name)}") from None
        raise SystemExit(f"cannot stream {repo} from the Hugging Face hub ({reason}). "
                         f"{offline_help(name)}") from None


def main(argv, name, repo, description, packages=("datasets",)):
    """Prepare data/NAME (or --out_dir) from the hub dataset `repo` (streamed: needs `packages`) or
    --input files; returns the meta dict."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", default=[], type=os.path.expanduser,
                        help="a local .jsonl / .parquet / .txt file (repeatable); default: stream from the hub")
    parser.add_argument("--max_tokens", type=int, default=MAX_TOKENS,
                        help=f"training tokens at most (default {MAX_TOKENS:,})")
    parser.add_argument("--val_tokens", type=int, default=VAL_TOKENS,
                        help=f"validation tokens at least (default {VAL_TOKENS:,}), taken first")
    parser.add_argument("--out_dir", type=common.folder, default=os.path.join(common.DATA_DIR, name),
                        help="output folder")
    args = parser.parse_args(argv)
    for key in ("max_tokens", "val_tokens"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key}={getattr(args, key)} must be >= 1")
    if args.input:
        common.check_inputs(args.input, offline_help(name))  # a .jsonl.zst too: decompress it first
        docs, sources = read_stories(args.input), args.input
    else:
        docs, sources = hub_documents(repo, name, packages), [f"https://huggingface.co/datasets/{repo}"]
    t0 = time.time()
    with common.scratch_files(args.out_dir, "stream") as scratch:
        # one stream, one pass-1 file: the validation documents first, the training ones after them
        tmp = scratch["stream"]
        limit = args.val_tokens + args.max_tokens
        ends, skipped = common.encode_documents(docs, tmp, desc="encode", batch_chars=BATCH_CHARS, max_tokens=limit)
        i = np.searchsorted(ends, args.val_tokens)  # the first document end at or past val_tokens
        if i >= len(ends) - 1:
            raise SystemExit(f"the input holds {int(ends[-1]) if len(ends) else 0:,} tokens in {len(ends)} "
                             f"documents: the validation split (--val_tokens={args.val_tokens:,}) leaves no "
                             "document for training; give more documents or a smaller --val_tokens")
        val_end = int(ends[i])
        j = np.searchsorted(ends, limit, side="right") - 1  # the last document end within the limit
        if j <= i:
            raise SystemExit(f"the first training document ends {int(ends[i + 1]) - args.val_tokens:,} tokens "
                             f"past --val_tokens, more than --max_tokens={args.max_tokens:,}")
        splits = {"train": [(tmp, val_end, int(ends[j]))], "val": [(tmp, 0, val_end)]}
        meta = common.write_dataset(args.out_dir, splits, 0, sources, skipped)
    common.report(meta, args.out_dir, time.time() - t0)
    return meta
