"""Score a Hugging Face causal LM on the local tasks of ``megatron_lrattn.eval.tasks``.

One scoring primitive serves every task: the summed log-probability of the last ``n`` tokens
of a token sequence, and whether each of them is the greedy choice. Sequences are batched
with right padding and no attention mask (causal attention and per-token depth reads never
look at later positions, so padding after a sequence cannot change its scores), longest
first; sequences longer than the window keep their last ``max_length + 1`` tokens.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_lrattn.eval import tasks as T

TASKS = ("heldout", "last_word", "next_line")


@dataclass
class Request:
    """Token ids whose last ``n_scored`` tokens are scored (given the ones before)."""

    ids: List[int]
    n_scored: int


def load_model(path: str, device: str = "cpu", dtype: Optional[torch.dtype] = None,
               trust_remote_code: bool = False):
    """(model in eval mode, tokenizer, model_type) of an HF folder.

    Our exports (``model_type: lrattn``) load through the installed ``LRAttnForCausalLM`` and
    ``PreTrainedTokenizerFast``, so no remote code runs; other folders (a Llama export, any
    causal LM) through ``AutoModelForCausalLM`` / ``AutoTokenizer``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path}: no config.json (an HF model folder is expected)")
    with open(cfg_file) as f:
        model_type = json.load(f).get("model_type")
    if model_type == "lrattn":
        from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

        model = LRAttnForCausalLM.from_pretrained(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
    if model_type == "lrattn" and os.path.isfile(os.path.join(path, "tokenizer.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval(), tok, model_type


def default_max_length(model, cap: int = 4096) -> int:
    """The model's ``max_position_embeddings`` (at most ``cap``)."""
    return min(int(getattr(model.config, "max_position_embeddings", cap) or cap), cap)


class Scorer:
    """Batched log-likelihoods of continuations under a causal LM.

    Args:
        model: HF causal LM returning ``.logits`` [b, s, vocab].
        batch_size: sequences per forward pass.
        max_length: tokens per forward pass (the context window).
        progress: draw a tqdm bar per task.
    """

    def __init__(self, model, batch_size: int = 8, max_length: int = 2048, progress: bool = True):
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.progress = progress
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def score(self, requests: Sequence[Request], desc: str = "") -> List[Tuple[float, bool]]:
        """(summed log-probability in nats, every scored token greedy) per request.

        Raises:
            ValueError: a request scores more tokens than the window holds.
        """
        from tqdm.auto import tqdm

        out: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -min(len(requests[i].ids),
                                                                 self.max_length + 1))
        bar = tqdm(total=len(requests), desc=desc, disable=not self.progress, leave=False,
                   unit="seq")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            seqs = []
            for i in batch:
                r = requests[i]
                if not 0 < r.n_scored <= self.max_length or r.n_scored >= len(r.ids):
                    raise ValueError(f"request scores {r.n_scored} of {len(r.ids)} tokens with "
                                     f"a window of {self.max_length}")
                seqs.append(r.ids[-(self.max_length + 1):])
            width = max(len(s) - 1 for s in seqs)
            inp = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, s in enumerate(seqs):
                inp[row, : len(s) - 1] = torch.tensor(s[:-1])
            logits = self.model(inp.to(self.device)).logits.float()
            for row, (i, s) in enumerate(zip(batch, seqs)):
                n = requests[i].n_scored
                pos = torch.arange(len(s) - 1 - n, len(s) - 1, device=logits.device)
                target = torch.tensor(s[-n:], device=logits.device)
                lp = torch.log_softmax(logits[row, pos], dim=-1)
                total = lp.gather(-1, target[:, None]).sum().item()
                greedy = bool((lp.argmax(-1) == target).all().item())
                out[i] = (total, greedy)
            bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]


def _encode(tok, text: str) -> List[int]:
    return tok(text, add_special_tokens=False).input_ids


def _continuation(tok, context: str, cont: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids): the whole string is encoded and split after the
    context's tokens (tokenizers merge across the boundary otherwise)."""
    ctx = _encode(tok, context)
    whole = _encode(tok, context + cont)
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, _encode(tok, cont)


def _doc_start(tok) -> List[int]:
    """The token a document follows in training: BOS, else EOS (our end-of-document)."""
    for t in (tok.bos_token_id, tok.eos_token_id):
        if t is not None:
            return [int(t)]
    return []


def perplexity(scorer: Scorer, tok, texts: Sequence[str], stride: Optional[int] = None
               ) -> Dict[str, float]:
    """Token perplexity and bits per byte over ``texts`` (each a document after the
    document-start token). Long documents are scored in windows of ``scorer.max_length``
    that advance by ``stride`` (default half a window): every token is scored once, with at
    least ``max_length - stride`` tokens of context after the first window."""
    window = scorer.max_length
    stride = stride or max(1, window // 2)
    requests, n_tokens = [], 0
    for text in texts:
        ids = _doc_start(tok) + _encode(tok, text)
        if len(ids) < 2:
            continue
        n_tokens += len(ids) - 1
        end = min(len(ids), window + 1)
        requests.append(Request(ids[:end], end - 1))
        while end < len(ids):
            new_end = min(len(ids), end + stride)
            requests.append(Request(ids[max(0, new_end - window - 1):new_end], new_end - end))
            end = new_end
    if not requests:
        raise ValueError("no text to score")
    nll = -sum(lp for lp, _ in scorer.score(requests, desc="heldout"))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"documents": len(texts), "tokens": n_tokens, "bytes": n_bytes,
            "nll_per_token": nll / n_tokens, "perplexity": math.exp(nll / n_tokens),
            "bits_per_byte": nll / math.log(2) / n_bytes}


def _acc(hits: Sequence[bool]) -> Tuple[float, float]:
    p = sum(hits) / len(hits)
    return p, math.sqrt(p * (1 - p) / len(hits))


def last_word(scorer: Scorer, tok, items: Sequence[T.ClozeItem]) -> Dict[str, float]:
    """Greedy accuracy of the cloze targets, and their mean log-probability."""
    requests = []
    for it in items:
        ctx, cont = _continuation(tok, it.context, it.target)
        requests.append(Request(ctx + cont, len(cont)))
    scores = scorer.score(requests, desc="last_word")
    acc, se = _acc([g for _, g in scores])
    return {"items": len(items), "acc": acc, "acc_stderr": se,
            "mean_logprob": sum(lp for lp, _ in scores) / len(scores)}


def next_line(scorer: Scorer, tok, items: Sequence[T.ChoiceItem]) -> Dict[str, float]:
    """Accuracy of the highest-likelihood choice (``acc``) and of the highest likelihood
    per byte (``acc_norm``)."""
    requests, spans = [], []
    for it in items:
        spans.append((len(requests), len(it.choices)))
        for c in it.choices:
            ctx, cont = _continuation(tok, it.context, c)
            requests.append(Request(ctx + cont, len(cont)))
    scores = [lp for lp, _ in scorer.score(requests, desc="next_line")]
    hits, hits_norm = [], []
    for it, (s, n) in zip(items, spans):
        lps = scores[s:s + n]
        per_byte = [lp / len(c.encode("utf-8")) for lp, c in zip(lps, it.choices)]
        hits.append(max(range(n), key=lps.__getitem__) == it.answer)
        hits_norm.append(max(range(n), key=per_byte.__getitem__) == it.answer)
    acc, se = _acc(hits)
    acc_norm, se_norm = _acc(hits_norm)
    return {"items": len(items), "choices": len(items[0].choices) if items else 0,
            "acc": acc, "acc_stderr": se, "acc_norm": acc_norm, "acc_norm_stderr": se_norm}


def run_eval(path: str, tasks: Sequence[str] = TASKS, *, text_file: Optional[str] = None,
             data_path: Optional[str] = None, split: str = "969,30,1",
             split_part: str = "valid",
             limit: int = 500, heldout_bytes: Optional[int] = None, seed: int = 0,
             batch_size: int = 8, max_length: Optional[int] = None, device: str = "cpu",
             dtype: Optional[torch.dtype] = None, trust_remote_code: bool = False,
             progress: bool = True) -> Dict:
    """Evaluate the HF folder ``path`` on ``tasks``; returns the JSON-able results.

    Args:
        text_file: UTF-8 text scored by ``heldout`` instead of the held-out documents (one
            document).
        data_path, split, split_part: take the documents of every task from part
            ``split_part`` of the indexed dataset ``data_path`` under ``split`` (decoded with
            the model's tokenizer) instead of the default corpus's test split.
        limit: items per accuracy task.
        heldout_bytes: cap on the held-out text (UTF-8 bytes) that ``heldout`` scores (the
            accuracy tasks always draw their items from the whole held-out split).
        seed: item selection seed.
        max_length: context window (default the model's ``max_position_embeddings``, at
            most 4096).
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    t0 = time.perf_counter()
    model, tok, model_type = load_model(path, device, dtype, trust_remote_code)
    window = max_length or default_max_length(model)
    scorer = Scorer(model, batch_size, window, progress)
    if data_path is not None:
        docs = T.dataset_documents(
            data_path, split, split_part,
            lambda ids: tok.decode(ids, skip_special_tokens=True))
        docs_source = f"{os.path.abspath(data_path)}, {split_part} part of {split}"
    else:
        docs = T.heldout_documents()
        docs_source = f"default corpus, test split of {T.HELDOUT_SPLIT}"
    # items first, so that a text too small for a task stops before any scoring
    items: Dict[str, list] = {}
    for task, build in (("last_word", T.last_word_items), ("next_line", T.next_line_items)):
        if task in tasks:
            items[task] = build(docs, limit, seed)
            if not items[task]:
                raise ValueError(f"{task}: no item can be built from {docs_source} (too few or "
                                 f"too short documents); leave the task out with --tasks")
    results: Dict[str, Dict] = {}
    if "heldout" in tasks:
        if text_file is not None:
            with open(text_file, encoding="utf-8") as f:
                texts, source = [f.read()], os.path.abspath(text_file)
        else:
            texts = T.first_bytes(docs, heldout_bytes) if heldout_bytes else docs
            source = docs_source
        results["heldout"] = {"source": source, **perplexity(scorer, tok, texts)}
    if "last_word" in tasks:
        results["last_word"] = {"source": docs_source,
                                "items_digest": T.items_digest(items["last_word"]),
                                **last_word(scorer, tok, items["last_word"])}
    if "next_line" in tasks:
        results["next_line"] = {"source": docs_source,
                                "items_digest": T.items_digest(items["next_line"]),
                                **next_line(scorer, tok, items["next_line"])}
    import platform

    return {"model": os.path.abspath(path), "model_type": model_type,
            "settings": {"limit": limit, "seed": seed, "max_length": window,
                         "batch_size": batch_size, "device": device,
                         "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                         "heldout_bytes": heldout_bytes, "data_path": data_path,
                         "split": split if data_path else None,
                         "split_part": split_part if data_path else None,
                         "python": platform.python_version()},
            "tasks": results, "seconds": round(time.perf_counter() - t0, 2)}


def format_table(results: Dict) -> str:
    """A readable table of ``run_eval``'s results."""
    rows = [("task", "metric", "value")]
    for task, r in results["tasks"].items():
        if task == "heldout":
            metrics = [("perplexity", f"{r['perplexity']:.4g}"),
                       ("bits_per_byte", f"{r['bits_per_byte']:.4f}"),
                       ("tokens", str(r["tokens"]))]
        else:
            metrics = [(m, f"{r[m]:.4f} ± {r[m + '_stderr']:.4f}")
                       for m in ("acc", "acc_norm") if m in r] + [("items", str(r["items"]))]
        for j, (m, v) in enumerate(metrics):
            rows.append((task if j == 0 else "", m, v))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
