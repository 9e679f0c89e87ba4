"""Atomic, pickle-free training checkpoints.

A checkpoint is a directory ``<out>/checkpoints/step_NNNNNN/`` holding the policy in Hugging Face format
(``model.safetensors`` + tokenizer), ``optimizer.pt`` (tensors and plain containers only, loaded with
``weights_only=True``), ``state.json`` (step, budget counters, RNG states, anything JSON) and
``manifest.json`` (SHA-256 of every file, checked on load). It is written to a temporary directory and
renamed; ``<out>/checkpoints/latest`` names the newest complete one and is replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from policy.fileio import write_text_atomic


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and the file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(root: Path, step: int, model, tokenizer, optimizer_state: dict, state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` (``<out>/checkpoints``) and point ``latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        from policy.model import quiet_io

        with quiet_io():
            model.save_pretrained(tmp / "model", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1, sort_keys=True))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        dest = root / name
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    write_text_atomic(root / "latest", name + "\n")
    olds = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return dest


def latest_checkpoint(root: Path) -> Path:
    """The directory ``latest`` names; a clear error when there is none."""
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"{root}: no checkpoint found (no 'latest' file); nothing to resume from")
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist; the checkpoint is missing")
    return path


def verify_checkpoint(path: Path) -> dict:
    """Check the manifest and return ``state.json``; raises :class:`CheckpointError` naming the bad file."""
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: incomplete checkpoint, manifest.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: corrupt ({e}); resume from an earlier checkpoint") from None
    for rel, digest in manifest.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: corrupt checkpoint, {rel} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: corrupt checkpoint file (checksum mismatch); "
                                  "delete this checkpoint directory to resume from an earlier one")
    try:
        return json.loads((path / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: unreadable ({e})") from None


def load_optimizer_state(path: Path) -> dict:
    try:
        return torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path / 'optimizer.pt'}: cannot load ({e})") from None
