"""Cluster planner: every layout of a cluster (``analysis.plan_layouts``) with its predicted
memory per GPU and step time (``analysis.plan_model``, whose docstring has the model), fastest
first, and the recommendation: the fastest that fits (pure Python)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_lrattn.analysis.flops import ModelShape
from megatron_lrattn.analysis.plan_layouts import Cluster, layouts
from megatron_lrattn.analysis.plan_model import Prediction, predict, with_recompute


def plan(shape: ModelShape, global_batch: int, cluster: Cluster,
         micro_batches: Optional[Sequence[int]] = None,
         context_parallel: Optional[Sequence[int]] = None,
         recompute: bool = True) -> List[Prediction]:
    """Predictions of every layout (``layouts``' arguments), fastest first; with
    ``recompute`` a layout that does not fit is listed once more with recomputation
    (``with_recompute``)."""
    out = []
    for lay in layouts(shape, global_batch, cluster, micro_batches, context_parallel):
        pred = predict(shape, lay, global_batch, cluster)
        out.append(pred)
        if recompute and not pred.fits:
            again = with_recompute(shape, lay, cluster)
            if again is not None:
                out.append(predict(shape, again, global_batch, cluster))
    return sorted(out, key=lambda p: (p.step_s, p.memory_gib))


def recommend(predictions: Sequence[Prediction]) -> Optional[Prediction]:
    """The fastest prediction that fits in memory (None when none fits)."""
    fitting = [p for p in predictions if p.fits]
    return min(fitting, key=lambda p: (p.step_s, p.memory_gib)) if fitting else None
