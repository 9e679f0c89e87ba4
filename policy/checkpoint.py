"""Atomic, pickle-free training checkpoints.

A checkpoint is a directory ``<out>/checkpoints/step_NNNNNN/`` holding the policy in Hugging Face format
(``model.safetensors`` + tokenizer), ``optimizer.pt`` (tensors and plain containers only, loaded with
``weights_only=True``), ``state.json`` (step, budget counters, RNG states, anything JSON) and
``manifest.json`` (SHA-256 of every file, checked on load). It is written to a temporary directory
``.step_NNNNNN.*`` and renamed; ``<out>/checkpoints/latest`` names the newest complete one and is replaced
atomically. A write that fails (a full disk) removes its temporary directory and leaves the previous
checkpoint and ``latest`` as they were; a temporary directory a killed writer left is removed by the next write.

Resuming takes the newest checkpoint that verifies (:func:`find_checkpoint`), so a damaged newest one, or a
``latest`` that names nothing usable, falls back to the one before it (two are kept) instead of stopping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from policy.fileio import sha256_file, write_text_atomic


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written; the message names the directory and the file."""


#: the name of a checkpoint directory; ``latest`` must hold one, never a path
STEP_DIR = re.compile(r"step_(\d{6,})")


def save_checkpoint(root: Path, step: int, model, tokenizer, optimizer_state: dict, state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` (``<out>/checkpoints``) and point ``latest`` at it."""
    name = f"step_{step:06d}"
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        from policy.model import quiet_io

        with quiet_io():
            model.save_pretrained(tmp / "model", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1, sort_keys=True))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): sha256_file(p) for p in files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        dest = root / name
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        write_text_atomic(root / "latest", name + "\n")
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as OSError, SafetensorError, RuntimeError...
        prev = sorted(p.name for p in root.glob("step_*") if p.is_dir() and p.name != name and STEP_DIR.fullmatch(p.name))
        kept = f"the earlier checkpoints (newest {prev[-1]}) are untouched" if prev else "no earlier checkpoint exists"
        raise CheckpointError(f"{root}: cannot write checkpoint {name} ({type(e).__name__}: {e}); {kept}. "
                              "Free space or fix the directory, then resume the run with `rail resume RUN`") from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    olds = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return dest


def remove_stale_temps(root: Path) -> None:
    """Remove the ``.step_*`` temporary directories a writer killed mid-write left (only one process writes a
    run's checkpoints: the run directory is locked)."""
    for p in root.glob(".step_*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _pointer(root: Path) -> str | None:
    """The checkpoint name ``latest`` holds, if it holds one (never a path out of ``root``)."""
    try:
        name = (root / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.fullmatch(name) else None


def find_checkpoint(root: Path, accept: Callable[[Path, dict], None] | None = None) -> tuple[Path, dict, list[str]]:
    """The newest checkpoint under ``root`` that verifies and that ``accept(path, state)`` does not refuse
    (by raising :class:`CheckpointError`): ``(directory, its state.json, why each newer one was passed over)``.

    Candidates are the ``step_*`` directories, newest first: ``latest`` is where a reader looks, but a directory
    written after it (a kill between the rename and the pointer) is complete too, and one ``latest`` names that
    is damaged or gone falls back to the one before it."""
    if not root.is_dir():
        raise CheckpointError(f"{root}: no checkpoint found; nothing to resume from")
    steps = sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)),
                   key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)), reverse=True)
    skipped: list[str] = []
    if (root / "latest").exists():
        name = _pointer(root)
        if name is None:
            skipped.append(f"{root / 'latest'} does not name a checkpoint of this run (expected step_NNNNNN)")
        elif not (root / name).is_dir():
            skipped.append(f"{root / 'latest'} names {name}, which does not exist")
    for path in steps:
        try:
            state = verify_checkpoint(path)
            if accept is not None:
                accept(path, state)
            return path, state, skipped
        except CheckpointError as e:
            skipped.append(str(e))
    if not steps and not skipped:
        raise CheckpointError(f"{root}: no checkpoint found; nothing to resume from")
    raise CheckpointError(f"{root}: no usable checkpoint ({'; '.join(skipped)})")


def verify_checkpoint(path: Path) -> dict:
    """Check the manifest and return ``state.json``; raises :class:`CheckpointError` naming the bad file."""
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: incomplete checkpoint, manifest.json is missing") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: corrupt ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: corrupt (not a JSON object)")
    for rel, digest in manifest.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{mpath}: corrupt (names {rel!r}, outside the checkpoint)")
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: corrupt checkpoint, {rel} is missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: corrupt checkpoint file (checksum mismatch)")
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: unreadable ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / 'state.json'}: not a checkpoint state (a JSON object)")
    return state


def load_optimizer_state(path: Path) -> dict:
    try:
        return torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path / 'optimizer.pt'}: cannot load ({e})") from None
