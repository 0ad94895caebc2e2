"""The prose rules: which paragraphs are prose, which paragraphs are boilerplate, and which
documents are too short, not English, or exact or near duplicates of others."""
from __future__ import annotations

import hashlib
import re
import zlib
from collections import Counter, defaultdict
from typing import Sequence


MIN_PARAGRAPH_WORDS = 8
MAX_CODE_SYMBOLS = 0.04
MIN_WORD_FRACTION = 0.7
MAX_UPPER_FRACTION = 0.25
MIN_DOCUMENT_WORDS = 80
MIN_STOPWORD_FRACTION = 0.15
BOILERPLATE_DOCUMENTS = 3
NEAR_DUPLICATE_CONTAINMENT = 0.8
_CODE_CHARS = set("{}[]<>=;|\\$#@~^`_*")
_WORD = re.compile(r"^[\"'(\[\u201c\u2018]*(?:[A-Za-z][a-z]*|[A-Z]+)(?:['\u2019-][A-Za-z]+)*"
                   r"[.,;:!?)\"'\]\u201d\u2019]*$")
_SENTENCE_END = re.compile(r"[A-Za-z0-9)\"'\u201d\u2019][.!?][\"')\u201d\u2019]?(?:\s|$)")
_STOPWORDS = frozenset("the of and to a in is that it for as with be on this are by or not an "
                       "can from if you which will at".split())
PARAGRAPH_RULES = ("too_short", "code_symbols", "not_words", "no_sentence", "upper_case")


def paragraph_verdict(para: str) -> str | None:
    """The first prose rule that ``para`` (whitespace-normalised) fails, or None.

    Rules: at least :data:`MIN_PARAGRAPH_WORDS` words; at most :data:`MAX_CODE_SYMBOLS` of
    its non-space characters from ``{}[]<>=;|\\$#@~^`_*``; at least :data:`MIN_WORD_FRACTION`
    of its words plain words (letters, inner apostrophes or hyphens, edge punctuation);
    a sentence end (``.``, ``!``, ``?``); at most :data:`MAX_UPPER_FRACTION` capitals.
    """
    words = para.split()
    if len(words) < MIN_PARAGRAPH_WORDS:
        return "too_short"
    chars = [c for c in para if not c.isspace()]
    if sum(c in _CODE_CHARS for c in chars) > MAX_CODE_SYMBOLS * len(chars):
        return "code_symbols"
    if sum(bool(_WORD.match(w)) for w in words) < MIN_WORD_FRACTION * len(words):
        return "not_words"
    if not _SENTENCE_END.search(para):
        return "no_sentence"
    letters = [c for c in para if c.isalpha()]
    if sum(c.isupper() for c in letters) > MAX_UPPER_FRACTION * len(letters):
        return "upper_case"
    return None


def normalise(para: str) -> str:
    """One line: whitespace runs (no-break spaces included) become one space."""
    return " ".join(para.replace("\u00a0", " ").replace("\u00b6", "").split())


def _fingerprints(text: str) -> set[int]:
    words = re.findall(r"\w+", text.lower())
    shingles = (" ".join(words[i:i + 5]) for i in range(max(len(words) - 4, 1)))
    return {h for h in (zlib.crc32(s.encode()) for s in shingles) if h % 8 == 0}


def near_duplicates(texts: Sequence[str]) -> set[int]:
    """Indices of documents whose sampled 5-word shingles are at least
    :data:`NEAR_DUPLICATE_CONTAINMENT` contained in one larger kept document (largest
    first, ties by index: deterministic)."""
    prints = [_fingerprints(t) for t in texts]
    index: dict[int, list[int]] = defaultdict(list)
    dropped = set()
    for i in sorted(range(len(texts)), key=lambda i: (-len(prints[i]), i)):
        fp = prints[i]
        if len(fp) >= 4:
            hits = Counter(j for h in fp for j in index.get(h, ()) if len(index[h]) <= 64)
            if hits and hits.most_common(1)[0][1] >= NEAR_DUPLICATE_CONTAINMENT * len(fp):
                dropped.add(i)
                continue
        for h in fp:
            index[h].append(i)
    return dropped


def clean_documents(docs: Sequence[tuple[str, str, list[str]]], counts: Counter
                    ) -> list[tuple[str, str, str]]:
    """Documents without prose, exact duplicates, boilerplate paragraphs, short or
    non-English documents and near duplicates removed from ``(source, path, paragraphs)``,
    in that order; returns ``(source, path, text)`` in input order. ``counts`` gets one
    entry per removal reason.

    A paragraph is boilerplate when it appears in at least :data:`BOILERPLATE_DOCUMENTS`
    distinct documents (navigation, licence blurbs, generated notes).
    """
    unique, hashes = [], set()
    for source, path, paras in docs:
        if not paras:
            counts["no_prose"] += 1
            continue
        digest = hashlib.sha256("\n\n".join(paras).encode()).digest()
        if digest in hashes:
            counts["exact_duplicate"] += 1
            continue
        hashes.add(digest)
        unique.append((source, path, paras))
    seen_in = Counter(p for _, _, paras in unique for p in set(paras))
    boiler = {p for p, n in seen_in.items() if n >= BOILERPLATE_DOCUMENTS}
    texts = []
    for source, path, paras in unique:
        kept = [p for p in paras if p not in boiler]
        counts["boilerplate_paragraphs"] += len(paras) - len(kept)
        words = " ".join(kept).split()
        if len(words) < MIN_DOCUMENT_WORDS:
            counts["too_short"] += 1
            continue
        if sum(w.lower() in _STOPWORDS for w in words) < MIN_STOPWORD_FRACTION * len(words):
            counts["not_english"] += 1
            continue
        texts.append((source, path, "\n\n".join(kept)))
    near = near_duplicates([t for _, _, t in texts])
    counts["near_duplicate"] += len(near)
    return [t for i, t in enumerate(texts) if i not in near]
