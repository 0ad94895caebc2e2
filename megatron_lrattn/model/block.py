"""Transformer block that owns the per-microbatch depth-source cache."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, make_viewless_tensor
from torch import Tensor, nn

from megatron_lrattn.depth.pipeline import chunk_ends_from_config
from megatron_lrattn.depth.schedule import schedule_from_config
from megatron_lrattn.depth.stage_cache import StageCache, assemble_input, chunk_plan, pack_output
from megatron_lrattn.depth.state import DepthState, rms_normalize, uses_two_phase
from megatron_lrattn.model.layer import DepthQuery


class LRAttnResBlock(TransformerBlock):
    """``TransformerBlock`` for depth attention.

    The stage's first layer starts from the embedding (first stage) or from the packed
    depth state received from the previous stage; every layer adds its two outputs to the
    ``DepthState``; the last stage reads site 2L before the final norm, other stages send the
    packed state on. ``depth_queries`` holds one query per read site of this chunk,
    keyed by the global site number (``depth_queries.<site>.weight``), so a checkpoint does
    not depend on the pipeline layout.

    Full activation recomputation (``config.recompute_granularity == 'full'``, training
    only) runs groups of layers inside megatron-core's ``tensor_parallel.checkpoint``: the
    group's inputs are the tensors of the ``DepthState`` that entered it
    (``DepthState.tensors``: sources, keys, cached phase-1 reads), saved as they are; the
    forward keeps nothing inside the group, and the backward reruns the group from those
    tensors (megatron's checkpoint restores the RNG states, so dropout repeats). ``uniform``
    checkpoints every ``recompute_num_layers`` consecutive layers of the chunk as one unit;
    ``block`` checkpoints each of the chunk's first ``recompute_num_layers`` layers alone and
    runs the rest normally, as megatron-core's ``TransformerBlock`` does.

    ``GPTModel`` constructs a plain ``TransformerBlock``; ``adopt`` turns that block (whose
    layers were already built from our spec) into this class and adds the block-level
    depth parameters, so nothing is built twice.
    """

    @classmethod
    def adopt(cls, block: TransformerBlock) -> "LRAttnResBlock":
        """Convert a freshly built ``TransformerBlock`` in place and return it."""
        if type(block) is not TransformerBlock:
            raise TypeError(f"expected a TransformerBlock, got {type(block).__name__}")
        block.__class__ = cls
        block._init_depth()
        return block

    def _init_depth(self) -> None:
        config = self.config
        self.schedule = schedule_from_config(config)
        sp = config.sequence_parallel
        sites = []
        for layer in self.layers:
            sites += [s for s in (2 * layer.layer_number - 2, 2 * layer.layer_number - 1) if s]
        if self.post_process:
            sites.append(self.schedule.num_sites)
        self.depth_queries = nn.ModuleDict({str(s): DepthQuery(config.key_rank, sp) for s in sites})
        self.embedding_key_proj = None
        if self.pre_process and config.projected_keys:
            self.embedding_key_proj = nn.Linear(config.hidden_size, config.key_rank, bias=False)
            config.init_method(self.embedding_key_proj.weight)
            self.embedding_key_proj.weight.sequence_parallel = sp
        first = self.layers[0].layer_number if len(self.layers) else None
        self._sublayers_before = 2 * (first - 1) if first is not None else None
        self.packed_input: Optional[Tensor] = None
        # Interleaved pipeline: what this chunk receives, sends and caches, and the
        # rank-local cache shared by the rank's chunks (``link_model_chunks``).
        self.chunk_plan = None
        self.stage_cache: Optional[StageCache] = None
        if getattr(config, "virtual_pipeline_model_parallel_size", None):
            from megatron.core import parallel_state

            pp = config.pipeline_model_parallel_size
            chunk = self.vp_stage * pp + parallel_state.get_pipeline_model_parallel_rank()
            self.chunk_plan = chunk_plan(self.schedule, chunk_ends_from_config(config), pp, chunk)

    def set_input_tensor(self, input_tensor: Optional[Tensor]) -> None:
        """Receive the packed depth state from the previous pipeline stage.

        The packed tensor is kept in ``packed_input``; ``input_tensor`` becomes its first
        source (a [s, b, w] view), because ``GPTModel`` sizes the rotary embedding from
        ``decoder.input_tensor.size(0)``.
        """
        self.packed_input = input_tensor
        if input_tensor is None or self._sublayers_before is None:
            self.input_tensor = input_tensor
            return
        if self.chunk_plan is not None:
            n_src = len(self.chunk_plan.received)
        else:
            n_src = self.schedule.state_after(self._sublayers_before).num_sources
        self.input_tensor = input_tensor[: input_tensor.shape[0] // n_src]

    def _query(self, site: int) -> Tensor:
        # through the module call, so DDP's pre-hook waits for an overlapped param gather
        return self.depth_queries[str(site)]()

    def _start_state(self, hidden_states: Tensor) -> DepthState:
        if self.pre_process:
            key = None
            if self.embedding_key_proj is not None:
                key = rms_normalize(self.embedding_key_proj(hidden_states), self.config.key_norm_eps)
            return DepthState(embedding=hidden_states, embedding_key=key)
        wire = (self.schedule, self._sublayers_before, self.config.hidden_size,
                self.config.projected_keys)
        if self.chunk_plan is not None:
            received = self.packed_input.chunk(len(self.chunk_plan.received), dim=0)
            return DepthState.from_parts(assemble_input(self.chunk_plan, received,
                                                        self.stage_cache), *wire)
        return DepthState.unpack(self.packed_input, *wire)

    def _pack(self, state: DepthState) -> Tensor:
        if self.chunk_plan is not None:
            return pack_output(self.chunk_plan, state.parts(), self.stage_cache)
        return state.pack()

    def recompute_groups(self) -> List[Tuple[int, int, bool]]:
        """The chunk's layers as (start, end, recompute) runs of local layer indices, from
        ``config.recompute_method`` / ``recompute_num_layers`` under full recompute (one
        run without recompute otherwise)."""
        n, c = len(self.layers), self.config
        k = c.recompute_num_layers
        if c.recompute_granularity != "full" or not n:
            return [(0, n, False)]
        if c.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        groups = [(i, i + 1, True) for i in range(min(k, n))]
        return groups + ([(k, n, False)] if k < n else [])

    def _run_layers(self, state: DepthState, start: int, end: int, tensor_args,
                    packed_seq_params) -> DepthState:
        mask, rope, cos, sin, bias = tensor_args
        for layer in self.layers[start:end]:
            first_site = 2 * layer.layer_number - 2
            state = layer(
                state,
                self._query(first_site) if first_site else None,
                self._query(first_site + 1),
                attention_mask=mask,
                rotary_pos_emb=rope,
                rotary_pos_cos=cos,
                rotary_pos_sin=sin,
                attention_bias=bias,
                packed_seq_params=packed_seq_params,
            )
        return state

    def _checkpointed_layers(self, state: DepthState, start: int, end: int, tensor_args,
                             packed_seq_params) -> DepthState:
        """``_run_layers`` inside megatron's checkpoint, given the state's flat tensors.

        The checkpointed function returns the tensors of the state after the group, with
        None for those it passes through unchanged (an autograd Function must not return
        its inputs); they are taken from the incoming state.
        """
        flat, layout = state.tensors()
        n = len(flat)
        out = {}

        def run(*args):
            inputs = args[:n]
            after = self._run_layers(state.with_tensors(inputs, layout), start, end,
                                     args[n:], packed_seq_params)
            out_flat, out["layout"] = after.tensors()
            index = {id(t): i for i, t in enumerate(inputs) if t is not None}
            out["kept"] = [None if t is None else index.get(id(t)) for t in out_flat]
            return tuple(None if k is not None else t for t, k in zip(out_flat, out["kept"]))

        made = tensor_parallel.checkpoint(run, False, *flat, *tensor_args)
        if isinstance(made, Tensor):
            made = (made,)
        merged = [flat[k] if k is not None else t for t, k in zip(made, out["kept"])]
        return state.with_tensors(merged, out["layout"])

    def forward(
        self,
        hidden_states,
        attention_mask: Optional[Tensor],
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[Tensor] = None,
        padding_mask: Optional[Tensor] = None,
        *,
        inference_params=None,
        dynamic_inference_decode_only: Optional[bool] = None,
    ) -> Tensor:
        """Run the stage's layers on the depth state.

        Returns:
            The final-normed read of site 2L [s, b, d] on the last stage, otherwise the
            packed depth state (``DepthState.pack``).
        """
        unsupported = {
            "context": context,
            "rotary_pos_cos_sin": rotary_pos_cos_sin,
            "inference_context": inference_context or inference_params,
        }
        bad = [k for k, v in unsupported.items() if v is not None]
        if bad:
            raise NotImplementedError(
                f"LRAttnResBlock does not support {', '.join(bad)}; generation runs through "
                "the Hugging Face export (lrattn-convert-hf)"
            )
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        state = self._start_state(hidden_states)
        if uses_two_phase(self.config, state.embedding.device):
            state.use_two_phase(self.schedule, {int(s): q() for s, q in self.depth_queries.items()})
        tensor_args = (attention_mask, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                       attention_bias)
        for start, end, recompute in self.recompute_groups():
            if recompute and self.training:
                state = self._checkpointed_layers(state, start, end, tensor_args,
                                                  packed_seq_params)
            else:
                state = self._run_layers(state, start, end, tensor_args, packed_seq_params)
        if not self.post_process:
            return make_viewless_tensor(inp=self._pack(state), requires_grad=True,
                                        keep_graph=True)
        out = state.read(self._query(self.schedule.num_sites), self.config,
                         site=self.schedule.num_sites)
        if self.final_layernorm is not None:
            out = self.final_layernorm(out)
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)


def link_model_chunks(chunks) -> Optional[StageCache]:
    """Give the model chunks of one pipeline rank (interleaved schedule) one shared
    ``StageCache``, so a chunk reads the sources its rank saw in its previous chunk.

    Args:
        chunks: this rank's models, one per virtual stage, before or after wrapping
            (``module`` attributes are followed to the ``GPTModel``).

    Returns:
        The cache, or None when no chunk has an ``LRAttnResBlock`` decoder.
    """
    cache = StageCache()
    linked = False
    for chunk in chunks:
        while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
            chunk = chunk.module
        decoder = getattr(chunk, "decoder", None)
        if isinstance(decoder, LRAttnResBlock):
            decoder.stage_cache = cache
            linked = True
    return cache if linked else None
