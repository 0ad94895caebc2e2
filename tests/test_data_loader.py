"""The data loader (``data/loader``: sample order, background workers, the old preprocess
name), ``--mock-data`` (``data/mock``) and document masking down to the attention core."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, tiny_config


class _Numbered(torch.utils.data.Dataset):
    """Sample i is a dict of tensors that name i (tokens i*10 .. i*10+3)."""

    def __init__(self, n: int = 50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.arange(4) + 10 * i, "loss_mask": torch.ones(4)}


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_sampler_is_megatrons_order_per_rank():
    from megatron_lrattn.data.loader import RankBatchSampler

    # Megatron's MegatronPretrainingSampler: rank r takes [base + r*mbs, base + (r+1)*mbs)
    # of every global chunk of mbs*dp samples, starting at the consumed samples.
    it = iter(RankBatchSampler(n=100, start_sample=8, micro_batch_size=2, dp_rank=1, dp=3))
    assert _take(it, 3) == [[10, 11], [16, 17], [22, 23]]
    wrap = iter(RankBatchSampler(n=10, start_sample=8, micro_batch_size=2, dp_rank=0, dp=1))
    assert _take(wrap, 2) == [[8, 9], [0, 1]]


def test_workers_give_the_same_batches_as_the_loop():
    from megatron_lrattn.data.loader import rank_batches

    ds = _Numbered()
    inline = _take(rank_batches(ds, 6, 3, dp_rank=1, dp=2), 5)
    background = _take(rank_batches(ds, 6, 3, dp_rank=1, dp=2, num_workers=2), 5)
    assert [b["tokens"][:, 0].tolist() for b in inline] == [
        [90, 100, 110], [150, 160, 170], [210, 220, 230], [270, 280, 290], [330, 340, 350]]
    for a, b in zip(inline, background):
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key])


def test_old_preprocess_name_is_read_with_a_deprecation_line(tmp_path, caplog):
    from megatron_lrattn.data.loader import resolve_data_path

    old = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    new = str(tmp_path / "corpus_text_document")
    with caplog.at_level(logging.WARNING):
        assert resolve_data_path(["0.5", new]) == ["0.5", str(old)]
    assert len(caplog.records) == 1 and "rename" in caplog.records[0].getMessage()
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    assert resolve_data_path([new]) == [new]  # the Megatron name wins when it exists
    missing = str(tmp_path / "other_text_document")
    assert resolve_data_path([missing]) == [missing]


def test_mock_data_samples_and_document_masks(tmp_path):
    from megatron_lrattn.data.mock import MockTokenizer, build_mock_datasets

    tok = MockTokenizer(64)
    train, valid, _ = build_mock_datasets(
        tok, 512, num_samples=(8, 4, 2), cache_dir=tmp_path, reset_position_ids=True,
        reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True)
    assert len(train) >= 8 and len(valid) >= 4
    found = False
    for i in range(8):
        s = train[i]
        tokens = s["tokens"].numpy()
        assert tokens.max() < 64 and s["labels"].shape == (512,)
        eods = np.flatnonzero(tokens == tok.eod)
        assert (s["loss_mask"].numpy()[eods] == 0).all()
        if len(eods) and eods[0] < 510:
            e = int(eods[0])
            found = True
            # positions restart after the end of a document
            assert s["position_ids"][e + 1] == 0
            mask = s["attention_mask"][0]  # True = masked
            assert mask[e + 1, e] and not mask[e, e] and not mask[e + 1, e + 1]
    assert found, "no sample with an end-of-document token inside it"


def test_document_mask_reaches_the_local_attention_core():
    """With a document mask the tokens after an end of document see nothing before it:
    their outputs equal those of the second document alone, and the first document's are
    unchanged. The depth read is per token and needs no mask."""
    with model_parallel_1x1():
        model = build_gpt(tiny_config("lr_attnres", num_blocks=2)).eval()
        s, cut = 16, 6
        tokens = torch.randint(0, 128, (1, s), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(s).unsqueeze(0)
        causal = ~torch.tril(torch.ones(s, s, dtype=torch.bool))
        doc = causal.clone()
        doc[cut:, :cut] = True
        with torch.no_grad():
            plain = model(tokens, pos, causal[None, None])
            masked = model(tokens, pos, doc[None, None])
            second = model(tokens[:, cut:], pos[:, cut:], causal[None, None, cut:, cut:])
        assert torch.allclose(masked[:, :cut], plain[:, :cut], atol=1e-6)
        assert not torch.allclose(masked[:, cut:], plain[:, cut:], atol=1e-4)
        assert torch.allclose(masked[:, cut:], second, atol=1e-5)


@pytest.mark.parametrize("impl, cuda, core", [("local", True, "SDPA core"),
                                              ("transformer_engine", False, "TEDotProductAttention")])
def test_reset_attention_mask_is_refused_where_the_core_is_causal_only(monkeypatch, impl, cuda,
                                                                       core):
    from argparse import Namespace

    from megatron_lrattn.training import arguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = Namespace(mock_data=False, data_path=None, reset_attention_mask=True,
                     transformer_impl=impl, num_workers=None)
    with pytest.raises(arguments.ArgumentError) as e:
        arguments._check_data_flags(args)
    assert "--reset-attention-mask" in str(e.value) and core in str(e.value)
    args.transformer_impl, args.reset_attention_mask = "local", False
    arguments._check_data_flags(args)
    assert args.num_workers == (2 if cuda else 0)
