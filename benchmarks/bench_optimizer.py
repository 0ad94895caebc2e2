"""The optimizer step after the gradient norm, over a preset's parameter tensors: megatron-core's
passes against the one kernel of ``megatron_lrattn.ops.adamw``, and the copy bandwidth.

    python benchmarks/bench_optimizer.py --presets 0.5b 1b 4b --csv optimizer.csv

Per preset, the fp32 main weights, gradients and moments and the bf16 model weights of every
parameter tensor of the model (embedding, output layer, final norm, per layer QKV, output
projection, fc1, fc2 and two norms; vocabulary ``--vocab-size``), and four candidates timed in
interleaved rounds:

- ``megatron clipped``: what megatron-core's ``Float16OptimizerWithFloat16Params`` does when
  the gradient norm is above ``--clip-grad``: the gradients scaled in place, torch's fused
  AdamW, the main weights copied into the bf16 model weights (42 bytes a parameter);
- ``megatron unclipped``: the same without the scaling (34 bytes);
- ``one kernel``: ``multi_tensor_adamw`` with the clipping factor (30 bytes either way);
- ``copy``: a 2 GiB bf16 copy, the bandwidth the others are compared with.

Bandwidth: bytes a parameter as above x parameters / time. ``--smoke`` runs the harness on
CPU under the Triton interpreter (tiny preset, vocabulary 256, no real timings). One step of
the one kernel is compared with one step of ``megatron clipped`` from the same state before
the timing; a mismatch stops the run after its rows are written.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from megatron_lrattn.ops import adamw  # noqa: E402
from megatron_lrattn.training.presets import PRESETS  # noqa: E402

FIELDS = bc.META_FIELDS + ["preset", "params", "tensors", "candidate", "bytes_per_param",
                           "median_ms", "tb_per_s", "pct_copy", "vs_megatron_clipped", "check"]
BYTES = {"megatron clipped": 42, "megatron unclipped": 34, "one kernel": 30}


def shapes(preset: str, vocab: int):
    p = PRESETS[preset]
    d, f, layers = p["hidden_size"], p["ffn_hidden_size"], p["num_layers"]
    heads = p["num_attention_heads"]
    groups = p.get("num_query_groups") or heads
    qkv = (heads + 2 * groups) * (d // heads)
    per_layer = [(qkv, d), (d, d), (2 * f if p.get("swiglu", True) else f, d), (d, f), (d,), (d,)]
    return [(vocab, d), (vocab, d), (d,)] + per_layer * layers


def candidates(preset: str, vocab: int, device: str):
    """{name: callable} over one set of tensors per candidate (each updates its own)."""
    sh = shapes(preset, vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda s, scale=1.0: torch.randn(s, device=device, generator=gen) * scale  # noqa: E731
    ref = [torch.nn.Parameter(rand(s)) for s in sh]
    for p in ref:
        p.grad = rand(p.shape, 1e-3)
    opt = torch.optim.AdamW(ref, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=device == "cuda")
    opt.step()   # the moments exist from here on, as in a running job
    model = [p.detach().to(torch.bfloat16) for p in ref]
    grads = [p.grad for p in ref]

    def megatron(clip: bool):
        def step():
            if clip:
                torch._foreach_mul_(grads, 0.5)
            opt.step()
            torch._foreach_copy_(model, [p.detach() for p in ref])
        return step

    # the one kernel's tensors start as copies of the reference's (moments and step count
    # after its first step), so that one step of each can be compared before timing
    ours = [adamw.AdamWTensors(param=p.detach().clone(), grad=p.grad.clone(),
                               exp_avg=opt.state[p]["exp_avg"].clone(),
                               exp_avg_sq=opt.state[p]["exp_avg_sq"].clone(),
                               step=opt.state[p]["step"].clone().to(device),
                               model=torch.empty(p.shape, dtype=torch.bfloat16, device=device),
                               group=0) for p in ref]
    table = adamw.AdamWTable()
    hyper = adamw.hyper_table(opt.param_groups, 0.5, device)
    n = sum(p.numel() for p in ref)
    fns = {"megatron clipped": megatron(True),
                        "megatron unclipped": megatron(False),
                        "one kernel": lambda: adamw.multi_tensor_adamw(ours, hyper, table)}
    fns["megatron clipped"]()
    fns["one kernel"]()
    err = max(((t.param - p.detach()).abs().max() / p.detach().abs().max()).item()
              for t, p in zip(ours, ref))
    bf16 = all(torch.equal(t.model, t.param.to(torch.bfloat16)) for t in ours)
    check = (f"ok: weights within {err:.1e} of torch's step, bf16 copy exact"
             if err < 1e-5 and bf16 else f"MISMATCH: weights {err:.1e}, bf16 copy exact {bf16}")
    return n, len(sh), check, fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["0.5b", "1b"])
    ap.add_argument("--vocab-size", type=bc.positive_int, default=32768)
    ap.add_argument("--rounds", type=bc.positive_int, default=bc.ROUNDS,
                    help="interleaved timing rounds per candidate (median taken)")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "optimizer.csv"))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU run of the harness under TRITON_INTERPRET=1 (no real timings)")
    args = ap.parse_args()
    bc.check_csv(ap, "--csv", args.csv)
    if args.smoke:
        args.presets, args.vocab_size = ["tiny"], min(args.vocab_size, 256)
    copy_tbps, meta = bc.start("bench_optimizer", args.smoke, args.rounds)
    print(f"{'preset':8} {'candidate':20} {'ms':>9} {'TB/s':>6} {'% copy':>7} {'vs clipped':>10}")
    for preset in args.presets:
        n, count, check, fns = candidates(preset, args.vocab_size, bc.DEVICE)
        print(f"{preset}: {n:,} parameters in {count} tensors; {check}", flush=True)
        ms = bc.bench_rounds(fns, rep=100)
        rows = []
        for name, t in ms.items():
            tbps = BYTES[name] * n / t / 1e9
            rows.append(dict(meta, preset=preset, params=n, tensors=count, candidate=name,
                             bytes_per_param=BYTES[name], median_ms=round(t, 4),
                             tb_per_s=round(tbps, 4),
                             pct_copy=round(bc.pct_copy(BYTES[name] * n, t, copy_tbps), 1),
                             vs_megatron_clipped=round(t / ms["megatron clipped"], 4),
                             check=check))
            print(f"{preset:8} {name:20} {t:9.3f} {tbps:6.2f} {rows[-1]['pct_copy']:7.1f} "
                  f"{rows[-1]['vs_megatron_clipped']:10.3f}", flush=True)
        bc.append_rows(args.csv, FIELDS, rows)
        if not check.startswith("ok"):
            sys.exit(f"bench_optimizer: {preset}: {check}")
        del fns
        if bc.DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
