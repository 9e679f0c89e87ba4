"""LoRA adapters (peft; the ``smollm2`` extra) on the built-in model: the merged weights an engine loads, a run
whose checkpoints hold adapters only, resumed, and evaluated from its run directory."""

from __future__ import annotations

import json

import pytest
import torch

from policy.model import build_tiny_model, load_policy
from rail.config import ConfigError, build_config
from rail.train import eval_checkpoint, resume_run, start_run

pytestmark = pytest.mark.smollm2


def test_full_state_dict_is_the_merged_model_and_leaves_the_base_alone():
    from policy.lora import apply_lora, full_state_dict

    base = build_tiny_model(64, hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                            max_positions=64, seed=0, pad_token_id=0, eos_token_id=1)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, 4, 8.0, ["all-linear"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # fresh adapters are zero; give them an update to merge
                p.copy_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 64, (2, 12))
    want = model(input_ids=ids).logits
    merged = full_state_dict(model)
    assert set(merged) == set(before)  # the base model's own names: what an engine (vLLM) loads
    assert any(not torch.equal(merged[k], before[k]) for k in before)  # the adapters' update is in them
    plain = build_tiny_model(64, hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                             max_positions=64, seed=1, pad_token_id=0, eos_token_id=1)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    base_now = {k.replace(".base_layer.", "."): v for k, v in model.get_base_model().state_dict().items()
                if "lora_" not in k}
    assert all(torch.equal(base_now[k], before[k]) for k in before)  # merging for the engine touched nothing


def test_a_lora_run_checkpoints_adapters_resumes_and_evaluates(tmp_path):
    out = tmp_path / "run"
    sets = [{"run": {"out": str(out), "steps": 2, "checkpoint_every": 1}, "tracking": {"uri": ""},
             "warmstart": {"cache_dir": str(tmp_path / "ws")}, "model": {"lora_rank": 4, "lora_alpha": 8.0},
             "eval": {"every": 100, "tasks_per_level": 2}}]
    cfg = build_config("smoke", sets=sets)
    trainer, _ = start_run(cfg, show_progress=False)
    frozen = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    trainer.run()
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in frozen.items())  # RL moved the adapters only
    ckpt = out / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()  # a checkpoint holds the adapters, not a copy of the base
    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (tmp_path / "ws").resolve() in __import__("pathlib").Path(base).parents  # the warm-start cache
    model, _ = load_policy(ckpt)
    lora = {k: v for k, v in state.items() if "lora_" in k}
    loaded = model.state_dict()
    assert lora and all(torch.equal(loaded[k], v) for k, v in lora.items())
    # a longer run resumes from the adapters' checkpoint, optimizer state included
    raw = json.loads((out / "config.json").read_text())
    raw["run"]["steps"] = 3
    (out / "config.json").write_text(json.dumps(raw))
    (out / "summary.json").unlink()
    trainer, _ = resume_run(out, show_progress=False)
    assert trainer.state.step == 2
    s = trainer.run()
    assert s["steps"] == 3 and (out / "checkpoints" / "step_000003" / "model" / "adapter_config.json").is_file()
    result = eval_checkpoint(out, tasks_per_level=1)
    assert result and all(0.0 <= v <= 1.0 for row in result.values() for v in row.values())


def test_lora_on_the_built_in_model_needs_the_warm_start():
    with pytest.raises(ConfigError, match="model.lora_rank > 0 on the built-in model needs the warm start"):
        build_config("smoke", sets=[{"model": {"lora_rank": 4}, "warmstart": {"enabled": False}}])
    with pytest.raises(ConfigError, match="model.lora_rank = -1"):
        build_config("smoke", sets=[{"model": {"lora_rank": -1}}])
