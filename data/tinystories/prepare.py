"""
Prepare TinyStories (https://huggingface.co/datasets/roneneldan/TinyStories) as
data/tinystories/{train.bin,val.bin,meta.json}:

    python data/tinystories/prepare.py          # downloads the V2 (GPT-4) text files, ~2 GB
    python data/tinystories/prepare.py --input=TinyStoriesV2-GPT4-train.txt \\
        --input=TinyStoriesV2-GPT4-valid.txt    # local files, no network
    python data/tinystories/prepare.py --input=train-00000-of-00004.parquet ... --vocab_size=0

--input takes the TinyStoriesV2-GPT4-{train,valid}.txt files (stories separated by
<|endoftext|> lines), .parquet files (needs pyarrow) or JSON Lines files (.jsonl / .json) with a
`text` column, one story per row. A file whose name contains "valid" (so also "validation") is
the validation split; if none is given, the last 1 % of the training stories is. Every story is
one document (GPT-2 BPE, end-of-text after it); empty or whitespace-only stories are skipped and
counted in meta.json (skipped_empty_docs). --vocab_size=K (default 10000) keeps the K - 1
most frequent training tokens plus <unk>; 0 keeps the full GPT-2 vocabulary. --out_dir=DIR writes
somewhere other than data/tinystories/. See data/common.py for the format.
"""

import argparse
import codecs
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/
import common  # noqa: E402

HF_REPO = "roneneldan/TinyStories"
HF_URL = "https://huggingface.co/datasets/roneneldan/TinyStories"
HF_FILES = ["TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt"]
VAL_FRACTION = 0.01       # of the training stories, when no validation file is given
MARKER = "<|endoftext|>"  # story separator in the .txt files
READ_BYTES = 1 << 23
OUT_DIR = os.path.dirname(os.path.abspath(__file__))
OFFLINE_HELP = f"""\
Without network access, download the two files on another machine from
  {HF_URL}  (Files and versions: {HF_FILES[0]}, {HF_FILES[1]})
and pass them as local files:
  python data/tinystories/prepare.py --input=/path/to/{HF_FILES[0]} --input=/path/to/{HF_FILES[1]}
(.parquet and JSON Lines files with a `text` column work too.)"""


def download():
    """Fetch HF_FILES from the hub into the huggingface_hub cache; returns their local paths. With
    the hub out of reach (common.hub_offline: one probe, not five retries a file) they come from
    that cache or not at all. SystemExit with OFFLINE_HELP if huggingface_hub is missing or the
    download fails."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise SystemExit("downloading TinyStories needs huggingface_hub (pip install "
                         f"huggingface_hub), which is not installed.\n{OFFLINE_HELP}") from None
    offline = common.hub_offline()
    try:
        return [hf_hub_download(repo_id=HF_REPO, repo_type="dataset", filename=name, local_files_only=offline)
                for name in HF_FILES]
    except Exception as e:  # offline, blocked, HF_HUB_OFFLINE=1: all mean "use local files"
        why = ("the hub is out of reach (no answer, or HF_HUB_OFFLINE=1), and the files are not in the local cache"
               if offline else f"{type(e).__name__}: {e}")
        raise SystemExit(f"could not download TinyStories from the Hugging Face hub ({why}).\n{OFFLINE_HELP}") from None


def read_txt(path):
    """Stories of a TinyStoriesV2 .txt file, split on <|endoftext|> (never encoded as text),
    stripped; an empty story between two markers is yielded as "" (encode_documents skips and
    counts it), whitespace after the last marker is not a story. Reads READ_BYTES at a time."""
    # a stray bad byte in a multi-GB download should not abort the run; it becomes U+FFFD
    # -sig: a leading byte-order mark (Notepad's, Gutenberg's) is dropped, not trained on
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    rest = ""
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            parts = (rest + decoder.decode(block, final=not block)).split(MARKER)
            rest = parts.pop()  # may hold a story (or a marker) cut by the block end
            yield from (s.strip() for s in parts)
            if not block:
                break
    if rest.strip():
        yield rest.strip()


def read_jsonl(path):
    """Stories (the `text` field, stripped; null is "") of a JSON Lines file; SystemExit on a
    malformed line."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # a bad byte: U+FFFD; a BOM: dropped, as in read_txt
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"{path}:{lineno} is not a JSON object with a \"text\" field; "
                                 "expected JSON Lines, one {\"text\": ...} per line") from None
            if not isinstance(text, (str, type(None))):  # an AttributeError on .strip() before
                raise SystemExit(f"{path}:{lineno}: its \"text\" is a JSON {type(text).__name__}, not a string")
            yield (text or "").strip()


def read_parquet(path):
    """Stories (the `text` column, stripped; null is "") of a parquet file, read in row batches
    through pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"reading {path} needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise SystemExit(f"{path} has no `text` column (columns: {pf.schema_arrow.names})")
    for batch in pf.iter_batches(batch_size=8192, columns=["text"]):
        yield from ((s or "").strip() for s in batch.column(0).to_pylist())


def read_stories(paths):
    """Stories of all files in order, each read by its format (by file extension)."""
    for path in paths:
        ext = os.path.splitext(path)[1].lower()
        if ext == ".parquet":
            yield from read_parquet(path)
        elif ext in (".jsonl", ".json"):
            yield from read_jsonl(path)
        else:
            yield from read_txt(path)


def is_validation(path):
    """A file whose name contains "valid" (e.g. -valid.txt, validation-*.parquet) is val."""
    return "valid" in os.path.basename(path).lower()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", default=[], type=os.path.expanduser,
                        help="local .txt / .parquet / .jsonl file (repeatable); default: download")
    parser.add_argument("--vocab_size", type=int, default=common.DEFAULT_VOCAB_SIZE,
                        help="compact vocabulary size incl. <unk>; 0 = full GPT-2 (50257)")
    parser.add_argument("--out_dir", type=common.folder, default=OUT_DIR, help="output folder")
    args = parser.parse_args(argv)

    common.check_vocab_size(args.vocab_size)
    if args.input:
        common.check_inputs(args.input, f"Pass local TinyStories files:\n{OFFLINE_HELP}")
        paths, sources = args.input, args.input
    else:
        try:
            paths = download()
        except KeyboardInterrupt:  # a 2 GB download: Ctrl-C is likely here
            raise common.stopped_by_sigint("downloading TinyStories", "no dataset was written; the same command "
                                           "downloads again") from None
        sources = [f"{HF_URL}/blob/main/{name}" for name in HF_FILES]
    train_files = [p for p in paths if not is_validation(p)]
    val_files = [p for p in paths if is_validation(p)]
    if not train_files:
        raise SystemExit(f"all inputs are validation files (name contains 'valid'): {val_files}; "
                         f"add the training file.\n{OFFLINE_HELP}")
    t0 = time.time()
    with common.scratch_files(args.out_dir, "train", "val") as tmp:
        doc_ends, skipped = common.encode_documents(read_stories(train_files), tmp["train"],
                                                    desc="train")
        n_train = int(doc_ends[-1]) if len(doc_ends) else 0
        if val_files:
            skipped += common.encode_documents(read_stories(val_files), tmp["val"],
                                               desc="val").skipped
            splits = {"train": [(tmp["train"], 0, n_train)],
                      "val": [(tmp["val"], 0, os.path.getsize(tmp["val"]) // 2)]}
        else:
            n_val = max(1, round(len(doc_ends) * VAL_FRACTION))
            if len(doc_ends) < 2:
                raise SystemExit(f"{train_files} hold {len(doc_ends)} stories; need at least two "
                                 "(or pass a validation file, name containing 'valid')")
            cut = int(doc_ends[-n_val - 1])
            print(f"no validation file: the last {n_val:,} of {len(doc_ends):,} training stories "
                  "are the validation split")
            splits = {"train": [(tmp["train"], 0, cut)], "val": [(tmp["train"], cut, n_train)]}
        meta = common.write_dataset(args.out_dir, splits, args.vocab_size, sources, skipped)
    common.report(meta, args.out_dir, time.time() - t0)
    return meta


if __name__ == "__main__":
    main()
