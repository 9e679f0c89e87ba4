"""Peak memory and time of one training forward and backward pass of SmolLM2-135M-Instruct on the CPU.

The learner's own log-probability path (policy.packing.token_logprobs) over a right-padded batch of random tokens,
with and without what the ``smollm2-cpu`` preset turns on: LoRA adapters, activation checkpointing, the vocabulary
projection in chunks. Each configuration runs in a fresh process, so each peak is its own (ru_maxrss)::

    python experiments/bench_smollm2_memory.py                       # the table in docs/benchmarks.md
    python experiments/bench_smollm2_memory.py --batch 8 --tokens 600 --checkpointing 1 --lora 16 --chunk 512

Needs the smollm2 extra and requirements-smollm2.txt (docs/models.md); converts the model into
``--cache-dir`` the first time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

GRID = [  # (batch, tokens, checkpointing, lora rank, chunk)
    (4, 600, 0, 16, 512),
    (4, 600, 1, 16, 512),
    (2, 600, 1, 16, 512),
    (8, 600, 1, 16, 512),
]


def one(args) -> dict:
    import torch

    from policy.model import load_policy
    from policy.packing import token_logprobs
    from rail.models import model_dir

    torch.manual_seed(0)
    model, tok = load_policy(model_dir("smollm2-135m", args.cache_dir))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from policy.lora import apply_lora

        model = apply_lora(model, args.lora, 2.0 * args.lora, ["all-linear"])
    model.train()
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    ids = torch.randint(0, 40_000, (args.batch, args.tokens))
    attn = torch.ones_like(ids)
    attn[1:, args.tokens // 2:] = 0  # rows of two lengths, as a training batch has
    t = time.perf_counter()
    lp, _ = token_logprobs(model, ids, attn, tok.pad_token_id or 0, chunk=args.chunk)
    (lp * attn[:, 1:]).sum().backward()
    return {"batch": args.batch, "tokens": args.tokens, "checkpointing": bool(args.checkpointing),
            "lora": args.lora, "chunk": args.chunk, "loaded_gb": round(loaded, 2),
            "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "seconds": round(time.perf_counter() - t, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--checkpointing", type=int, default=1)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--chunk", type=int, default=512, help="learner.logprob_chunk (0: full logits)")
    p.add_argument("--cache-dir", default=".cache/rail/models")
    args = p.parse_args()
    if args.batch is not None:
        print(json.dumps(one(args)), flush=True)
        return
    print("| batch x tokens | activation checkpointing | LoRA rank | chunk | peak RSS (GB) | forward+backward (s) |")
    print("|---|---|---|---|---:|---:|")
    for b, n, ck, r, c in GRID:
        out = subprocess.run([sys.executable, __file__, "--batch", str(b), "--tokens", str(n), "--checkpointing",
                              str(ck), "--lora", str(r), "--chunk", str(c), "--cache-dir", args.cache_dir],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        x = json.loads(out)
        print(f"| {b} x {n} | {'yes' if ck else 'no'} | {r} | {c} | {x['peak_gb']:.2f} | {x['seconds']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
