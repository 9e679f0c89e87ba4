# Builds "your own model" in miniature: a random Qwen2 checkpoint (Hugging Face format, safetensors) with a
# byte-level BPE tokenizer trained here with `tokenizers` on the built-in environments' texts, and a
# Qwen2.5-style chat template that lists tools (`apply_chat_template(..., tools=...)`) and reads and writes
# <tool_call> blocks. It stands in for a real checkpoint wherever nothing can be downloaded: the tests train on
# it with `rollout.tool_format = "hermes"`, and docs/models.md uses it.
# Run: .venv/bin/python experiments/make_tiny_model.py DIR [--hidden 64 --layers 2 --vocab 2048] [--bfcl]
#      .venv/bin/rail train --preset smoke --set model.path=DIR --set rollout.tool_format=hermes
# --bfcl (needs the bfcl extra) also trains the tokenizer on BFCL's tool docs and questions, so a BFCL prompt is
# about half as many tokens (docs/environments.md).
"""Writes DIR/config.json, model.safetensors and the tokenizer files; prints one JSON line describing them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

#: Qwen2.5-style: the system message carries the tool list; tool results come back inside a user turn as
#: <tool_response> blocks; an assistant message's `tool_calls` are written as <tool_call> blocks. The engine
#: writes calls as the assistant's text, which this template renders verbatim.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nThese functions are available. Their signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call>:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}{{- m['content'] }}{%- endif %}"
    "{%- for call in m.get('tool_calls') or [] %}{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + fn['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- fn['arguments'] | tojson if fn['arguments'] is mapping else fn['arguments'] }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def corpus(n_tasks: int = 300, seed: int = 0) -> list[str]:
    """What the model will read and write: system prompts, tool schemas, prompts, calls in the JSON formats,
    observations, hints and plans of the built-in families."""
    from rail.envs import ENVIRONMENTS, ToolRunner
    from rail.interventions import plan_text

    texts = [CHAT_TEMPLATE]
    rng = np.random.default_rng(seed)
    for name, cls in ENVIRONMENTS.items():
        env = cls(seed=0)
        texts += [env.system_prompt(), *(json.dumps(t) for t in env.tools())]
        for fmt in ("hermes", "json"):
            runner = ToolRunner(env, fmt)
            for task in env.sample_tasks(rng, env.levels[:4], n_tasks):
                texts.append(task.prompt)
                texts += [runner.render(a) for a in task.action_guide]
                texts += [f"{item.evidence} {item.result or ''}" for item in task.rubric]
                texts.append(plan_text(task, len(task.action_guide), runner.inline))
    return texts


def bfcl_corpus() -> list[str]:
    """BFCL multi-turn's texts: the system prompt, every function doc (both ``docs`` modes), every user turn, and
    the ground-truth calls in the JSON formats."""
    from rail.envs import ToolRunner
    from rail.envs.bfcl import CATEGORIES, BfclEnv

    texts = []
    for docs in ("full", "compact"):
        env = BfclEnv(categories=CATEGORIES, docs=docs)
        texts += [env.system_prompt(), *(json.dumps(t) for t in env.tools())]
    runner = ToolRunner(env, "hermes")
    for task in env.sample_tasks(np.random.default_rng(0), env.levels, 400):
        texts += [*env.start(task).case.turns, *(runner.render(a) for a in task.action_guide)]
    return texts


def build_tokenizer(vocab_size: int = 2048, bfcl: bool = False):
    """A byte-level BPE tokenizer (GPT-2 / Qwen pre-tokenisation) trained on :func:`corpus` (and, with ``bfcl``,
    :func:`bfcl_corpus`), with ChatML special tokens and the tool tags as ordinary added tokens (kept when
    decoding, as in Qwen's tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus() + (bfcl_corpus() if bfcl else []), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: str | Path, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
          intermediate: int = 192, vocab: int = 2048, max_positions: int = 2048, seed: int = 0,
          bfcl: bool = False) -> dict:
    """Write the checkpoint to ``out``; returns what was written."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from policy.model import count_parameters, save_policy

    tok = build_tokenizer(vocab, bfcl)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    save_policy(model, tok, out)
    return {"dir": str(out), "parameters": count_parameters(model), "vocab": len(tok),
            "eos": tok.eos_token, "tool_tags": TOOL_TAGS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bfcl", action="store_true", help="also train the tokenizer on BFCL's texts (bfcl extra)")
    a = ap.parse_args()
    print(json.dumps(build(a.out, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, seed=a.seed,
                           bfcl=a.bfcl)))


if __name__ == "__main__":
    main()
