"""Per-microbatch cache of depth sources, owned by the transformer block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from megatron_lrattn.ops import (
    depth_merge,
    depth_merge_update,
    depth_read,
    depth_read_multi,
    triton_available,
)


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """Stateless RMS normalisation over the last dimension, computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def uses_two_phase(config, device: Optional[torch.device] = None) -> bool:
    """Whether the depth reads run the two-phase block schedule.

    ``config.depth_schedule``: ``two_phase`` / ``per_site`` force it; ``auto`` (the default)
    is ``two_phase`` where the reads run on the fused kernels (``device`` is CUDA, the
    backend is ``auto`` or ``triton`` and Triton imports) and a depth block has more than
    one read site (num_blocks < 2 * num_layers: with one site per block phase 1 is a
    per-site read in more launches), else ``per_site`` (the reference path on CPU).

    Measured on one H200 (docs/kernels.md): a depth block of the L=24, N=8 schedule (K=6
    sites, d=2048, T=16384, S=9, bf16) takes 2.5 ms forward+backward in two phases against
    6.0 ms per site for sliced keys (3.8 / 6.1 ms AttnRes, 2.6 / 9.4 ms projected); the 1b
    preset (K=4) steps in 264.6 ms against 270.8 ms (lr_attnres) and trains alike.
    """
    schedule = getattr(config, "depth_schedule", "per_site")
    if schedule != "auto":
        return schedule == "two_phase"
    if device is None or device.type != "cuda":
        return False
    if config.num_blocks >= 2 * config.num_layers:
        return False
    return getattr(config, "depth_backend", "auto") in ("auto", "triton") and triton_available()


def apply_norm(norm, x: Tensor) -> Tensor:
    """Apply a PreNorm module; newer megatron-core norms built for a residual return
    (out, residual)."""
    out = norm(x)
    return out[0] if isinstance(out, tuple) else out


def fusable_rmsnorm(norm) -> Optional[Tuple[Tensor, Optional[float]]]:
    """(weight, eps) of a PreNorm a two-phase merge can apply itself, else None.

    Only ``torch.nn.RMSNorm`` with a weight (the local spec's norm) qualifies; its ``eps``
    may be None (then the input dtype's machine epsilon, as the module uses). LayerNorm, TE
    norms and the ``IdentityOp`` left where TE fuses the norm into the next linear do not.
    """
    if type(norm) is torch.nn.RMSNorm and norm.weight is not None \
            and len(norm.normalized_shape) == 1:
        return norm.weight, norm.eps
    return None


@dataclass
class DepthState:
    """The depth sources seen so far by one microbatch.

    Attributes:
        embedding: v_0, [s, b, d].
        blocks: completed block values B_1..B_n (raw sums of their members' outputs).
        partial: running sum of the current block's outputs, or None when it is empty.
        embedding_key, block_keys, partial_key: projected keys ([s, b, r]) matching the
            values; all None / empty for sliced keys.
        num_sublayers_done: global index of the last sub-layer whose output was added.

    With ``use_two_phase`` the reads of a depth block are split: the first read of the
    block on this chunk runs phase 1 (``depth_read_multi``) over the completed sources for
    all of the block's read sites this chunk owns and caches (out_k, lse_k) per site; each
    site then returns its phase-1 output (no partial sum yet) or merges the partial sum
    into it (``depth_merge_update``, which also forms the partial sum from the last
    sub-layer output, or ``depth_merge``).
    """

    embedding: Tensor
    embedding_key: Optional[Tensor] = None
    blocks: List[Tensor] = field(default_factory=list)
    block_keys: List[Tensor] = field(default_factory=list)
    partial: Optional[Tensor] = None
    partial_key: Optional[Tensor] = None
    num_sublayers_done: int = 0
    _schedule: Optional[object] = field(default=None, repr=False)
    _queries: Mapping[int, Tensor] = field(default_factory=dict, repr=False)
    _phase1: Dict[int, Tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    _phase1_blocks: int = field(default=-1, repr=False)
    _pending: Optional[Tensor] = field(default=None, repr=False)

    def use_two_phase(self, schedule, queries: Mapping[int, Tensor]) -> None:
        """Serve reads that name their site through the two-phase block schedule.

        Args:
            schedule: the model's ``DepthSchedule``.
            queries: global read site -> query [r] for every site this chunk reads.
        """
        self._schedule = schedule
        self._queries = dict(queries)
        self._phase1 = {}
        self._phase1_blocks = -1

    @property
    def projected(self) -> bool:
        """True when the state carries projected keys."""
        return self.embedding_key is not None

    def add(self, output: Tensor, key: Optional[Tensor], closes_block: bool) -> None:
        """Add one sub-layer's output (and its normalised key) to the current block.

        With ``use_two_phase`` an output that extends a non-empty partial sum (and does not
        close the block) is kept aside: the next read forms P = partial + output inside its
        merge (``depth_merge_update``), and ``sources()`` forms it when asked first.
        """
        if (key is None) == self.projected:
            raise ValueError("DepthState.add: key must be given exactly when keys are projected")
        self._flush()
        if self.partial is None:
            self.partial = output
        elif self._schedule is not None and not closes_block:
            self._pending = output
        else:
            self.partial = self.partial + output
        if key is not None:
            self.partial_key = key if self.partial_key is None else self.partial_key + key
        self.num_sublayers_done += 1
        if closes_block:
            self.blocks.append(self.partial)
            self.partial = None
            if key is not None:
                self.block_keys.append(self.partial_key)
                self.partial_key = None

    def _flush(self) -> None:
        # form the partial sum an output kept aside for a fused merge would have extended
        if self._pending is not None:
            self.partial = self.partial + self._pending
            self._pending = None

    def sources(self) -> Tuple[List[Tensor], Optional[List[Tensor]]]:
        """Values [v_0, B_1.., P?] and matching keys (None for sliced keys)."""
        self._flush()
        values = [self.embedding, *self.blocks]
        if self.partial is not None:
            values.append(self.partial)
        if not self.projected:
            return values, None
        keys = [self.embedding_key, *self.block_keys]
        if self.partial_key is not None:
            keys.append(self.partial_key)
        return values, keys

    def read(self, query: Tensor, config, site: Optional[int] = None) -> Tensor:
        """Depth read of the current sources with ``query`` ([r], fp32).

        Args:
            query: the site's query.
            config: the model config (eps, scale, backend).
            site: global read-site number; with ``use_two_phase`` it selects the two-phase
                path (``query`` must then be the query registered for ``site``).

        Runs inside ``torch.profiler.record_function("depth_read")`` (two-phase: with
        ``depth_read_multi`` and ``depth_merge`` ranges inside) so that profiles
        (``lrattn-profile``) can attribute the forward of every read site.
        """
        if site is not None and self._schedule is not None:
            with torch.profiler.record_function("depth_read"):
                return self._read_two_phase(query, config, site)
        values, keys = self.sources()
        with torch.profiler.record_function("depth_read"):
            return depth_read(
                values,
                query,
                keys,
                eps=config.key_norm_eps,
                scale=config.depth_scale,
                backend=config.depth_backend,
            )

    def read_normed(self, query: Tensor, config, site: int, norm) -> Tensor:
        """The next sub-layer's input: ``norm(read(query, config, site))``.

        With the two-phase schedule, a read that merges the partial sum applies the norm
        inside the merge when ``config.fuse_depth_norm`` and ``norm`` is a
        ``torch.nn.RMSNorm`` (``fusable_rmsnorm``); otherwise the norm module runs on the
        read.
        """
        fused = fusable_rmsnorm(norm) if config.fuse_depth_norm else None
        if fused is not None and self._schedule is not None and self.partial is not None:
            with torch.profiler.record_function("depth_read"):
                return self._read_two_phase(query, config, site, fused)
        return apply_norm(norm, self.read(query, config, site=site))

    def _read_two_phase(self, query: Tensor, config, site: int, norm=None) -> Tensor:
        n = len(self.blocks)
        if self._phase1_blocks != n:
            self._phase1, self._phase1_blocks = {}, n
        if site not in self._phase1:
            sites = [s for s in self._schedule.block_sites(n) if s >= site and s in self._queries]
            if site not in sites:
                raise RuntimeError(
                    f"two-phase read of site {site} with {n} completed blocks: the schedule's "
                    f"sites for that state are {self._schedule.block_sites(n)}"
                )
            values = [self.embedding, *self.blocks]
            keys = [self.embedding_key, *self.block_keys] if self.projected else None
            queries = torch.stack([self._queries[s] for s in sites])
            with torch.profiler.record_function("depth_read_multi"):
                outs, lse = depth_read_multi(values, queries, keys, eps=config.key_norm_eps,
                                             scale=config.depth_scale,
                                             backend=config.depth_backend, split=True)
            self._phase1 = {s: (outs[k], lse[k]) for k, s in enumerate(sites)}
        out, lse = self._phase1.pop(site)
        if self.partial is None:
            return out
        kw = dict(eps=config.key_norm_eps, scale=config.depth_scale,
                  backend=config.depth_backend)
        if norm is not None:
            weight, eps = norm
            kw.update(norm_weight=weight,
                      norm_eps=torch.finfo(out.dtype).eps if eps is None else eps)
        if self._pending is not None:
            with torch.profiler.record_function("depth_merge"):
                h, self.partial = depth_merge_update(
                    out, lse, self.partial, self._pending, query, self.partial_key, **kw)
            self._pending = None
            return h
        with torch.profiler.record_function("depth_merge"):
            return depth_merge(out, lse, self.partial, query, self.partial_key, **kw)
