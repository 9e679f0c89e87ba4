"""RAIL: post-training LLM agents with GRPO and learned rollout-time interventions under a fixed budget."""

__version__ = "0.1.0"
