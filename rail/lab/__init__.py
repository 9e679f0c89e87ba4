"""The research tooling, apart from the product: ``rail ablate`` (every arm x seed of an ablation file, as worker
processes or Ray tasks, tracked in MLflow), ``rail report`` (an ablation's runs aggregated and paired, with
figures) and the adaptivity measures the report reads from runs' metrics.

It sits below the CLI and above the training loop: it starts ``rail train`` runs and reads what they write;
nothing in ``rail``'s training loop, ``policy/`` or ``controller/`` imports it (a test checks).
"""
