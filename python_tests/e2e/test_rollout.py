"""Rollout engines: log-probs match the transformers model, top-K rows are right, weights sync.

The independent reference is the float32 transformers model itself: for every sampled response
we recompute ``log_softmax(logits / T)`` at each response position with one teacher-forced
forward pass and compare it with what the engine reported.
"""

from __future__ import annotations

import ast
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dppo_testing import child_env

from dppo_ext.rollout import (
    RolloutEngine,
    RolloutSample,
    extract_token_logprobs,
    force_sampled_into_topk,
    make_engine,
    ranked_topk_rows,
    rollout_samples_from_vllm,
    vllm_rollout_tensors,
)
from dppo_ext.rollout import factory as rollout_factory
from dppo_ext.rollout.hf_engine import topk_with_sampled
from dppo_ext.trainer.batch import collate_rollouts

logger = logging.getLogger(__name__)

# Max |engine log-prob - transformers log-prob| in float32 (measured: <= 1e-6 for vLLM and HF).
FP32_LOGPROB_ATOL = 1e-5
# A bf16 rollout copy must differ from the fp32 model (real mismatch) but stay close.
BF16_MISMATCH_RANGE = (1e-4, 5e-2)
# The weight perturbation used to prove sync moves log-probs by far more than this.
STALE_MIN_DIFF = 1e-2

# "<s>12+7=" and "<s>34-5=" in the tiny character tokenizer.
PROMPTS = [[1, 5, 6, 14, 11, 16], [1, 7, 8, 15, 9, 16]]
TEMPERATURE = 1.7
MAX_TOKENS = 12


def model_logprobs(model: torch.nn.Module, sample: RolloutSample, temperature: float) -> torch.Tensor:
    """[T, V] ``log_softmax(logits / temperature)`` at each response position (teacher-forced)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def max_logprob_error(model: torch.nn.Module, groups: list[list[RolloutSample]], temperature: float) -> float:
    """Largest |reported - model| over sampled-token and top-K log-probs of all samples."""
    worst = 0.0
    for group in groups:
        for sample in group:
            ref = model_logprobs(model, sample, temperature)
            sampled = torch.tensor(sample.response_ids)
            reported = torch.tensor(sample.logprobs)
            worst = max(worst, (ref.gather(-1, sampled[:, None])[:, 0] - reported).abs().max().item())
            if sample.topk_ids is not None:
                ref_topk = ref.gather(-1, torch.tensor(sample.topk_ids))
                worst = max(worst, (ref_topk - torch.tensor(sample.topk_logprobs)).abs().max().item())
    return worst


def check_fields(groups: list[list[RolloutSample]], prompts: list[list[int]], n: int, top_k: int, eos_id: int) -> None:
    """Shapes and invariants every engine must honour."""
    assert len(groups) == len(prompts)
    for prompt, group in zip(prompts, groups):
        assert len(group) == n
        for s in group:
            t = len(s.response_ids)
            assert s.prompt_ids == prompt
            assert 1 <= t <= MAX_TOKENS
            assert len(s.logprobs) == t
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert isinstance(s.text, str)
            if s.finish_reason == "stop":
                assert s.response_ids[-1] == eos_id and eos_id not in s.response_ids[:-1]
            else:
                assert s.finish_reason == "length" and t == MAX_TOKENS and eos_id not in s.response_ids
            if top_k == 0:
                assert s.topk_ids is None and s.topk_logprobs is None
                continue
            assert len(s.topk_ids) == len(s.topk_logprobs) == t
            for tok, lp, ids, lps in zip(s.response_ids, s.logprobs, s.topk_ids, s.topk_logprobs):
                assert len(ids) == len(lps) == top_k and len(set(ids)) == top_k
                assert tok in ids and lps[ids.index(tok)] == pytest.approx(lp, abs=1e-6)


def check_topk_is_model_topk(
    model: torch.nn.Module, groups: list[list[RolloutSample]], temperature: float, k: int
) -> int:
    """Each top-K row must be the model's K best tokens in rank order, except that a sampled
    token outside them replaces the last one. Returns how many rows needed that replacement."""
    forced = 0
    for group in groups:
        for s in group:
            ref = model_logprobs(model, s, temperature)
            best = ref.topk(k, dim=-1).indices.tolist()
            for tok, ids, true_ids in zip(s.response_ids, s.topk_ids, best):
                if tok in true_ids:
                    assert ids == true_ids
                else:
                    forced += 1
                    assert ids == true_ids[:-1] + [tok]
    return forced


# --- hand-made data: the insertion helper and vLLM's log-prob dictionaries -------------------


def test_force_sampled_into_topk_keeps_a_member_row() -> None:
    ids, lps = force_sampled_into_topk([4, 9, 2], [-0.1, -1.0, -2.0], 9, -1.0)
    assert (ids, lps) == ([4, 9, 2], [-0.1, -1.0, -2.0])


def test_force_sampled_into_topk_replaces_lowest_ranked() -> None:
    src_ids, src_lps = [4, 9, 2], [-0.1, -1.0, -2.0]
    ids, lps = force_sampled_into_topk(src_ids, src_lps, 7, -5.5)
    assert (ids, lps) == ([4, 9, 7], [-0.1, -1.0, -5.5])
    assert src_ids == [4, 9, 2] and src_lps == [-0.1, -1.0, -2.0]
    assert force_sampled_into_topk([4], [-0.1], 7, -5.5) == ([7], [-5.5])


def test_force_sampled_into_topk_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        force_sampled_into_topk([1, 2], [-1.0], 3, -2.0)
    with pytest.raises(ValueError, match="at least one candidate"):
        force_sampled_into_topk([], [], 3, -2.0)


@dataclass
class FakeLogprob:
    """Stand-in for vllm.logprobs.Logprob (rank 1 = most likely)."""

    logprob: float
    rank: int


def test_extract_token_logprobs_on_vllm_shaped_dicts() -> None:
    # Position 0: sampled token 5 is rank 2 (inside K=2; vLLM returns K entries).
    # Position 1: sampled token 8 is rank 6 (outside; vLLM returns K + 1 entries, sampled first).
    positions = [
        {5: FakeLogprob(-1.2, 2), 3: FakeLogprob(-0.5, 1)},
        {8: FakeLogprob(-4.0, 6), 1: FakeLogprob(-0.3, 1), 2: FakeLogprob(-1.9, 2)},
    ]
    logprobs, ids, lps = extract_token_logprobs([5, 8], positions, 2)
    assert logprobs == [-1.2, -4.0]
    assert ids == [[3, 5], [1, 8]]
    assert lps == [[-0.5, -1.2], [-0.3, -4.0]]
    assert extract_token_logprobs([5, 8], positions, 0) == ([-1.2, -4.0], None, None)
    one_ids, one_lps = extract_token_logprobs([5, 8], positions, 1)[1:]
    assert one_ids == [[5], [8]] and one_lps == [[-1.2], [-4.0]]


def test_extract_token_logprobs_errors() -> None:
    with pytest.raises(ValueError, match="no log-prob for the sampled token 7 at position 0"):
        extract_token_logprobs([7], [{3: FakeLogprob(-0.5, 1)}], 1)
    with pytest.raises(ValueError, match="fewer than top_k=3"):
        extract_token_logprobs([3], [{3: FakeLogprob(-0.5, 1), 4: FakeLogprob(-0.9, 2)}], 3)
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        extract_token_logprobs([3, 4], [{3: FakeLogprob(-0.5, 1)}], 1)


def test_ranked_topk_rows_forces_the_sampled_token_in() -> None:
    # TRL's shape: candidates sorted by rank, the sampled token appended when it ranks below K.
    logprobs, ids, lps = ranked_topk_rows([7, 9], [[3, 7], [5, 6, 9]], [[-0.1, -2.5], [-0.3, None, -4.0]], 2)
    assert logprobs == [-2.5, -4.0]
    assert ids == [[3, 7], [5, 9]]
    assert lps == [[-0.1, -2.5], [-0.3, -4.0]]
    assert ranked_topk_rows([7], [[3, 7]], [[None, None]], 1) == ([None], [[7]], [[-math.inf]])
    with pytest.raises(ValueError, match="same length, got 2, 1 and 1"):
        ranked_topk_rows([7, 9], [[7]], [[-0.1]], 1)
    with pytest.raises(ValueError, match="top_k must be >= 0, got -1"):
        ranked_topk_rows([7], [[7]], [[-0.1]], -1)


def test_rollout_package_has_no_import_circle() -> None:
    """No module of dppo_ext.rollout imports one that (directly or not) imports it back."""
    package = Path(rollout_factory.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        graph[path.stem] = {n.rsplit(".", 1)[-1] for n in names if n.startswith("dppo_ext.rollout.")}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if m != "__init__" and reaches(m, m, {m}))
    assert not circles, f"import circle through {circles}: {graph}"
    assert "factory" not in set().union(*graph.values()) - graph["__init__"]


def test_topk_with_sampled_on_hand_made_rows() -> None:
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 5.0, 2.0]]), dim=-1)
    ids, lps = topk_with_sampled(logprobs, torch.tensor([1, 0]), 2)
    assert ids == [[0, 1], [2, 0]]
    assert lps[0] == pytest.approx(logprobs[0, [0, 1]].tolist())
    assert lps[1] == pytest.approx(logprobs[1, [2, 0]].tolist())


# --- engine construction -------------------------------------------------------------------


def test_make_engine_rejects_unknown_kind(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown rollout engine kind 'sglang'"):
        make_engine("sglang", str(tiny_model_dir))


def test_make_engine_without_vllm(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_factory, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match="'vllm' was requested but the vllm package is not installed"):
        make_engine("vllm", str(tiny_model_dir))
    engine = make_engine("auto", str(tiny_model_dir), max_model_len=16, device="cpu")
    assert engine.name == "hf"


def test_generate_rejects_bad_arguments(hf_engine: RolloutEngine) -> None:
    good = dict(n=2, temperature=1.0, max_tokens=4)
    for kwargs, match in [
        ({**good, "n": 0}, "n \\(samples per prompt\\) must be >= 1, got 0"),
        ({**good, "temperature": 0.0}, "temperature must be > 0"),
        ({**good, "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({**good, "top_k": -1}, "top_k .* must be >= 0, got -1"),
        ({**good, "top_k": 1000}, "top_k=1000 exceeds the vocabulary size 17"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf_engine.generate(PROMPTS, **kwargs)
    with pytest.raises(ValueError, match="prompts must be a list of non-empty"):
        hf_engine.generate([[]], **good)
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len=64"):
        hf_engine.generate([[1] * 64], **good)


# --- vLLM engine ---------------------------------------------------------------------------


@pytest.fixture()
def vllm_on_tiny(vllm_engine: RolloutEngine, tiny_model: torch.nn.Module) -> RolloutEngine:
    """The shared vLLM engine holding exactly the tiny model's weights (other tests may have
    synced different ones)."""
    vllm_engine.sync_weights(tiny_model)
    return vllm_engine


@pytest.mark.vllm
def test_vllm_logprobs_match_transformers(vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    groups = vllm_on_tiny.generate(PROMPTS, n=4, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, top_k=3, seed=11)
    check_fields(groups, PROMPTS, 4, 3, tiny_model.config.eos_token_id)
    error = max_logprob_error(tiny_model, groups, TEMPERATURE)
    logger.info("vLLM fp32 vs transformers: max |logprob diff| = %.3g", error)
    assert error < FP32_LOGPROB_ATOL
    check_topk_is_model_topk(tiny_model, groups, TEMPERATURE, 3)


@pytest.mark.vllm
def test_vllm_logprobs_are_temperature_processed(vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    """At T=0.5 the reported log-probs must be of logits/T, not of the raw logits."""
    groups = vllm_on_tiny.generate(PROMPTS[:1], n=2, temperature=0.5, max_tokens=MAX_TOKENS, seed=5)
    assert max_logprob_error(tiny_model, groups, 0.5) < FP32_LOGPROB_ATOL
    assert max_logprob_error(tiny_model, groups, 1.0) > STALE_MIN_DIFF


@pytest.mark.vllm
def test_vllm_forces_sampled_token_into_top1(vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    """K=1 at temperature 2 (vLLM's maximum): most sampled tokens are not the argmax, so the single top-K entry
    must be the sampled token itself with its own log-prob."""
    groups = vllm_on_tiny.generate(PROMPTS, n=4, temperature=2.0, max_tokens=MAX_TOKENS, top_k=1, seed=2)
    check_fields(groups, PROMPTS, 4, 1, tiny_model.config.eos_token_id)
    forced = check_topk_is_model_topk(tiny_model, groups, 2.0, 1)
    assert forced > 0
    for group in groups:
        for s in group:
            assert [row[0] for row in s.topk_ids] == s.response_ids
            assert [row[0] for row in s.topk_logprobs] == s.logprobs


@pytest.mark.vllm
def test_vllm_seed_determinism(vllm_on_tiny: RolloutEngine) -> None:
    def draw(seed: int) -> list[list[int]]:
        groups = vllm_on_tiny.generate(PROMPTS, n=3, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=seed)
        return [s.response_ids for g in groups for s in g]

    first = draw(7)
    assert draw(7) == first
    assert draw(8) != first
    # Distinct seeds per sample: the group members differ from each other.
    assert len({tuple(r) for r in first}) == len(first)


@pytest.mark.vllm
def test_vllm_weight_sync(vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module, tiny_model_dir: Path) -> None:
    """After sync, fresh rollouts of the same prompts are scored by the UPDATED model and not by
    the stale one."""
    from transformers import AutoModelForCausalLM

    stale = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in tiny_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    try:
        seconds = vllm_on_tiny.sync_weights(tiny_model)
        assert 0.0 < seconds < 5.0
        groups = vllm_on_tiny.generate(PROMPTS, n=4, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, top_k=2, seed=11)
        updated_error = max_logprob_error(tiny_model, groups, TEMPERATURE)
        stale_error = max_logprob_error(stale, groups, TEMPERATURE)
        logger.info(
            "vLLM weight sync took %.4f s; max |logprob diff| vs updated model %.3g, vs stale model %.3g",
            seconds,
            updated_error,
            stale_error,
        )
        assert updated_error < FP32_LOGPROB_ATOL
        assert stale_error > STALE_MIN_DIFF
    finally:
        vllm_on_tiny.sync_weights(stale)


@pytest.mark.vllm
def test_vllm_weight_sync_is_quiet(vllm_engine: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    """vLLM's reload warns "RotaryEmbedding: Failed to load weights" on every sync; the engine drops exactly that
    record (the rotary cache is no checkpoint tensor and is rightly kept), so the sync logs no warning."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_logger.addHandler(handler)
    try:
        vllm_engine.sync_weights(tiny_model)
        vllm_engine.sync_weights(tiny_model)
    finally:
        reload_logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]


# --- transformers engine -------------------------------------------------------------------


def test_hf_engine_fields_and_logprobs(hf_engine: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    groups = hf_engine.generate(PROMPTS, n=3, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, top_k=3, seed=4)
    check_fields(groups, PROMPTS, 3, 3, tiny_model.config.eos_token_id)
    error = max_logprob_error(tiny_model, groups, TEMPERATURE)
    logger.info("HF fp32 engine vs transformers: max |logprob diff| = %.3g", error)
    assert error < FP32_LOGPROB_ATOL
    check_topk_is_model_topk(tiny_model, groups, TEMPERATURE, 3)
    no_topk = hf_engine.generate(PROMPTS, n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=4)
    check_fields(no_topk, PROMPTS, 2, 0, tiny_model.config.eos_token_id)


def test_hf_engine_forces_sampled_token_into_top1(hf_engine: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    groups = hf_engine.generate(PROMPTS, n=4, temperature=2.0, max_tokens=MAX_TOKENS, top_k=1, seed=2)
    assert check_topk_is_model_topk(tiny_model, groups, 2.0, 1) > 0


def test_hf_engine_seed_determinism(hf_engine: RolloutEngine) -> None:
    def draw(seed: int) -> list[list[int]]:
        groups = hf_engine.generate(PROMPTS, n=3, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=seed)
        return [s.response_ids for g in groups for s in g]

    first = draw(7)
    assert draw(7) == first
    assert draw(8) != first


def test_hf_engine_weight_sync(tiny_model_dir: Path, tiny_model: torch.nn.Module) -> None:
    from transformers import AutoModelForCausalLM

    stale = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = make_engine("hf", str(tiny_model_dir), max_model_len=32, device="cpu")
    with torch.no_grad():
        for param in tiny_model.parameters():
            param.mul_(1.5)
    assert engine.sync_weights(tiny_model) > 0.0
    groups = engine.generate(PROMPTS, n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1)
    assert max_logprob_error(tiny_model, groups, TEMPERATURE) < FP32_LOGPROB_ATOL
    assert max_logprob_error(stale, groups, TEMPERATURE) > STALE_MIN_DIFF


def test_hf_engine_bf16_rollouts_mismatch(tiny_model_dir: Path, tiny_model: torch.nn.Module) -> None:
    """A bf16 rollout copy of an fp32 model reports log-probs that really differ, by a little."""
    engine = make_engine("hf", str(tiny_model_dir), dtype="bfloat16", max_model_len=32, device="cpu")
    groups = engine.generate(PROMPTS, n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1)
    error = max_logprob_error(tiny_model, groups, TEMPERATURE)
    logger.info("HF bf16 rollouts vs fp32 model: max |logprob diff| = %.3g", error)
    low, high = BF16_MISMATCH_RANGE
    assert low < error < high


@pytest.mark.vllm
def test_one_rollout_same_topk_on_trainer_and_trl_paths(
    vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module
) -> None:
    """The same vLLM RequestOutputs through the reference trainer's path, the public helper and the TRL
    integration's path give identical tensors, hence the same top-K divergence; at T=2 with K=2 some sampled
    tokens rank below K, so the forced-in rows are exercised."""
    pytest.importorskip("trl")
    from trl.generation.vllm_generation import extract_logprobs
    from vllm import SamplingParams

    from dppo_ext import dppo_loss
    from dppo_ext.integrations.trl import split_vllm_logprobs
    from dppo_ext.integrations.trl.generation import pad_topk

    k, temperature = 2, 2.0
    params = SamplingParams(n=4, temperature=temperature, max_tokens=MAX_TOKENS, logprobs=k, seed=3)
    outputs = vllm_on_tiny.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)

    samples = [s for group in rollout_samples_from_vllm(outputs, k) for s in group]
    trainer = collate_rollouts(samples, [1.0] * len(samples), pad_id=0, with_topk=True)
    helper = vllm_rollout_tensors(outputs, top_k=k)
    completions = [list(c.token_ids) for r in outputs for c in r.outputs]
    trl_logprobs, trl_ids = extract_logprobs(outputs)
    sampled, topk_ids, topk_lps = split_vllm_logprobs(completions, trl_logprobs, trl_ids, k)
    length, mask = trainer.response_len, trainer.response_mask
    trl_topk_ids = pad_topk(topk_ids, length, k, 0, torch.long, "cpu")
    trl_topk_lps = pad_topk(topk_lps, length, k, -math.inf, torch.float32, "cpu")
    trl_sampled = pad_topk([[[lp] for lp in row] for row in sampled], length, 1, 0.0, torch.float32, "cpu")[..., 0]

    outside = 0
    for request in outputs:
        for c in request.outputs:
            for tok, entries in zip(c.token_ids, c.logprobs):
                outside += entries[tok].rank > k
    assert outside > 0, "no sampled token ranked below K: the forced-in case is not exercised"
    for name in ("tokens", "rollout_logprobs", "response_mask", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(helper, name), getattr(trainer, name)), name
    assert torch.equal(trl_topk_ids[mask], trainer.topk_ids[mask])
    assert torch.equal(trl_topk_lps[mask], trainer.topk_logprobs[mask])
    assert torch.equal(trl_sampled[mask], trainer.rollout_logprobs[mask])

    # The op sees the same inputs on both paths: the same top-K divergence.
    logits = torch.randn(
        *trainer.tokens.shape, tiny_model.config.vocab_size, generator=torch.Generator().manual_seed(0)
    )
    divergences = []
    for ids, lps in ((trainer.topk_ids, trainer.topk_logprobs), (trl_topk_ids, trl_topk_lps.clamp(min=-1e4))):
        _, metrics = dppo_loss(
            logits,
            trainer.tokens,
            trainer.rollout_logprobs,
            trainer.advantages,
            response_mask=mask,
            mode="topk_tv",
            topk_ids=ids,
            topk_logprobs=lps,
            temperature=temperature,
        )
        divergences.append(float(metrics["divergence_mean"]))
    assert divergences[0] == divergences[1] and divergences[0] > 0


@pytest.mark.slow
def test_vllm_rollout_example_shows_the_raw_logprobs_pitfall(tmp_path: Path) -> None:
    """``examples/vllm_rollout_tensors.py`` as a user runs it (its own processes, one vLLM engine each): with
    ``processed_logprobs`` mu is pi up to float32 rounding and nothing is masked; vLLM's default ``raw_logprobs``
    at T = 0.7 shows a large spurious mismatch and DPPO masks tokens (what the README's "The right μ from vLLM"
    warns about)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("vllm")
    example = Path(__file__).resolve().parents[2] / "examples" / "vllm_rollout_tensors.py"
    env = child_env()
    out = subprocess.run(
        [sys.executable, str(example), "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads((tmp_path / "r.json").read_text())
    ok, raw = r["processed_logprobs"], r["raw_logprobs"]
    assert ok["tokens"] > 0 and ok["tokens"] == raw["tokens"]
    assert ok["mismatch_max"] < FP32_LOGPROB_ATOL, ok
    assert ok["binary_tv_masked_frac"] == 0.0 and ok["topk_tv_masked_frac"] == 0.0, ok
    assert raw["mismatch_mean"] > 100 * max(ok["mismatch_mean"], 1e-7), (ok, raw)
    assert raw["binary_tv_masked_frac"] > 0.0 and raw["topk_tv_masked_frac"] > 0.0, raw


# --- rollout logit noise (a dosed training-inference mismatch) ------------------------------

NOISE_SIGMA = 1.0
NOISE_TEMPERATURE = 0.7


def reference_noise(sample_seed: int, position: int, vocab: int) -> torch.Tensor:
    """eps of one token, from the documented key (``dppo_ext.rollout.noise``), written out here."""
    generator = torch.Generator().manual_seed((sample_seed * 65536 + position) % 2**63)
    return torch.randn(vocab, generator=generator)


def noisy_reference(
    model: torch.nn.Module, groups: list[list[RolloutSample]], seed: int, sigma: float, temperature: float
) -> list[tuple[RolloutSample, torch.Tensor, torch.Tensor]]:
    """(sample, log mu [T, V], log pi [T, V]) per sample: mu = softmax((z + sigma eps) / T), pi = softmax(z / T),
    z from a teacher-forced float32 forward pass, eps regenerated from the sample's seed seed + i * n + j."""
    out = []
    for i, group in enumerate(groups):
        for j, sample in enumerate(group):
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            with torch.no_grad():
                z = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
            eps = torch.stack([reference_noise(seed + i * len(group) + j, t, z.shape[-1]) for t in range(len(z))])
            out.append(
                (sample, torch.log_softmax((z + sigma * eps) / temperature, -1), torch.log_softmax(z / temperature, -1))
            )
    return out


def check_noisy_rollout(engine: RolloutEngine, model: torch.nn.Module, prompts: list[list[int]], n: int) -> None:
    """The engine's log-probs are log mu of the noisy distribution, and the tokens were drawn from mu, not pi."""
    seed = 123
    groups = engine.generate(
        prompts, n=n, temperature=NOISE_TEMPERATURE, max_tokens=MAX_TOKENS, top_k=3, seed=seed, logit_noise=NOISE_SIGMA
    )
    rows = noisy_reference(model, groups, seed, NOISE_SIGMA, NOISE_TEMPERATURE)
    worst_mu = worst_pi = 0.0
    ratios, variance, if_from_pi = [], 0.0, []
    for sample, log_mu, log_pi in rows:
        tokens = torch.tensor(sample.response_ids)
        reported = torch.tensor(sample.logprobs)
        worst_mu = max(worst_mu, (log_mu.gather(-1, tokens[:, None])[:, 0] - reported).abs().max().item())
        worst_pi = max(worst_pi, (log_pi.gather(-1, tokens[:, None])[:, 0] - reported).abs().max().item())
        topk = log_mu.gather(-1, torch.tensor(sample.topk_ids))
        worst_mu = max(worst_mu, (topk - torch.tensor(sample.topk_logprobs)).abs().max().item())
        # E_{y ~ mu}[pi(y) / mu(y)] = 1 at every position; were y drawn from pi it would be sum_v pi^2 / mu >= 1
        ratio_all = (log_pi - log_mu).exp()
        ratios += (log_pi - log_mu).gather(-1, tokens[:, None])[:, 0].exp().tolist()
        second = (ratio_all * log_pi.exp()).sum(-1)  # sum_v pi^2 / mu = E_mu[(pi / mu)^2]
        variance += float((second - 1).sum())
        if_from_pi += second.tolist()
    # the reported mu is the noisy distribution, to float32 rounding, and far from pi (a real mismatch)
    assert worst_mu < 1e-4, worst_mu
    assert worst_pi > 0.3, worst_pi
    count = len(ratios)
    mean, se = sum(ratios) / count, math.sqrt(variance) / count
    logger.info(
        "%s noise: max |log mu err| %.2g, max |reported - log pi| %.2g, mean pi/mu %.3f +- %.3f over %d tokens "
        "(%.3f if drawn from pi)",
        engine.name,
        worst_mu,
        worst_pi,
        mean,
        se,
        count,
        sum(if_from_pi) / count,
    )
    assert abs(mean - 1.0) < 4 * se, (mean, se, count)
    assert sum(if_from_pi) / count > 1.0 + 10 * se, (sum(if_from_pi) / count, se)


@pytest.mark.vllm
def test_vllm_logit_noise_is_what_was_sampled_and_reported(
    vllm_on_tiny: RolloutEngine, tiny_model: torch.nn.Module
) -> None:
    check_noisy_rollout(vllm_on_tiny, tiny_model, PROMPTS * 8, n=16)


def test_hf_logit_noise_is_what_was_sampled_and_reported(hf_engine: RolloutEngine, tiny_model: torch.nn.Module) -> None:
    check_noisy_rollout(hf_engine, tiny_model, PROMPTS * 8, n=16)


@pytest.mark.vllm
def test_vllm_logit_noise_does_not_depend_on_the_batch(vllm_on_tiny: RolloutEngine) -> None:
    """A sample's noise is a function of its seed and position: the same request alone or among others gets
    the same tokens and log-probs, and a request without noise in the same batch gets none."""
    args = dict(temperature=NOISE_TEMPERATURE, max_tokens=MAX_TOKENS, seed=40, logit_noise=NOISE_SIGMA)
    alone = vllm_on_tiny.generate(PROMPTS[:1], n=3, **args)[0]
    shared = vllm_on_tiny.generate(PROMPTS[:1] * 5, n=3, **args)[0]
    assert [s.response_ids for s in alone] == [s.response_ids for s in shared]
    assert [s.logprobs for s in alone] == [s.logprobs for s in shared]
    clean = vllm_on_tiny.generate(PROMPTS[:1], n=3, temperature=NOISE_TEMPERATURE, max_tokens=MAX_TOKENS, seed=40)[0]
    assert [s.logprobs for s in clean] != [s.logprobs for s in alone]


def test_logit_noise_errors(hf_engine: RolloutEngine) -> None:
    good = dict(n=2, temperature=1.0, max_tokens=4, seed=0)
    for value, match in [
        (-0.5, r"logit_noise must be in \[0, 1000\] .*got -0.5"),
        (1e39, r"logit_noise must be in \[0, 1000\] .*more would overflow the logits\), got 1e\+39"),
        (math.nan, "logit_noise must be a finite"),
        ("1", "logit_noise must be a finite number"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf_engine.generate(PROMPTS, **good, logit_noise=value)
    with pytest.raises(ValueError, match="logit_noise > 0 needs a seed"):
        hf_engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=4, logit_noise=0.3)
