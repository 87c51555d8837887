"""The reference RL trainer: config, GRPO advantages, rollout batching, the DPPO update loop,
checkpoints, metrics and plots. The CLI lives in ``dppo_ext.train``."""

from dppo_ext.trainer.advantages import group_advantages
from dppo_ext.trainer.batch import RolloutBatch, collate_rollouts, response_logits
from dppo_ext.trainer.cli import build_parser, parse_config
from dppo_ext.trainer.config import LOSS_MODES, TrainConfig
from dppo_ext.trainer.loop import Trainer
from dppo_ext.trainer.sampler import PromptSampler

__all__ = [
    "LOSS_MODES",
    "PromptSampler",
    "RolloutBatch",
    "TrainConfig",
    "Trainer",
    "build_parser",
    "collate_rollouts",
    "group_advantages",
    "parse_config",
    "response_logits",
]
