"""The ``RolloutEngine`` protocol on vLLM (``rollout.engine = "vllm"``).

Token-in/token-out: every assistant turn of every open episode is one vLLM request whose prompt is the episode's
whole context as token ids (``TokensPrompt``), so prompts, tool observations, hints and branch prefixes are
rendered exactly as for :class:`~policy.engine.TransformersEngine` (the episodes, the multi-turn loop and the
guidance marking are the same code, :class:`policy.engine.RolloutStream`); vLLM's prefix cache reuses the blocks
of the turns before. Each sampled token comes back with its log-prob under the distribution it was drawn from
(``logprobs_mode = "processed_logprobs"``: after temperature, and after top-p where ``top_p < 1``). Each request
is seeded with (seed, episode handle, turn), so an episode's tokens do not depend on what else shares the batch:
requests added to a running stream (:meth:`VLLMEngine.stream`) sample what ``generate`` samples for the request
at the same index.

Weights: the engine starts from a copy of the trainer's model written to a temporary directory, and
:meth:`VLLMEngine.sync_weights` pushes the trainer's weights after every optimizer update (one safetensors blob
through ``collective_rpc``, :mod:`policy.vllm_worker`) and then resets the prefix cache, whose blocks were
computed with the old weights.

Processes: by default vLLM runs its engine core in a process of its own (``multiprocess``). A
:class:`~policy.reaper.Reaper` watches those processes and the temporary directory, so a trainer killed with
SIGKILL leaves neither behind; :meth:`close` shuts everything down on a normal exit.

vLLM is imported lazily (inside the constructor), so importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from policy.lora import full_state_dict, save_full

from policy.engine import EngineStats, RolloutState, RolloutRequest, RolloutStream, SamplingParams, run_stream
from policy.reaper import Reaper, process_tree
from policy.records import Origin, Trajectory
from policy.tokenizer import ChatRenderer

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _request_seed(seed: int, episode: int, turn: int) -> int:
    """A per-request sampling seed: an episode's tokens do not depend on which other requests share the batch."""
    return int(np.random.SeedSequence([int(seed), episode, turn]).generate_state(1, dtype=np.uint32)[0])


def _check_supported(config) -> None:
    """vLLM's CPU attention kernels take only some head sizes; say so before the engine core dies on it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ValueError(f"vLLM's CPU attention supports head sizes {sizes}; this model's is {head} "
                         f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads). Use the "
                         "transformers engine, or a model whose head size is supported (for the built-in model: "
                         "model.hidden_size / model.heads >= 32)")


class VLLMEngine:
    """Multi-turn rollouts on vLLM, behind the same protocol as the transformers engine.

    ``model`` is the trainer's model (any Hugging Face causal LM vLLM supports); ``renderer`` its chat renderer.
    ``max_model_len`` bounds an episode's context (an episode that reaches it is truncated);
    ``kv_cache_bytes`` is the KV cache's memory (RAM on CPU); ``multiprocess`` runs vLLM's engine core in its
    own process (vLLM's default; in-process mode starts faster but pins this process's torch threads).
    """

    def __init__(self, model: torch.nn.Module, renderer: ChatRenderer, *, max_model_len: int,
                 kv_cache_bytes: int = 512 * 2**20, multiprocess: bool = True, seed: int = 0,
                 workdir: str | os.PathLike | None = None):
        self.renderer = renderer
        self.max_model_len = int(max_model_len)
        self.stats = EngineStats()
        self.llm = None
        self.reaper = Reaper.start()
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="rail-vllm-", dir=workdir))
        self.reaper.watch_path(self.dir)
        try:
            self._start(model, kv_cache_bytes, multiprocess, seed)
        except BaseException:
            self.close()
            raise

    def _start(self, model, kv_cache_bytes: int, multiprocess: bool, seed: int) -> None:
        save_full(model, self.dir)  # vLLM loads its first weights from a directory (adapters merged in)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        _check_supported(model.config)
        # Token-in/token-out needs no tokenizer in vLLM; its chat-template warm-up then logs a traceback about the
        # missing tokenizer that means nothing here.
        logging.getLogger("vllm.renderers.base").addFilter(
            lambda r: not r.getMessage().startswith("Chat template warmup failed"))
        before = set(process_tree(os.getpid()))
        dtype = _DTYPES.get(next(model.parameters()).dtype, "float32")
        from vllm.platforms import current_platform

        # On CPU, whole prompts only: after a partial (chunked) prefill vLLM 0.32 rewinds the request's seeded
        # generator with set_offset, which a CPU generator does not have, and the engine dies ("CPU Generator
        # does not use offset") as soon as a turn's prompts exceed one scheduler step.
        whole = ({"enable_chunked_prefill": False, "max_num_batched_tokens": max(self.max_model_len, 8192)}
                 if current_platform.is_cpu() else {})
        self.llm = LLM(model=str(self.dir), dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                       kv_cache_memory_bytes=int(kv_cache_bytes), max_model_len=self.max_model_len,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs", seed=int(seed),
                       worker_extension_cls="policy.vllm_worker.WeightSync", **whole)
        for pid in process_tree(os.getpid()):
            if pid not in before and pid != self.reaper.proc.pid:
                self.reaper.watch_pid(pid)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> list[Trajectory]:
        with self.stream(params, seed, max_new_tokens) as stream:
            return run_stream(stream, requests)

    def stream(self, params: SamplingParams, seed: int, max_new_tokens: int | None = None) -> RolloutStream:
        """A :class:`~policy.engine.RolloutStream` on vLLM: each turn of the open episodes is one batched
        ``LLM.generate`` call. A request's seed is (``seed``, handle, turn), so an episode's tokens are the ones
        ``generate`` gives the request at the same index, whichever wave added it (with a token budget, its share of
        the budget can differ)."""
        return _VLLMStream(self, params, seed, max_new_tokens)

    def _sample_turn(self, active: list[RolloutState], budget: list, params: SamplingParams, seed: int) -> None:
        """One assistant turn for every open episode, in one batched ``LLM.generate`` call."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        eot = self.renderer.end_of_turn
        # every episode may sample the same number of tokens, so the turn never overspends the token budget
        share = params.max_tokens_per_turn
        if budget[0] != float("inf"):
            share = min(share, int(budget[0] // len(active)))
        prompts, sampling, asked = [], [], []
        for e in active:
            ctx = e.context()
            room = min(share, self.max_model_len - len(ctx))
            asked.append(room)
            if room <= 0:
                continue
            prompts.append(TokensPrompt(prompt_token_ids=ctx))
            temp = params.temperature if e.req.temperature is None else e.req.temperature
            sampling.append(VSampling(n=1, temperature=temp, top_p=params.top_p, max_tokens=room,
                                      stop_token_ids=[eot], logprobs=0, detokenize=False,
                                      seed=_request_seed(seed, e.handle, e.traj.n_turns)))
        outs = iter(self.llm.generate(prompts, sampling, use_tqdm=False) if prompts else [])
        self.stats.forward_calls += 1
        for e, room in zip(active, asked):
            turn = e.traj.n_turns
            if room <= 0:  # the context filled the model's length: nothing more can be sampled
                e.traj.truncated = True
                e.pending_text = ""
                continue
            c = next(outs).outputs[0]
            toks = list(c.token_ids)
            for tok, lps in zip(toks, c.logprobs):
                e.push(tok, Origin.POLICY, lps[tok].logprob, turn)
            budget[0] -= len(toks)
            self.stats.generated_tokens += len(toks)
            if not toks or toks[-1] != eot:  # the turn was cut: close it with an untrained end-of-turn
                e.push(eot, Origin.TOOL, 0.0, turn)
                if room < params.max_tokens_per_turn:  # cut by the token budget or the model's length
                    e.traj.truncated = True
            e.pending_text = self.renderer.decode([t for t in toks if t != eot])

    # ------------------------------------------------------------------ weights and lifetime
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights into vLLM and reset the prefix cache (its blocks hold the old weights' keys)."""
        from safetensors.torch import save

        seen, tensors = set(), {}
        for name, t in full_state_dict(model).items():
            if t.data_ptr() in seen:  # tied weights (lm_head = embed_tokens): vLLM ties them itself
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().to("cpu").contiguous()
        self.llm.collective_rpc("rail_load_weights", args=(save(tensors),))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut vLLM down and remove the temporary weights (idempotent)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - whatever is left, the reaper ends below
                pass
            del llm
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None


class _VLLMStream(RolloutStream):
    def __init__(self, engine: VLLMEngine, params: SamplingParams, seed: int, max_new_tokens: int | None):
        super().__init__(engine.renderer, params, max_new_tokens, engine.stats)
        self.engine, self.seed = engine, int(seed)

    def _sample_turn(self, active: list[RolloutState], budget: list) -> None:
        self.engine._sample_turn(active, budget, self.params, self.seed)
