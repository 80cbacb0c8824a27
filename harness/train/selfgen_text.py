"""Text checks of the self-generated training data (:mod:`harness.train.selfgen`): normalisation, word n-gram shingles,
near-duplicate detection (MinHash with banded LSH, Broder 1997 / Leskovec et al., "Mining of Massive Datasets" ch. 3,
every candidate pair verified by its exact Jaccard; :func:`near_duplicates_exact` is the all-pairs reference), the
overlap with held-out text (exact normalised match or a shared word n-gram, the GPT-3 contamination check of Brown
et al. 2020, appendix C, at a shorter n for short questions), the Latin-script share of a text's letters, and the
nearest Spec-Bench category by TF-IDF cosine.
"""
from __future__ import annotations

import json
import math
import re
import unicodedata
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

WORD = re.compile(r"[^\W_]+", re.UNICODE)
SPECBENCH = Path(__file__).resolve().parent.parent / "data" / "specbench" / "questions.jsonl"
GSM8K_TEST = Path(__file__).resolve().parent.parent / "data" / "gsm8k" / "test.jsonl"


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters or digits, any script)."""
    return WORD.findall(text.lower())


def normalise(text: str) -> str:
    """The text as its lower-cased words joined by single spaces (punctuation, case and spacing dropped)."""
    return " ".join(words(text))


def shingles(text: str, n: int) -> set[str]:
    """The word ``n``-grams of ``text`` (:func:`words`); a text of fewer than ``n`` words is one shingle (its
    normalised form), an empty text none."""
    w = words(text)
    if len(w) < n:
        return {" ".join(w)} if w else set()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: set, b: set) -> float:
    """|a & b| / |a | b| (0 for two empty sets)."""
    return len(a & b) / len(a | b) if a or b else 0.0


def near_duplicates_exact(sets: list[set], threshold: float) -> list[int | None]:
    """Reference twin of :func:`near_duplicates`: all pairs. Item i (in order) is a duplicate of the first earlier
    kept item j with Jaccard(sets[i], sets[j]) >= ``threshold``; returns j per item (None: kept)."""
    out: list[int | None] = []
    kept: list[int] = []
    for i, s in enumerate(sets):
        out.append(next((j for j in kept if s and jaccard(s, sets[j]) >= threshold), None))
        if out[-1] is None:
            kept.append(i)
    return out


def _minhash(sets: list[set], perms: int, seed: int) -> np.ndarray:
    """[len(sets), perms] uint64 MinHash signatures: min over the set of (a * crc32(x) + b) mod (2^31 - 1), a and b
    seeded per permutation (every product stays below 2^63)."""
    p = (1 << 31) - 1
    rng = np.random.default_rng(seed)
    a = rng.integers(1, p, perms, dtype=np.uint64)
    b = rng.integers(0, p, perms, dtype=np.uint64)
    sig = np.full((len(sets), perms), p, dtype=np.uint64)
    for i, s in enumerate(sets):
        if s:
            h = np.fromiter((zlib.crc32(x.encode()) for x in s), dtype=np.uint64, count=len(s))
            sig[i] = ((h[:, None] * a[None, :] + b[None, :]) % np.uint64(p)).min(axis=0)
    return sig


def near_duplicates(sets: list[set], threshold: float, bands: int = 16, rows: int = 4,
                    seed: int = 0) -> list[int | None]:
    """Near-duplicates by MinHash LSH: ``bands`` x ``rows`` hashes per set; two sets whose signatures agree on a
    whole band are candidates (probability 1 - (1 - J^rows)^bands at Jaccard J: 0.99 at J = 0.7 with 16 x 4),
    and a candidate counts only when its exact Jaccard is >= ``threshold``. Same contract as
    :func:`near_duplicates_exact` (the earliest kept candidate is named), which it equals whenever every pair at or
    above the threshold collides in a band."""
    sig = _minhash(sets, bands * rows, seed)
    buckets: list[dict] = [{} for _ in range(bands)]
    out: list[int | None] = []
    for i, s in enumerate(sets):
        keys = [sig[i, k * rows:(k + 1) * rows].tobytes() for k in range(bands)]
        cands = sorted({j for k, key in enumerate(keys) for j in buckets[k].get(key, ())}) if s else []
        out.append(next((j for j in cands if jaccard(s, sets[j]) >= threshold), None))
        if out[-1] is None and s:
            for k, key in enumerate(keys):
                buckets[k].setdefault(key, []).append(i)
    return out


def latin_share(text: str) -> float:
    """Share of the letters of ``text`` that are Latin script (Unicode name starting "LATIN"); 1.0 without
    letters."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 1.0
    return sum(unicodedata.name(c, "").startswith("LATIN") for c in letters) / len(letters)


class HeldOut:
    """The held-out text no training item may overlap: every turn of Spec-Bench (``harness/data/specbench``) and
    every GSM8K test question. An item overlaps when its normalised text equals a held-out text's, or it shares a
    word ``n``-gram with one (a held-out text shorter than ``n`` words: its whole normalised form inside the
    item's)."""

    def __init__(self, texts: list[str], n: int = 8):
        self.n = n
        self.exact = {normalise(t) for t in texts} - {""}
        self.grams: set[str] = set()
        self.short: list[str] = []
        for t in texts:
            if len(words(t)) < n:
                self.short.append(normalise(t))
            else:
                self.grams |= shingles(t, n)

    @classmethod
    def default(cls, n: int = 8) -> "HeldOut":
        """Spec-Bench's turns and the GSM8K test questions of the bundled data."""
        texts = [t for line in SPECBENCH.read_text().splitlines() if line.strip()
                 for t in json.loads(line)["turns"]]
        texts += [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
        return cls(texts, n)

    def hit(self, text: str) -> bool:
        """Whether ``text`` overlaps the held-out text."""
        norm = normalise(text)
        if not norm:
            return False
        if norm in self.exact or any(s and f" {s} " in f" {norm} " for s in self.short):
            return True
        return len(words(text)) >= self.n and not self.grams.isdisjoint(shingles(text, self.n))


def specbench_categories() -> dict[str, str]:
    """{category: all of its Spec-Bench turns joined}, in file order."""
    docs: dict[str, list[str]] = {}
    for line in SPECBENCH.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            docs.setdefault(r["category"], []).extend(r["turns"])
    return {c: " ".join(v) for c, v in docs.items()}


def nearest_category(texts: list[str], docs: dict[str, str] | None = None) -> list[str]:
    """Per text, the category whose document (:func:`specbench_categories`) is nearest by TF-IDF cosine (terms:
    :func:`words`; idf = log((1 + D) / (1 + df)) + 1 over the category documents; tf = raw counts, rows
    L2-normalised); "none" when the text shares no term with any category."""
    docs = docs or specbench_categories()
    cats = list(docs)
    vocab: dict[str, int] = {}
    tf_docs = [Counter(words(d)) for d in docs.values()]
    for c in tf_docs:
        for w in c:
            vocab.setdefault(w, len(vocab))
    df = np.zeros(len(vocab))
    for c in tf_docs:
        df[[vocab[w] for w in c]] += 1
    idf = np.log((1 + len(cats)) / (1 + df)) + 1

    def mat(counters):
        m = np.zeros((len(counters), len(vocab)))
        for i, c in enumerate(counters):
            for w, k in c.items():
                if w in vocab:
                    m[i, vocab[w]] = k
        m *= idf
        return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)

    sim = mat([Counter(words(t)) for t in texts]) @ mat(tf_docs).T
    return [cats[int(r.argmax())] if r.max() > 0 else "none" for r in sim]


def length_stats(lens: list[int]) -> dict:
    """{mean, p50, p90, max} of token lengths (all 0 for none)."""
    if not lens:
        return {"mean": 0, "p50": 0, "p90": 0, "max": 0}
    s = sorted(lens)
    q = lambda f: s[min(len(s) - 1, max(0, math.ceil(f * len(s)) - 1))]    # noqa: E731 (nearest-rank percentile)
    return {"mean": round(sum(s) / len(s), 1), "p50": q(0.5), "p90": q(0.9), "max": s[-1]}
