"""Adapters to other trainers, one module each, imported only by those who use them: ``rail.integrations.trl``
(TRL's ``GRPOTrainer``) and ``rail.integrations.verl`` (a verl agent loop). Each only translates between that
trainer's types and rail's own seam (``controller.Session`` through ``rail.controllers``), engine and environments
(docs/integrations.md)."""
