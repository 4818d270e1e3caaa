"""
Prepare OpenWebText (https://huggingface.co/datasets/Skylion007/openwebtext), the open
reproduction of GPT-2's WebText, as data/openwebtext/{train.bin,val.bin,meta.json} in the full
GPT-2 vocabulary (50257 ids), streamed from the Hugging Face hub (needs: pip install datasets):

    python data/openwebtext/prepare.py                            # 4.5M val + 200M train tokens
    python data/openwebtext/prepare.py --max_tokens=1000000000    # more training tokens
    python data/openwebtext/prepare.py --input=PATH/TO/openwebtext.jsonl   # local files, no network

The first documents of the stream (--val_tokens) are the validation split, the next ones (up to
--max_tokens) the training split; --input takes .jsonl / .parquet files with a `text` column or
.txt files. See data/hub_corpus.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/
import hub_corpus  # noqa: E402

HF_REPO = "Skylion007/openwebtext"


def main(argv=None):
    return hub_corpus.main(argv, "openwebtext", HF_REPO, __doc__)


if __name__ == "__main__":
    main()
