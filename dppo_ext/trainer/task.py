"""The task a run trains on: the embedded arithmetic task, or the JSONL task of ``--data`` / ``--eval-data``."""

from __future__ import annotations

from dppo_ext.tasks import Task, load_jsonl_task, make_arithmetic_task
from dppo_ext.trainer.config import TrainConfig


def build_task(config: TrainConfig) -> Task:
    """The embedded arithmetic task, or the JSONL task of ``--data`` / ``--eval-data``."""
    if config.data:
        return load_jsonl_task(
            config.data,
            eval_path=config.eval_data or None,
            num_eval=config.num_eval,
            verifier=config.verifier,
            seed=config.seed,
        )
    return make_arithmetic_task(
        max_operand=config.max_operand,
        max_second_operand=config.max_second_operand,
        num_eval=config.num_eval,
        num_sft=config.warm_start_problems,
        seed=config.seed,
    )
