"""Integrations of the DPPO loss with existing training frameworks.

Each integration is a package of its own that imports its framework only when one of its names is used, so
``import dppo_ext`` never needs them: ``from dppo_ext.integrations.trl import DPPOGRPOConfig, DPPOGRPOTrainer``
(needs ``trl``, see ``SUPPORTED_TRL`` there).
"""
