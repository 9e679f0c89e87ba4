# Rollout throughput of the rollout engines on the same model and requests: the transformers engine against the
# model's raw batched decode rate on the same shapes (the ceiling for that engine) and, with --engine vllm, the vLLM
# engine beside it; then packed against padded training passes on warm-start batches, a training step's time
# split into generate / score / controller / update, and step_rollouts_over_one_batch: the wall time of all of a
# step's rollouts (base, rounds, fill) over that of the same number of fresh rollouts in one batch.
# Run: .venv/bin/python experiments/bench_rollout.py [--batch 64 128 256] [--steps 5] [--repeats 5]
#      .venv/bin/python experiments/bench_rollout.py --only-step --steps 10 [--step-engine vllm] [--set controller.max_rounds=2] \
#          [--model .cache/rail/warmstart/<key> --tool-format builtin]  (a step's rollouts, one warm-started model)
#      .venv/bin/python experiments/bench_rollout.py --only-step --steps 10 --trace   (each step's stream timeline and chain of rounds)
#      .venv/bin/python experiments/bench_rollout.py --skip-train --threads 1 --clock cpu --repeats 5  (shared machine)
#      .venv/bin/python experiments/bench_rollout.py --engine transformers vllm --batch 64 128 --skip-train
#      .venv/bin/python experiments/make_tiny_model.py /tmp/qwen75m --hidden 768 --layers 12 --heads 12 \
#          --kv-heads 4 --intermediate 2048 && .venv/bin/python experiments/bench_rollout.py --model /tmp/qwen75m \
#          --engine transformers vllm --batch 64 --max-turns 2 --skip-train
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
from rail.config import build_config, parse_set, validate
from rail.envs import ToolRunner, make_env
from rail.policy_setup import make_policy

#: What the rollout rates are timed with: wall-clock time, or with --clock cpu this process's CPU time (at one
#: thread, the work itself, whatever else the machine runs).
clock = time.perf_counter


@torch.no_grad()
def raw_decode_rate(model, batch: int, context: int, new_tokens: int) -> float:
    """Tokens/s of a bare prefill + ``new_tokens`` cached decode steps at batch ``batch`` (no sampling, no tools)."""
    ids = torch.full((batch, context), 5, dtype=torch.long)
    t = clock()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        cache = getattr(out, "cache", None) or out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * new_tokens / (clock() - t)


@torch.no_grad()
def hf_generate_rate(model, renderer, reqs, params) -> dict:
    """Tokens/s of transformers' own ``model.generate`` on the first turn of ``reqs``: the same prompts the engine
    renders (left-padded into one batch), sampled at the same temperature, up to the same tokens per turn, stopped
    at the end-of-turn token. One assistant turn only: ``generate`` runs no tools."""
    prompts = [renderer.prompt(r.system, r.task.prompt, r.env.tools, r.env.describes_tools) for r in reqs]
    L = max(len(p) for p in prompts)
    pad = renderer.pad
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    eos = renderer.tok.eos_token_id
    kw = dict(attention_mask=attn, do_sample=True, temperature=params.temperature, top_p=1.0, top_k=0,
              max_new_tokens=params.max_tokens_per_turn, eos_token_id=eos, pad_token_id=pad)
    model.generate(ids[:8], **{**kw, "attention_mask": attn[:8]})  # warm-up
    torch.manual_seed(1)
    t = clock()
    out = model.generate(ids, **kw)[:, L:]
    seconds = clock() - t
    done = (out == eos).int().cumsum(1)
    generated = int(((done == 0) | ((done == 1) & (out == eos))).sum())  # up to and including each row's end
    return {"hf_generate_tokens_per_s": round(generated / seconds, 1), "hf_generate_tokens": generated}


def packed_vs_padded(model, renderer, envs, cfg, batches: int = 8, repeats: int = 3) -> dict:
    """Seconds per forward + backward of the warm start's loss on its first batches, packed and padded,
    alternated in one run; the share of real tokens in the padded batches."""
    from policy.learner import pad_training_views, sft_loss
    from rail.policy_setup import demonstration_batches

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


def engine_rate(eng, reqs, params) -> tuple[float, list]:
    """Tokens/s of one ``generate`` over ``reqs`` (the same seed every time, so the same tokens), and the
    trajectories."""
    eng.stats.__init__()
    t = clock()
    trajs = eng.generate(reqs, params, seed=1)
    return sum(tr.n_generated for tr in trajs) / (clock() - t), trajs


def transformers_rates(eng, model, reqs, params, repeats: int) -> dict:
    """The engine's tokens/s and the raw decode rate on the same shapes, timed alternately ``repeats`` times: the
    medians, and the median of each pair's share (load from elsewhere on a shared machine then slows both sides
    of a pair alike)."""
    eng.generate(reqs[:8], params, seed=0)  # warm-up
    rates, ceilings = [], []
    for _ in range(repeats):
        rate, trajs = engine_rate(eng, reqs, params)
        gen = sum(tr.n_generated for tr in trajs)
        ctx = int(sum(len(tr.prompt_ids) + len(tr.ids) for tr in trajs) / len(trajs))
        rates.append(rate)
        ceilings.append(raw_decode_rate(model, len(reqs), ctx // 2, max(1, gen // len(reqs))))
    return {"engine_tokens_per_s": round(float(np.median(rates)), 1),
            "raw_decode_tokens_per_s": round(float(np.median(ceilings)), 1),
            "engine_share_of_ceiling": round(float(np.median(np.array(rates) / np.array(ceilings))), 3),
            "generated_tokens": gen, "forward_calls": eng.stats.forward_calls,
            "tool_seconds": round(eng.stats.tool_seconds, 4), "mean_context": ctx}


class StreamTrace:
    """What a step's rollout stream does, recorded by wrapping the trainer's engine and controller.

    ``timeline``: ``+N`` (N episodes join), ``R:MS`` (a turn over R open episodes took MS milliseconds), ``DN`` (the
    controller decided N interventions or refills). :meth:`chains` compares the turns the stream ran after the base
    batch with the longest chain of one group's own rounds: each wave of requests that joined on a group lasts, for
    that group, from the turn it joined to the turn its last episode ended, and a group's chain is the sum over its
    waves. Were each group's next round started as soon as its own episodes ended (not when the whole round had),
    the rounds would still take at least that chain.
    """

    def __init__(self, trainer):
        self.timeline: list[str] = []
        self.spans: dict[int, list] = {}  # handle -> [wave, group, turn joined, turn ended]
        make_stream, decide = trainer.engine.stream, trainer.controller.decide

        def stream(*args, **kw):
            st = make_stream(*args, **kw)
            add, advance = st.add, st.advance
            self.timeline, self.spans, turn, waves = [], {}, [0], [0]

            def traced_add(requests):
                self.timeline.append(f"+{len(requests)}")
                handles = add(requests)
                for h, r in zip(handles, requests):
                    self.spans[h] = [waves[0], r.group, turn[0], None]
                waves[0] += 1
                return handles

            def traced_advance():
                rows, t = st.open, time.perf_counter()
                ended = advance()
                self.timeline.append(f"{rows}:{(time.perf_counter() - t) * 1000:.0f}")
                turn[0] += 1
                for h, _ in ended:
                    self.spans[h][3] = turn[0]
                return ended
            st.add, st.advance = traced_add, traced_advance
            return st

        def traced_decide(*args, **kw):
            out = decide(*args, **kw)
            self.timeline.append(f"D{len(out)}")
            return out
        trainer.engine.stream, trainer.controller.decide = stream, traced_decide

    def chains(self) -> dict:
        """``turns_after_base`` (the turns from the base batch's end to the step's last) and ``longest_group_chain``."""
        spans = [s for s in self.spans.values() if s[3] is not None]
        base_end = max((s[3] for s in spans if s[0] == 0), default=0)
        per: dict[tuple, list] = {}  # (wave, group) -> [first turn joined, last turn ended]
        for wave, group, start, end in spans:
            if wave > 0:
                w = per.setdefault((wave, group), [start, end])
                w[0], w[1] = min(w[0], start), max(w[1], end)
        chain: dict = {}
        for (_, group), (start, end) in per.items():
            chain[group] = chain.get(group, 0) + end - start
        return {"turns_after_base": max((s[3] for s in spans), default=0) - base_end,
                "longest_group_chain": max(chain.values(), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--engine", nargs="+", default=["transformers"], choices=["transformers", "vllm"],
                    help="engines to measure on the same model and requests, in one run")
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: the built-in model, warm-started)")
    ap.add_argument("--tool-format", default="", help="rollout.tool_format (default: builtin, or hermes with --model)")
    ap.add_argument("--max-turns", type=int, default=0, help="rollout.max_turns (0: the config's)")
    ap.add_argument("--steps", type=int, default=5, help="training steps for the time split")
    ap.add_argument("--skip-train", action="store_true", help="only the rollout engines")
    ap.add_argument("--only-step", action="store_true",
                    help="only the training steps: their time split and step_rollouts_over_one_batch")
    ap.add_argument("--step-engine", default="transformers", choices=["transformers", "vllm"],
                    help="rollout.engine of the training steps")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config field, as rail train's --set (e.g. controller.max_rounds=2)")
    ap.add_argument("--trace", action="store_true",
                    help="with the training steps: print each step's stream timeline (requests joining, and every "
                         "turn's open episodes and milliseconds, the controller's decisions per round) and its "
                         "turns_after_base against longest_group_chain (StreamTrace)")
    ap.add_argument("--hf-generate", action="store_true",
                    help="also time transformers' own model.generate on the requests' first turn (single turn, tokens/s)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="time the transformers engine and the raw decode this many times, alternately, and "
                         "report medians (on a shared machine)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time the rollout rates by wall clock or by this process's CPU time (use with --threads 1; "
                         "not for --engine vllm, whose work runs in other processes)")
    a = ap.parse_args()
    global clock
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    sets = [{"tracking": {"uri": ""}, "rollout": {"tool_format": a.tool_format or ("hermes" if a.model else "builtin")}}]
    if a.model:
        sets.append({"model": {"path": a.model}, "warmstart": {"enabled": False}})
    if a.max_turns:  # shorter episodes: only the levels that many turns can solve (a level-L task takes L + 1)
        levels = list(range(1, max(2, a.max_turns)))
        sets.append({"rollout": {"max_turns": a.max_turns}, "env": {"levels": levels}, "eval": {"levels": levels},
                     "warmstart": {"levels": levels, "guided_levels": []}})
    cfg = build_config("default", sets=sets + [parse_set(x) for x in a.sets])
    validate(cfg)
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, _ = make_policy(cfg, envs)
    renderer = ChatRenderer(tok)
    params = SamplingParams(cfg.rollout.temperature, 1.0, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
    vllm_engine = None
    if "vllm" in a.engine:
        from policy.vllm_engine import VLLMEngine
        vllm_engine = VLLMEngine(model, renderer, max_model_len=int(model.config.max_position_embeddings),
                                 kv_cache_bytes=cfg.rollout.vllm_kv_cache_mb * 2**20)
    results = []
    try:
        for B in ([] if a.only_step else a.batch):
            rng = np.random.default_rng(0)
            reqs = []
            for i in range(B):  # the default training mix: every family, levels 1-4
                fam = cfg.env.families[i % len(cfg.env.families)]
                (task,) = envs[fam].sample_tasks(rng, cfg.env.levels, 1)
                reqs.append(RolloutRequest(task=task, env=ToolRunner(envs[fam], cfg.rollout.tool_format),
                                           system=envs[fam].system_prompt()))
            r = {"batch": B, "model_parameters": sum(p.numel() for p in model.parameters())}
            if "transformers" in a.engine:
                r.update(transformers_rates(TransformersEngine(model, renderer, batch_size=B), model, reqs, params,
                                            a.repeats))
            if a.hf_generate:
                r.update(hf_generate_rate(model, renderer, reqs, params))
            if vllm_engine is not None:
                vllm_engine.generate(reqs[:8], params, seed=0)  # warm-up
                rate, trajs = engine_rate(vllm_engine, reqs, params)
                r.update({"vllm_tokens_per_s": round(rate, 1),
                          "vllm_generated_tokens": sum(tr.n_generated for tr in trajs)})
                if "engine_tokens_per_s" in r:
                    r["vllm_over_transformers"] = round(rate / r["engine_tokens_per_s"], 3)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        if vllm_engine is not None:
            vllm_engine.close()
    if a.skip_train:
        print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {a.clock} clock",
                          "rollout": results}))
        return

    packing = None if a.only_step else packed_vs_padded(model, renderer, envs, cfg)
    print(json.dumps(packing), flush=True)

    from rail.train import Trainer
    try:
        from rail.rounds import score
    except ImportError:  # an earlier commit, measured for comparison
        from rail.train import score
    import tempfile
    from pathlib import Path
    cfg.warmstart.enabled = not a.model
    cfg.rollout.engine = a.step_engine
    out = Path(tempfile.mkdtemp())
    (out / "config.json").write_text("{}")
    trainer = Trainer(cfg, out, show_progress=False)
    trace = StreamTrace(trainer) if a.trace else None
    split = {"generate": 0.0, "score": 0.0, "controller": 0.0, "update": 0.0}
    step_rollouts, one_batch = [], []
    for s in range(1, a.steps + 1):
        m = trainer.step(s)
        if trace is not None:
            print(json.dumps({"step": s, "rollouts_s": round(m["time/rollouts_s"], 4), **trace.chains(),
                              "timeline": " ".join(trace.timeline)}), flush=True)
        for k in split:
            split[k] += m[f"time/{k}_s"]
        # all of the step's rollouts (base, rounds, fill, scored) against the same number of fresh rollouts
        # generated and scored in one batch, on the same engine, right after it
        step_rollouts.append(m.get("time/rollouts_s", m["time/generate_s"] + m["time/score_s"] + m["time/controller_s"]))
        n = int(m["budget/step_base"] + m["budget/step_intervention"])
        g = cfg.budget.group_size
        tasks = trainer._sample_tasks(10_000 + s, -(-n // g))
        reqs = [RolloutRequest(task=t, env=trainer.runners[f], system=trainer.envs[f].system_prompt(), group=i)
                for i, (f, t) in enumerate(tasks) for _ in range(g)][:n]
        t = time.perf_counter()
        score(trainer.engine.generate(reqs, trainer.params, seed=s), tasks, trainer.envs)
        one_batch.append(time.perf_counter() - t)
    tot = sum(split.values())
    step = {"step_seconds": round(tot / a.steps, 3),
            **{f"{k}_share": round(v / tot, 3) for k, v in split.items()},
            "step_rollouts_seconds": round(float(np.mean(step_rollouts)), 3),
            "one_batch_seconds": round(float(np.mean(one_batch)), 3),
            "step_rollouts_over_one_batch": round(float(np.sum(step_rollouts) / np.sum(one_batch)), 3)}
    print(json.dumps(step), flush=True)
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {a.clock} clock",
                      "rollout": results, "packing": packing, "train_step": step}))


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from re-running this script
    main()
