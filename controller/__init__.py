"""The learned intervention controller (a torch-free contextual-bandit library); see docs/controller.md."""
