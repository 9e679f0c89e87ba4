"""The language-model side: models and tokenizers, rollout engines, the GRPO learner, checkpoints."""
