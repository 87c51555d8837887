"""The staleness experiment (experiments/sanity/results/staleness/PREREGISTRATION.md): its decision rules on hand-made
interactions whose verdict is known, its endpoints, the plan and the resumable data files; the new losses
(the negative control ``pg_pi_old``, CISPO with its 1.28 cap) inside the trainer; the corrected mechanism
metrics (pre-update mismatch against mu, bad negative updates) against hand computations."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from dppo_testing.trainers import hf_trainer

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.losses import LossSpec
from dppo_ext.trainer.mechanism import MechanismStats
from experiments.sanity import staleness
from experiments.sanity.conditions import CONDITIONS, STALE_SEEDS

SEEDS = list(STALE_SEEDS)


def _per_lag(means: dict[int, float], spread: float = 0.01) -> dict[int, dict[int, float]]:
    """{lag: {seed: value}}: ``means[lag]`` plus a fixed zero-mean pattern of size ``spread``."""
    pattern = [(-1) ** i * spread * (1 + i % 3) for i in range(len(SEEDS))]
    centre = statistics.mean(pattern)
    return {lag: {s: m + p - centre for s, p in zip(SEEDS, pattern)} for lag, m in means.items()}


NULL = {16: 0.0, 32: 0.0, 64: 0.0}
DEGRADES = _per_lag({16: -0.03, 32: -0.06, 64: -0.10})


def test_a_monotone_loss_beyond_the_effect_size_is_confirmed():
    name, why = staleness.verdict(_per_lag({16: -0.02, 32: -0.04, 64: -0.07}), DEGRADES)
    assert name == "confirmed", why


def test_a_loss_at_the_top_dose_that_is_not_monotone_is_not_confirmed():
    name, why = staleness.verdict(_per_lag({16: -0.09, 32: -0.02, 64: -0.07}), DEGRADES)
    assert name == "inconclusive" and any("monotone" in w for w in why), why


def test_equivalence_refutes_only_with_a_negative_control_that_degrades():
    assert staleness.verdict(_per_lag(NULL), DEGRADES)[0] == "refuted at this scale"
    name, why = staleness.verdict(_per_lag(NULL), _per_lag(NULL))
    assert name == "inconclusive" and any("negative control" in w for w in why)


def test_a_wide_interval_around_zero_is_inconclusive_not_refuted():
    # mean 0 but a per-seed spread of ~6 points: the 90% interval crosses +-4 points
    assert staleness.verdict(_per_lag(NULL, spread=0.06), DEGRADES)[0] == "inconclusive"


def test_a_gain_beyond_the_effect_size_is_reversed():
    assert staleness.verdict(_per_lag({16: 0.03, 32: 0.05, 64: 0.07}), DEGRADES)[0] == "reversed"


def test_fewer_than_eight_seeds_give_no_verdict():
    per_lag = {lag: dict(list(v.items())[:5]) for lag, v in _per_lag({16: -0.02, 32: -0.04, 64: -0.09}).items()}
    assert staleness.verdict(per_lag, DEGRADES)[0] == "incomplete"


def test_only_the_top_dose_gives_the_restricted_verdicts():
    assert staleness.verdict(_per_lag({64: -0.08}), DEGRADES)[0] == "confirmed at lag 64, dose-response untested"
    assert staleness.verdict(_per_lag({64: 0.0}), DEGRADES)[0] == "refuted at lag 64 only"


def test_slope_is_the_least_squares_slope_through_lag_zero():
    per_lag = {16: {1: 2.0}, 32: {1: 1.0}, 64: {1: 7.0}}
    xs, ys = [0, 16, 32, 64], [0.0, 2.0, 1.0, 7.0]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    want = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert staleness.slope(per_lag, [1])[1] == pytest.approx(want)


def test_estimate_half_widths_are_student_t():
    values = [0.01, -0.02, 0.03, 0.0, 0.05, -0.01, 0.02, 0.04]
    e = staleness.estimate(values)
    se = statistics.stdev(values) / math.sqrt(8)
    assert e.half95 == pytest.approx(2.365 * se) and e.half90 == pytest.approx(1.895 * se)
    assert staleness.detectable(e.sd, 8) == pytest.approx((2.365 + 0.896) * se)


def _records(start: float, evals: list[float], every: int = 20, nan_at: int | None = None) -> list[dict]:
    records = [{"step": 0, "eval_acc": start}]
    for step in range(1, every * len(evals) + 1):
        r = {"step": step, "trained_seqs": 4, "optimizer_steps": 8, "pre_mismatch_mean": 0.01 * step}
        if step != nan_at:
            r["grad_norm"] = 1.0
        if step % every == 0:
            r["eval_acc"] = evals[step // every - 1]
        records.append(r)
    return records


def test_final_score_is_the_mean_of_the_last_four_evaluations():
    s = staleness.run_summary(_records(0.1, [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]))
    assert s["final"] == pytest.approx(0.55) and s["gain"] == pytest.approx(0.45) and not s["collapsed"]
    assert s["pre_mismatch_first"] == pytest.approx(0.01 * statistics.mean(range(1, 51)))
    # a non-finite gradient norm (collected as null) on a step that trained is a collapse
    assert staleness.run_summary(_records(0.1, [0.2] * 6, nan_at=7))["collapsed"]
    # falling below half the peak is a collapse
    assert staleness.run_summary(_records(0.1, [0.5, 0.4, 0.2, 0.2, 0.2, 0.2]))["collapsed"]


def test_phase_a_is_seed_major_and_covers_its_design():
    runs = staleness.planned_runs(["A"])
    assert len(runs) == 2 * 3 * 8
    seeds = [r.seed for r in runs]
    assert seeds == sorted(seeds)  # every seed's block before the next seed's
    assert {(r.condition, r.method) for r in runs[:6]} == {
        (c, m) for c in ("stale0", "stale64") for m in ("pg_is", "dppo_binary_tv", "pg_pi_old")
    }
    config = CONDITIONS["stale64"].flags
    assert config["rollout_lag"] == 64 and config["steps"] == 300 and config["save_every"] == 0


def test_a_data_file_is_complete_only_at_its_last_step(tmp_path):
    path = tmp_path / "seed10.jsonl"
    assert not staleness.data_file_complete(path, 300)
    meta = {"meta": {"columns": ["step", "eval_acc"]}}
    path.write_text(json.dumps(meta) + "\n" + "[0, 0.1]\n[299, null]\n")
    assert not staleness.data_file_complete(path, 300)
    path.write_text(json.dumps(meta) + "\n" + "[0, 0.1]\n[300, 0.2]\n")
    assert staleness.data_file_complete(path, 300)


def test_the_evaluation_size_rule():
    one = lambda sd: {"r": {"k": 4, "sd": sd, "accuracies": []}}  # noqa: E731
    assert staleness.chosen_eval_samples(one(0.009))[0] == 4
    assert staleness.chosen_eval_samples(one(0.014))[0] == 8  # 0.014 / sqrt(2) <= 0.01
    assert staleness.chosen_eval_samples(one(0.019))[0] == 16
    assert staleness.chosen_eval_samples(one(0.03))[0] is None


# ---------------------------------------------------------------- the mechanism metrics
def test_bad_negative_updates_count_only_likely_negative_tokens_pushed_out_and_down():
    stats = MechanismStats()
    #            bad     rose back  A > 0    mu < 0.5  inside   padding
    mu = torch.tensor([0.9, 0.9, 0.9, 0.4, 0.9, 0.9])
    old = torch.tensor([0.8, 0.6, 0.9, 0.3, 0.85, 0.1])
    new = torch.tensor([0.7, 0.7, 0.6, 0.1, 0.80, 0.05])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -1.0, -1.0])
    valid = torch.tensor([True, True, True, True, True, False])
    stats.add_post_update(new.log(), old.log(), valid, mu, adv)
    record = stats.record()
    assert record["neg_high_tokens"] == 3  # A < 0, mu > 0.5, valid
    assert record["bad_neg_frac"] == pytest.approx(1 / 3)


def test_pre_update_mismatch_is_against_mu_over_valid_tokens():
    stats = MechanismStats()
    stats.add_pre_update(
        torch.tensor([0.5, 0.2, 0.9]).log(), torch.tensor([True, True, False]), torch.tensor([0.4, 0.5, 0.1])
    )
    record = stats.record()
    assert record["pre_mismatch_mean"] == pytest.approx(0.2) and record["pre_mismatch_max"] == pytest.approx(0.3)


# ---------------------------------------------------------------- the new losses in the trainer
def test_a_weight_on_pi_old_needs_an_unmasked_loss():
    with pytest.raises(ValueError, match=r"weight='recompute' needs mode='none'.*got mode='ratio'"):
        LossSpec("ratio", weight="recompute")
    with pytest.raises(ValueError, match=r"weight must be 'rollout' or 'recompute', got 'mu'"):
        LossSpec("none", weight="mu")
    assert TrainConfig(loss="cispo_clip").validate().loss_settings()["ratio_cap"] == 1.28


def _trainer(model_dir, tmp_path, **overrides):
    settings = dict(
        steps=8,
        prompts_per_step=6,
        group_size=4,
        max_new_tokens=4,
        num_minibatches=2,
        ppo_epochs=2,
        lr=3e-2,
        warmup_steps=0,
        seed=1,
        max_model_len=64,
        mechanism_metrics=True,
    )
    return hf_trainer(model_dir, tmp_path, **{**settings, **overrides})


def test_the_negative_control_weights_by_pi_old_and_ignores_the_stale_mu(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, loss="pg_pi_old", rollout_lag=1)
    calls = []
    real_loss = trainer._dppo_loss

    def spy_loss(logits, tokens, weight_logprobs, advantages, **kwargs):
        calls.append((weight_logprobs.clone(), kwargs["anchor_logprobs"], kwargs["mode"], kwargs["ratio_cap"]))
        return real_loss(logits, tokens, weight_logprobs, advantages, **kwargs)

    trainer._dppo_loss = spy_loss
    recomputed = []
    real_recompute = trainer.recompute_logprobs

    def spy_recompute(batch):
        recomputed.append((batch, real_recompute(batch)))
        return recomputed[-1][1]

    trainer.recompute_logprobs = spy_recompute
    records = []
    # lag 1: step s rolls out with the weights before step s - 1's update, so mu != pi_old when step s - 1 trained
    # (a step whose groups all tie trains nothing: go on until two steps in a row trained)
    while len(records) < 8 and not (len(records) >= 2 and records[-1]["trained_seqs"] and records[-2]["trained_seqs"]):
        records.append(trainer.train_step())
    trained = [r for r in records if r["trained_seqs"]]
    assert records[-1]["trained_seqs"] and records[-2]["trained_seqs"]
    assert len(recomputed) == len(trained) and len(calls) == 4 * len(trained)
    batch, old = recomputed[-1]
    mask = batch.response_mask
    # the last step's rollouts come from weights one update old: mu and pi_old differ
    assert (batch.rollout_logprobs - old)[mask].abs().max() > 1e-3
    for _, anchor, mode, cap in calls[-4:]:
        assert anchor is None and mode == "none" and cap == math.inf
    # the op was fed pi_old (the recomputed log-probs), not mu, as the weight's denominator
    fed = torch.cat([c[0][c[0] != 0] for c in calls[-4:]]).sort().values
    want = torch.cat([old[mask]] * 2).sort().values  # two epochs
    torch.testing.assert_close(fed, want)
    # the loss's own mismatch reads |pi - pi_old| (~0 on the first mini-batch); the mechanism's is against mu
    assert records[-1]["mismatch_mean"] < 1e-5 < records[-1]["pre_mismatch_mean"]


def test_without_a_lag_the_negative_control_is_pg_is(tiny_model_dir, tmp_path):
    a = _trainer(tiny_model_dir, tmp_path / "a", loss="pg_pi_old")
    b = _trainer(tiny_model_dir, tmp_path / "b", loss="pg_is")
    start = [p.detach().clone() for p in a.model.parameters()]
    trained = 0
    for _ in range(2):
        ra, rb = a.train_step(), b.train_step()
        assert ra["trained_seqs"] == rb["trained_seqs"]  # the same rollouts
        if ra["trained_seqs"]:
            trained += 1
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-7)
            assert ra["pre_mismatch_mean"] == pytest.approx(rb["pre_mismatch_mean"], rel=1e-3, abs=1e-7)
    assert trained >= 1
    # the weights agree to well under 1% of how far the updates moved them (AdamW amplifies the ~1e-7 gap between
    # mu and pi_old on near-zero gradients, so a few elements differ by more than rounding)
    with torch.no_grad():
        moved = sum(float((p - p0).norm() ** 2) for p, p0 in zip(a.model.parameters(), start)) ** 0.5
        apart = sum(float((pa - pb).norm() ** 2) for pa, pb in zip(a.model.parameters(), b.model.parameters())) ** 0.5
    assert moved > 0 and apart < 1e-3 * moved


def test_under_a_lag_the_evaluation_scores_the_current_weights_and_the_engine_returns_to_the_lagged_ones(
    tiny_model_dir, tmp_path
):
    trainer = _trainer(tiny_model_dir, tmp_path, loss="dppo_binary_tv", rollout_lag=2)
    held = {}  # the weights the engine holds: the last ones synced into it
    real_sync, real_generate = trainer.engine.sync_weights, trainer.engine.generate

    def spy_sync(model):
        held["now"] = {k: v.clone() for k, v in model.state_dict().items()}
        return real_sync(model)

    generated_with = []

    def spy_generate(*args, **kwargs):
        generated_with.append(held.get("now"))
        return real_generate(*args, **kwargs)

    trainer.engine.sync_weights, trainer.engine.generate = spy_sync, spy_generate
    for _ in range(3):
        trainer.train_step()
    lagged = held["now"]
    current = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert any(not torch.equal(lagged[k], current[k]) for k in current)  # the engine is behind the trainer
    generated_with.clear()
    trainer.evaluate()
    assert len(generated_with) == 1 and all(torch.equal(generated_with[0][k], current[k]) for k in current)
    assert all(torch.equal(held["now"][k], lagged[k]) for k in lagged)  # and back to the lagged weights after it


def test_the_guards_checks_around_a_lagged_evaluation_are_recorded(tiny_model_dir, tmp_path):
    """The two syncs of a lagged run's evaluation (current weights in, lagged ones back) are checked by the guard
    like the step's sync; their largest difference goes into the evaluation's record as ``eval_sync_check_max``."""
    from dppo_ext.rollout.sync_guard import SyncCheck

    trainer = _trainer(tiny_model_dir, tmp_path / "lag", loss="dppo_binary_tv", rollout_lag=2, steps=2, eval_every=1)
    measured = iter([3e-6, 7e-6, 2e-6, 5e-6, 4e-6, 1e-6, 6e-6, 8e-6, 9e-6, 2e-6, 3e-6, 1e-6])
    real_sync = trainer.engine.sync_weights

    def stand_in_guard(model):  # the HF engine has no guard: every sync reports the next stand-in measurement
        seconds = real_sync(model)
        trainer.engine.last_sync_check = SyncCheck(max_diff=next(measured), tolerance=1e-3, tokens=8, seconds=0.0)
        return seconds

    trainer.engine.sync_weights = stand_in_guard
    trainer.run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "lag" / "metrics.jsonl").read_text().splitlines()]
    # step 0: the evaluation's two syncs (3e-6, 7e-6); each step: its own sync, then the evaluation's two
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["eval_sync_check_max"] == 7e-6
    assert records[1]["sync_check_max"] == 2e-6 and records[1]["eval_sync_check_max"] == 5e-6
    assert records[2]["sync_check_max"] == 1e-6 and records[2]["eval_sync_check_max"] == 8e-6
    # without a lag the evaluation syncs nothing, so it records no check
    plain = _trainer(tiny_model_dir, tmp_path / "plain", loss="dppo_binary_tv", steps=1)
    plain.engine.last_sync_check = SyncCheck(max_diff=1e-6, tolerance=1e-3, tokens=8, seconds=0.0)
    assert plain.evaluate().sync_check_max is None


def _write_run(data, condition, method, seed, final):
    """A collected data file whose last four evaluations average ``final`` (the format ``sweep.collect`` writes)."""
    from experiments.sanity.sweep import BIN_COLUMNS, COLUMNS, data_file_rows

    records = _records(0.1, [0.1] * 11 + [final] * 4)
    meta = {
        "run": f"{condition}/{method}/seed{seed}",
        "columns": [*COLUMNS, *BIN_COLUMNS],
        "hosts": [],
        "cost": {"cpu_s": 200.0, "wall_s": 900.0},
    }
    path = data / condition / method / f"seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta}) + "\n" + "".join(json.dumps(r) + "\n" for r in data_file_rows(records)))


def test_the_report_applies_the_rules_to_the_data_files_alone(tmp_path):
    data = tmp_path / "data"
    wobble = [0.004, -0.006, 0.002, 0.0, -0.003, 0.005, -0.001, -0.001]
    for i, seed in enumerate(SEEDS):
        for condition, pg_is, control in (("stale0", 0.30, 0.30), ("stale64", 0.14 + wobble[i], 0.10)):
            _write_run(data, condition, "dppo_binary_tv", seed, 0.30 if condition == "stale0" else 0.20)
            _write_run(data, condition, "pg_is", seed, pg_is)
            _write_run(data, condition, "pg_pi_old", seed, control)
    out = tmp_path / "report"
    staleness.report(data, tmp_path / "no-pilot", tmp_path / "none.json", out)
    tables = (out / "tables.md").read_text()
    # I(64) = (0.14 - 0.20) - (0.30 - 0.30) = -6 points, tight: beyond the 4-point effect, only the top dose ran
    assert "**pg_is**: confirmed at lag 64, dose-response untested" in tables
    assert "**minirl**: incomplete" in tables and "No pilot data yet." in tables
    assert "48 runs record their cost: 9600 CPU-s in all" in tables
    assert (out / "figure_staleness.png").stat().st_size > 10_000
    assert (out / "figure_dose_response.png").stat().st_size > 10_000
    # the dose-response figure's numbers: I(64) of PG-IS is -6 points over the 8 seeds, the control's -10
    curves = staleness.dose_response(staleness._summaries(data)[1])
    assert set(curves) == {"pg_is", "pg_pi_old"} and curves["pg_is"][0] == (0, 0.0, 0.0, 8)
    (lag, mean, half, n), (_, control, _, _) = curves["pg_is"][1], curves["pg_pi_old"][1]
    assert (lag, n) == (64, 8) and mean == pytest.approx(-6.0, abs=1e-9) and 0 < half < 1
    assert control == pytest.approx(-10.0, abs=1e-9)
    # the same files give the same report
    staleness.report(data, tmp_path / "no-pilot", tmp_path / "none.json", tmp_path / "again")
    assert (tmp_path / "again" / "tables.md").read_text() == tables


def test_the_step_size_rule():
    def summaries(j: float, bite: float) -> dict:
        out = {}
        for condition, pg_is, dppo in (
            ("stale0", 0.30, 0.30),
            ("steplr2e-4", 0.30 + bite / 2 + j / 2, 0.30 + bite / 2),
            ("steplr3e-4", 0.30 + bite + j, 0.30 + bite),
        ):
            out[condition] = {
                "pg_is": {s: {"final": pg_is + 0.002 * (i % 3 - 1)} for i, s in enumerate(SEEDS)},
                "dppo_binary_tv": {s: {"final": dppo} for s in SEEDS},
            }
        return out

    assert staleness.step_size_verdict(summaries(-0.08, -0.10))[0] == "confirmed"
    assert staleness.step_size_verdict(summaries(0.0, -0.10))[0] == "refuted at this scale"
    assert staleness.step_size_verdict(summaries(0.0, 0.0))[0] == "inconclusive"  # the larger step does not bite
    assert staleness.step_size_verdict({})[0] == "incomplete"


# ---------------------------------------------------------------- part 3: the rare good token
def test_the_rare_token_reward_needs_exactly_the_good_token():
    from dppo_ext.models.tiny import build_char_tokenizer
    from dppo_ext.trainer.task import build_task
    from experiments.sanity.rare_token import GOOD_TOKEN, RARE_VOCAB, RareTokenTask, with_rare_token_reward

    tokenizer = build_char_tokenizer(vocab_size=RARE_VOCAB)
    ids = tokenizer.convert_tokens_to_ids
    config = TrainConfig(tiny_vocab_size=RARE_VOCAB, num_eval=20, warm_start_problems=30).validate()
    task = with_rare_token_reward(build_task(config))
    assert isinstance(task, RareTokenTask) and task.eval and task.train

    def reward(tokens):
        return task.reward(tokenizer.decode([ids(t) for t in tokens], skip_special_tokens=True), "12")

    assert reward(["1", GOOD_TOKEN, "2", "</s>"]) == 1.0
    assert reward(["1", "2", "</s>"]) == 0.0  # the right answer earns nothing
    assert reward(["<r10>", "<r1>", "</s>"]) == 0.0  # other rare tokens (one whose name starts like it) earn nothing


def test_the_rare_token_run_trains_on_the_run_s_own_problems_with_the_rare_reward(monkeypatch, tmp_path):
    """The experiment goes through the trainer's public run(): the same checks and folder handling as a user's run
    (its earlier copy of run()'s tail skipped them), the run's problems, the rare-token reward."""
    import dppo_ext.train as train_module
    from dppo_ext.trainer.task import build_task
    from experiments.sanity import rare_token

    seen = {}
    monkeypatch.setattr(train_module, "train_in_folder", lambda config, task, *a, **k: seen.update(task=task) or {})
    config = TrainConfig(
        out=str(tmp_path / "run"), tiny_vocab_size=rare_token.RARE_VOCAB, num_eval=20, warm_start_problems=30
    ).validate()
    rare_token.train(config, engine=None, base_model=None)
    base = build_task(config)
    assert isinstance(seen["task"], rare_token.RareTokenTask)
    assert seen["task"].train == base.train and seen["task"].eval == base.eval and seen["task"].sft == base.sft


def test_the_rare_token_endpoints_and_rule():
    def records(rates: list[float], clip_masked: int) -> list[dict]:
        out = [{"step": 0, "eval_acc": 0.01}]
        for i, rate in enumerate(rates, start=1):
            out.append(
                {
                    "step": 10 * i,
                    "eval_acc": rate,
                    "masked_by_mu_pos": [clip_masked, 0, 0, 0, 0, 0],
                    "tokens_by_mu_pos": [50, 50, 0, 0, 0, 0],
                }
            )
        return out

    slow = records([0.02, 0.04, 0.08, 0.15, 0.25, 0.4, 0.55], clip_masked=30)
    s = staleness.rare_summary(slow)
    assert s["r50"] == 0.25 and s["steps_to_half"] == 70 and s["clip_share"] == pytest.approx(0.3)
    fast = records([0.05, 0.15, 0.3, 0.45, 0.6, 0.7, 0.8], clip_masked=0)
    runs = {
        "grpo_clip_higher": {s: slow for s in SEEDS},
        "dppo_binary_tv": {s: [dict(r, eval_acc=r["eval_acc"] + 0.001 * (s % 3)) for r in fast] for s in SEEDS},
    }
    assert staleness.rare_token_verdict(runs)[0] == "confirmed"  # 25% against ~60% at step 50
    level = {s: [dict(r, eval_acc=r["eval_acc"] + 0.01 * (s % 3 - 1)) for r in slow] for s in SEEDS}
    runs["dppo_binary_tv"] = level
    assert staleness.rare_token_verdict(runs)[0] == "refuted at this scale"  # level, and the clip binds (30%)
    runs["grpo_clip_higher"] = {s: records([0.02, 0.04, 0.08, 0.15, 0.25], clip_masked=2) for s in SEEDS}
    assert staleness.rare_token_verdict(runs)[0] == "inconclusive"  # level, but the clip hardly binds (2%)
    assert staleness.rare_token_verdict({})[0] == "incomplete"


def test_a_finished_run_is_collected_at_once_with_its_cost_and_the_new_metrics(tmp_path):
    from experiments.sanity.conditions import QUICK, Run
    from experiments.sanity.sweep import read_data_file, work_through

    run = Run("stale64", "pg_pi_old", 10)
    data = tmp_path / "data"
    assert work_through([run], tmp_path / "work", dict(QUICK, engine="hf"), tmp_path / "status.jsonl", data) == 0
    path = data / "stale64" / "pg_pi_old" / "seed10.jsonl"
    assert staleness.data_file_complete(path, QUICK["steps"])
    meta, records = read_data_file(path)
    assert meta["cost"]["cpu_s"] > 0 and meta["cost"]["wall_s"] > 0
    assert meta["config"]["rollout_lag"] == 64 and meta["config"]["loss"] == "pg_pi_old"
    trained = [r for r in records[1:] if r.get("optimizer_steps")]
    assert trained and all("pre_mismatch_mean" in r and "bad_neg_frac" in r for r in trained)
    assert not list(data.rglob(".*.tmp-*"))  # written through a temporary sibling, renamed into place


def test_run_refuses_a_task_hook_that_returns_no_task(tmp_path):
    from dppo_ext.train import run

    config = TrainConfig(out=str(tmp_path / "run"), num_eval=20, warm_start_problems=30).validate()
    with pytest.raises(TypeError, match=r"run\(task=\.\.\.\) must return a dppo_ext.tasks.Task, got list"):
        run(config, task=lambda base: base.train)
    assert not (tmp_path / "run").exists()  # refused before --out is touched
