"""Planner model: memory per GPU and step time of TP/CP/PP/VPP/DP layouts (pure Python).

For a model shape (``analysis.flops.ModelShape``), a global batch and a cluster, every
layout ``TP x CP x PP (x V virtual stages) x DP`` with a micro-batch size and with or
without the distributed optimizer gets a predicted peak memory per GPU and step time;
a layout that does not fit is tried again with activation recomputation; ``recommend``
picks the fastest that fits. The model and its assumptions (docs/parallelism.md,
"Planner"):

Context parallelism (megatron's ``--context-parallel-size``)
  * each sequence is cut into 2 CP chunks and CP rank i holds chunks i and 2 CP - 1 - i
    (balanced causal work), so a GPU holds s / CP tokens of each sequence (s / (TP CP)
    under sequence parallelism); s must be divisible by 2 CP (by 2 TP CP with TP > 1),
    and layouts that do not divide are not listed. Weights are replicated over CP; the
    gradient reduction and the distributed optimizer run over the DP x CP ranks.
  * the depth read is per token (no communication); attention all-gathers K and V over
    the CP group in the forward and reduce-scatters their gradients in the backward.

Activation recomputation (megatron's ``--recompute-granularity full``)
  * ``Layout.recompute_layers`` = k of the n = L / (PP V) layers of each model chunk run
    under full recompute: k = n is ``--recompute-method uniform --recompute-num-layers 1``,
    0 < k < n ``--recompute-method block --recompute-num-layers k`` (selective recompute
    saves nothing with the SDPA core, which stores no probabilities, and is not planned).
  * a recomputed layer keeps only its input instead of its activations: the hidden state
    ([s/(TP CP), b, d] bf16) with standard residuals; with depth attention the depth state
    that entered it, whose shared sources (embedding, completed block sums) are the depth
    state below, plus ``RECOMPUTE_INPUTS`` tensors of [s/(TP CP), b, w] bf16 of its own
    (the partial sum entering it and the two-phase schedule's cached phase-1 reads).
    When every layer of a chunk is recomputed, the backward rebuilds one layer's
    activations of one micro-batch on top (with k < n they fit in the space the
    non-recomputed layers of that micro-batch have freed).
  * the backward reruns the recomputed layers' forward: their compute x 4/3 (the LM head
    is not recomputed), their TP collectives x 3/2 (the 2 forward ones again) and the CP
    K/V all-gather again.
  * ``plan`` lists a layout with recomputation only when it does not fit without: the
    smallest k that fits (the fastest), else the k of least memory.

Memory per GPU (the busiest stage: the first, which holds the embedding and the most
micro-batches in flight)
  * weights bf16 (2 B), gradients fp32 (4 B: megatron's main-grad buffer, reduced in fp32),
    optimizer fp32 master weights + Adam moments (12 B), divided by DP x CP with the
    distributed optimizer; parameters of a stage are its L/PP layers / TP plus the
    embedding / TP (and the head / TP when PP = 1).
  * activations: per layer and token, ``ACT_ALPHA x (2 (6 d + 2 g k) + 6 h)`` bytes, the
    tensors a pre-norm SwiGLU layer with SDPA attention saves for the backward in bf16
    (norm inputs and outputs, Q K V, attention output, both FC1 halves and the SwiGLU
    output), scaled by a factor fitted to the one-H200 peaks (a recomputed layer: its
    input, above); divided by TP (sequence parallelism on with TP > 1) and by CP; 1F1B
    keeps PP micro-batches in flight on the first stage, the interleaved schedule
    ``PP (1 + (PP - 1) / (PP V))`` chunk-micro-batches.
  * depth state per micro-batch in flight: the sources ``v_0, B_1..B_N`` and a partial sum
    (``N + 2`` tensors of [s/(TP CP), b, w] bf16, w = d or d + r), plus the packed input
    of a pipeline hop (its source count from the depth schedule).
  * logits: [s/CP, b, V/TP] fp32 and their gradient on the last stage.
Step time
  * compute: the model FLOPs of ``lrattn-flops`` (6 M + 12 L s a k, plus 3 x the depth
    reads' forward FLOPs) / (peak x MFU), spread evenly over the GPUs (a CP rank does 1/CP
    of each sequence's attention FLOPs and of its other FLOPs). MFU(T) = MFU_MAX x T /
    (T + T_HALF) with T the tokens of one micro-batch per TP x CP rank; MFU_MAX and
    T_HALF are fitted to the one-H200 measurements in ``CALIBRATION`` (standard
    residuals), and a depth mode multiplies the compute by its measured ratio to
    standard (``RESIDUAL_FACTOR``). Recomputation adds its own term (above).
  * optimizer: fused AdamW moves ``OPT_BYTES`` bytes per local parameter at
    ``HBM_EFFICIENCY`` of the HBM bandwidth (divided by DP x CP with the distributed
    optimizer).
  * tensor parallelism: per layer and micro-batch 4 all-reduce-equivalents of
    [s/CP, b, d] bf16 (2 forward, 2 backward; all-gather + reduce-scatter under SP), ring
    cost 2 (t - 1) / t x bytes / bandwidth, not overlapped.
  * context parallelism: per layer and micro-batch an all-gather of K and V (each
    [s, b, g k / TP] bf16 gathered) in the forward and a reduce-scatter of their gradients
    in the backward, ring cost (c - 1) / c x bytes / bandwidth, not overlapped.
  * data parallelism: fp32 gradient all-reduce over the DP x CP ranks (reduce-scatter
    with the distributed optimizer, plus the bf16 parameter all-gather), ring cost; with
    overlap the reduce hides under the last micro-batch's backward (2/3 of its compute)
    and the gather under the first forward (1/3), one bucket (40M parameters) stays
    exposed.
  * pipeline: bubble ``(PP - 1) / (V m)`` of the compute and recompute (m micro-batches
    per DP rank), and per micro-batch and chunk one forward and one backward hop of the
    packed depth state (the cached payload of ``depth.payload.hop_payloads`` with V > 1).
  * groups are placed as megatron orders ranks (tp-cp-ep-dp-pp: TP fastest, then CP, then
    DP, then PP): a group whose span exceeds the node uses the inter-node bandwidth.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional, Tuple

from megatron_lrattn.analysis.flops import (
    ModelShape,
    forward_flops,
    model_flops_per_token,
    parameter_counts,
)
from megatron_lrattn.analysis.plan_layouts import Cluster, Layout, check_layout
from megatron_lrattn.depth.schedule import depth_schedule

GIB = 2 ** 30

CALIBRATION = (
    # (preset, micro-batch, sequence, TP, measured standard step ms, one-H200 note)
    ("1b", 8, 2048, 1, 199.6, "lrattn-profile, 8 x 2048, 51.0% MFU (docs/performance.md)"),
    ("4b", 1, 4096, 1, 238.2, "lrattn-profile --sequential, 1 x 4096, 43.1% MFU"),
)
"""One-H200 measurements the MFU curve is fitted to (peak 989 TFLOP/s, vocabulary 4096)."""

RESIDUAL_FACTOR = {"standard": 1.0, "attnres": 1.064, "lr_attnres": 1.041}
"""Step time of a depth mode over standard on one H200 (1b / 4b means: attnres 1.060 and
1.068, lr_attnres sliced 1.042 and 1.039; docs/performance.md)."""

ACT_ALPHA = 1.65
"""Saved-activation bytes over the counted bf16 tensors (fp32 norm statistics, masks,
megatron's extra copies): fitted to the 1b peak of 20.8 GiB at micro-batch 2 x 2048 and
matching the 4b peak at 1 x 4096 (78.5 GB) within 1%."""

OPT_BYTES = 34
"""Bytes fused AdamW moves per parameter: reads fp32 master, grad, m, v; writes master,
m, v; writes the bf16 copy."""

HBM_TBPS = 4.8
HBM_EFFICIENCY = 0.75
BUCKET_PARAMS = 40_000_000
USABLE_MEMORY = 0.92
"""Share of GPU memory a layout may plan for (allocator fragmentation, CUDA context)."""
RECOMPUTE_INPUTS = {"standard": 1, "attnres": 2, "lr_attnres": 2}
"""[s, b, w] bf16 tensors a recomputed layer keeps besides the shared depth sources: the
hidden state (standard); the partial sum entering the layer (none at a block start, so an
upper bound) plus about one cached phase-1 read per layer with the two-phase schedule (the
saved tensors counted in docs/performance.md: 38 kB two-phase against 21 kB per-site for
4 layers of 32 tokens x 32 fp32, about 4 more [tokens, d] tensors)."""


@dataclass(frozen=True)
class Prediction:
    """Predicted memory (GiB per GPU, busiest stage) and step time (s) of a layout;
    ``recompute`` is its recomputation method (``"uniform"``, ``"block"`` or ``"none"``)."""

    layout: Layout
    num_micro: int
    recompute: str
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    depth_state_gib: float
    logits_gib: float
    memory_gib: float
    fits: bool
    compute_s: float
    recompute_s: float
    optimizer_s: float
    tp_comm_s: float
    cp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> Dict:
        """Flat dict: the prediction's fields and the layout's."""
        out = asdict(self)
        out.update(out.pop("layout"))
        return out


def _mfu_fit() -> Tuple[float, float]:
    """(MFU_MAX, T_HALF) through the two ``CALIBRATION`` points (optimizer time removed)."""
    pts = []
    for name, mbs, seq, tp, ms, _ in CALIBRATION:
        shape = preset_shape(name, seq_length=seq, residual="standard")
        cluster = Cluster()
        opt = _optimizer_time(parameter_counts(shape).total, cluster)
        flops = model_flops_per_token(shape) * mbs * seq
        pts.append((mbs * seq / tp, flops / (ms / 1e3 - opt) / (cluster.peak_tflops * 1e12)))
    (t1, m1), (t2, m2) = pts
    # m = M t / (t + T): m1 (t1 + T) / t1 = m2 (t2 + T) / t2
    t_half = (m2 - m1) / (m1 / t1 - m2 / t2)
    return m1 * (t1 + t_half) / t1, t_half


def preset_shape(name: str, vocab_size: int = 4096, config: Optional[Dict] = None,
                 **overrides) -> ModelShape:
    """The ``ModelShape`` of preset ``name``: its model flags, then ``config`` (values of an
    ``lrattn-pretrain --config`` file), then the ``overrides`` that are not None win."""
    from types import SimpleNamespace

    from megatron_lrattn.training.presets import PRESETS

    values = dict(num_query_groups=None, rank=None, qk_layernorm=False)
    values.update(PRESETS[name])
    values.update(config or {})
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelShape.from_args(SimpleNamespace(**values), vocab_size)


def _optimizer_time(params: float, cluster: Cluster) -> float:
    return params * OPT_BYTES / (HBM_TBPS * 1e12 * HBM_EFFICIENCY)


def _ring(bytes_: float, n: int, bandwidth: float, factor: float = 2.0) -> float:
    return 0.0 if n <= 1 else factor * (n - 1) / n * bytes_ / bandwidth



@functools.lru_cache(maxsize=None)
def _hop_sources(shape: ModelShape, pp: int, vpp: int) -> float:
    """Mean sources per pipeline hop of one micro-batch (cached payload with V > 1)."""
    if pp == 1 or shape.residual == "standard":
        return 1.0
    chunks = pp * vpp
    ends = [2 * shape.num_layers * (c + 1) // chunks for c in range(chunks)]
    sched = depth_schedule(shape.num_layers, shape.num_blocks)
    seen: Dict[int, set] = {r: set() for r in range(pp)}
    total = 0
    for c, end in enumerate(ends[:-1]):
        labels = sched.site(end).labels()
        dst = (c + 1) % pp
        src = c % pp
        seen[src].update(x for x in labels if not x.startswith("P"))
        new = [x for x in labels if x.startswith("P") or x not in seen[dst]]
        seen[dst].update(x for x in new if not x.startswith("P"))
        total += len(new) if vpp > 1 else len(labels)
    return total / (chunks - 1)


@functools.lru_cache(maxsize=None)
def _shape_costs(shape: ModelShape) -> Tuple[float, float, float, float]:
    """(parameters, parameters of a layer, training FLOPs per token with 3 x the depth
    reads, model FLOPs per token) of ``shape``."""
    counts = parameter_counts(shape)
    layer_params = (counts.total - counts.embedding - shape.hidden_size) / shape.num_layers
    model = model_flops_per_token(shape)
    return counts.total, layer_params, model + 3 * forward_flops(shape).depth_reads, model


def _memory(shape: ModelShape, layout: Layout) -> Tuple[float, ...]:
    """(weights, grads, optimizer, activations, depth state, logits) bytes per GPU of the
    busiest stage, and the local parameters (module docstring)."""
    tp, cp, pp, v, dp = layout.tp, layout.cp, layout.pp, layout.vpp, layout.dp
    s, d, h, L, V = (shape.seq_length, shape.hidden_size, shape.ffn_hidden_size,
                     shape.num_layers, shape.vocab_size)
    _, layer_params, _, _ = _shape_costs(shape)
    embed = V * d
    stage = layer_params * L / pp + (embed * (2 if shape.untied else 1) if pp == 1 else embed)
    local = stage / tp
    shard = dp * cp if layout.distributed_optimizer else 1

    gk = shape.num_query_groups * shape.head_dim
    tokens_rank = s * layout.micro_batch / cp / tp
    inflight = pp * (1 + (pp - 1) / (pp * v)) if pp > 1 else 1
    width = d + (shape.rank if shape.projected else 0)
    full = ACT_ALPHA * (2 * (6 * d + 2 * gk) + 6 * h) * tokens_rank
    kept = RECOMPUTE_INPUTS[shape.residual] * 2 * width * tokens_rank
    n, k = L // (pp * v), layout.recompute_layers
    act = ((n - k) * full + k * kept) / n * (L / pp) * inflight + (full if k == n else 0.0)
    n_src = 0 if shape.residual == "standard" else shape.num_blocks + 2
    hop = _hop_sources(shape, pp, v) if pp > 1 else 0
    depth = (n_src + hop) * tokens_rank * width * 2 * inflight
    logits = 2 * 4 * tokens_rank * V if pp == 1 else 0.0
    return 2 * local, 4 * local, 12 * local / shard, act, depth, logits, local


def predict(shape: ModelShape, layout: Layout, global_batch: int, cluster: Cluster
            ) -> Prediction:
    """Memory and step time of ``layout`` (module docstring); raises ``ValueError`` when the
    global batch does not split into its micro-batches, the sequence not over TP x CP, or
    ``recompute_layers`` exceeds the layers of a model chunk."""
    check_layout(shape, layout, global_batch)
    tp, cp, pp, v, dp = layout.tp, layout.cp, layout.pp, layout.vpp, layout.dp
    b = layout.micro_batch
    m = global_batch // (b * dp)
    s, d, L = shape.seq_length, shape.hidden_size, shape.num_layers
    weights, grads, opt, act, depth, logits, local = _memory(shape, layout)
    memory = (weights + grads + opt + act + depth + logits) / GIB
    fits = memory <= USABLE_MEMORY * cluster.gpu_memory_gib
    grad_ranks = dp * cp
    shard = grad_ranks if layout.distributed_optimizer else 1

    _, _, flops_token, model_flops_token = _shape_costs(shape)
    mfu_max, t_half = MFU_FIT
    tokens_mb = s * b / cp
    tokens_rank = tokens_mb / tp
    mfu = mfu_max * tokens_rank / (tokens_rank + t_half)
    step_flops = flops_token * global_batch * s
    compute = step_flops / (cluster.gpus * cluster.peak_tflops * 1e12 * mfu)
    compute *= RESIDUAL_FACTOR[shape.residual]
    recomputed = layout.recompute_layers * v  # layers of this pipeline rank
    layer_share = 1 - 6 * shape.vocab_size * d / flops_token
    recompute = compute * layer_share * recomputed / (L / pp) / 3
    per_micro = (compute + recompute) / m
    optimizer = _optimizer_time(local / shard, cluster)
    tp_bytes = tokens_mb * d * 2
    tp_comm = (4 * L / pp + 2 * recomputed) * m * _ring(tp_bytes, tp, cluster.bandwidth(tp))
    gk = shape.num_query_groups * shape.head_dim
    kv_bytes = 2 * s * b * gk / tp * 2
    cp_comm = (2 * L / pp + recomputed) * m * _ring(kv_bytes, cp, cluster.bandwidth(tp * cp),
                                                    1.0)
    bw_dp = cluster.bandwidth(tp * cp * dp)
    if layout.distributed_optimizer:
        reduce = _ring(4 * local, grad_ranks, bw_dp, 1.0)
        gather = _ring(2 * local, grad_ranks, bw_dp, 1.0)
    else:
        reduce, gather = _ring(4 * local, grad_ranks, bw_dp), 0.0
    if layout.overlap and grad_ranks > 1:
        tail = min(1.0, BUCKET_PARAMS / local)
        reduce = max(reduce - 2 / 3 * per_micro, tail * reduce)
        gather = max(gather - 1 / 3 * per_micro, tail * gather)
    dp_comm = reduce + gather
    pp_comm = 0.0
    if pp > 1:
        # the slowest hop sets the pace: inter-node unless the whole pipeline is in a node
        width = d + (shape.rank if shape.projected else 0)
        hop_bytes = _hop_sources(shape, pp, v) * tokens_rank * width * 2
        pp_comm = 2 * m * v * hop_bytes / cluster.bandwidth(tp * cp * dp * pp)
    bubble = (compute + recompute) * (pp - 1) / (v * m)
    step = compute + recompute + optimizer + tp_comm + cp_comm + dp_comm + pp_comm + bubble
    model_flops = model_flops_token * global_batch * s
    return Prediction(layout, m, layout.recompute_method(L) or "none", weights / GIB,
                      grads / GIB, opt / GIB, act / GIB, depth / GIB, logits / GIB, memory,
                      fits, compute, recompute, optimizer, tp_comm, cp_comm, dp_comm, pp_comm,
                      bubble, step, global_batch * s / step,
                      model_flops / (step * cluster.gpus * cluster.peak_tflops * 1e12))


def with_recompute(shape: ModelShape, layout: Layout, cluster: Cluster) -> Optional[Layout]:
    """``layout`` with the fewest recomputed layers per model chunk that make it fit (the
    fastest: time grows with them), else with the recomputation of least memory; None
    when recomputation is not possible (a chunk of no layers)."""
    chunk = shape.num_layers // (layout.pp * layout.vpp)
    limit = USABLE_MEMORY * cluster.gpu_memory_gib * GIB
    best, best_bytes = None, math.inf
    for k in range(1, chunk + 1):
        candidate = replace(layout, recompute_layers=k)
        used = sum(_memory(shape, candidate)[:6])
        if used <= limit:
            return candidate
        if used < best_bytes:
            best, best_bytes = candidate, used
    return best


MFU_FIT = _mfu_fit()
"""(MFU_MAX, T_HALF) fitted to ``CALIBRATION``."""
