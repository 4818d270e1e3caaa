"""
Prepare The Pile, without its copyrighted parts (https://huggingface.co/datasets/monology/pile-uncopyrighted),
as data/pile/{train.bin,val.bin,meta.json} in the full GPT-2 vocabulary (50257 ids), streamed from
the Hugging Face hub (needs: pip install datasets zstandard; its files are .jsonl.zst):

    python data/pile/prepare.py                                   # 4.5M val + 200M train tokens
    python data/pile/prepare.py --max_tokens=1000000000           # more training tokens
    python data/pile/prepare.py --input=PATH/TO/pile.jsonl        # local files (decompress .jsonl.zst first)

The first documents of the stream (--val_tokens) are the validation split, the next ones (up to
--max_tokens) the training split; --input takes .jsonl / .parquet files with a `text` column or
.txt files. See data/hub_corpus.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/
import hub_corpus  # noqa: E402

HF_REPO = "monology/pile-uncopyrighted"


def main(argv=None):
    return hub_corpus.main(argv, "pile", HF_REPO, __doc__, packages=("datasets", "zstandard"))


if __name__ == "__main__":
    main()
