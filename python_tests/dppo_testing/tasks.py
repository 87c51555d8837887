"""Tasks the trainer tests train on."""

from __future__ import annotations

from dppo_ext.tasks import Task, make_arithmetic_task


class LeadingDigitTask(Task):
    """Arithmetic prompts with a reward a random tiny model already earns about half the time (the response starts
    with a digit), so group advantages are non-zero from the first step."""

    def reward(self, response: str, answer: str) -> float:
        return float(response[:1].isdigit())


def leading_digit_task() -> Task:
    """The leading-digit task on the arithmetic task's prompts (a in 0..9, 8 held out, no warm-start split)."""
    base = make_arithmetic_task(max_operand=9, num_eval=8, num_sft=0, seed=0)
    return LeadingDigitTask(name="leading-digit", train=base.train, eval=base.eval, verifier="exact")
