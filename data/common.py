"""
Shared data preparation: GPT-2 BPE tokenization, the compact vocabulary, train.bin / val.bin /
meta.json. Used by the prepare scripts, and by train.py / sample.py through load_meta, decode
and encode_prompt:

    python data/text/prepare.py --name=austen     # downloads; or --input=FILE ... for local files
    python data/tinystories/prepare.py            # downloads; or --input=FILE ... for local files

How a dataset is made (both scripts):
1. Pass 1 encodes documents with GPT-2 BPE (tiktoken "gpt2", encode_ordinary, 2 worker
   processes) and appends the GPT-2 ids, with the end-of-text id 50256 after every document, to a
   temporary uint16 file per split. Every document's line endings are normalized ("\\r\\n" and
   a lone "\\r" become "\\n"); an empty or whitespace-only document is skipped (no tokens, no
   end-of-text) and counted. Nothing holds the whole token stream in memory.
2. The compact vocabulary is built from the token counts of the training split only: the K - 1
   most frequent GPT-2 tokens (end-of-text always among them), by descending count, ties by
   GPT-2 id, become ids 0 .. K-2; every other token becomes <unk> = K - 1.
3. Pass 2 maps the temporary files chunk by chunk through a lookup table into train.bin /
   val.bin (uint16), written under a temporary name and renamed, then meta.json:
   vocab_size, tokenizer, gpt2_ids (compact id -> GPT-2 id, <unk> excluded), unk_id, eot_id,
   tokens {train, val}, unk_rate {train, val}, sources, skipped_empty_docs.
vocab_size = 0 keeps the full GPT-2 vocabulary (50257 ids, identity mapping, unk_id null).
"""

import argparse
import contextlib
import errno
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
from collections import deque
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

GPT2_VOCAB_SIZE = 50257  # GPT-2 ids 0 .. 50256; every one fits in uint16
GPT2_EOT = 50256         # <|endoftext|>
EOT_TEXT = "<|endoftext|>"
UNK_TEXT = "<unk>"
DEFAULT_VOCAB_SIZE = 10000
NUM_PROC = 2             # encoder processes (this project's CPU machines have 2 cores)
BATCH_CHARS = 1 << 21    # characters per worker task: ~2 MB, a few thousand TinyStories
PIECE_CHARS = 1 << 20    # longer documents are encoded in pieces of about this size
CHUNK_TOKENS = 1 << 23   # tokens per read in the counting and remapping passes (16 MB)

DATA_DIR = os.path.dirname(os.path.abspath(__file__))

_encoder = None
# how get_encoder's SystemExit begins, the cause following it; tests/conftest.py skips with it
NO_BPE = ("could not load the GPT-2 BPE from tiktoken: offline, point TIKTOKEN_CACHE_DIR at a folder holding "
          "tiktoken's cached gpt2 files, copied from a machine with a network where tiktoken cached them")


def get_encoder():
    """The tiktoken "gpt2" Encoding, loaded once per process (offline: from TIKTOKEN_CACHE_DIR).
    SystemExit in one line, NO_BPE and the cause, if tiktoken cannot load the encoding (offline
    without a cache; with TIKTOKEN_CACHE_DIR set, the line says the folder lacks the files or holds
    a damaged one).
    """
    global _encoder
    if _encoder is None:
        import tiktoken
        try:
            _encoder = tiktoken.get_encoding("gpt2")
        except Exception as e:  # tiktoken raises requests/OS errors when it has to download
            cause = (str(e).splitlines() or [""])[0]  # a connection error's text runs to 100 lines
            cache = os.environ.get("TIKTOKEN_CACHE_DIR")
            given = (f"; TIKTOKEN_CACHE_DIR={cache} is set, but lacks them or holds one that failed tiktoken's "
                     "hash check (tiktoken deletes such a file): copy them in again" if cache else "")
            raise SystemExit(f"{NO_BPE} ({type(e).__name__}: {cause[:120]}){given}") from None
    return _encoder


HUB_PROBE_S = 10.0  # seconds the one probe of hub_offline waits for the hub's answer


def hub_offline():
    """True when the Hugging Face hub does not answer one HEAD request (timeout HUB_PROBE_S seconds a
    connection attempt), sent through huggingface_hub's own session (so HF_ENDPOINT, proxies and
    HF_HUB_OFFLINE=1 count; the last sends nothing).
    Offline, huggingface_hub retries every request five times over about 25 s before it fails;
    a download that asks this first goes to the local cache at once (local_files_only) and fails
    there in a second when the files are not in it. False when huggingface_hub is not installed
    (the download's own import then says so)."""
    try:
        from huggingface_hub import constants, get_session
    except ImportError:
        return False
    if constants.HF_HUB_OFFLINE:
        return True
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S)
    except Exception:  # no DNS, no route, a proxy that refuses, a timeout: all mean "not now"
        return True
    return False


def folder(text):
    """argparse type of --out_dir: ~ expanded; an empty value is refused, where it wrote into the
    current folder or fell back to the default without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name a folder, or leave --out_dir out for the default")
    return os.path.expanduser(text)


def check_vocab_size(vocab_size):
    """SystemExit unless vocab_size is 0 (full GPT-2 vocabulary) or 2 <= vocab_size <= 50257."""
    if vocab_size != 0 and not 2 <= vocab_size <= GPT2_VOCAB_SIZE:
        raise SystemExit(
            f"--vocab_size={vocab_size} is out of range: use 2 .. {GPT2_VOCAB_SIZE} (the size of "
            "the compact vocabulary, <unk> included) or 0 for the full GPT-2 vocabulary")


def check_inputs(paths, fix):
    """SystemExit naming the first missing file (`fix` is the command line to suggest), or the first
    text file (any but .parquet) that is not UTF-8 (check_utf8): every input is checked before the
    first is read, so a bad validation file is refused before the training split is encoded."""
    if not paths:
        raise SystemExit(f"no input files given. {fix}")
    for p in paths:
        if os.path.exists(p) and not os.path.isfile(p):  # a folder, or a pipe: <(zcat x.gz), /dev/stdin
            what = "a folder" if os.path.isdir(p) else "not a regular file (a pipe?)"
            raise SystemExit(f"input {p} is {what}: prepare reads its inputs from files (save a pipe's output "
                             f"to one first). {fix}")
        if not os.path.isfile(p):
            mix7 = os.path.realpath(os.path.dirname(p)) == os.path.join(os.path.realpath(DATA_DIR), "downloads", "mix7")
            made_by = " (python data/mix7/build_corpora.py downloads that folder's texts)" if mix7 else ""
            raise SystemExit(f"input file not found: {p}{made_by}. {fix}")
    for p in paths:
        if not str(p).lower().endswith(".parquet"):
            check_utf8(p)


# ------------------------------------------------------------------------------------------------
# pass 1: documents -> GPT-2 ids in a temporary file

# ASCII whitespace followed by an ASCII letter or digit: a place split_exact may cut before
_EXACT_CUT = re.compile(r"[ \t\n\r\x0b\x0c](?=[A-Za-z0-9])")


def split_exact(text, piece_chars=PIECE_CHARS):
    """Cut text into pieces of about piece_chars whose GPT-2 encodings, concatenated, equal the
    encoding of the whole text. Returns a list of str.

    Cuts go before the last character of a whitespace run that is followed by a letter or digit
    (" Word", "\\n\\nWord"). GPT-2's pre-tokenizer splits such a run the same way whether or not
    the text ends before its last character: the run minus its last character is one piece
    (`\\s+(?!\\S)`), the last character is its own piece or joins the word (" Word"); the
    non-space text before the run never joins whitespace. BPE never merges across pieces. Only
    ASCII is trusted, as Python's and the Rust regex's ideas of whitespace differ outside it.
    Text with no such place stays one piece.
    """
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        m = _EXACT_CUT.search(text, start + max(1, piece_chars))
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def normalize_newlines(text):
    """Text with every line ending as "\\n": "\\r\\n" and a lone "\\r" become "\\n". Every document
    and prompt goes through this, so a CRLF file and an LF file of the same text give the same
    ids, and no split holds "\\r" tokens the others never see."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


# byte-order marks of the encodings that are not UTF-8; UTF-32 LE's starts with UTF-16 LE's, so it comes first
WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}
NOT_TEXT_SHARE = 0.01  # NUL or U+FFFD in more than this share of the characters: not UTF-8 text
# the first bytes of compressed files (a .jsonl.zst of The Pile, a .gz dump): (format, the command that decompresses)
COMPRESSED = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -d"), b"\x1f\x8b": ("gzip", "gunzip -k"),
              b"\xfd7zXZ\x00": ("xz", "unxz -k"), b"BZh": ("bzip2", "bunzip2 -k")}


def check_utf8(path, sample_bytes=1 << 20):
    """SystemExit, in one line with the command that fixes it, for a compressed file (COMPRESSED:
    decompress it), a file that starts with a UTF-16/32 byte-order mark, or one whose first
    sample_bytes decode to more than NOT_TEXT_SHARE NUL or undecodable (U+FFFD) characters: UTF-16
    without a mark, Latin-1, a binary file (iconv). Read as UTF-8 it would be prepared into garbage
    tokens. Every --input of every prepare script (check_inputs) and every downloaded text
    (read_text) goes through this."""
    with open(path, "rb") as f:
        head = f.read(sample_bytes)
    if packed := next((v for magic, v in COMPRESSED.items() if head.startswith(magic)), None):
        raise SystemExit(f"{path} is {packed[0]}-compressed: decompress it first ({packed[1]} {path}) and pass "
                         "the file that gives")
    wide = next((name for bom, name in WIDE_BOMS.items() if head.startswith(bom)), None)
    convert = lambda source: f"convert it to UTF-8 first: iconv -f {source} -t UTF-8 {path} > {path}.utf8.txt"
    if wide:
        raise SystemExit(f"{path} starts with a {wide} byte-order mark, and prepare reads UTF-8: {convert(wide)}")
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\0") + text.count("\ufffd")
    if bad > NOT_TEXT_SHARE * len(text):
        raise SystemExit(f"{path} is not UTF-8 text: {bad:,} of its {len(text):,} characters{' read' * (len(head) == sample_bytes)} "
                         f"({bad / len(text):.0%}) are NUL or undecodable bytes; {convert('UTF-16')} (or -f UTF-32, "
                         "-f LATIN1: the encoding it was written in)")


def read_text(path):
    """The whole of a UTF-8 text file as str, line endings normalized (normalize_newlines), a
    leading byte-order mark dropped. A stray bad byte does not abort a run: it becomes U+FFFD.
    SystemExit for a file that is not UTF-8 text (check_utf8)."""
    check_utf8(path)
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:  # -sig: a byte-order mark is not text
        return normalize_newlines(f.read())


def _batches(docs, batch_chars):
    """Group documents into worker tasks: lists of (text, ends_document) of ~batch_chars."""
    batch, size = [], 0
    for doc in docs:
        pieces = split_exact(doc) if len(doc) > PIECE_CHARS else [doc]
        for j, piece in enumerate(pieces):
            batch.append((piece, j == len(pieces) - 1))
            size += len(piece)
            if size >= batch_chars:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(batch):
    """Worker task: [(text, ends_document)] -> uint16 array of GPT-2 ids, 50256 after each doc."""
    enc = get_encoder()
    eot = [GPT2_EOT]
    ids = (enc.encode_ordinary(text) + eot if ends else enc.encode_ordinary(text)
           for text, ends in batch)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint16)


class Encoded(NamedTuple):
    """What encode_documents returns."""
    doc_ends: np.ndarray  # int64 (n_docs,): token offset just past each document's end-of-text
    skipped: int          # empty or whitespace-only documents left out (no tokens, no end-of-text)


def encode_documents(docs, path, desc="encode", num_proc=NUM_PROC, batch_chars=BATCH_CHARS,
                     max_tokens=None):
    """Pass 1: encode an iterable of documents (str) with GPT-2 BPE and write their ids, each
    document followed by end-of-text (50256), to `path` as uint16 (the file is overwritten).

    Every document's line endings are normalized first (normalize_newlines). A document that is
    empty or whitespace-only is skipped: it adds no tokens and no end-of-text, and is counted.
    Streams: the documents are consumed lazily and at most 2 * num_proc batches of ~batch_chars
    characters are in flight, so memory does not grow with the corpus. encode_ordinary never
    emits 50256 (the special token is not in the BPE ranks), so end-of-text ids mark documents.
    max_tokens: stop taking documents from `docs` once that many tokens are written; the batches
    already in flight still finish (a few times batch_chars characters at most), so the file can
    end past max_tokens: cut it at a document end with doc_ends (data/hub_corpus.py does).
    Returns Encoded(doc_ends, skipped). A progress bar counts tokens.
    """
    get_encoder()  # load (and fail, if it must) before forking, so workers inherit it
    skipped = n = 0

    def kept(docs):
        nonlocal skipped
        docs = iter(docs)
        while max_tokens is None or n < max_tokens:  # checked before a document is taken
            doc = next(docs, None)
            if doc is None:
                return
            doc = normalize_newlines(doc)
            if doc.strip():
                yield doc
            else:
                skipped += 1

    batches = _batches(kept(docs), batch_chars)
    head = list(itertools.islice(batches, 2))
    if len(head) < 2 or num_proc < 2:
        # small inputs (tests, tiny corpora) are not worth starting processes for
        results, pool = map(_encode_batch, itertools.chain(head, batches)), None
    else:
        pool = encoder_pool(num_proc)
        results = _bounded_imap(pool, _encode_batch, itertools.chain(head, batches), 2 * num_proc)
    doc_ends = []
    try:
        with open(path, "wb") as f, tqdm(desc=desc, unit="tok", unit_scale=True, total=max_tokens) as bar:
            for ids in results:
                doc_ends.append(np.flatnonzero(ids == GPT2_EOT) + (n + 1))
                f.write(memoryview(ids))  # not ids.tofile: on a full disk it raises an OSError without errno
                n += len(ids)
                bar.update(len(ids))
    finally:
        if pool is not None:
            pool.terminate()
    ends = np.concatenate(doc_ends) if doc_ends else np.zeros(0, dtype=np.int64)
    return Encoded(ends, skipped)


def encoder_pool(num_proc):
    """A multiprocessing.Pool of num_proc processes that ignore SIGINT: Ctrl-C reaches every process
    of the terminal's group, and the main one alone says what it left (scratch_files) and ends them;
    each worker printed a KeyboardInterrupt traceback of its own before."""
    return multiprocessing.Pool(num_proc, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))


def _bounded_imap(pool, fn, items, window):
    """Ordered pool.imap that reads `items` only `window` tasks ahead (Pool.imap would read the
    whole iterator, i.e. the whole corpus, into its task queue)."""
    pending = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ------------------------------------------------------------------------------------------------
# vocabulary and pass 2

def _read_chunks(segments):
    """Yield uint16 arrays covering segments [(path, start, end)] (token offsets) in order."""
    for path, start, end in segments:
        with open(path, "rb") as f:
            f.seek(2 * start)
            for pos in range(start, end, CHUNK_TOKENS):
                yield np.fromfile(f, dtype=np.uint16, count=min(CHUNK_TOKENS, end - pos))


def count_tokens(segments):
    """Counts of each GPT-2 id over segments: int64 array (50257,)."""
    counts = np.zeros(GPT2_VOCAB_SIZE, dtype=np.int64)
    for ids in _read_chunks(segments):
        counts += np.bincount(ids, minlength=GPT2_VOCAB_SIZE)
    return counts


def build_vocab(counts, vocab_size):
    """Compact vocabulary from training counts (int array (50257,)).

    Returns gpt2_ids: int64 array (vocab_size - 1,), compact id -> GPT-2 id, the vocab_size - 1
    most frequent tokens by descending count, ties by GPT-2 id; end-of-text is always kept (it
    displaces the last token if it would not make the cut). Tokens never seen in training fill any
    remaining places by id, so the vocabulary size is exactly what was asked for.
    vocab_size = 0 returns the identity over the full GPT-2 vocabulary.
    """
    check_vocab_size(vocab_size)
    if vocab_size == 0:
        return np.arange(GPT2_VOCAB_SIZE, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    ids = np.arange(GPT2_VOCAB_SIZE)
    priority = counts.copy()
    priority[GPT2_EOT] = np.iinfo(np.int64).max
    kept = np.lexsort((ids, -priority))[:vocab_size - 1]  # lexsort: last key is the primary one
    return kept[np.lexsort((kept, -counts[kept]))]


def compact_vocabulary(meta):
    """Whether a prepared dataset's meta.json (dict) is of a compact vocabulary (--vocab_size > 0):
    its ids are not GPT-2's own, and one of them is <unk> (unk_id; null in the full vocabulary)."""
    return meta.get("unk_id") is not None


def lookup_table(gpt2_ids, unk_id):
    """GPT-2 id -> compact id: uint16 array (50257,); ids not in gpt2_ids map to unk_id."""
    lut = np.full(GPT2_VOCAB_SIZE, GPT2_VOCAB_SIZE - 1 if unk_id is None else unk_id, np.uint16)
    lut[np.asarray(gpt2_ids)] = np.arange(len(gpt2_ids), dtype=np.uint16)
    return lut


def temporary_name(path):
    """A new, empty file beside path, PID-N.BASENAME.tmp, for a file to be written and then renamed to
    path: its own for each writer, where PATH.tmp was shared by two prepares into one folder (four
    train.py runs started at once, each preparing TinyStories), and each removed or replaced the file
    the other was writing. Created as open() creates a file (0666 less the umask; mkstemp's 0600
    would pass to the dataset: unreadable to anyone else)."""
    folder, base = os.path.split(path)
    for n in itertools.count():
        tmp = os.path.join(folder, f"{os.getpid()}-{n}.{base}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def replacing(path):
    """Yield a temporary name beside path (temporary_name) to write the new file under: when the
    block ends it replaces path in one rename; when it raises, it is removed and path is as it was."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_scratch(folder):
    """Remove the PID-N.*.tmp files (temporary_name) in folder whose process is gone: a prepare
    killed outright (kill -9, the out-of-memory killer) leaves them, gigabytes for a web corpus."""
    if os.name == "nt":  # os.kill(pid, 0) sends CTRL_C_EVENT there
        return
    for name in os.listdir(folder):
        match = re.fullmatch(r"(\d+)-\d+\..+\.tmp", name)
        if match and int(match[1]) != os.getpid():
            try:
                os.kill(int(match[1]), 0)
            except ProcessLookupError:
                os.remove(os.path.join(folder, name))
            except OSError:  # alive, someone else's
                pass


def _remap(segments, lut, unk_id, out_path):
    """Pass 2: write segments mapped through lut to out_path (temporary name, then renamed).
    Returns (n_tokens, n_unk)."""
    n = n_unk = 0
    with replacing(out_path) as tmp, open(tmp, "wb") as f:
        for ids in _read_chunks(segments):
            ids = lut[ids]
            if unk_id is not None:
                n_unk += int(np.count_nonzero(ids == unk_id))
            f.write(memoryview(ids))  # as in encode_documents: a full disk is then ENOSPC
            n += len(ids)
    return n, n_unk


def os_error(error, codes):
    """The OSError whose errno is one of codes behind error, following its causes and contexts
    (torch.save, for one, reports a failed write as 'unexpected pos'), or None."""
    while error is not None and getattr(error, "errno", None) not in codes:
        error = error.__cause__ or error.__context__
    return error


def disk_full(error):
    """The OSError saying a filesystem is full (ENOSPC, or EDQUOT: a quota) behind error, or None."""
    return os_error(error, (errno.ENOSPC, errno.EDQUOT))


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # no permission, a read-only filesystem


def stopped_by_sigint(doing, left):
    """Say in one line on stderr what a Ctrl-C (SIGINT) stopped and what it left, and return the
    SystemExit(130) to raise in place of the KeyboardInterrupt traceback."""
    print(f"stopped by SIGINT {doing}: {left}", file=sys.stderr)
    return SystemExit(130)


@contextlib.contextmanager
def scratch_files(out_dir, *names):
    """Create out_dir if needed and yield {name: path} of the pass-1 files (PID-N.NAME.gpt2.tmp,
    temporary_name) in it, after removing those of a killed prepare (remove_stale_scratch).

    On exit, whether the block succeeded or raised, the pass-1 files are removed, and out_dir too
    if this call created it and it is still empty: a first run that fails (offline, a bad input)
    leaves no empty data/<name>/ behind. A folder that existed before is always kept. A full
    filesystem is a SystemExit in one line: failing in pass 1, it leaves a dataset already there
    whole; in pass 2, write_dataset has removed its meta.json, so the folder no longer reads as one.
    Ctrl-C (SIGINT) is one line saying which of the two it left, and exit status 130.
    """
    created = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file of that name, a file above it, no permission
        what = "names a file" if os.path.exists(out_dir) else f"cannot be made ({e.strerror})"
        raise SystemExit(f"--out_dir={out_dir} {what}: pass --out_dir a folder you can write to") from None
    paths = {}
    try:
        remove_stale_scratch(out_dir)
        paths.update((name, temporary_name(os.path.join(out_dir, f"{name}.gpt2"))) for name in names)
        yield paths
    except KeyboardInterrupt:
        meta = os.path.join(out_dir, "meta.json")
        left = ("a dataset already there is whole" if os.path.exists(meta) else
                f"{out_dir} holds no whole dataset (no meta.json): prepare it again"
                if any(n.endswith(".bin") for n in os.listdir(out_dir)) else "no dataset was written")
        raise stopped_by_sigint("preparing the dataset", left) from None
    except Exception as e:
        if (denied := os_error(e, NOT_WRITABLE)) is not None:
            raise SystemExit(f"cannot write in {os.path.abspath(out_dir)} ({denied.strerror}) preparing the dataset: "
                             "pass --out_dir a folder you can write to") from None
        if (full := disk_full(e)) is None:
            raise
        # pass 1 writes 2 bytes a token in GPT-2 ids, pass 2 as much again in the dataset's ids
        raise SystemExit(f"the filesystem of {os.path.abspath(out_dir)} is full ({full.strerror}) preparing the "
                         "dataset, which needs about 4 bytes a token while it runs (2 in the end); free space "
                         "there, or pass --out_dir on a disk with room") from None
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.remove(path)
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)


def write_dataset(out_dir, splits, vocab_size, sources, skipped_empty_docs=0):
    """Build the vocabulary from splits["train"] and write train.bin, val.bin and meta.json.

    splits: {"train": segments, "val": segments}, segments = [(path, start, end)] of the pass-1
    GPT-2 id files (token offsets). vocab_size: K (2 .. 50257) or 0 for full GPT-2. sources: list
    of str for meta.json. skipped_empty_docs: the empty documents encode_documents left out (the
    sum of its `skipped`), recorded in meta.json. SystemExit if a split is empty. Returns the meta
    dict.
    """
    check_vocab_size(vocab_size)
    for split in ("train", "val"):
        if sum(end - start for _, start, end in splits[split]) == 0:
            raise SystemExit(f"the {split} split is empty: the inputs hold no text for it "
                             "(check that the input files are not empty)")
    counts = count_tokens(splits["train"])
    distinct = int(np.count_nonzero(counts))
    if vocab_size and distinct < vocab_size - 1:  # the rest would be ids training never sees
        print(f"warning: the training split holds {distinct:,} distinct GPT-2 tokens, fewer than the "
              f"{vocab_size - 1:,} a vocabulary of {vocab_size:,} keeps: {vocab_size - 1 - distinct:,} ids "
              f"would never be trained; --vocab_size={distinct + 1} fits this corpus")
    gpt2_ids = build_vocab(counts, vocab_size)
    unk_id = None if vocab_size == 0 else vocab_size - 1
    lut = lookup_table(gpt2_ids, unk_id)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # no meta.json while the .bin files are being replaced
    tokens, unk_rate = {}, {}
    for split in ("train", "val"):
        n, n_unk = _remap(splits[split], lut, unk_id, os.path.join(out_dir, f"{split}.bin"))
        tokens[split], unk_rate[split] = n, n_unk / n
    meta = {
        "vocab_size": vocab_size or GPT2_VOCAB_SIZE,
        "tokenizer": "gpt2",
        "gpt2_ids": [int(i) for i in gpt2_ids],
        "unk_id": unk_id,
        "eot_id": int(lut[GPT2_EOT]),
        "tokens": tokens,
        "unk_rate": unk_rate,
        "sources": [str(s) for s in sources],
        "skipped_empty_docs": int(skipped_empty_docs),
    }
    with replacing(meta_path) as tmp, open(tmp, "w") as f:
        json.dump(meta, f)
    return meta


def report(meta, out_dir, seconds):
    """Print the one-paragraph summary both scripts end with."""
    for split in ("train", "val"):
        print(f"{split}: {meta['tokens'][split]:,} tokens, unk rate "
              f"{100 * meta['unk_rate'][split]:.3f} %  -> {os.path.join(out_dir, split + '.bin')}")
    print(f"vocab_size {meta['vocab_size']} (unk_id {meta['unk_id']}, eot_id {meta['eot_id']}), "
          f"{seconds:.1f} s -> {os.path.join(out_dir, 'meta.json')}")
    if meta.get("skipped_empty_docs"):
        print(f"skipped {meta['skipped_empty_docs']:,} empty or whitespace-only documents")


# ------------------------------------------------------------------------------------------------
# for train.py / sample.py

def load_meta(data_dir):
    """meta.json of a prepared dataset folder as a dict; SystemExit if it is missing."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: prepare the dataset first, e.g.\n"
                         "  python data/text/prepare.py --name=austen   "
                         "# downloads; or add --input=FILE for a local file")
    with open(path) as f:
        return json.load(f)


def encode(text, meta):
    """Text -> list of compact ids under meta, as the prepare scripts encode a document: line
    endings normalized, GPT-2 BPE with "<|endoftext|>" as ordinary text (as it is in training
    documents), unknown tokens -> unk_id. For prompts, use encode_prompt."""
    lut = lookup_table(meta["gpt2_ids"], meta["unk_id"])
    ids = get_encoder().encode_ordinary(normalize_newlines(text))
    return lut[np.asarray(ids, dtype=np.int64)].tolist()


class Prompt(NamedTuple):
    """What encode_prompt returns."""
    ids: list        # compact ids (int)
    unk_rate: float  # share of ids that are <unk>; 0.0 for an empty prompt or the full vocabulary


def encode_prompt(text, meta):
    """A prompt -> Prompt(ids, unk_rate).

    Like encode, except that the text "<|endoftext|>" becomes the end-of-text id (meta["eot_id"];
    50256 in the full GPT-2 vocabulary) instead of 7 ordinary tokens, so a prompt can start where
    documents start, and decode(encode_prompt(t, meta).ids, meta) == t for any text t within the
    vocabulary (decode prints the end-of-text id as that text). unk_rate lets a caller warn when
    much of a prompt is outside the vocabulary and so reaches the model as <unk>.
    """
    lut = lookup_table(meta["gpt2_ids"], meta["unk_id"])
    gpt2 = get_encoder().encode(normalize_newlines(text), allowed_special={EOT_TEXT},
                                disallowed_special=())
    ids = lut[np.asarray(gpt2, dtype=np.int64)]
    unk = meta["unk_id"]
    n_unk = 0 if unk is None else int(np.count_nonzero(ids == unk))
    return Prompt(ids.tolist(), n_unk / len(ids) if len(ids) else 0.0)


def decode(ids, meta):
    """Compact ids (any int sequence or array) -> text. <unk> decodes as the text "<unk>", the
    end-of-text id as "<|endoftext|>". Undecodable byte sequences become U+FFFD."""
    enc = get_encoder()
    gpt2_ids = np.asarray(meta["gpt2_ids"], dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64).ravel()
    unk = meta["unk_id"]
    if unk is None:
        return enc.decode(gpt2_ids[ids].tolist())
    parts, start = [], 0
    for i in itertools.chain(np.flatnonzero(ids == unk).tolist(), [len(ids)]):
        parts.append(enc.decode(gpt2_ids[ids[start:i]].tolist()))
        start = i + 1
    return UNK_TEXT.join(parts)
