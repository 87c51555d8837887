"""Part 3 of the staleness pre-registration: the rare good token
(experiments/sanity/results/staleness/PREREGISTRATION.md).

The embedded arithmetic prompts with a reward that only a rare token earns: 1 when the response
holds ``GOOD_TOKEN`` (``<r0>``, the first padding token of a padded vocabulary), else 0. The warm
start (vocabulary padded to ``RARE_VOCAB`` tokens, label smoothing 0.3) gives each padding token
≈ 0.3 / 150 = 2e-3 per position, so the token that earns the reward is one the policy samples at
μ ≈ 1e-3 .. 5e-3 (``good_token_mu`` measures it before any run). The held-out "accuracy" of such a
run is the rate of responses that hold the token.

The trainer builds the arithmetic task from its config; ``train`` runs it with this task instead
(``dppo_ext.train.run``'s steps, with the task given), so no trainer flag is needed.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dppo_ext.models.tiny import RARE_TOKEN
from dppo_ext.tasks import Task
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.task import build_task

GOOD_TOKEN = RARE_TOKEN.format(0)
RARE_VOCAB = 150  # 0.3 label smoothing / 150 tokens = 2e-3 per padding token
MU_RANGE = (1e-3, 5e-3)  # the pre-registered range of the good token's mu at the first response position


class RareTokenTask(Task):
    """The arithmetic task's problems; reward 1.0 when the response holds ``GOOD_TOKEN`` (the answer is not graded)."""

    def reward(self, response: str, answer: str) -> float:
        return float(GOOD_TOKEN in response)


def with_rare_token_reward(base: Task) -> RareTokenTask:
    """The run's own problems (same split, same warm-start problems) with the rare-token reward."""
    return RareTokenTask(name="rare_token", train=base.train, eval=base.eval, verifier=base.verifier, sft=base.sft)


def train(config: TrainConfig, *, engine: Any, base_model: Path | None) -> dict[str, Any]:
    """The trainer's own ``dppo_ext.train.run`` on the run's problems with the rare-token reward."""
    from dppo_ext.train import run

    return run(config, progress=False, engine=engine, base_model=base_model, task=with_rare_token_reward)


def good_token_mu(model_dir: Path, config: TrainConfig) -> dict[str, float]:
    """The warm start's probability of ``GOOD_TOKEN`` as the first response token of each held-out prompt, at the
    rollout temperature: ``{"median", "min", "max"}`` over the prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    good = tokenizer.convert_tokens_to_ids(GOOD_TOKEN)
    probs = []
    with torch.no_grad():
        for problem in build_task(config).eval:
            ids = torch.tensor([tokenizer(problem.prompt)["input_ids"]])
            logits = model(input_ids=ids).logits[0, -1].float() / config.temperature
            probs.append(float(torch.softmax(logits, -1)[good]))
    return {"median": statistics.median(probs), "min": min(probs), "max": max(probs)}
