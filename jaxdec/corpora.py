"""The two fixed text corpora that perplexity is reported on, and their token windows.

Both are real human-written text that a fresh Debian 12 machine can get from a package
registry; neither is ever model output.

- `prose`: English quotations, jokes and verse from the Debian package `fortunes`
  (version `FORTUNES_VERSION`, the fortune-mod cookie files; the offensive ones live in
  another package and are never fetched). `fetch_corpus("prose")` runs `apt-get download`
  and `dpkg-deb -x` into the data folder; nothing is installed system-wide. The `%`
  separators are dropped, terminal overstrikes (`_\\bn`) are resolved and bells removed;
  each fortune is one document. `PROSE_FILES` is the fixed list of cookie files.
- `code`: the `CODE_MODULES` sources of the running Python's standard library
  (`sysconfig.get_paths()["stdlib"]`), one document per module. The Python version
  defines the text, so `corpus_source("code")` names it.

Documents are joined in a fixed order with `SEPARATOR`. Token windows are fixed,
non-overlapping and split by index: window `i` is `calib` when `i % 10 == 9`, else `eval`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jaxdec.errors import JaxdecError

CORPORA = ("prose", "code")
SEPARATOR = "\n\n"
SPLITS = ("eval", "calib")
FETCH_HINT = "run `jaxdec fetch corpora` (or `make corpora`)"

FORTUNES_PACKAGE = "fortunes"
FORTUNES_VERSION = "1:1.99.1-7.3"  # Debian 12 (bookworm)
_FORTUNES_DIR = "usr/share/games/fortunes"
# English prose and verse; left out: ascii-art, tech jargon (computers, debian, linux,
# linuxcookie, perl), lists (definitions, disclaimer), chat logs (knghtbrd), startrek,
# zippy, non-English (translate-me), ethnic/drugs, and the tiny goedel/magic/paradoxum/
# pratchett files.
PROSE_FILES = (
    "art", "cookie", "education", "food", "humorists", "kids", "law", "love", "medicine",
    "men-women", "miscellaneous", "news", "people", "pets", "platitudes", "politics",
    "science", "songs-poems", "sports", "tao", "wisdom", "work",
)
# Large pure-Python modules that are single files in CPython 3.11 to 3.14.
CODE_MODULES = (
    "argparse", "ast", "bdb", "calendar", "configparser", "contextlib", "dataclasses",
    "difflib", "doctest", "enum", "fractions", "functools", "imaplib", "inspect",
    "ipaddress", "mailbox", "optparse", "pickle", "pickletools", "platform", "shutil",
    "smtplib", "statistics", "subprocess", "tarfile", "tempfile", "threading", "tokenize",
    "traceback", "typing",
)
_SOURCE_FILE = "SOURCE"  # written last by fetch_corpus("prose"): "fortunes <version>"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_OVERSTRIKE = re.compile(r"[^\n\x08]\x08")


def data_dir() -> pathlib.Path:
    """Where corpora live: `$JAXDEC_DATA` if set, else `<repo>/data/corpora` for a source
    checkout (the repo's `data/` is git-ignored), else `~/.cache/jaxdec/corpora`."""
    if os.environ.get("JAXDEC_DATA"):
        return pathlib.Path(os.environ["JAXDEC_DATA"])
    repo = pathlib.Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file():
        return repo / "data" / "corpora"
    return pathlib.Path.home() / ".cache" / "jaxdec" / "corpora"


def _check_name(name: str) -> None:
    if name not in CORPORA:
        raise JaxdecError(f"unknown corpus {name!r} (known: {', '.join(CORPORA)})")


def fetch_corpus(name: str, *, progress: Callable[[str], None] = print) -> pathlib.Path:
    """Make corpus `name` available locally and return its folder; idempotent.

    `prose` downloads the pinned `fortunes` .deb with apt-get, extracts it with dpkg-deb
    into a temporary folder and moves only `PROSE_FILES` into place (never a partial
    folder). `code` needs no download; this checks that the stdlib sources are present.
    """
    _check_name(name)
    if name == "code":
        missing = [p for p in _code_paths() if not p.is_file()]
        if missing:
            raise JaxdecError(f"Python stdlib sources missing (e.g. {missing[0]}); the code "
                              "corpus needs a CPython install that ships its .py files")
        return _code_paths()[0].parent
    out = data_dir() / "prose"
    if _prose_fetched(out):
        progress(f"{out} already holds {FORTUNES_PACKAGE} {FORTUNES_VERSION}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = _stage_fortunes(pathlib.Path(tmp), progress)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staged, out)
    progress(f"fetched {FORTUNES_PACKAGE} {FORTUNES_VERSION} into {out}")
    return out


def _stage_fortunes(tmp: pathlib.Path, progress: Callable[[str], None]) -> pathlib.Path:
    """Download and extract the fortunes .deb under `tmp`; return the finished folder."""
    spec = f"{FORTUNES_PACKAGE}={FORTUNES_VERSION}"
    hint = (f"make `apt-get update && apt-get download {spec}` work (Debian 12, network), "
            f"then {FETCH_HINT.removeprefix('run ')}")
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise JaxdecError(f"{tool} not found: the prose corpus is the Debian package "
                              f"{FORTUNES_PACKAGE}; {hint}")
    progress(f"downloading {spec} with apt-get")
    if _run(["apt-get", "download", spec], tmp) is not None:
        progress("download failed; running apt-get update and retrying")
        _run(["apt-get", "update"], tmp)
        error = _run(["apt-get", "download", spec], tmp)
        if error is not None:
            raise JaxdecError(f"apt-get download {spec} failed ({error}); {hint}")
    deb = next(tmp.glob("*.deb"))
    error = _run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], tmp)
    if error is not None:
        raise JaxdecError(f"dpkg-deb -x {deb.name} failed ({error}); {hint}")
    staged = tmp / "prose"
    staged.mkdir()
    for f in PROSE_FILES:
        shutil.copyfile(tmp / "x" / _FORTUNES_DIR / f, staged / f)
    (staged / _SOURCE_FILE).write_text(f"{FORTUNES_PACKAGE} {FORTUNES_VERSION}\n")
    return staged


def _prose_fetched(folder: pathlib.Path) -> bool:
    source = folder / _SOURCE_FILE
    return source.is_file() and source.read_text() == f"{FORTUNES_PACKAGE} {FORTUNES_VERSION}\n"


def _run(cmd: list[str], cwd: pathlib.Path) -> str | None:
    """Run a command; None on success, else the last line of its stderr."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        return str(e)
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("W:")]
    return (lines or [f"exit status {r.returncode}"])[-1]


def corpus_source(name: str) -> str:
    """What defines the text: the Debian package version, or the Python version."""
    _check_name(name)
    if name == "code":
        return f"CPython {platform.python_version()} stdlib, {len(CODE_MODULES)} modules"
    _require_prose()
    return f"Debian {FORTUNES_PACKAGE} {FORTUNES_VERSION}, {len(PROSE_FILES)} cookie files"


def corpus_documents(name: str) -> tuple[str, ...]:
    """The corpus as documents, in their fixed order (a fortune, or a module's source)."""
    _check_name(name)
    if name == "code":
        fetch_corpus("code")
        return tuple(p.read_text(encoding="utf-8") for p in _code_paths())
    folder = _require_prose()
    return tuple(doc for f in PROSE_FILES
                 for doc in split_fortunes((folder / f).read_text(encoding="utf-8")))


def _require_prose() -> pathlib.Path:
    folder = data_dir() / "prose"
    if not _prose_fetched(folder):
        raise JaxdecError(f"corpus 'prose' ({FORTUNES_PACKAGE} {FORTUNES_VERSION}) is not "
                          f"fetched into {folder}: {FETCH_HINT}")
    return folder


def corpus_text(name: str) -> str:
    """The whole corpus: its documents joined with `SEPARATOR`; the same on every call."""
    return SEPARATOR.join(corpus_documents(name))


def split_fortunes(text: str) -> list[str]:
    """A cookie file's fortunes: split at `%` lines, overstrikes resolved, bells dropped."""
    docs = re.split(r"^%$", text, flags=re.MULTILINE)
    return [d for d in (clean_fortune(d) for d in docs) if d]


def clean_fortune(text: str) -> str:
    """Resolve `x\\by` overstrikes to `y` (repeatedly, so `___\\b\\b\\band` -> `and`),
    drop other control characters except tab and newline, and strip blank edges."""
    while _OVERSTRIKE.search(text):
        text = _OVERSTRIKE.sub("", text)
    text = _CONTROL.sub("", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _code_paths() -> list[pathlib.Path]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / f"{m}.py" for m in CODE_MODULES]


def document_chunks(docs: Sequence[str], *, chunk_chars: int) -> Iterator[str]:
    """Consecutive runs of whole documents, each run about `chunk_chars` long and every
    run but the last ending in `SEPARATOR`, so `"".join(chunks) == SEPARATOR.join(docs)`."""
    run: list[str] = []
    size = 0
    for i, doc in enumerate(docs):
        run.append(doc)
        size += len(doc)
        if size >= chunk_chars or i == len(docs) - 1:
            yield SEPARATOR.join(run) + ("" if i == len(docs) - 1 else SEPARATOR)
            run, size = [], 0


def corpus_token_ids(name: str, encode: Callable[[str], list[int]], *,
                     chunk_chars: int = 1 << 16) -> np.ndarray:
    """int32[n_tokens]: the corpus tokenized chunk by chunk (see `document_chunks`).

    The ids are the concatenation of per-chunk encodings, so at a chunk boundary (always
    right after a `SEPARATOR` between two documents) they can differ from encoding the
    whole text at once. `encode` must add no BOS or other special tokens.
    """
    chunks = document_chunks(corpus_documents(name), chunk_chars=chunk_chars)
    return np.fromiter((t for c in chunks for t in encode(c)), dtype=np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Windows:
    """Fixed windows of one split of a tokenized corpus.

    `np.asarray(windows)` gives `tokens`. Window `index[j]` covers token ids
    `[index[j] * window, (index[j] + 1) * window)` of the whole corpus.
    """

    tokens: np.ndarray  # i32[n_windows, window]
    index: np.ndarray  # i64[n_windows]: position in the list of all windows
    split: str
    window: int

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def split_of(index: np.ndarray) -> np.ndarray:
    """The split name of each window index: every 10th window (`i % 10 == 9`) is calib."""
    return np.where(np.asarray(index) % 10 == 9, "calib", "eval")


def make_windows(token_ids, *, window: int, split: str,
                 max_windows: int | None = None) -> Windows:
    """Cut `token_ids` into non-overlapping `window`-token windows (a ragged tail is
    dropped) and keep those of `split`, the first `max_windows` of them if given."""
    if split not in SPLITS:
        raise JaxdecError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    if window < 2:
        raise JaxdecError(f"window must be at least 2 tokens, got {window}")
    ids = np.asarray(token_ids, dtype=np.int32)
    n_all = ids.shape[0] // window
    all_windows = ids[: n_all * window].reshape(n_all, window)
    index = np.flatnonzero(split_of(np.arange(n_all)) == split)[:max_windows]
    return Windows(tokens=all_windows[index], index=index, split=split, window=window)
