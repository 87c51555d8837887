"""The trainer as people expect from HF-style trainers: --report-to tensorboard (events read back and
compared with metrics.jsonl), a clear error when its package is missing, and quiet vLLM logging that
drops exactly the benign warnings (the RotaryEmbedding reload fallback on every weight sync) and
nothing else, with --verbose bringing everything back."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from dppo_testing import child_env

from dppo_ext.rollout import vllm_logging
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.metrics import read_metrics
from dppo_ext.trainer.reporting import tensorboard_tag
from dppo_ext.trainer.run_folder.files import RunError

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _tiny_run_config(out: Path, **overrides) -> TrainConfig:
    settings = dict(
        out=str(out),
        engine="hf",
        max_operand=9,
        num_eval=16,
        warm_start_problems=60,
        warm_start_steps=20,
        steps=3,
        prompts_per_step=6,
        group_size=4,
        num_minibatches=2,
        eval_every=2,
        eval_samples=1,
        save_every=0,
        max_new_tokens=4,
        lr=1e-3,
        threads=1,
        seed=5,
        warm_start_label_smoothing=0.0,
    )
    settings.update(overrides)
    return TrainConfig(**settings).validate()


def test_tensorboard_tags():
    assert tensorboard_tag("eval_acc") == "eval/acc"
    assert tensorboard_tag("eval_s") == "time/eval_s"
    assert tensorboard_tag("rollout_s") == "time/rollout_s"
    assert tensorboard_tag("mismatch_max") == "train/mismatch_max"


def test_report_to_tensorboard_events_match_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dppo_ext.train import run

    out = tmp_path / "run"
    run(_tiny_run_config(out, report_to="tensorboard"), progress=False)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    checked = 0
    for key in ("reward", "loss", "mismatch_max", "eval_acc", "rollout_s"):
        want = {r["step"]: r[key] for r in records if r.get(key) is not None}
        got = {s.step: s.value for s in events.Scalars(tensorboard_tag(key))}
        assert got.keys() == want.keys(), key
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-12), (key, step)
            checked += 1
    assert checked >= 10


def test_report_to_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    from dppo_ext.train import run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    out = tmp_path / "run"
    with pytest.raises(
        RunError, match=r"--report-to tensorboard needs the tensorboard package.*pip install tensorboard"
    ):
        run(_tiny_run_config(out, report_to="tensorboard"), progress=False)
    assert not out.exists(), "a refused run leaves no folder behind"


def test_report_to_rejects_unknown_targets(tmp_path):
    with pytest.raises(
        ValueError, match=r"--report-to: unknown value 'wandb'; expected one of \['none', 'tensorboard'\]"
    ):
        _tiny_run_config(tmp_path, report_to="wandb")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture()
def reload_logger(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # TRL's import sets it to ERROR
    logger = logging.getLogger(RELOAD_LOGGER)
    capture = _Capture()
    logger.addHandler(capture)
    yield logger, capture
    logger.removeHandler(capture)
    vllm_logging.quiet_vllm_logging()


def test_quiet_drops_only_the_benign_reload_warning_and_verbose_restores_it(reload_logger):
    logger, capture = reload_logger
    vllm_logging.quiet_vllm_logging()
    # what a sync plan records from the loaded vLLM model: layer classes that hold buffers and no parameter
    vllm_logging.note_buffer_only_layers(["RotaryEmbedding", "Gemma2Model"])
    logger.warning("%s: Failed to load weights", "RotaryEmbedding")
    logger.warning("%s: Failed to load weights", "Gemma2Model")
    logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    logger.warning("%s: Failed to load weights", "ParallelLMHead")
    assert capture.messages == [
        "QKVParallelLinear: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
    ], "a layer with parameters that got no tensor must still show"
    vllm_logging.verbose_vllm_logging()
    vllm_logging.install_benign_warning_filters()  # what a weight sync does: no-op once verbose was asked for
    logger.warning("%s: Failed to load weights", "RotaryEmbedding")
    assert capture.messages[-1] == "RotaryEmbedding: Failed to load weights"
    assert logging.getLogger("vllm").getEffectiveLevel() <= logging.INFO


def test_quiet_respects_a_user_set_vllm_logging_level(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    vllm_logging.quiet_vllm_logging()
    assert logging.getLogger("vllm").level == logging.DEBUG
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    vllm_logging.quiet_vllm_logging()
    assert logging.getLogger("vllm").level == logging.WARNING


@pytest.mark.vllm
@pytest.mark.slow
def test_cli_run_with_vllm_is_quiet_by_default(tmp_path):
    """`python -m dppo_ext.train` with vLLM rollouts: none of vLLM's start-up INFO lines, none of the benign
    warnings (the RotaryEmbedding reload fallback would print on every step's weight sync), and the run works."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    env = child_env(drop=("VLLM_LOGGING_LEVEL",), VLLM_CPU_KVCACHE_SPACE="1")
    flags = [
        "--engine",
        "vllm",
        "--rollout-dtype",
        "bfloat16",
        "--max-operand",
        "9",
        "--num-eval",
        "16",
        "--warm-start-problems",
        "60",
        "--warm-start-steps",
        "20",
        "--steps",
        "3",
        "--prompts-per-step",
        "6",
        "--group-size",
        "4",
        "--num-minibatches",
        "2",
        "--eval-every",
        "2",
        "--eval-samples",
        "1",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "dppo_ext.train", *flags], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()  # vLLM's own log handler writes to stdout
    vllm_lines = [line for line in lines if "(MainProcess pid=" in line or ":vllm." in line]
    assert not [line for line in vllm_lines if " INFO " in line or line.startswith("INFO:")], vllm_lines
    assert not [line for line in lines if "Failed to load weights" in line]
    # bf16 rollouts of the fp32 trainer: the sync hands vLLM bf16 weights, so no per-tensor dtype warning
    assert not [line for line in lines if "Attempted to load weight" in line]
    benign = [entry[1].replace("%s", "") for entry in vllm_logging.BENIGN_VLLM_WARNINGS]
    assert not [line for line in vllm_lines if any(b and b in line for b in benign)], vllm_lines
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 4


def test_vllm_sync_hands_weights_in_the_engine_dtype():
    """The vLLM weight sync rounds floating tensors to the engine's dtype the way vLLM's own load
    would (Tensor.to, round to nearest even) and leaves integer buffers alone."""
    from dppo_ext.rollout.vllm_engine import _checkpoint_weights

    model = torch.nn.Linear(3, 5)
    model.register_buffer("steps", torch.arange(4))
    model.weight.data[0, 0] = 1.0 + 2.0**-9  # not a bf16 value: rounds
    weights = dict(_checkpoint_weights(model, torch.bfloat16))
    assert set(weights) == {"weight", "bias", "steps"}
    assert weights["weight"].dtype == weights["bias"].dtype == torch.bfloat16
    assert torch.equal(weights["weight"], model.weight.detach().to(torch.bfloat16))
    assert torch.equal(weights["bias"], model.bias.detach().to(torch.bfloat16))
    assert weights["steps"].dtype == torch.int64 and torch.equal(weights["steps"], torch.arange(4))
    same = dict(_checkpoint_weights(model, torch.float32))
    assert torch.equal(same["weight"], model.weight.detach()) and same["weight"].dtype == torch.float32


def test_vllm_sync_weights_passes_the_engine_dtype():
    """sync_weights hands vLLM's reload the model's tensors already in the engine's dtype (a stand-in
    for the LLM records what it receives), so the reload itself never narrows a weight."""
    from dppo_ext.rollout.vllm_engine import VLLMEngine

    class RecordingLLM:
        def apply_model(self, func):  # the sync plan is made from the engine's model: a Linear of the same shape
            return [func(torch.nn.Linear(4, 3))]

        def collective_rpc(self, method, kwargs):
            self.method, self.weights = method, dict(kwargs["weights_iterator"])

        def reset_prefix_cache(self):
            pass

    engine = object.__new__(VLLMEngine)  # no vLLM needed: only the sync path is exercised
    engine.llm, engine.dtype, engine.guard, engine._plans = RecordingLLM(), "bfloat16", None, {}
    model = torch.nn.Linear(4, 3)
    engine.sync_weights(model)
    assert engine.llm.method == "reload_weights"
    assert {k: v.dtype for k, v in engine.llm.weights.items()} == {"weight": torch.bfloat16, "bias": torch.bfloat16}
    assert torch.equal(engine.llm.weights["weight"], model.weight.detach().to(torch.bfloat16))


def test_threads_default_is_every_usable_cpu():
    import os

    from dppo_ext.trainer.process import resolve_threads

    assert TrainConfig().threads == 0
    assert resolve_threads(0) == len(os.sched_getaffinity(0))
    assert resolve_threads(3) == 3


def test_cli_restarts_once_with_passive_omp_waits(monkeypatch, tmp_path):
    """More than one thread: the CLI restarts itself with OMP_WAIT_POLICY=PASSIVE (read when OpenMP loads), unless
    the variable is already set or it runs one thread."""
    import os
    import sys

    from dppo_ext.trainer.process import restart_with_passive_omp_waits

    calls = []
    monkeypatch.setattr(
        os, "execv", lambda path, args: calls.append((path, list(args), os.environ.get("OMP_WAIT_POLICY")))
    )
    monkeypatch.setattr(sys, "argv", ["dppo-train", "--threads", "2", "--out", str(tmp_path)])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    restart_with_passive_omp_waits(_tiny_run_config(tmp_path, threads=2))
    assert calls == [
        (sys.executable, [sys.executable, "-m", "dppo_ext.train", "--threads", "2", "--out", str(tmp_path)], "PASSIVE")
    ]
    restart_with_passive_omp_waits(_tiny_run_config(tmp_path, threads=2))  # now set: no second restart
    monkeypatch.delenv("OMP_WAIT_POLICY")
    restart_with_passive_omp_waits(_tiny_run_config(tmp_path, threads=1))
    assert len(calls) == 1
