"""
Prepare a plain-text corpus (UTF-8) as data/NAME/{train.bin,val.bin,meta.json}:

    python data/text/prepare.py --name=austen     # downloads Jane Austen's six novels
    python data/text/prepare.py --name=austen --input=austen.txt   # a local file, no network
    python data/text/prepare.py --name=kjv --input=kjv.txt
    python data/text/prepare.py --name=mix --input=a.txt --input=b.txt --vocab_size=0

Each input file is one document (GPT-2 BPE, end-of-text after it), or, where it holds lines that
hold only a form feed ("\\f"), one document per part between such lines (a manual's pages, say).
Its last 5 % of characters goes to the validation split, the rest to training, so the two never
overlap: cut at a line break (one document) or between documents (several). Line endings are normalized to "\\n". --vocab_size=K (default 10000) keeps the K - 1
most frequent training tokens plus <unk>; 0 keeps the full GPT-2 vocabulary. --out_dir=DIR
writes somewhere other than data/NAME/. See data/common.py for the format.

Without --input, a NAME in PUBLIC_CORPORA is downloaded (urllib, once: the files are kept in
data/downloads/NAME/ and reused): "austen" is the six novels from Project Gutenberg, each with
Gutenberg's header and licence removed (the text between the "*** START OF" and "*** END OF"
lines), each novel one document, so the validation split is the last 5 % of every novel.
"""

import argparse
import itertools
import os
import re
import ssl
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/
import common  # noqa: E402

VAL_FRACTION = 0.05
USAGE = "Use: python data/text/prepare.py --name=NAME --input=FILE [--input=FILE ...]"

GUTENBERG = "https://www.gutenberg.org/cache/epub/{0}/pg{0}.txt"
# The corpora `--name=NAME` downloads when no --input is given: NAME -> [(title, url)], each url
# one document, in this order. "austen": Jane Austen's six novels in order of publication, by
# Project Gutenberg ebook number (plain-text UTF-8 files).
PUBLIC_CORPORA = {
    "austen": [(title, GUTENBERG.format(number)) for title, number in (
        ("Sense and Sensibility", 161), ("Pride and Prejudice", 1342), ("Mansfield Park", 141),
        ("Emma", 158), ("Northanger Abbey", 121), ("Persuasion", 105))],
}
USER_AGENT = "tapernorm-data-prepare (Python urllib)"
TIMEOUT_S = 60
# Project Gutenberg's own lines around the text of an ebook; what is outside them is its header and
# licence. Older files also close the text with an "End of the Project Gutenberg EBook of ..." line.
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF[^\n]*PROJECT GUTENBERG[^\n]*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF[^\n]*PROJECT GUTENBERG[^\n]*$", re.M | re.I)
_GUTENBERG_END_LINE = re.compile(r"\n\s*End of (?:the )?Project Gutenberg[^\n]*\s*$", re.I)


def offline_help(name):
    return f"pass local files: python data/text/prepare.py --name={name} --input=PATH/TO/{name}.txt"


def fetch(url, name):
    """The bytes at url, through urllib. SystemExit, one line, if the download fails: it names
    the url and the reason and says how to pass local files instead."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.read()
    except Exception as e:  # offline, DNS, HTTP errors, timeouts: all mean "use local files"
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        if isinstance(getattr(e, "reason", e), ssl.SSLCertVerificationError):  # online, without CA certificates
            raise SystemExit(f"cannot download {url} ({reason}): this Python cannot verify the server's "
                             "certificate. On python.org's macOS Python run its 'Install Certificates.command'; "
                             "elsewhere (a proxy with its own certificate) set SSL_CERT_FILE to your CA bundle; "
                             f"or {offline_help(name)}") from None
        raise SystemExit(f"cannot download {url} ({reason}): offline? {offline_help(name)}") \
            from None


def strip_gutenberg(text, source):
    """The text of a Project Gutenberg plain-text ebook without Gutenberg's header and licence:
    what lies between the "*** START OF ... PROJECT GUTENBERG ..." and "*** END OF ..." lines,
    stripped, ending in one "\\n". SystemExit if either line is missing."""
    start = _GUTENBERG_START.search(text)
    end = _GUTENBERG_END.search(text, start.end()) if start else None
    if end is None:
        raise SystemExit(f"{source} has no '*** START OF ... PROJECT GUTENBERG' line followed by "
                         "an '*** END OF ...' line: not a Project Gutenberg plain-text ebook?")
    return _GUTENBERG_END_LINE.sub("", text[start.end():end.start()]).strip() + "\n"


def download_corpus(name):
    """Local paths of the files of PUBLIC_CORPORA[name], downloading the ones not yet in
    data/downloads/NAME/ (each kept as its text only: Gutenberg's header and licence removed,
    line endings "\\n"; written under a temporary name and renamed, so a failed download leaves
    nothing behind). A second run reads them from there and does not download again."""
    folder = os.path.join(common.DATA_DIR, "downloads", name)
    paths = []
    for title, url in PUBLIC_CORPORA[name]:
        path = os.path.join(folder, os.path.basename(urllib.parse.urlparse(url).path))
        if os.path.isfile(path):
            print(f"{title}: {path} (downloaded before)")
        else:
            print(f"{title}: downloading {url}")
            raw = fetch(url, name).decode("utf-8-sig", errors="replace")
            text = strip_gutenberg(common.normalize_newlines(raw), url)
            os.makedirs(folder, exist_ok=True)
            with common.replacing(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        paths.append(path)
    return paths


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


# a line holding only a form feed ends a document (the separator of files that hold many)
_DOC_SEPARATOR = re.compile(r"^\f(?:\n|$)", re.M)


def split_documents(docs, val_fraction=VAL_FRACTION):
    """Cut a list of documents (str) into (train docs, val docs) at the boundary between two
    documents nearest to the last val_fraction of the characters (the earlier one on a tie), so
    no document is in both splits. Returns None for fewer than two documents."""
    target, ends = (1 - val_fraction) * sum(map(len, docs)), list(itertools.accumulate(map(len, docs)))
    if len(docs) < 2:
        return None
    k = min(range(1, len(docs)), key=lambda k: abs(ends[k - 1] - target))
    return docs[:k], docs[k:]


def read_split(path):
    """(train documents, val documents) of one input file, lists of str: the file is one
    document cut at a line break (split_at_line), or, where it has form-feed lines, the
    documents between them cut between documents (split_documents). SystemExit if it cannot
    be split."""
    text = common.read_text(path)
    docs = [d for d in _DOC_SEPARATOR.split(text) if d.strip()]
    if len(docs) > 1:
        parts = split_documents(docs)
    else:
        parts = split_at_line(text)
        parts = parts and ([parts[0]], [parts[1]])
    if parts is None:
        raise SystemExit(f"{path} is too short to split: the validation split is its last "
                         f"{VAL_FRACTION:.0%} cut at a line break, so it needs at least two "
                         "non-empty lines (or two documents, separated by form-feed lines)")
    return parts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", help="dataset name; output goes to data/NAME/")
    parser.add_argument("--input", action="append", default=[], type=os.path.expanduser,
                        help="a text file (repeatable); default for a NAME in PUBLIC_CORPORA "
                             "(austen): download it")
    parser.add_argument("--vocab_size", type=int, default=common.DEFAULT_VOCAB_SIZE,
                        help="compact vocabulary size incl. <unk>; 0 = full GPT-2 (50257)")
    parser.add_argument("--out_dir", type=common.folder, help="output folder (default: data/NAME/)")
    args = parser.parse_args(argv)

    if args.input:
        common.check_inputs(args.input, USAGE)
        paths = sources = args.input
    elif args.name not in PUBLIC_CORPORA:
        common.check_inputs([], f"{USAGE}\n(Without --input, --name={'|'.join(PUBLIC_CORPORA)} "
                                "downloads a public corpus.)")
    common.check_vocab_size(args.vocab_size)
    if args.out_dir is not None:
        out_dir = args.out_dir
    elif args.name and os.path.basename(args.name) == args.name and args.name not in (".", ".."):
        out_dir = os.path.join(common.DATA_DIR, args.name)
    else:
        raise SystemExit(f"--name=NAME is required (a folder name, no '/'; got {args.name!r}). "
                         f"{USAGE}")
    if not args.input:
        try:
            paths = download_corpus(args.name)
        except KeyboardInterrupt:  # a partial file is removed (common.replacing)
            raise common.stopped_by_sigint(f"downloading {args.name}", "no dataset was written; the same command "
                                           "downloads again") from None
        sources = [url for _, url in PUBLIC_CORPORA[args.name]]
    t0 = time.time()
    with common.scratch_files(out_dir, "train", "val") as tmp:
        # the files are read twice (once per split) rather than kept: a corpus may be large
        for i, split in enumerate(("train", "val")):
            docs = (doc for path in paths for doc in read_split(path)[i])
            common.encode_documents(docs, tmp[split], desc=split)
        splits = {split: [(tmp[split], 0, os.path.getsize(tmp[split]) // 2)]
                  for split in ("train", "val")}
        meta = common.write_dataset(out_dir, splits, args.vocab_size, sources)
    common.report(meta, out_dir, time.time() - t0)
    return meta


if __name__ == "__main__":
    main()
