"""SmolLM2-135M-Instruct by name (the ``smollm2`` extra and requirements-smollm2.txt): converted once from the
package's GGUF file into a safetensors checkpoint, its chat template given the tools in the system message, and a
LoRA run on it with the chunked log-probabilities and activation checkpointing of the ``smollm2-cpu`` preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rail import models
from rail.config import build_config

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("models")
    said = []
    path = Path(models.model_dir("smollm2-135m", str(cache), said.append))
    assert said and "converting" in said[0]  # converted once ...
    return path


def test_the_model_is_converted_once_into_a_directory_keyed_by_the_files_hash(smol):
    said = []
    again = models.model_dir("smollm2-135m", str(smol.parent), said.append)
    assert again == str(smol) and not said  # ... and found again without converting
    source = json.loads((smol / "rail_source.json").read_text())
    assert smol.name == f"smollm2-135m-{source['sha256'][:16]}"
    assert (smol / "model.safetensors").is_file() and (smol / "config.json").is_file()
    cfg = json.loads((smol / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and "quantization_config" not in cfg


def test_the_tools_are_described_in_the_system_message_in_the_hermes_format(smol):
    from policy.model import load_tokenizer
    from policy.tokenizer import ChatRenderer
    from rail.envs import ToolRunner, make_env

    env = make_env("lookup", 0)
    runner = ToolRunner(env, "hermes")
    assert runner.describes_tools
    r = ChatRenderer(load_tokenizer(smol))
    text = r.tok.decode(r.prompt(env.system_prompt(), "Who?", runner.tools, describe=True))
    plain = r.tok.decode(r.prompt(env.system_prompt(), "Who?", runner.tools))
    assert "<tool_call>" in text and "<tool_call>" not in plain  # SmolLM2's template lists no tools itself
    names = [t["function"]["name"] if "function" in t else t["name"] for t in runner.tools]
    assert names and all(f"\"name\": \"{n}\"" in text and f"\"name\": \"{n}\"" not in plain for n in names)


def test_the_model_by_name_brings_its_settings_unless_one_is_chosen():
    """model.path = "smollm2-135m" brings hermes calls and the CPU memory settings; a preset, a config file or a
    flag that sets one of those keys wins; another model.path gets none of them."""
    cfg = build_config("smoke", sets=[{"model": {"path": "smollm2-135m"}}])
    assert (cfg.rollout.tool_format, cfg.model.lora_rank, cfg.model.activation_checkpointing,
            cfg.learner.logprob_chunk, cfg.learner.tokens_per_pass) == ("hermes", 16, True, 512, 1024)
    assert cfg.rollout.max_tokens_per_turn == 64  # resolved from the format it brought
    cfg = build_config("default", toml={"model": {"path": "smollm2-135m", "lora_rank": 0}},
                       sets=[{"rollout": {"tool_format": "json"}}, {"learner": {"tokens_per_pass": 0}}])
    assert (cfg.rollout.tool_format, cfg.model.lora_rank, cfg.learner.tokens_per_pass) == ("json", 0, 0)
    assert cfg.model.activation_checkpointing  # not chosen: the model's
    assert build_config("smollm2-cpu").model.lora_rank == 16  # the preset names the model


def test_a_lora_run_on_smollm2_trains_its_adapters(smol, tmp_path):
    from rail.train import start_run

    cfg = build_config("smollm2-cpu", sets=[{
        "run": {"out": str(tmp_path / "run"), "steps": 1, "checkpoint_every": 1}, "tracking": {"uri": ""},
        "model": {"cache_dir": str(smol.parent)}, "warmstart": {"steps": 1, "batch_size": 2, "cache_dir": str(tmp_path / "ws")},
        "budget": {"rollouts_per_step": 4, "group_size": 2}, "rollout": {"max_turns": 2, "max_tokens_per_turn": 24},
        "env": {"levels": [1]}, "eval": {"every": 100, "tasks_per_level": 1, "levels": [1]},
        "controller": {"name": "none"}}])
    trainer, out = start_run(cfg, show_progress=False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    s = trainer.run()
    assert s["steps"] == 1 and s["budget"]["spent"]["total"] == 4
    after = trainer.model.state_dict()
    moved = [k for k in before if not (after[k] == before[k]).all()]
    ckpt = out / "checkpoints" / "step_000001" / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "rollout/reward_mean" in x]
    # an update ran when some group's rewards differed; then the adapters moved
    assert steps and (moved or steps[0].get("loss/skipped")), steps
