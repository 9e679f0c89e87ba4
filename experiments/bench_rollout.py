# Rollout throughput of the transformers engine against the model's raw batched decode rate on the same
# shapes (the ceiling for this engine), packed against padded training passes on warm-start batches, and a
# training step's time split into generate / score / controller / update.
# Run: .venv/bin/python experiments/bench_rollout.py [--batch 64 128 256] [--steps 5]
"""Prints one JSON line per measurement and a final JSON summary line."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import time

import numpy as np
import torch

from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.tokenizer import ChatRenderer
from rail.config import build_config
from rail.envs import ToolRunner, make_env
from rail.policy_setup import make_policy


@torch.no_grad()
def raw_decode_rate(model, batch: int, context: int, new_tokens: int, pad: int) -> float:
    """Tokens/s of a bare prefill + ``new_tokens`` cached decode steps at batch ``batch`` (no sampling, no tools)."""
    ids = torch.full((batch, context), 5, dtype=torch.long)
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        cache = getattr(out, "cache", None) or out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * new_tokens / (time.perf_counter() - t)


def packed_vs_padded(model, renderer, envs, cfg, batches: int = 8, repeats: int = 3) -> dict:
    """Seconds per forward + backward of the warm start's loss on its first batches, packed and padded,
    alternated in one run; the share of real tokens in the padded batches."""
    from policy.learner import pad_training_views
    from rail.policy_setup import demonstration_batches, sft_loss

    captured = list(itertools.islice(demonstration_batches(renderer, envs, cfg), batches))
    real = sum(len(t.prompt_ids) + len(t.ids) for b in captured for t in b)
    padded = sum(pad_training_views(b, renderer.pad)[0].numel() for b in captured)
    m = copy.deepcopy(model).train()
    times = {"packed": 0.0, "padded": 0.0}
    for _ in range(repeats):
        for mode in ("packed", "padded"):
            m._rail_packing_ok = None if mode == "packed" else False  # None: check (and pack) again
            t = time.perf_counter()
            for b in captured:
                m.zero_grad()
                sft_loss(m, b, renderer.pad).backward()
            times[mode] += time.perf_counter() - t
    n = repeats * len(captured)
    return {"real_token_share_padded": round(real / padded, 3),
            "padded_s_per_batch": round(times["padded"] / n, 4), "packed_s_per_batch": round(times["packed"] / n, 4),
            "packed_speedup": round(times["padded"] / times["packed"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=5, help="training steps for the time split")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = build_config("default", sets=[{"tracking": {"uri": ""}}])
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, _ = make_policy(cfg, envs)
    renderer = ChatRenderer(tok)
    params = SamplingParams(cfg.rollout.temperature, 1.0, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
    results = []
    for B in a.batch:
        rng = np.random.default_rng(0)
        reqs = []
        for i in range(B):  # the default training mix: both families, levels 1-4
            fam = cfg.env.families[i % len(cfg.env.families)]
            (task,) = envs[fam].sample_tasks(rng, cfg.env.levels, 1)
            reqs.append(RolloutRequest(task=task, env=ToolRunner(envs[fam]), system=envs[fam].system_prompt()))
        eng = TransformersEngine(model, renderer, batch_size=B)
        eng.generate(reqs[:8], params, seed=0)  # warm-up
        eng.stats.__init__()
        t = time.perf_counter()
        trajs = eng.generate(reqs, params, seed=1)
        dt = time.perf_counter() - t
        gen = sum(tr.n_generated for tr in trajs)
        ctx = int(sum(len(tr.prompt_ids) + len(tr.ids) for tr in trajs) / len(trajs))
        steps_per_row = max(1, gen // B)
        ceiling = raw_decode_rate(model, B, ctx // 2, steps_per_row, renderer.pad)
        r = {"batch": B, "engine_tokens_per_s": round(gen / dt, 1), "raw_decode_tokens_per_s": round(ceiling, 1),
             "engine_share_of_ceiling": round(gen / dt / ceiling, 3), "generated_tokens": gen,
             "forward_calls": eng.stats.forward_calls, "tool_seconds": round(eng.stats.tool_seconds, 4),
             "mean_context": ctx}
        print(json.dumps(r), flush=True)
        results.append(r)

    packing = packed_vs_padded(model, renderer, envs, cfg)
    print(json.dumps(packing), flush=True)

    from rail.train import Trainer
    import tempfile
    from pathlib import Path
    cfg.warmstart.enabled = True
    out = Path(tempfile.mkdtemp())
    (out / "config.json").write_text("{}")
    trainer = Trainer(cfg, out, show_progress=False)
    split = {"generate": 0.0, "score": 0.0, "controller": 0.0, "update": 0.0}
    for s in range(1, a.steps + 1):
        m = trainer.step(s)
        for k in split:
            split[k] += m[f"time/{k}_s"]
    tot = sum(split.values())
    step = {"step_seconds": round(tot / a.steps, 3),
            **{f"{k}_share": round(v / tot, 3) for k, v in split.items()}}
    print(json.dumps(step), flush=True)
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                      "rollout": results, "packing": packing, "train_step": step}))


if __name__ == "__main__":
    main()
