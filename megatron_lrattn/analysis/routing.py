"""Routing, activation and gradient statistics of a trained model (``lrattn-analyze``).

What is measured, for every micro-batch of a dataset (mean loss over the unmasked tokens,
one forward and one backward, dropout off):

- Depth weights of every read site j (1..2L): ``a = softmax_i(tau <q_j, RMS(k_i)>)`` over the
  S_j sources ``[v0, B1..Bn, P?]`` the schedule gives the site. They are recomputed from the
  sources the model reads, with the reference math of ``megatron_lrattn.ops``
  (``depth_read_logits``), by temporarily wrapping ``DepthState.read``; the training path is
  unchanged.
  Per site: the mean weight of each source over all tokens, and the *effective number of
  sources* ``exp(H)``, ``H = -sum_i a_i log a_i``, averaged over tokens (1 = all weight on one
  source, S_j = uniform, which is what zero queries give).
- RMS of every sub-layer output (the d-wide value, bias included): ``sqrt(mean(out^2))`` over
  all tokens and features, then averaged over batches.
- Gradient of the loss with respect to every sub-layer output: the L2 norm of ``dL/d out``
  over the whole micro-batch, averaged over batches (it scales like 1/sqrt(tokens) for a
  fixed model, so compare runs at equal batch shapes).
- Parameter-gradient L2 norms per sub-layer (attention: its input norm and self-attention;
  MLP: its pre-MLP norm and MLP), per layer, per depth query and for the embedding, the
  embedding key projection, the final norm and the output layer; averaged over batches.

Sub-layers are numbered 1..2L (attention of layer l is 2l-1, its MLP 2l).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional

import torch
from torch import Tensor

from megatron_lrattn.depth.state import DepthState
from megatron_lrattn.ops import depth_read_logits
from megatron_lrattn.depth.schedule import schedule_from_config

STANDARD_NOTE = ("residual 'standard' has no depth reads: routing statistics (effective "
                 "sources, depth weights) do not apply; RMS and gradient norms are reported")


class AnalysisError(ValueError):
    """A bad analysis input (checkpoint, dataset, option); the message says which and why."""


def depth_weights_and_entropy(state: DepthState, query: Tensor, config) -> tuple:
    """Depth weights of one read, from the reference logits.

    Args:
        state: the depth state at the read (its sources and keys are used, detached).
        query: the site's query [r].
        config: supplies ``key_norm_eps`` and ``depth_scale``.

    Returns:
        ``(weights [S, T] float64, entropy [T] float64)`` over the T tokens of the read.
    """
    values, keys = state.sources()
    r = query.shape[-1]
    if keys is None:
        keys = [v[..., -r:] for v in values]
    flat = [k.detach().reshape(-1, r) for k in keys]
    logits = depth_read_logits(flat, query.detach(), config.key_norm_eps,
                               config.depth_scale).double()
    logp = torch.log_softmax(logits, dim=0)
    weights = logp.exp()
    return weights, -(weights * logp).sum(0)


@contextlib.contextmanager
def capture_depth_reads(callback: Callable[[int, DepthState, Tensor], None]) -> Iterator[None]:
    """Call ``callback(site, state, query)`` before every ``DepthState.read``.

    The site is the number of sub-layers already added (read site j follows sub-layer j).
    ``DepthState.read`` is wrapped only inside the ``with`` block and restored afterwards.
    """
    original = DepthState.read

    def read(self, query, config, site=None):
        callback(self.num_sublayers_done, self, query)
        return original(self, query, config, site=site)

    DepthState.read = read
    try:
        yield
    finally:
        DepthState.read = original


@dataclass
class _Accumulator:
    """Running sums over batches (float64 on the CPU)."""

    weight_sum: Dict[int, Tensor] = field(default_factory=dict)
    eff_sum: Dict[int, float] = field(default_factory=dict)
    tokens: Dict[int, int] = field(default_factory=dict)
    per_batch: Dict[str, Dict] = field(default_factory=dict)

    def add_read(self, site: int, weights: Tensor, entropy: Tensor) -> None:
        w = weights.sum(1).cpu()
        self.weight_sum[site] = self.weight_sum.get(site, 0) + w
        self.eff_sum[site] = self.eff_sum.get(site, 0.0) + float(entropy.exp().sum())
        self.tokens[site] = self.tokens.get(site, 0) + weights.shape[1]

    def add(self, kind: str, key, value: float) -> None:
        self.per_batch.setdefault(kind, {}).setdefault(key, []).append(float(value))

    def mean(self, kind: str, keys: Iterable) -> List[Optional[float]]:
        table = self.per_batch.get(kind, {})
        return [sum(table[k]) / len(table[k]) if table.get(k) else None for k in keys]


def _norm(tensors: Iterable[Optional[Tensor]]) -> float:
    sq = [t.detach().double().pow(2).sum() for t in tensors if t is not None]
    return math.sqrt(float(sum(sq))) if sq else 0.0


def _grads(module: Optional[torch.nn.Module]) -> List[Optional[Tensor]]:
    return [] if module is None else [p.grad for p in module.parameters()]


def _sublayer_hook(acc: _Accumulator, sublayer: int, d: int):
    """Forward hook of a sub-layer module returning ``(out, bias)``: RMS of the value and a
    tensor hook for the norm of the loss gradient with respect to it."""

    def hook(module, inputs, output):
        out, bias = output if isinstance(output, tuple) else (output, None)
        value = out[..., :d].detach().double()
        if bias is not None:
            value = value + bias[..., :d].detach().double()
        acc.add("output_rms", sublayer, value.pow(2).mean().sqrt())
        if out.requires_grad:
            out.register_hook(
                lambda g: acc.add("output_grad_norm", sublayer, _norm([g[..., :d]])))

    return hook


def _param_grad_norms(model, acc: _Accumulator, num_sites: int) -> None:
    decoder = model.decoder
    for layer in decoder.layers:
        l = layer.layer_number
        attn = _grads(layer.input_layernorm) + _grads(layer.self_attention)
        mlp = _grads(layer.pre_mlp_layernorm) + _grads(layer.mlp)
        acc.add("param_grad_norm", 2 * l - 1, _norm(attn))
        acc.add("param_grad_norm", 2 * l, _norm(mlp))
        acc.add("layer_param_grad_norm", l, _norm(_grads(layer)))
    queries = getattr(decoder, "depth_queries", None)
    if queries is not None:
        for site in range(1, num_sites + 1):
            if str(site) in queries:
                acc.add("query_grad_norm", site, _norm([queries[str(site)].weight.grad]))
    parts = {
        "embedding": getattr(model, "embedding", None),
        "embedding_key_proj": getattr(decoder, "embedding_key_proj", None),
        "final_layernorm": getattr(decoder, "final_layernorm", None),
        "output_layer": getattr(model, "output_layer", None),
    }
    for name, module in parts.items():
        if module is not None:
            acc.add("other_param_grad_norm", name, _norm(_grads(module)))


def _masked_mean(per_token: Tensor, loss_mask: Tensor) -> Tensor:
    mask = loss_mask.reshape(-1).float()
    return (per_token.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1)


def analyze_model(model, config, batches: Iterable[Mapping[str, Tensor]],
                  progress: Optional[Callable[[Iterable], Iterable]] = None) -> Dict:
    """Run the statistics of this module over ``batches`` (one forward + backward each).

    Args:
        model: a bare ``LRAttnResGPTModel`` (TP=PP=1) holding all layers; its gradients are
            zeroed before every batch and left in ``.grad`` afterwards.
        config: the model's ``LRAttnResConfig``.
        batches: dicts with ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ([b, s]).
        progress: optional wrapper of the batch iterable (e.g. ``tqdm``).

    Returns:
        A JSON-ready dict (see docs/analysis.md): ``loss``, ``num_batches``, ``tokens``,
        ``routing`` (None for ``standard``, with ``note`` set), ``sublayers``, ``layers``,
        ``query_grad_norm`` and ``other_param_grad_norm``. Missing values are None.
    """
    L, d = config.num_layers, config.hidden_size
    n_sub = 2 * L
    depth = config.uses_depth_attention
    acc = _Accumulator()
    handles = []
    for layer in model.decoder.layers:
        l = layer.layer_number
        for module, sublayer in ((layer.self_attention, 2 * l - 1), (layer.mlp, 2 * l)):
            handles.append(module.register_forward_hook(_sublayer_hook(acc, sublayer, d)))

    def on_read(site: int, state: DepthState, query: Tensor) -> None:
        acc.add_read(site, *depth_weights_and_entropy(state, query, config))

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses, tokens = [], 0
    try:
        with capture_depth_reads(on_read) if depth else contextlib.nullcontext():
            for batch in (progress(batches) if progress else batches):
                tok, labels, mask, pos = (batch[k].to(device) for k in
                                          ("tokens", "labels", "loss_mask", "position_ids"))
                model.zero_grad(set_to_none=True)
                loss = _masked_mean(model(tok.long(), pos.long(), None, labels=labels.long()), mask)
                loss.backward()
                losses.append(float(loss.detach()))
                tokens += tok.numel()
                _param_grad_norms(model, acc, n_sub)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not losses:
        raise AnalysisError("no batches to analyse")

    sublayers = list(range(1, n_sub + 1))
    others = list(acc.per_batch.get("other_param_grad_norm", {}))
    report = {
        "loss": sum(losses) / len(losses),
        "num_batches": len(losses),
        "tokens": tokens,
        "routing": _routing_report(acc, config) if depth else None,
        "note": None if depth else STANDARD_NOTE,
        "sublayers": {
            "index": sublayers,
            "layer": [(j + 1) // 2 for j in sublayers],
            "kind": ["attention" if j % 2 else "mlp" for j in sublayers],
            "output_rms": acc.mean("output_rms", sublayers),
            "output_grad_norm": acc.mean("output_grad_norm", sublayers),
            "param_grad_norm": acc.mean("param_grad_norm", sublayers),
        },
        "layers": {
            "index": list(range(1, L + 1)),
            "param_grad_norm": acc.mean("layer_param_grad_norm", range(1, L + 1)),
        },
        "query_grad_norm": acc.mean("query_grad_norm", sublayers) if depth else None,
        "other_param_grad_norm": dict(zip(others, acc.mean("other_param_grad_norm", others))),
    }
    return report


def _routing_report(acc: _Accumulator, config) -> Dict:
    schedule = schedule_from_config(config)
    sites = list(range(1, schedule.num_sites + 1))
    missing = [j for j in sites if j not in acc.tokens]
    if missing:
        raise AnalysisError(f"no depth read was seen at sites {missing}")
    num_sources = [schedule.site(j).num_sources for j in sites]
    width = max(num_sources)
    weights = []
    for j, s in zip(sites, num_sources):
        row = (acc.weight_sum[j] / acc.tokens[j]).tolist()
        if len(row) != s:
            raise AnalysisError(f"site {j} read {len(row)} sources, the schedule says {s}")
        weights.append(row + [None] * (width - s))
    return {
        "sites": sites,
        "num_sources": num_sources,
        "source_labels": [list(schedule.site(j).labels()) for j in sites],
        "effective_sources": [acc.eff_sum[j] / acc.tokens[j] for j in sites],
        "mean_weights": weights,
        "block_ends": list(schedule.block_ends),
        "num_blocks": schedule.num_blocks,
        "rank": config.key_rank,
        "key": config.key_type,
    }
