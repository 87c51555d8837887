"""The sanity-test baselines and tool: every ``--loss`` added for the paper's comparison against a
reference written here, the MiniRL anchor's semantics (recomputed once per rollout batch with the
pre-update weights, fixed for every epoch and mini-batch), the lagged rollout engine, and the
``--quick`` sweep (fresh, resumed from checkpoints, skipped when finished)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dppo_testing.trainers import hf_trainer

from dppo_ext import dppo_loss
from dppo_ext.trainer.config import TrainConfig
from experiments.sanity.conditions import QUICK_CONDITION, QUICK_METHODS

# The baselines as the papers define them, written independently of dppo_ext.trainer.losses:
# (mask anchor or None = never masked, clip low, clip high, weight cap or None = uncapped).
REFERENCE_BASELINES = {
    "pg_is": (None, 0.0, 0.0, None),
    "cispo": (None, 0.0, 0.0, 10.0),
    "cispo_clip": (None, 0.0, 0.0, 1.28),  # MiniMax-M1's CISPO: the weight clipped at 1 + 0.28, no lower bound
    "grpo_clip": ("rollout", 0.2, 0.2, 10.0),
    "grpo_clip_higher": ("rollout", 0.2, 0.28, 10.0),
    "minirl": ("recompute", 0.2, 0.28, None),
    "minirl_tis": ("recompute", 0.2, 0.28, 10.0),
}


def reference_baseline_loss(name, logits, tokens, rollout_lp, advantages, old_lp, temperature):
    """Token-mean of -A * sg(w) * M * log pi, with w = pi/mu (capped or not) and M the PPO clip of
    pi / anchor used as a mask (anchor = mu, or the recomputed old policy)."""
    anchor, low, high, cap = REFERENCE_BASELINES[name]
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    ratio = torch.exp(torch.clamp(logp - rollout_lp, max=20.0))
    weight = ratio if cap is None else torch.clamp(ratio, max=cap)
    if anchor is None:
        keep = torch.ones_like(logp)
    else:
        r = torch.exp(logp - (rollout_lp if anchor == "rollout" else old_lp))
        outside = torch.where(advantages > 0, r > 1 + high, r < 1 - low)
        keep = (~outside).to(logp.dtype)
    return (-advantages * weight.detach() * keep.detach() * logp).mean()


def _baseline_inputs(seed: int = 0, n: int = 257, vocab: int = 19):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    # mu and the old policy off by tens of percent, so the clips bind
    rollout_lp = torch.clamp(logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.8, max=0.0)
    rollout_lp[::10] -= 3.0  # tokens the engine found far less likely: pi/mu above the cap
    old_lp = torch.clamp(logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.3, max=0.0)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    return logits, tokens, rollout_lp, advantages, old_lp


@pytest.mark.parametrize("name", sorted(REFERENCE_BASELINES))
def test_baseline_losses_match_reference(name):
    config = TrainConfig(loss=name).validate()
    logits, tokens, rollout_lp, advantages, old_lp = _baseline_inputs()
    temperature = 0.9
    ours_in = logits.clone().requires_grad_()
    loss, metrics = dppo_loss(
        ours_in,
        tokens,
        rollout_lp,
        advantages,
        mode=config.mode,
        temperature=temperature,
        anchor_logprobs=old_lp if config.uses_recompute_anchor else None,
        **config.loss_settings(),
    )
    loss.backward()
    ref_in = logits.clone().requires_grad_()
    ref = reference_baseline_loss(name, ref_in, tokens, rollout_lp, advantages, old_lp, temperature)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-9, atol=1e-12)
    # the inputs exercise what distinguishes the baselines: weights above the cap, clipped tokens
    ratio = torch.exp(torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1) - rollout_lp)
    assert (ratio > 10).any()
    anchor = REFERENCE_BASELINES[name][0]
    assert (float(metrics["masked_frac"]) > 0.05) == (anchor is not None)


def test_minirl_mask_follows_the_recomputed_anchor_not_mu():
    logits, tokens, rollout_lp, advantages, old_lp = _baseline_inputs(seed=3)
    settings = TrainConfig(loss="minirl_tis").validate().loss_settings()
    with_anchor, _ = dppo_loss(logits, tokens, rollout_lp, advantages, mode="ratio", anchor_logprobs=old_lp, **settings)
    on_mu, _ = dppo_loss(logits, tokens, rollout_lp, advantages, mode="ratio", **settings)
    grpo, _ = dppo_loss(
        logits,
        tokens,
        rollout_lp,
        advantages,
        mode="ratio",
        **TrainConfig(loss="grpo_clip_higher").validate().loss_settings(),
    )
    assert not torch.allclose(with_anchor, on_mu)
    torch.testing.assert_close(on_mu, grpo)


def test_loss_flags_override_the_loss_defaults():
    assert TrainConfig(loss="cispo", ratio_cap=3.0).validate().loss_settings()["ratio_cap"] == 3.0
    assert TrainConfig(loss="pg_is").validate().loss_settings()["ratio_cap"] == float("inf")
    assert TrainConfig(loss="grpo_clip", delta_high=0.3).validate().loss_settings() == {
        "delta_low": 0.2,
        "delta_high": 0.3,
        "ratio_cap": 10.0,
        "mask_direction": "advantage",
        "kl_tau": 0.0,
        "sequence_mask": None,
    }
    ipo = TrainConfig(loss="ipo").validate().loss_settings()
    assert (ipo["mask_direction"], ipo["kl_tau"], ipo["delta_low"], ipo["delta_high"]) == ("symmetric", 1e-3, 0.1, 0.1)
    icepop = TrainConfig(loss="icepop").validate().loss_settings()
    assert (icepop["mask_direction"], icepop["delta_low"], icepop["delta_high"]) == ("symmetric", 0.5, 4.0)
    seq = TrainConfig(loss="dppo_binary_tv_seq_mask").validate().loss_settings()["sequence_mask"]
    assert (seq.statistic, seq.reduce, seq.high, seq.low) == ("k1", "sum", None, pytest.approx(-math.log(3.0)))
    with pytest.raises(ValueError, match=r"--ratio-cap must be > 0, got -1.0"):
        TrainConfig(ratio_cap=-1.0).validate()
    with pytest.raises(ValueError, match=r"--rollout-lag must be >= 0, got -1"):
        TrainConfig(rollout_lag=-1).validate()


# ---------------------------------------------------------------- the trainer: anchor and lag
def _trainer(model_dir, tmp_path, **overrides):
    settings = dict(
        steps=2,
        prompts_per_step=6,
        group_size=4,
        max_new_tokens=4,
        num_minibatches=2,
        ppo_epochs=2,
        lr=1e-2,
        warmup_steps=0,
        seed=1,
        max_model_len=64,
    )
    return hf_trainer(model_dir, tmp_path, **{**settings, **overrides})


def test_recompute_anchor_uses_pre_update_weights_and_stays_fixed(tiny_model_dir, tmp_path, monkeypatch):
    import copy

    from dppo_ext.trainer import loop

    trainer = _trainer(tiny_model_dir, tmp_path, loss="minirl")
    calls = []  # (micro batch, its anchor, the trainer's log-probs when the loss ran)
    pending = []
    real_response_logits, real_loss = loop.response_logits, trainer._dppo_loss

    def spy_response_logits(model, batch, logits_dtype=None):
        if torch.is_grad_enabled():
            pending.append(batch)
        return real_response_logits(model, batch, logits_dtype)

    def spy_loss(logits, tokens, *args, **kwargs):
        logp = (
            torch.log_softmax(logits.detach() / trainer.config.temperature, -1)
            .gather(-1, tokens[..., None])
            .squeeze(-1)
        )
        calls.append((pending.pop(), kwargs["anchor_logprobs"].clone(), logp))
        return real_loss(logits, tokens, *args, **kwargs)

    monkeypatch.setattr(loop, "response_logits", spy_response_logits)
    trainer._dppo_loss = spy_loss
    before = copy.deepcopy(trainer.model)
    record = trainer.train_step()
    assert record["optimizer_steps"] == 4 and len(calls) == 4
    for index, (micro, anchor, logp_now) in enumerate(calls):
        mask = micro.response_mask
        with torch.no_grad():
            logits = real_response_logits(before.train(), micro) / trainer.config.temperature
            pre = torch.log_softmax(logits, -1).gather(-1, micro.tokens[..., None]).squeeze(-1)
        # the anchor is the pre-update policy's log-prob in every mini-batch of both epochs ...
        torch.testing.assert_close(anchor[mask], pre[mask], rtol=0, atol=1e-5)
        if index == 0:  # ... which the first mini-batch's own policy still is
            torch.testing.assert_close(logp_now[mask], anchor[mask], rtol=0, atol=1e-5)
    # ... while the policy the loss sees has moved away from it (negative control)
    _, anchor, logp_now = calls[-1]
    assert (logp_now - anchor)[calls[-1][0].response_mask].abs().max() > 1e-3


def test_rollout_lag_feeds_the_engine_weights_of_k_steps_ago(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, loss="dppo_binary_tv", rollout_lag=1, steps=3)
    synced = []
    real_sync = trainer.engine.sync_weights

    def spy_sync(model):
        synced.append({k: v.clone() for k, v in model.state_dict().items()})
        return real_sync(model)

    trainer.engine.sync_weights = spy_sync
    after = [{k: v.clone() for k, v in trainer.model.state_dict().items()}]
    for _ in range(3):
        trainer.train_step()
        after.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert len(synced) == 3
    for step, weights in enumerate(synced, start=1):
        # after step s the engine holds the weights after step s - 1 (rollout of step s + 1 lags one update)
        expected = after[step - 1]
        assert all(torch.equal(weights[k], expected[k]) for k in expected), step
        assert any(not torch.equal(weights[k], after[step][k]) for k in expected), step


# ---------------------------------------------------------------- the --quick sweep
TIMINGS = ("rollout_s", "update_s")


def _collected(data: Path, method: str) -> tuple[dict, list[dict]]:
    from experiments.sanity.sweep import read_data_file

    return read_data_file(data / QUICK_CONDITION / method / "seed0.jsonl")


def _without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.mark.slow
def test_quick_sweep_runs_resumes_skips_and_repeats(tmp_path):
    """The CI smoke test of the experiment: 2 steps fresh, resumed to 3, then skipped; then the same 3-step
    command in a fresh folder gives the same records (timings aside) as the resumed run."""
    from experiments.sanity import main

    def common(name: str) -> list[str]:
        return [
            "--quick",
            "--work",
            str(tmp_path / name / "work"),
            "--data",
            str(tmp_path / name / "data"),
            "--report-dir",
            str(tmp_path / name / "report"),
            "--jobs",
            "2",
        ]

    assert main([*common("a"), "--steps", "2"]) == 0
    first = {m: _collected(tmp_path / "a" / "data", m)[1] for m in QUICK_METHODS}
    assert main(common("a")) == 0  # 3 steps: every run continues from its step-2 checkpoint
    assert main(common("a")) == 0  # nothing left to do
    log = [json.loads(line) for line in (tmp_path / "a" / "work" / "sweep_log.jsonl").read_text().splitlines()]
    n = len(QUICK_METHODS)
    assert [(r["fresh"], r["resumed"], r["skipped"]) for r in log] == [(n, 0, 0), (0, n, 0), (0, 0, n)]
    assert main(common("b")) == 0
    for method in QUICK_METHODS:
        meta, records = _collected(tmp_path / "a" / "data", method)
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert records[:3] == first[method]  # resumed, not restarted: steps 0-2 (timings too) are the first run's
        # the data file names its host and run: SIMD levels, library versions, the full configuration
        assert [h["attempt"] for h in meta["hosts"]] == ["fresh", "resumed"]
        assert meta["hosts"][0]["dppo_cpu_capability"] and meta["hosts"][0]["versions"]["torch"]
        assert meta["config"]["rollout_logit_noise"] == 1.0 and meta["config"]["loss"] == method
        # logit noise sigma = 1 on fp32 rollouts: a large, measured mismatch on every step that trained
        trained = [r for r in records[1:] if "mismatch_max" in r]
        assert trained and all(r["mismatch_max"] > 0.05 for r in trained)
        assert all("drift_mean" in r and "masked_frac_first" in r for r in trained)
        # the same command on the same host gives the same records (uninterrupted here, resumed above)
        again = _collected(tmp_path / "b" / "data", method)[1]
        assert _without_timings(again) == _without_timings(records)
    tables = (tmp_path / "a" / "report" / "tables.md").read_text()
    assert all(f"| {m} | 1 |" in tables for m in QUICK_METHODS)
    assert "avx" in tables.lower() or "AVX" in tables  # the host section names the SIMD level
    assert (tmp_path / "a" / "report" / "figure_noise.png").stat().st_size > 10_000
    # --report-only redraws the same tables from the collected data alone
    assert main(["--report-only", "--data", str(tmp_path / "a" / "data"), "--report-dir", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "tables.md").read_text() == tables


def test_a_non_finite_gradient_skips_the_optimizer_step_and_shows_in_the_record(tiny_model_dir, tmp_path):
    import math

    trainer = _trainer(tiny_model_dir, tmp_path)
    with torch.no_grad():  # one NaN row of the LM head: every logits row is NaN, so are loss and grads
        trainer.model.get_output_embeddings().weight[3].fill_(float("nan"))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    record = trainer.train_step()
    assert record["skipped_optimizer_steps"] == 4 and record["optimizer_steps"] == 0
    assert math.isnan(record["loss"]) and math.isnan(record["ratio_max"])
    for name, p in trainer.model.named_parameters():  # no NaN reached the weights or AdamW's moments
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True)
    assert not trainer.optimizer.state


@pytest.mark.parametrize("loss", ("ipo", "icepop", "dppo_binary_tv_seq_mask"))
def test_the_mask_family_losses_train_and_record_the_sequence_masked_share(tiny_model_dir, tmp_path, loss):
    """--loss ipo / icepop / dppo_binary_tv_seq_mask run a step through the trainer, change the weights and record
    seq_masked_frac (0 for the token-level losses, a share for the sequence-masked one)."""
    trainer = _trainer(tiny_model_dir, tmp_path, loss=loss)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    record = trainer.train_step()
    assert record["optimizer_steps"] == 4 and math.isfinite(record["loss"])
    assert 0.0 <= record["seq_masked_frac"] <= 1.0
    if loss != "dppo_binary_tv_seq_mask":
        assert record["seq_masked_frac"] == 0.0
    assert any(not torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())


def test_nan_max_keeps_a_nan_whichever_side_it_is_on():
    import math

    from dppo_ext.trainer.step_stats import nan_max

    assert nan_max(0.0, 2.0) == 2.0 and nan_max(3.0, 1.0) == 3.0
    assert math.isnan(nan_max(0.0, math.nan)) and math.isnan(nan_max(math.nan, 5.0))


_PRIORITY_PROBE = """
import os, subprocess, sys
from experiments.sanity.sweep import lower_priority
child = subprocess.run(
    [sys.executable, "-c", "print(open('/proc/self/autogroup').read().split()[-1], os.nice(0))".replace(
        "print", "import os; print", 1)],
    preexec_fn=lambda: lower_priority(7), capture_output=True, text=True, check=True,
)
print(child.stdout.strip())
"""


def _autogroup_nice() -> str | None:
    """This process's autogroup niceness, or None where the kernel shows none: the file can be missing, or present
    and empty (seen on a CI host's kernel), and then there is nothing to test."""
    try:
        fields = Path("/proc/self/autogroup").read_text().split()
    except OSError:
        return None
    return fields[-1] if len(fields) == 3 and fields[1] == "nice" else None


@pytest.mark.slow
@pytest.mark.skipif(_autogroup_nice() is None, reason="the kernel shows no autogroup niceness")
@pytest.mark.parametrize("own_session", [True, False])
def test_sweep_workers_yield_the_cpu_even_when_the_sweep_leads_its_own_session(own_session):
    """A sweep started with setsid sits in its own autogroup, where niceness only ranks it against itself: the
    workers then raise the autogroup's niceness too. Started from a shell, the autogroup is the user's and is left
    alone."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    before = _autogroup_nice()
    out = subprocess.run(
        [sys.executable, "-c", _PRIORITY_PROBE],
        cwd=repo,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
        start_new_session=own_session,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    group_nice, process_nice = int(out[0]), int(out[1])
    assert process_nice >= 7
    assert group_nice == (7 if own_session else int(before))
