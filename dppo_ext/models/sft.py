"""Supervised warm start: a short next-token fine-tune on (prompt, answer) pairs.

RL from a random policy never sees a reward on arithmetic, so the embedded default first
fine-tunes the tiny model on a small, disjoint set of solved problems for a few hundred steps.
The result is a partly competent policy (tens of percent held-out accuracy) that RL improves.
The loss is the usual cross-entropy on the answer tokens and the EOS only (prompt tokens are
not trained); this is supervised pre-training, not the RL step, which never builds a
full-vocabulary log-softmax.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dppo_ext.contract import IGNORE_INDEX
from dppo_ext.tasks.base import Problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm-start hyper-parameters."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    label_smoothing: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"warm-start steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"warm-start batch_size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"warm-start lr must be > 0, got {self.lr}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"warm-start label_smoothing must be in [0, 1), got {self.label_smoothing}")


def encode_sft_batch(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize ``prompt + answer + EOS`` for each problem, right-padded.

    Returns:
        input_ids [B, L] int64, attention_mask [B, L] int64, labels [B, L] int64 where labels
        are the input ids on answer/EOS positions and ``IGNORE_INDEX`` (-100) elsewhere (prompt and padding).
    """
    rows, label_rows = [], []
    for problem in problems:
        prompt_ids = tokenizer(problem.prompt)["input_ids"]
        answer_ids = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
    length = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([row + [pad] * (length - len(row)) for row in rows], dtype=torch.long)
    labels = torch.tensor([row + [IGNORE_INDEX] * (length - len(row)) for row in label_rows], dtype=torch.long)
    attention_mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows], dtype=torch.long)
    return input_ids, attention_mask, labels


def supervised_warm_start(
    model: torch.nn.Module, tokenizer, problems: list[Problem], config: WarmStartConfig
) -> list[float]:
    """Fine-tune ``model`` in place on ``problems`` for ``config.steps`` AdamW steps.

    Mini-batches are drawn by cycling through seeded shuffles of ``problems``; the learning rate
    warms up linearly and then decays linearly to 10% of ``config.lr``.

    Returns:
        The per-step training losses.
    """
    if not problems:
        raise ValueError("supervised_warm_start needs at least one problem, got an empty list")
    rng = random.Random(config.seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        return config.lr * (1.0 - 0.9 * (step - config.warmup_steps) / span)

    model.train()
    losses = []
    for step in range(config.steps):
        if len(order) < config.batch_size:
            fresh = list(range(len(problems)))
            rng.shuffle(fresh)
            order.extend(fresh)
        batch = [problems[i] for i in order[: config.batch_size]]
        del order[: config.batch_size]
        input_ids, attention_mask, labels = encode_sft_batch(tokenizer, batch)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),
            labels[:, 1:].flatten(),
            ignore_index=IGNORE_INDEX,
            label_smoothing=config.label_smoothing,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == config.steps:
            logger.info("warm start step %d/%d: loss %.4f", step + 1, config.steps, losses[-1])
    model.eval()
    return losses
