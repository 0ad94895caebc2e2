"""Continued training of an exported Hugging Face model under DeepSpeed ZeRO (or plain
PyTorch for comparison).

The folder is what ``lrattn-convert-hf`` writes: a ``LlamaForCausalLM`` for the standard
residual, our ``lrattn`` type (remote code in the folder) for AttnRes and LR-AttnRes. The
batches are seeded Zipf-distributed tokens (the same for every mode), so that the losses of ZeRO-2,
ZeRO-3 and plain PyTorch can be compared step by step.

    # one GPU (torchrun / the deepspeed launcher set the rank variables on several); without
    # CUDA it runs on the CPU (DeepSpeed's CPU accelerator, gloo)
    python examples/hf_deepspeed.py --model export/ --zero 2 --steps 20 --json zero2.json
    python examples/hf_deepspeed.py --model export/ --zero 3 --steps 20 --json zero3.json
    python examples/hf_deepspeed.py --model export/ --zero none --steps 20 --json plain.json

DeepSpeed runs bf16 weights with fp32 master weights in its optimizer (torch's AdamW, no
compiled DeepSpeed ops); the plain run keeps fp32 weights under bf16 autocast with torch's
AdamW. Both clip the gradient norm at ``--clip-grad``. The depth queries of AttnRes and
LR-AttnRes are fp32 in our model whatever its dtype; they form a parameter group of their
own (no weight decay), and under ZeRO-3, which keeps every parameter in one flat buffer of
one dtype, they are bf16 like the other weights. Needs ``pip install deepspeed`` (not a
dependency of megatron_lrattn).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf_deepspeed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="exported HF folder")
    p.add_argument("--zero", choices=("none", "2", "3"), default="2",
                   help="ZeRO stage, or none for plain PyTorch (default: 2)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--seq-length", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="(default: 0.1)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="(default: 1.0)")
    p.add_argument("--seed", type=int, default=1234, help="batches and dropout (default: 1234)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when there is a GPU, else the CPU (DeepSpeed's CPU "
                        "accelerator over gloo) (default: auto)")
    p.add_argument("--json", default=None, help="write the losses and settings here")
    return p


def _batches(vocab: int, args, device):
    """Seeded tokens drawn from a Zipf law over the vocabulary (token i with weight
    1 / (i + 1)): like text, a model can learn their frequencies, so the loss falls."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    for _ in range(args.steps):
        yield torch.multinomial(weights, args.batch_size * (args.seq_length + 1), replacement=True,
                                generator=g).view(args.batch_size, -1).to(device)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for name, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--seq-length", args.seq_length)):
        if value < 1:
            print(f"hf_deepspeed.py: error: {name} {value}: must be at least 1", file=sys.stderr)
            return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"hf_deepspeed.py: error: --model {args.model}: no config.json (not an HF folder)",
              file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM

    if args.device == "cuda" and not torch.cuda.is_available():
        print("hf_deepspeed.py: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # fp32 weights (the dtype keyword changed names across transformers versions)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).float()
    vocab = model.config.vocab_size
    # Our depth queries (modeling_lrattn.DepthQuery): fp32 unless told otherwise.
    queries = [m for m in model.modules() if hasattr(m, "keep_fp32")]
    if args.zero == "3":
        for m in queries:
            m.keep_fp32 = False
    in_queries = {id(p) for m in queries for p in m.parameters()}
    params = [p for p in model.parameters() if id(p) not in in_queries]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if in_queries:
        groups.append({"params": [p for m in queries for p in m.parameters()],
                       "weight_decay": 0.0})

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if args.zero == "none":
        model.to(device)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)

        def step(tokens):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        import deepspeed

        for key, default in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"),
                             ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, default)
        deepspeed.init_distributed()
        world = int(os.environ["WORLD_SIZE"])
        config = {
            "train_batch_size": args.batch_size * world,
            "train_micro_batch_size_per_gpu": args.batch_size,
            "gradient_clipping": args.clip_grad,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": int(args.zero)},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9,
        }
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(tokens):
            loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            return loss

    losses, times = [], []
    for i, tokens in enumerate(_batches(vocab, args, device)):
        sync()
        t0 = time.perf_counter()
        loss = float(step(tokens).detach())
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        print(f"step {i + 1}/{args.steps}  loss {loss:.4f}  {times[-1] * 1e3:.1f} ms", flush=True)
    report = {"model": os.path.abspath(args.model), "zero": args.zero, "losses": losses,
              "step_s": times, "device": str(device),
              "peak_memory_bytes": (torch.cuda.max_memory_allocated()
                                    if device.type == "cuda" else None),
              "settings": {k: v for k, v in vars(args).items() if k not in ("json",)}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
