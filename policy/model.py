"""Policy models through ``transformers``: the built-in tiny Qwen2 and any Hugging Face checkpoint.

The built-in policy is an ordinary ``Qwen2ForCausalLM`` with a word-level tokenizer, saved and loaded in
Hugging Face format (``config.json`` + ``model.safetensors`` + tokenizer files), so ``--model PATH`` with a
real checkpoint takes the same code path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)
from transformers import Qwen2Config, Qwen2ForCausalLM


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate_size: int,
    max_positions: int,
    seed: int,
    pad_token_id: int,
    eos_token_id: int,
) -> PreTrainedModel:
    """A small Qwen2 causal LM with tied embeddings, initialised deterministically from ``seed``."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model


@contextlib.contextmanager
def quiet_io():
    """No transformers progress bars ("Loading weights", "Writing model shards") while a run's own bar shows."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_policy(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a Hugging Face causal LM and its tokenizer from a local directory (safetensors only)."""
    p = Path(path)
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        return _load_adapters(p)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p}: not a Hugging Face model directory (no config.json)")
    try:
        with quiet_io():
            model = AutoModelForCausalLM.from_pretrained(p, use_safetensors=True)
            tokenizer = _load_tokenizer(p)
    except Exception as e:  # corrupt or partial files: say which directory and what to do
        raise ValueError(f"{p}: cannot load the model or tokenizer ({e}); is the directory complete?") from e
    return model, tokenizer


def _load_adapters(p: Path):
    """A checkpoint of LoRA adapters (:mod:`policy.lora`): the base it names, with the adapters."""
    import json

    from policy.lora import load_adapters

    base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{p}: holds LoRA adapters for the base model {base!r}, which is not there (a "
                                "warm-start cache that was removed?); restore it or train again")
    model, _ = load_policy(base)
    try:
        with quiet_io():
            tokenizer = _load_tokenizer(p) if (p / "tokenizer_config.json").is_file() else _load_tokenizer(Path(base))
            return load_adapters(model, p), tokenizer
    except Exception as e:
        raise ValueError(f"{p}: cannot load the adapters ({e}); is the directory complete?") from e


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of the model directory ``path`` alone, as :func:`load_policy` loads it."""
    p = Path(path)
    try:
        with quiet_io():
            return _load_tokenizer(p)
    except Exception as e:
        raise ValueError(f"{p}: cannot load the tokenizer ({e}); is the directory complete?") from e


def _load_tokenizer(p: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except that a plain ``tokenizers`` tokenizer stays one.

    AutoTokenizer prefers the model type's own tokenizer class (Qwen2Tokenizer for a Qwen2 config), which
    would rebuild the built-in word-level tokenizer as BPE; the class the directory declares wins.
    """
    import json

    tc = p / "tokenizer_config.json"
    declared = json.loads(tc.read_text()).get("tokenizer_class") if tc.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(p)
    return AutoTokenizer.from_pretrained(p)


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike) -> None:
    """Save model (safetensors) and tokenizer to ``path`` atomically: written beside it, then renamed."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with quiet_io():
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: Path, dest: Path) -> None:
    """Move directory ``src`` to ``dest``, replacing any old ``dest`` with a rename (never a half-written one)."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(src, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA GPU when there is one, else the CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
