"""The order in which the RL loop draws its training problems: without replacement, reshuffled (seeded)
after each pass; its state is checkpointed, so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Draws training problems without replacement, reshuffling (seeded) after each pass."""

    def __init__(self, num_problems: int, seed: int) -> None:
        self.num_problems = num_problems
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def draw(self, count: int) -> list[int]:
        """``count`` problem indices."""
        picked = []
        while len(picked) < count:
            if not self.order:
                self.order = list(range(self.num_problems))
                self.rng.shuffle(self.order)
            picked.append(self.order.pop())
        return picked

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same sequence of draws."""
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``."""
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
