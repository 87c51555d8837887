"""Which weights the rollout engine holds: the trainer's (``rollout_lag = 0``) or those of k steps ago.

With ``rollout_lag = k`` (asynchronous RL) every sync pushes the weights after step ``step - k`` (the initial
weights while ``step < k``), so a step's rollouts are ``k + 1`` updates behind the trainer. The weights of the
last ``k + 1`` steps are kept on the CPU, oldest first, and one model copy carries the oldest into the engine.

A held-out evaluation scores the trained policy, not the lagged one: under a lag the current weights go into the
engine for it and the lagged ones back after it, and the sync guard checks both syncs (:meth:`RolloutLag.evaluation`).
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Iterator

import torch

from dppo_ext.rollout.base import RolloutEngine
from dppo_ext.rollout.sync_guard import SyncCheck

__all__ = ["RolloutLag"]


class RolloutLag:
    """The weights ``engine`` rolls out with: ``model``'s, or (``steps = k > 0``) ``model``'s of k steps ago."""

    def __init__(self, model: torch.nn.Module, engine: RolloutEngine, steps: int) -> None:
        self.model = model
        self.engine = engine
        self.steps = steps
        self._history: deque[dict[str, torch.Tensor]] = deque(maxlen=steps + 1)
        self._lagged: torch.nn.Module | None = None
        if steps:
            self._lagged = copy.deepcopy(model).eval()
            self._history.append(_cpu_state(model))

    def sync(self) -> float:
        """Push the weights the next rollout should use into the engine (after a step: under a lag, that step's
        weights join the history and the oldest go in); return seconds."""
        if self._lagged is None:
            return self.engine.sync_weights(self.model)
        self._history.append(_cpu_state(self.model))
        self._lagged.load_state_dict(self._history[0])
        return self.engine.sync_weights(self._lagged)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[list[SyncCheck | None]]:
        """While the block runs the engine holds the current weights; the sync guard's checks of the syncs this
        takes (none without a lag: the engine holds them already) fill the list it yields."""
        checks: list[SyncCheck | None] = []
        if self._lagged is not None:
            self.engine.sync_weights(self.model)
            checks.append(self.engine.last_sync_check)
        yield checks
        if self._lagged is not None:
            self.engine.sync_weights(self._lagged)
            checks.append(self.engine.last_sync_check)


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
