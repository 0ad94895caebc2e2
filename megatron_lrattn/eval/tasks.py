"""Local evaluation tasks built from text that is on every machine (no download).

The text is the held-out part of the embedded default corpus: the Python standard library's
sources in the order of ``megatron_lrattn.data.corpus`` (the documents of the default
training data), of which the last documents form the test split of
``default_corpus.RECOMMENDED_SPLIT`` (90,5,5) that ``lrattn-pretrain`` never trains on with
the default data. Items depend only on that text and a seed, never on a tokenizer or model,
so every model sees the same items; ``items_digest`` names them (the stdlib differs between
Python versions, so results are comparable at one digest).

Tasks:

With ``lrattn-eval --data-path`` the text is instead one split part (valid by default) of
a preprocessed dataset, decoded with the model's tokenizer (``dataset_documents``), so a
model trained on other data is scored on its own held-out documents.

* ``heldout``: held-out documents (or a text file) for perplexity and bits per byte.
* ``last_word``: cloze; the context ends just before a line's last identifier, which also
  occurs earlier in the context; the model must produce it greedily (LAMBADA's rule).
* ``next_line``: multiple choice; after some lines of code, pick the true next line among
  distractor lines of the same indentation from other held-out documents.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import random
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

HELDOUT_SPLIT = "90,5,5"
"""The default data's split (``default_corpus.RECOMMENDED_SPLIT``); its test share is held out."""

CONTEXT_CHARS = 1200
"""Context of the accuracy tasks: the preceding lines of the document, up to this many chars."""

_TRIVIAL_WORDS = frozenset(keyword.kwlist) | {"self", "cls"}
"""Last words too easy to say anything (``None``, ``True``, ``self``, ...): never targets."""
_LAST_WORD = re.compile(r"^(.*?)(\s?)([A-Za-z_][A-Za-z0-9_]{3,})\s*$")


@dataclass(frozen=True)
class ClozeItem:
    """A context and the continuation the model must produce greedily."""

    context: str
    target: str


@dataclass(frozen=True)
class ChoiceItem:
    """A context, continuations to choose from, and the index of the true one."""

    context: str
    choices: Tuple[str, ...]
    answer: int


def split_range(num_documents: int, split: str = HELDOUT_SPLIT, which: int = 2) -> range:
    """Documents of split ``which`` (0 train, 1 valid, 2 test) as megatron-core's dataset
    builder computes them (normalized shares, cumulative book-ends, rounded)."""
    shares = [float(s) for s in split.replace("/", ",").split(",")]
    shares = [s / sum(shares) for s in shares]
    ends = [0.0]
    for s in shares:
        ends.append(ends[-1] + s)
    return range(int(round(ends[which] * num_documents)),
                 int(round(ends[which + 1] * num_documents)))


def heldout_documents(max_bytes: Optional[int] = None) -> List[str]:
    """Texts of the default corpus's test split (its order), up to ``max_bytes`` UTF-8 bytes
    in total when given (the last document is cut at a line end)."""
    from megatron_lrattn.data.corpus import DEFAULT_MAX_BYTES, iter_stdlib_documents

    docs = [text for _, text in iter_stdlib_documents(DEFAULT_MAX_BYTES)]
    held = [docs[i] for i in split_range(len(docs))]
    return held if max_bytes is None else first_bytes(held, max_bytes)


def first_bytes(docs: Sequence[str], max_bytes: int) -> List[str]:
    """The documents up to ``max_bytes`` UTF-8 bytes in all (the last one cut at a line end)."""
    out, total = [], 0
    for text in docs:
        raw = text.encode("utf-8")
        if total + len(raw) > max_bytes:
            cut = raw[: max_bytes - total].decode("utf-8", errors="ignore")
            cut = cut[: cut.rfind("\n") + 1]
            if cut:
                out.append(cut)
            break
        out.append(text)
        total += len(raw)
    return out


SPLIT_PARTS = ("train", "valid", "test")


def dataset_documents(prefix: str, split: str, part: str, decode) -> List[str]:
    """Texts of one split part of an ``lrattn-preprocess`` / Megatron indexed dataset.

    Args:
        prefix: the dataset's path prefix (``PREFIX.bin`` / ``PREFIX.idx``).
        split: the shares that training used (``--split``, e.g. ``98,2,0``); the documents
            of ``part`` are the ones megatron-core's dataset builder puts there.
        part: ``train``, ``valid`` or ``test``.
        decode: token ids (a list of int) -> text; the training tokenizer's decode, special
            tokens (the end-of-document token) left out.

    Raises:
        ValueError: a missing dataset, an unknown part, or an empty part.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if part not in SPLIT_PARTS:
        raise ValueError(f"split part {part!r}: use one of {', '.join(SPLIT_PARTS)}")
    if not (IndexedDataset.exists(prefix)):
        raise ValueError(f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx")
    ds = IndexedDataset(prefix, mmap=True)
    bounds = ds.document_indices
    docs = split_range(len(bounds) - 1, split, SPLIT_PARTS.index(part))
    if not len(docs):
        raise ValueError(f"--split {split}: the {part} part of {prefix} holds no document")
    out = []
    for d in docs:
        ids = [int(t) for i in range(int(bounds[d]), int(bounds[d + 1])) for t in ds[i]]
        out.append(decode(ids))
    return out


def _context(lines: Sequence[str], i: int) -> str:
    """Lines before ``i`` (each with its newline), at most ``CONTEXT_CHARS`` chars, whole lines."""
    out, n = [], 0
    for line in reversed(lines[:i]):
        if n + len(line) + 1 > CONTEXT_CHARS:
            break
        out.append(line + "\n")
        n += len(line) + 1
    return "".join(reversed(out))


def last_word_items(docs: Sequence[str], limit: int, seed: int = 0) -> List[ClozeItem]:
    """Cloze items: a line's last identifier (4+ chars, not a keyword nor ``self``/``cls``)
    that occurs earlier in the context.

    The target carries the space before the word when there is one (`` name``), as LAMBADA's
    continuations do. Candidates are shuffled with ``seed`` and the first ``limit`` kept.
    """
    found = []
    for text in docs:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            m = _LAST_WORD.match(line)
            if not m or len(line.strip()) < 8 or i < 3:
                continue
            ctx = _context(lines, i)
            word = m.group(3)
            if word in _TRIVIAL_WORDS or len(ctx) < 200 or re.search(rf"\b{re.escape(word)}\b", ctx) is None:
                continue
            found.append(ClozeItem(ctx + m.group(1), m.group(2) + word))
    random.Random(f"last_word-{seed}").shuffle(found)
    return found[:limit]


def next_line_items(docs: Sequence[str], limit: int, seed: int = 0, num_choices: int = 4
                    ) -> List[ChoiceItem]:
    """Choice items: the true next line (with its newline) against ``num_choices - 1`` lines
    of the same indentation drawn from other held-out documents. Candidates are shuffled with
    ``seed`` and the first ``limit`` kept; the answer's position is drawn per item."""
    def indent(line):
        return line[: len(line) - len(line.lstrip())]

    pool: Dict[str, List[Tuple[int, str]]] = {}
    candidates = []
    for d, text in enumerate(docs):
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if len(line.strip()) < 16 or line.lstrip().startswith("#"):
                continue
            pool.setdefault(indent(line), []).append((d, line))
            ctx = _context(lines, i)
            if i >= 3 and len(ctx) >= 200:
                candidates.append((d, ctx, line))
    rng = random.Random(f"next_line-{seed}")
    rng.shuffle(candidates)
    items = []
    for d, ctx, line in candidates:
        others = [x for doc, x in pool[indent(line)] if doc != d and x != line]
        others = sorted(set(others))
        if len(others) < num_choices - 1:
            continue
        wrong = rng.sample(others, num_choices - 1)
        answer = rng.randrange(num_choices)
        choices = wrong[:answer] + [line] + wrong[answer:]
        items.append(ChoiceItem(ctx, tuple(c + "\n" for c in choices), answer))
        if len(items) == limit:
            break
    return items


def items_digest(items) -> str:
    """SHA-256 (first 16 hex digits) of the items' JSON: equal digests, equal items."""
    blob = json.dumps([asdict(x) if hasattr(x, "__dataclass_fields__") else x for x in items],
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
