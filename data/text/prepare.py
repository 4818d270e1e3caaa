"""
Prepare any local plain-text corpus (UTF-8) as data/NAME/{train.bin,val.bin,meta.json}:

    python data/text/prepare.py --name=austen --input=../shared/corpora/austen.txt
    python data/text/prepare.py --name=kjv --input=../shared/corpora/kjv.txt
    python data/text/prepare.py --name=mix --input=a.txt --input=b.txt --vocab_size=0

Each input file is one document (GPT-2 BPE, end-of-text after it). Its last 5 % of characters,
cut at a line break, goes to the validation split, the rest to training, so the two never
overlap. Line endings are normalized to "\\n". --vocab_size=K (default 10000) keeps the K - 1 most frequent training tokens plus
<unk>; 0 keeps the full GPT-2 vocabulary. --out_dir=DIR writes somewhere other than data/NAME/.
See data/common.py for the format.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/
import common  # noqa: E402

VAL_FRACTION = 0.05
USAGE = "Use: python data/text/prepare.py --name=NAME --input=FILE [--input=FILE ...]"


def split_at_line(text, val_fraction=VAL_FRACTION):
    """Cut text into (train, val) at the line break nearest before the last val_fraction of its
    characters (the first one after, if there is none before). train + val == text.
    Returns None if the cut would leave either part empty (fewer than two lines)."""
    target = int(len(text) * (1 - val_fraction))
    cut = text.rfind("\n", 0, target) + 1
    if cut == 0:
        cut = text.find("\n", target) + 1
    if cut == 0 or not text[:cut].strip() or not text[cut:].strip():
        return None
    return text[:cut], text[cut:]


def read_split(path):
    """(train, val) text of one input file; SystemExit if it cannot be split."""
    parts = split_at_line(common.read_text(path))
    if parts is None:
        raise SystemExit(f"{path} is too short to split: the validation split is its last "
                         f"{VAL_FRACTION:.0%} cut at a line break, so it needs at least two "
                         "non-empty lines")
    return parts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", help="dataset name; output goes to data/NAME/")
    parser.add_argument("--input", action="append", default=[], help="a text file (repeatable)")
    parser.add_argument("--vocab_size", type=int, default=common.DEFAULT_VOCAB_SIZE,
                        help="compact vocabulary size incl. <unk>; 0 = full GPT-2 (50257)")
    parser.add_argument("--out_dir", help="output folder (default: data/NAME/)")
    args = parser.parse_args(argv)

    common.check_inputs(args.input, USAGE)
    common.check_vocab_size(args.vocab_size)
    if args.out_dir:
        out_dir = args.out_dir
    elif args.name and os.path.basename(args.name) == args.name and args.name not in (".", ".."):
        out_dir = os.path.join(common.DATA_DIR, args.name)
    else:
        raise SystemExit(f"--name=NAME is required (a folder name, no '/'; got {args.name!r}). "
                         f"{USAGE}")
    os.makedirs(out_dir, exist_ok=True)

    t0 = time.time()
    tmp = {split: os.path.join(out_dir, f"{split}.gpt2.tmp") for split in ("train", "val")}
    try:
        # the files are read twice (once per split) rather than kept: a corpus may be large
        for i, split in enumerate(("train", "val")):
            docs = (read_split(path)[i] for path in args.input)
            common.encode_documents(docs, tmp[split], desc=split)
        splits = {split: [(tmp[split], 0, os.path.getsize(tmp[split]) // 2)]
                  for split in ("train", "val")}
        meta = common.write_dataset(out_dir, splits, args.vocab_size, args.input)
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
    common.report(meta, out_dir, time.time() - t0)
    return meta


if __name__ == "__main__":
    main()
