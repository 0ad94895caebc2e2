"""Per-microbatch cache of depth sources, owned by the transformer block, and its wire format.

A pipeline stage boundary after sub-layer j carries the state's sources [v_0, B_1..B_n, P?]
(those of read site j, from the depth schedule) concatenated along the sequence dimension
into one view-free tensor [(S * s), b, w] with w = d, or d + r when keys are projected (each
source then travels as [value | key]): ``DepthState.pack`` / ``DepthState.unpack``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_lrattn.depth.schedule import DepthSchedule
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

    def tensors(self) -> Tuple[List[Optional[Tensor]], tuple]:
        """The state's tensors as one flat list (None where a field is empty), and the
        layout ``with_tensors`` rebuilds the state from: an activation checkpoint takes and
        returns flat tensors. Phase-1 results cached for later sites and an output kept
        aside for a fused merge are part of the state.

        Returns:
            (flat, layout): flat = [embedding, embedding_key, partial, partial_key,
            pending, *blocks, *block_keys, (out, lse) per cached phase-1 site].
        """
        sites = tuple(sorted(self._phase1))
        flat = [self.embedding, self.embedding_key, self.partial, self.partial_key,
                self._pending, *self.blocks, *self.block_keys,
                *(t for s in sites for t in self._phase1[s])]
        layout = (len(self.blocks), len(self.block_keys), sites, self.num_sublayers_done,
                  self._phase1_blocks)
        return flat, layout

    def with_tensors(self, flat: Sequence[Optional[Tensor]], layout: tuple) -> "DepthState":
        """A new state with this one's schedule and queries holding ``flat`` (from
        ``tensors()`` of a state with ``layout``)."""
        n_blocks, n_keys, sites, done, phase1_blocks = layout
        rest = list(flat[5:])
        cached = rest[n_blocks + n_keys:]
        state = DepthState(embedding=flat[0], embedding_key=flat[1],
                           blocks=rest[:n_blocks], block_keys=rest[n_blocks:n_blocks + n_keys],
                           partial=flat[2], partial_key=flat[3], num_sublayers_done=done)
        state._schedule, state._queries, state._pending = self._schedule, self._queries, flat[4]
        state._phase1 = {s: (cached[2 * i], cached[2 * i + 1]) for i, s in enumerate(sites)}
        state._phase1_blocks = phase1_blocks
        return state

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

    def parts(self) -> List[Tensor]:
        """The sources in label order as they cross a stage boundary, each [s, b, w]
        ([value | key] when keys are projected)."""
        values, keys = self.sources()
        if keys is not None:
            values = [torch.cat([v, k.to(v.dtype)], dim=-1) for v, k in zip(values, keys)]
        return values

    def pack(self) -> Tensor:
        """The ``parts()`` concatenated along dim 0 into one new tensor [(S * s), b, w]."""
        return torch.cat(self.parts(), dim=0)

    @classmethod
    def from_parts(cls, parts: Sequence[Tensor], schedule: DepthSchedule, sublayers_done: int,
                   hidden_size: int, projected: bool) -> "DepthState":
        """The state after ``sublayers_done`` sub-layers from its ``parts()``.

        Args:
            parts: the sources in label order, each [s, b, w].
            schedule: the model's ``DepthSchedule``; it says which parts are completed
                blocks and whether the last one is a partial sum.
            sublayers_done: boundary position j (0..2L).
            hidden_size: d; with ``projected`` the last w - d columns of a part are its key.
            projected: whether the parts carry projected keys.
        """
        site = schedule.state_after(sublayers_done)
        parts = list(parts)
        keys = None
        if projected:
            keys = [p[..., hidden_size:] for p in parts]
            parts = [p[..., :hidden_size] for p in parts]
        n = site.num_completed
        return cls(
            embedding=parts[0],
            embedding_key=keys[0] if keys else None,
            blocks=parts[1 : 1 + n],
            block_keys=keys[1 : 1 + n] if keys else [],
            partial=parts[1 + n] if site.partial is not None else None,
            partial_key=keys[1 + n] if keys and site.partial is not None else None,
            num_sublayers_done=sublayers_done,
        )

    @classmethod
    def unpack(cls, packed: Tensor, schedule: DepthSchedule, sublayers_done: int,
               hidden_size: int, projected: bool) -> "DepthState":
        """Inverse of ``pack`` for the boundary after ``sublayers_done`` sub-layers.

        Args:
            packed: [(S * s), b, w] with S the number of sources the schedule gives that
                boundary; the others as for ``from_parts``.

        Raises:
            ValueError: the rows of ``packed`` are not a multiple of S.
        """
        n_src = schedule.state_after(sublayers_done).num_sources
        if packed.shape[0] % n_src:
            raise ValueError(
                f"packed depth state has {packed.shape[0]} rows, not a multiple of the "
                f"{n_src} sources expected after sub-layer {sublayers_done}"
            )
        return cls.from_parts(packed.chunk(n_src, dim=0), schedule, sublayers_done,
                              hidden_size, projected)

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

    def read_normed(self, query: Tensor, config, site: int, norm: Callable[[Tensor], Tensor],
                    rmsnorm: Optional[Callable[[], Optional[Tuple[Tensor, Optional[float]]]]]
                    = None) -> Tensor:
        """The next sub-layer's input: ``norm(read(query, config, site))``.

        Args:
            query, config, site: as for ``read``.
            norm: the next sub-layer's PreNorm.
            rmsnorm: called only where a merge could apply the norm itself; returns
                (weight, eps) of ``norm`` when it is an RMSNorm a merge can apply (the layer
                passes ``model.norms.fusable_rmsnorm`` of its norm), else None.

        With the two-phase schedule, a read that merges the partial sum applies the RMSNorm
        inside the merge when ``config.fuse_depth_norm``; otherwise ``norm`` runs on the
        read.
        """
        if rmsnorm is not None and config.fuse_depth_norm and self._schedule is not None \
                and self.partial is not None:
            params = rmsnorm()
            if params is not None:
                with torch.profiler.record_function("depth_read"):
                    return self._read_two_phase(query, config, site, params)
        return norm(self.read(query, config, site=site))

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
