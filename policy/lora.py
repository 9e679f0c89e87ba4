"""Parameter-efficient training with LoRA adapters (``peft``), for a model too large to fine-tune whole on a CPU.

``model.lora_rank > 0``: the policy is the model with low-rank adapters on ``model.lora_targets`` (the base
weights frozen); the learner's optimizer then holds state for the adapters only. Checkpoints hold the adapters
(``adapter_config.json``, ``adapter_model.safetensors``) and name the base they apply to; loading one
(:func:`policy.model.load_policy`) loads that base and the adapters. An engine with its own copy of the weights
(vLLM) gets the merged weights (:func:`full_state_dict`, :func:`save_full`).

``peft`` is imported only when adapters are used.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def is_lora(model) -> bool:
    """Whether ``model`` carries peft adapters."""
    return hasattr(model, "peft_config")


def apply_lora(model, rank: int, alpha: float, targets: list[str], base: str | os.PathLike | None = None):
    """``model`` with fresh LoRA adapters of ``rank`` (scaled by ``alpha / rank``) on the modules named ``targets``
    (``["all-linear"]``: every linear layer but the output head); only the adapters train. ``base``: the
    directory of ``model``'s weights, which the adapters' checkpoints name."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(rank), lora_alpha=float(alpha), lora_dropout=0.0, bias="none",
                        target_modules=targets[0] if targets == ["all-linear"] else list(targets),
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if base is not None:
        model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    return model


def merged(model):
    """A plain copy-free view of the merged model: ``model`` itself without adapters, or the adapters merged into
    the base and unloaded (for the warm start's cache, whose RL adapters are fresh ones on top of it)."""
    return model.merge_and_unload() if is_lora(model) else model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights an engine loads: the base model's names and tensors, each adapted layer's weight with its
    adapter's update added (new tensors: the base weights are never touched, so no merge-unmerge rounding builds
    up in them). Tied weights stay one tensor."""
    if not is_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer):
                for adapter in mod.active_adapters:
                    key = f"{name}.base_layer.weight"
                    d = mod.get_delta_weight(adapter)
                    deltas[key] = d if key not in deltas else deltas[key] + d
        out = {}
        for name, t in base.state_dict().items():
            if "lora_" in name:
                continue
            out[name.replace(".base_layer.", ".")] = (t + deltas[name]).detach() if name in deltas else t.detach()
    return out


def save_full(model, path: str | os.PathLike) -> None:
    """The merged model as an ordinary Hugging Face directory (config and safetensors) at ``path``."""
    if not is_lora(model):
        model.save_pretrained(path, safe_serialization=True)
        return
    base = model.get_base_model()
    state = full_state_dict(model)
    base.save_pretrained(Path(path), state_dict=state, safe_serialization=True)


def load_adapters(base, path: str | os.PathLike, trainable: bool = True):
    """``base`` with the adapters saved at ``path``."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)
