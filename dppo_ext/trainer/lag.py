"""Which weights the rollout engine holds: the trainer's (``rollout_lag = 0``) or those of k steps ago, and either
as they are or fake-quantised (``rollout_weight_bits``, ``dppo_ext.rollout.quantize``).

With ``rollout_lag = k`` (asynchronous RL) every sync pushes the weights after step ``step - k`` (the initial
weights while ``step < k``), so a step's rollouts are ``k + 1`` updates behind the trainer. The weights of the
last ``k + 1`` steps are kept on the CPU, oldest first, and one model copy carries the oldest into the engine.
With ``rollout_weight_bits = b`` that copy's linear weights are rounded to b-bit integers before every sync, and
the engine gets them from the start (the trainer syncs once when it is built).

A held-out evaluation scores the trained policy, not the lagged or quantised one: the current weights go into the
engine for it and the rollout ones back after it, and the sync guard checks both syncs (:meth:`RolloutLag.evaluation`).
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Iterator

import torch

from dppo_ext.rollout.base import RolloutEngine
from dppo_ext.rollout.quantize import check_weight_quantization, quantize_rollout_weights_
from dppo_ext.rollout.sync_guard import SyncCheck

__all__ = ["RolloutLag"]


class RolloutLag:
    """The weights ``engine`` rolls out with: ``model``'s, or (``steps = k > 0``) ``model``'s of k steps ago; with
    ``bits`` (> 0) fake-quantised to that many bits, one scale per ``group`` input weights."""

    def __init__(
        self, model: torch.nn.Module, engine: RolloutEngine, steps: int, bits: int = 0, group: int = 128
    ) -> None:
        if bits:
            check_weight_quantization(bits, group)
        self.model = model
        self.engine = engine
        self.steps = steps
        self.bits = bits
        self.group = group
        self._history: deque[dict[str, torch.Tensor]] = deque(maxlen=steps + 1)
        self._rollout: torch.nn.Module | None = None
        if steps or bits:
            self._rollout = copy.deepcopy(model).eval()
        if steps:
            self._history.append(_cpu_state(model))
        if bits:  # the engine was built from the trainer's weights: it rolls out with the quantised ones from now on
            self._push()

    def sync(self) -> float:
        """Push the weights the next rollout should use into the engine (after a step: under a lag, that step's
        weights join the history and the oldest go in); return seconds."""
        if self._rollout is None:
            return self.engine.sync_weights(self.model)
        if self.steps:
            self._history.append(_cpu_state(self.model))
        return self._push()

    def _push(self) -> float:
        """Load the rollout copy with the weights of k steps ago (the trainer's without a lag), quantise it when
        asked, and sync it into the engine; return seconds."""
        assert self._rollout is not None
        self._rollout.load_state_dict(self._history[0] if self.steps else self.model.state_dict())
        if self.bits:
            quantize_rollout_weights_(self._rollout, self.bits, self.group)
        return self.engine.sync_weights(self._rollout)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[list[SyncCheck | None]]:
        """While the block runs the engine holds the current weights; the sync guard's checks of the syncs this
        takes (none without a lag or quantisation: the engine holds them already) fill the list it yields."""
        checks: list[SyncCheck | None] = []
        if self._rollout is not None:
            self.engine.sync_weights(self.model)
            checks.append(self.engine.last_sync_check)
        yield checks
        if self._rollout is not None:
            self.engine.sync_weights(self._rollout)
            checks.append(self.engine.last_sync_check)


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
