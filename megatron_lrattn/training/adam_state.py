"""Repairs that let megatron-core's ``DistributedOptimizer`` around a torch Adam(W) (no Apex
or TE) save and load its per-parameter state: empty state before a load, ``fully_reshardable``
loads, and the step count after a load."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

import torch


def _distributed_torch_adams(optimizer) -> List[Tuple[int, Any]]:
    """``(index in the chain, optimizer)`` of every megatron ``DistributedOptimizer`` in
    ``optimizer`` (plain or chained) that wraps a torch Adam(W): the ones whose per-parameter
    ``step`` state megatron-core mishandles without Apex/TE."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [(i, opt) for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer]))
            if isinstance(opt, DistributedOptimizer)
            and isinstance(getattr(opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def init_empty_adam_state(optimizer) -> None:
    """Give a fresh torch Adam(W) inside a distributed optimizer zero moments and step 0.

    Without Apex/TE, megatron's ``DistributedOptimizer.state_dict`` (called to build the
    loading state dict) reads every parameter's ``step`` and fails before the first step.
    The zeros are overwritten by the load; parameters are left untouched (unlike a dummy
    optimizer step, which would apply weight decay).
    """
    for _, opt in _distributed_torch_adams(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


@contextlib.contextmanager
def fully_reshardable_adam_load(optimizer, active: bool):
    """Let megatron-core load ``fully_reshardable`` state into a torch Adam(W) (when
    ``active``).

    megatron's ``load_state_dict`` first gives every parameter's state a ``step`` (torch Adam
    keeps one per parameter), then copies the checkpoint's per-parameter tensors into every
    key of that state, and ``step`` is not among the tensors it read (the count lives in the
    param groups): ``KeyError: 'step'``. For the duration, each per-parameter copy runs with
    ``step`` held aside; ``restore_adam_steps`` sets the saved count afterwards.
    """
    patched = []
    if active:
        for _, opt in _distributed_torch_adams(optimizer):
            original = opt._set_main_param_and_optimizer_states

            def copy_without_step(model_param, tensors, _opt=opt, _original=original):
                group, order = _opt.model_param_group_index_map[model_param]
                state = _opt.optimizer.state[_opt.optimizer.param_groups[group]["params"][order]]
                step = state.pop("step", None) if "step" not in tensors else None
                try:
                    _original(model_param, tensors)
                finally:
                    if step is not None:
                        state["step"] = step

            opt._set_main_param_and_optimizer_states = copy_without_step
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def restore_adam_steps(optimizer, loaded: Dict[str, Any]) -> None:
    """Give every parameter of a distributed optimizer's torch Adam(W) its own ``step``
    tensor holding the saved step count.

    megatron-core's ``DistributedOptimizer`` without Apex/TE loses the count on load: the
    bucket-space parameter state copies the template's ``step`` over the restored one, and
    ``load_state_dict`` puts one shared ``step`` tensor into every parameter's state (which
    torch's foreach Adam then increments once per parameter). Either way the bias
    correction of the resumed run is wrong. The count saved in the param groups is right.
    """
    single = len(getattr(optimizer, "chained_optimizers", [optimizer])) == 1
    for i, opt in _distributed_torch_adams(optimizer):
        inner = opt.optimizer
        saved = loaded if single else loaded[i]
        steps = {g.get("step") for g in saved.get("optimizer", {}).get("param_groups", [])}
        if len(steps) != 1 or None in steps:
            continue
        step = float(steps.pop())
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=state["step"].dtype,
                                             device=state["step"].device)

