"""Integrations of the DPPO loss with existing training frameworks.

Each integration lives in its own module and imports its framework lazily, so ``import dppo_ext`` never needs
them: ``from dppo_ext.integrations.trl import DPPOGRPOConfig, DPPOGRPOTrainer`` (needs ``trl``, see
``SUPPORTED_TRL`` there).
"""
