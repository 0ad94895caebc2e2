"""Model tier: parity with megatron-core's GPTModel, parameter counts, and the whole
LR-AttnRes forward against a hand-written plain-PyTorch reimplementation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    BATCH,
    SEQ,
    VOCAB,
    build_gpt,
    model_parallel_1x1,
    seed_all,
    tiny_batch,
    tiny_config,
)


@pytest.fixture(scope="module", autouse=True)
def mp():
    with model_parallel_1x1():
        yield


def _set_random_queries(model, seed: int, std: float = 2.0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.decoder.depth_queries.values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g) * std)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_ends(num_layers: int, num_blocks: int) -> set:
    return {_ceil_div(2 * num_layers * k, num_blocks) for k in range(1, num_blocks + 1)}


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """The whole LR-AttnRes forward in plain PyTorch, from docs/design.md; only the attention
    and MLP sub-modules (and norms, head) of ``model`` are reused. Returns logits [b, s, V]."""
    cfg = model.config
    dec = model.decoder
    L, d, r = cfg.num_layers, cfg.hidden_size, cfg.key_rank
    eps, tau = cfg.key_norm_eps, cfg.depth_scale
    projected = cfg.residual == "lr_attnres" and cfg.key_type == "projected"
    ends = _block_ends(L, cfg.num_blocks)
    s = tokens.shape[1]

    emb = F.embedding(tokens.t(), model.embedding.word_embeddings.weight)  # [s, b, d]
    rope = model.rotary_pos_emb(s)
    emb_key = _rms(emb @ dec.embedding_key_proj.weight.t(), eps) if projected else emb[..., -r:]
    completed = [(emb, emb_key)]
    partial = None  # (value, key)

    def read(site: int) -> torch.Tensor:
        srcs = completed + ([partial] if partial is not None else [])
        q = dec.depth_queries[str(site)].weight
        logits = torch.stack([tau * (_rms(k, eps) @ q) for _, k in srcs])  # [S, s, b]
        a = torch.softmax(logits, dim=0)
        return sum(a[i].unsqueeze(-1) * v for i, (v, _) in enumerate(srcs))

    for j in range(1, 2 * L + 1):
        layer = dec.layers[(j - 1) // 2]
        x = emb if j == 1 else read(j - 1)
        if j % 2:
            out, bias = layer.self_attention(layer.input_layernorm(x), attention_mask=None,
                                             rotary_pos_emb=rope)
        else:
            out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
        if bias is not None:
            out = out + bias
        if projected:
            value, key = out[..., :d], _rms(out[..., d:], eps)
        else:
            value, key = out, None
        if partial is None:
            partial = (value, key)
        else:
            partial = (partial[0] + value, None if key is None else partial[1] + key)
        if not projected:
            partial = (partial[0], partial[0][..., -r:])
        if j in ends:
            completed.append(partial)
            partial = None
    assert partial is None
    h = dec.final_layernorm(read(2 * L))
    logits, _ = model.output_layer(h)
    return logits.transpose(0, 1).contiguous()


def _params_standard(V: int, d: int, h: int, L: int) -> int:
    per_layer = (
        3 * d * d  # linear_qkv: q, k, v (num_query_groups = heads)
        + d * d  # linear_proj
        + 2 * h * d  # linear_fc1 (SwiGLU: gate and up)
        + h * d  # linear_fc2
        + 2 * d  # input_layernorm, pre_mlp_layernorm
    )
    return V * d + V * d + L * per_layer + d  # embedding, untied head, layers, final norm


@pytest.mark.parametrize("L,d,h", [(2, 32, 64), (3, 64, 96)])
@pytest.mark.parametrize(
    "residual,key,rank",
    [("standard", "sliced", None), ("attnres", "sliced", None), ("lr_attnres", "sliced", 8),
     ("lr_attnres", "sliced", 5), ("lr_attnres", "projected", 8), ("lr_attnres", "projected", 3)],
)
def test_parameter_count_formula(L, d, h, residual, key, rank):
    depth = {} if residual == "standard" else dict(key_type=key, key_rank=rank, num_blocks=2)
    cfg = tiny_config(residual, num_layers=L, hidden_size=d, ffn_hidden_size=h, **depth)
    model = build_gpt(cfg)
    expected = _params_standard(VOCAB, d, h, L)
    if residual == "attnres":
        expected += 2 * L * d
    elif residual == "lr_attnres":
        r = rank
        expected += 2 * L * r  # one [r] query per read site
        if key == "projected":
            expected += d * r  # embedding key Linear(d, r)
            expected += L * (d * r + h * r)  # r extra rows of linear_proj and linear_fc2
    assert sum(p.numel() for p in model.parameters()) == expected


def test_standard_is_bit_identical_to_megatron_gpt():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = tiny_config("standard", dropout=0.1)
    ours = build_gpt(cfg, seed=11)
    stock = build_gpt(cfg, seed=11, cls=GPTModel,
                      spec=get_gpt_layer_local_spec(normalization="RMSNorm"))
    assert type(ours.decoder) is type(stock.decoder)
    ours_params = dict(ours.named_parameters())
    stock_params = dict(stock.named_parameters())
    assert ours_params.keys() == stock_params.keys()
    for name, p in stock_params.items():
        assert torch.equal(ours_params[name], p), name

    tokens, pos, labels = tiny_batch(3)
    outs = {}
    for tag, model in (("ours", ours), ("stock", stock)):
        seed_all(5)
        logits = model(tokens, pos, None)
        seed_all(6)
        loss = model(tokens, pos, None, labels=labels)
        loss.sum().backward()
        outs[tag] = (logits, loss)
    assert outs["ours"][0].shape == (BATCH, SEQ, VOCAB)
    assert torch.equal(outs["ours"][0], outs["stock"][0])
    assert torch.equal(outs["ours"][1], outs["stock"][1])
    for name, p in stock_params.items():
        assert p.grad is not None, name
        assert torch.equal(ours_params[name].grad, p.grad), name


DEPTH_MODES = [
    pytest.param(dict(residual="attnres"), id="attnres"),
    pytest.param(dict(residual="lr_attnres", key_type="sliced", key_rank=8), id="sliced"),
    pytest.param(dict(residual="lr_attnres", key_type="projected", key_rank=8), id="projected"),
]


@pytest.mark.parametrize("num_blocks", [1, 2, 6])
@pytest.mark.parametrize("mode", DEPTH_MODES)
def test_forward_matches_plain_pytorch_reimplementation(mode, num_blocks):
    mode = dict(mode)
    cfg = tiny_config(mode.pop("residual"), num_layers=3, num_blocks=num_blocks, **mode)
    model = build_gpt(cfg, seed=21)
    model.eval()
    _set_random_queries(model, seed=num_blocks)
    tokens, pos, _ = tiny_batch(4)
    with torch.no_grad():
        got = model(tokens, pos, None)
        want = reference_forward(model, tokens)
    assert got.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Random queries actually move the reads away from the plain mean.
    with torch.no_grad():
        for q in model.decoder.depth_queries.values():
            q.weight.zero_()
        assert not torch.allclose(model(tokens, pos, None), got, atol=1e-4)


def test_forward_with_linear_biases_matches_reimplementation():
    cfg = tiny_config("lr_attnres", key_type="projected", key_rank=8, num_blocks=3, bias=True)
    model = build_gpt(cfg, seed=22)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.shape[0] != cfg.hidden_size:
                p.normal_()  # biases (and queries): make them matter
    tokens, pos, _ = tiny_batch(5)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, pos, None), reference_forward(model, tokens),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", DEPTH_MODES)
def test_zero_queries_read_the_plain_mean_of_sources(mode):
    L, N = 3, 4
    mode = dict(mode)
    cfg = tiny_config(mode.pop("residual"), num_layers=L, num_blocks=N, **mode)
    model = build_gpt(cfg, seed=23)
    model.eval()
    dec = model.decoder
    assert all(torch.count_nonzero(q.weight) == 0 for q in dec.depth_queries.values())
    d = cfg.hidden_size
    reads, outputs = {}, {}

    def capture_read(site):
        return lambda mod, args: reads.__setitem__(site, args[0].detach().clone())

    def capture_out(sub):
        return lambda mod, args, out: outputs.__setitem__(sub, out[0][..., :d].detach().clone())

    hooks = []
    for i, layer in enumerate(dec.layers):
        hooks.append(layer.input_layernorm.register_forward_pre_hook(capture_read(2 * i)))
        hooks.append(layer.pre_mlp_layernorm.register_forward_pre_hook(capture_read(2 * i + 1)))
        hooks.append(layer.self_attention.register_forward_hook(capture_out(2 * i + 1)))
        hooks.append(layer.mlp.register_forward_hook(capture_out(2 * i + 2)))
    hooks.append(dec.final_layernorm.register_forward_pre_hook(capture_read(2 * L)))
    tokens, pos, _ = tiny_batch(6)
    with torch.no_grad():
        model(tokens, pos, None)
    for hk in hooks:
        hk.remove()

    ends = sorted(_block_ends(L, N))
    emb = reads[0]  # site 0 is the embedding itself
    for site in range(1, 2 * L + 1):
        done = [e for e in ends if e <= site]
        sources, start = [emb], 1
        for e in done:
            sources.append(sum(outputs[k] for k in range(start, e + 1)))
            start = e + 1
        if start <= site:
            sources.append(sum(outputs[k] for k in range(start, site + 1)))
        mean = torch.stack(sources).mean(0)
        torch.testing.assert_close(reads[site], mean, rtol=0, atol=1e-6, msg=f"site {site}")


def test_every_parameter_gets_a_gradient_also_in_bf16():
    cfg = tiny_config("lr_attnres", key_type="projected", key_rank=8, num_blocks=2)
    model = build_gpt(cfg, seed=24)
    tokens, pos, labels = tiny_batch(7)
    depth_names = [n for n, _ in model.named_parameters()
                   if "depth_queries" in n or "embedding_key_proj" in n]
    assert len(depth_names) == 2 * cfg.num_layers + 1
    # At the zero init every logit is 0 whatever the keys, so key parameters get exactly
    # zero gradient; the queries' gradients are not zero.
    model(tokens, pos, None, labels=labels).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    for q in model.decoder.depth_queries.values():
        assert torch.count_nonzero(q.weight.grad) > 0
    assert torch.count_nonzero(model.decoder.embedding_key_proj.weight.grad) == 0

    model.zero_grad()
    _set_random_queries(model, seed=3, std=1.0)
    model(tokens, pos, None, labels=labels).sum().backward()
    d = cfg.hidden_size
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.count_nonzero(p.grad) > 0, name
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert torch.count_nonzero(p.grad[d:]) > 0, f"key rows of {name}"

    # Under bf16 the queries are bf16 model parameters (megatron's optimizer holds their
    # fp32 main copies); the read's logits and softmax still run in fp32.
    model.zero_grad()
    model.bfloat16()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
    model(tokens, pos, None, labels=labels).sum().backward()
    for q in model.decoder.depth_queries.values():
        assert torch.isfinite(q.weight.grad).all() and torch.count_nonzero(q.weight.grad) > 0


def test_sliced_with_full_rank_equals_attnres():
    d = 32
    attn = build_gpt(tiny_config("attnres", num_blocks=3, hidden_size=d), seed=25)
    _set_random_queries(attn, seed=9)
    sliced = build_gpt(tiny_config("lr_attnres", key_type="sliced", key_rank=d, num_blocks=3,
                                   hidden_size=d), seed=26)
    sliced.load_state_dict(attn.state_dict())
    tokens, pos, labels = tiny_batch(8)
    for m in (attn, sliced):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(sliced(tokens, pos, None), attn(tokens, pos, None),
                                   rtol=0, atol=0)


def test_layer_refuses_standard_and_selective_modules_it_does_not_run():
    from megatron_lrattn.model.layer import LRAttnResLayer
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    submodules = get_lr_attnres_layer_spec(tiny_config("attnres", num_blocks=2)).submodules
    with pytest.raises(ValueError, match="residual standard"):
        LRAttnResLayer(tiny_config("standard"), submodules)
    mlp = tiny_config("attnres", num_blocks=2, recompute_granularity="selective",
                      recompute_modules=["core_attn", "mlp"])
    with pytest.raises(ValueError, match=r"recompute_modules \['mlp'\]"):
        LRAttnResLayer(mlp, submodules)
