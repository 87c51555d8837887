"""verl's side at config level, without verl installed: the plugin's config check and examples/verl_dppo.py's overrides.

Runs in the quick tier on any machine (verl is not imported; the config is a plain tree built from the example's
``KEY=VALUE`` overrides). The same overrides against verl's own composed config and ``validate_config`` are checked
in test_verl_plugin.py where verl is installed (CI's .venv-verl).

Checks: every one of dppo_ext's own mode names and aliases is either a verl loss mode of the plugin or refused at
config time with verl's name for it (issue 38: ``loss_mode=binary_tv`` used to pass with a warning and fail 188 s
later); the example runs every mode of the plugin and reports the one that ran; ``--workers N`` derives the
data-parallel settings and satisfies verl 0.9.1's batch rules; a user's override replaces the example's; a failed
run's console shows the errors of verl's log.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from dppo_ext.contract import MODE_ALIASES, MODES
from dppo_ext.integrations.verl.config import VERL_MODES, validate

ROOT = Path(__file__).resolve().parents[2]
MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
# dppo_ext's names that are not verl's, and verl's name for each (None: the plugin does not provide it); docs/names.md
OURS_IN_VERL = {
    "binary_tv": "dppo_tv",
    "dppo_binary_tv": "dppo_tv",
    "binary_kl": "dppo_kl",
    "dppo_binary_kl": "dppo_kl",
    "topk_tv": "dppo_topk_tv",
    "topk_kl": "dppo_topk_kl",
    "ratio": None,
    "none": None,
}


def _example():
    spec = importlib.util.spec_from_file_location("verl_dppo", ROOT / "examples" / "verl_dppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "null": None}.get(text, text)


def tree(overrides: list[str]) -> dict:
    """A config tree from hydra-style ``KEY=VALUE`` overrides (scalars only; what validate reads)."""
    root: dict = {}
    for override in overrides:
        key, value = override.lstrip("+").split("=", 1)
        *parents, leaf = key.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _value(value)
    return root


def _args(**changes) -> argparse.Namespace:
    args = _example().build_parser().parse_args([])
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def _overrides(tmp_path: Path, **changes) -> list[str]:
    example = _example()
    args = _args(**changes)
    return example.overrides(tmp_path / "model", tmp_path / "t.parquet", tmp_path / "v.parquet", args)


def test_every_name_of_ours_is_named_in_the_expectations():
    """A new mode or alias in dppo_ext.contract must be decided for verl (a verl mode of the plugin, or refused)."""
    assert set(MODES) | set(MODE_ALIASES) == set(OURS_IN_VERL) | set(VERL_MODES)


@pytest.mark.parametrize("ours, verl_name", sorted(OURS_IN_VERL.items()))
def test_our_own_mode_names_are_refused_with_verls_name(tmp_path, ours, verl_name):
    config = tree(_overrides(tmp_path) + [f"{MODE_KEY}={ours}"])
    expected = f"loss_mode={verl_name}" if verl_name else r"does not provide it \(it provides \('dppo_topk_tv'"
    with pytest.raises(ValueError, match=rf"loss_mode='{ours}' is dppo_ext's name, not a verl loss mode: .*{expected}"):
        validate(config)


def test_other_names_are_left_to_verl(tmp_path):
    """verl's own losses and unknown non-DPPO names are not the plugin's to refuse."""
    for name in ("vanilla", "gspo", "cispo", "my_registered_loss"):
        validate(tree(_overrides(tmp_path, mode="dppo_tv") + [f"{MODE_KEY}={name}"]))


@pytest.mark.parametrize("mode", sorted(VERL_MODES))
def test_the_example_runs_every_mode_and_its_config_passes_the_plugins_check(tmp_path, mode):
    example = _example()
    assert mode in example.build_parser()._option_string_actions["--mode"].choices
    settings = _overrides(tmp_path, mode=mode)
    assert example.setting(settings, MODE_KEY) == mode
    topk = example.setting(settings, "actor_rollout_ref.rollout.custom.dppo_topk")
    assert (topk is not None) == VERL_MODES[mode].topk
    validate(tree(settings))


def test_the_examples_rollout_runs_in_the_actors_dtype_with_the_seed(tmp_path):
    example = _example()
    settings = _overrides(tmp_path, seed=7)
    # the actor's FSDP mixed precision keeps float32 parameters; the rollout must score in the same dtype
    assert "param_dtype:fp32" in example.setting(settings, "actor_rollout_ref.actor.fsdp_config.mixed_precision")
    assert example.setting(settings, "actor_rollout_ref.rollout.dtype") == "float32"
    for key in ("data.seed", "actor_rollout_ref.actor.data_loader_seed", "actor_rollout_ref.rollout.seed"):
        assert example.setting(settings, key) == "7", key
    assert example.setting(settings, "data.dataloader_num_workers") == "0"


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_workers_derive_the_data_parallel_settings(tmp_path, workers):
    """verl 0.9.1's rules (verl/utils/config.py validate_config, ActorConfig.validate, engine_workers.py
    train_mini_batch): the generation batch divides over the GPUs, the mini-batch over the data-parallel ranks, each
    rank's mini-batch into whole micro-batches, and on a CPU Ray declares one GPU slot per worker."""
    example = _example()
    settings = _overrides(tmp_path, workers=workers)
    args = _args(workers=workers)
    get = lambda key: int(example.setting(settings, key))  # noqa: E731
    n_gpus = get("trainer.n_gpus_per_node") * get("trainer.nnodes")
    assert n_gpus == workers and get("ray_kwargs.ray_init.num_gpus") == workers
    samples = get("data.train_batch_size") * get("actor_rollout_ref.rollout.n")
    assert samples == args.prompts * args.samples and samples % n_gpus == 0
    mini = get("actor_rollout_ref.actor.ppo_mini_batch_size") * get("actor_rollout_ref.rollout.n")
    assert mini % n_gpus == 0
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ):
        assert (mini // n_gpus) % get(key) == 0 and get(key) >= 1, key
    validate(tree(settings))


def test_a_batch_the_workers_cannot_share_is_refused_by_name():
    example = _example()
    with pytest.raises(ValueError, match=r"--workers 3 must divide .*--prompts 4 x --samples 8 = 32"):
        example.check_batch(_args(workers=3))
    with pytest.raises(ValueError, match=r"--workers must be >= 1, got 0"):
        example.check_batch(_args(workers=0))
    # issue 38 row 2: this override alone failed inside verl's workers, with the error only in verl.log
    with pytest.raises(ValueError, match=r"'trainer.n_gpus_per_node=2': set the number of data-parallel workers with"):
        example.check_batch(_args(verl_overrides=["trainer.n_gpus_per_node=2"]))


def test_a_users_override_replaces_the_examples(tmp_path):
    example = _example()
    ours = _overrides(tmp_path)
    merged = example.merge_overrides(
        ours,
        [
            f"{MODE_KEY}=dppo_kl",
            "actor_rollout_ref.rollout.custom.dppo_topk=8",  # written without the + the example needs
            "trainer.rollout_data_dir=/tmp/x",
        ],
    )
    assert [o for o in merged if MODE_KEY in o] == [f"{MODE_KEY}=dppo_kl"]
    assert example.setting(merged, MODE_KEY) == "dppo_kl"
    assert "+actor_rollout_ref.rollout.custom.dppo_topk=8" in merged
    assert merged[-1] == "trainer.rollout_data_dir=/tmp/x" and len(merged) == len(ours) + 1


def test_a_failed_run_shows_the_errors_of_verls_log():
    """The cause is logged by a worker long before verl's driver stops; the console gets it, not only the tail."""
    example = _example()
    log = "\n".join(
        ["(TaskRunner pid=1) starting"] * 5
        + [
            "(TaskRunnerV1 pid=1) verl/workers/engine/__init__.py:32: UserWarning: torchtitan engine is not available: "
            "ModuleNotFoundError(\"No module named 'torchtitan'\")"
        ]
        + ["(WorkerDict pid=2) ValueError: micro batch size 32 does not divide the mini-batch 16"]
        + [f"(raylet) line {i}" for i in range(100)]
    )
    shown = example.error_excerpt(log, tail_lines=10)
    assert "ValueError: micro batch size 32 does not divide the mini-batch 16" in shown
    assert "(raylet) line 99" in shown and "(raylet) line 89" not in shown
    assert "starting" not in shown and "torchtitan" not in shown


# ----------------------------------------------------------------------------- engine_kwargs.vllm.max_logprobs
def _topk_config(max_logprobs=None, topk=4) -> dict:
    rollout = {"name": "vllm", "custom": {"dppo_topk": topk}}
    if max_logprobs is not None:
        rollout["engine_kwargs"] = {"vllm": {"max_logprobs": max_logprobs}}
    actor = {
        "policy_loss": {"loss_mode": "dppo_topk_tv"},
        "strategy": "fsdp2",
        "clip_ratio_low": 0.15,
        "clip_ratio_high": 0.15,
    }
    return {"actor_rollout_ref": {"actor": actor, "rollout": rollout}}


def test_max_logprobs_minus_one_is_no_cap():
    """vLLM's max_logprobs=-1 means no cap: any K passes (it was refused as 'more than vLLM returns (-1)')."""
    validate(_topk_config(max_logprobs=-1, topk=64))
    validate(_topk_config(max_logprobs=64, topk=64))
    with pytest.raises(ValueError, match=r"dppo_topk=65 is more than vLLM returns \(max_logprobs=64\)"):
        validate(_topk_config(max_logprobs=64, topk=65))
    with pytest.raises(ValueError, match=r"dppo_topk=21 is more than vLLM returns \(max_logprobs=20\)"):
        validate(_topk_config(topk=21))  # unset: vLLM's default, 20


@pytest.mark.parametrize("value", ["lots", "20", 2.5, True, -2])
def test_max_logprobs_that_is_not_a_count_is_refused_by_name(value):
    with pytest.raises(
        ValueError, match=r"engine_kwargs\.vllm\.max_logprobs must be an int >= 0 .* or -1 \(no cap\), got "
    ):
        validate(_topk_config(max_logprobs=value))


POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"
TARGET = f"{POLICY_LOSS}._target_=dppo_ext.integrations.verl.policy_loss_config.DPPOPolicyLossConfig"


@pytest.mark.parametrize(
    "settings, match",
    [
        (["dppo_mask_direction=both"], r"policy_loss\.dppo_mask_direction must be one of \('advantage', 'symmetric'\)"),
        (["dppo_kl_tau=-0.1"], r"policy_loss\.dppo_kl_tau must be a finite number >= 0 \(0: no penalty\), got -0.1"),
        (["dppo_kl_mask_type=kept"], r"policy_loss\.dppo_kl_mask_type must be one of \('all', 'unmasked', 'masked'\)"),
        (["dppo_sequence_mask.statistic=k1"], r"policy_loss\.dppo_sequence_mask takes the fields .*statistic and"),
        (
            ["dppo_sequence_mask.statistic=k5", "dppo_sequence_mask.reduce=sum", "dppo_sequence_mask.high=1.0"],
            r"policy_loss\.dppo_sequence_mask: SequenceMask statistic must be one of \('k1', 'k2', 'k3', 'tv'\)",
        ),
        (["dppo_logits_dtype=fp32"], r"policy_loss\.dppo_logits_dtype must be None \(the model's dtype\) or 'float32'"),
    ],
)
def test_the_mask_family_settings_are_checked_by_name(tmp_path, settings, match):
    """The DPPO settings of verl's policy_loss (DPPOPolicyLossConfig) are refused in the driver, naming the setting,
    the value and what is expected; good values pass."""
    base = _overrides(tmp_path, mode="dppo_tv") + [TARGET]
    with pytest.raises(ValueError, match=match):
        validate(tree(base + [f"+{POLICY_LOSS}.{setting}" for setting in settings]))
    good = ["dppo_mask_direction=symmetric", "dppo_kl_tau=0.001", "dppo_kl_mask_type=unmasked"]
    good += ["dppo_sequence_mask.statistic=k3", "dppo_sequence_mask.reduce=mean", "dppo_sequence_mask.high=0.01"]
    validate(tree(base + [f"+{POLICY_LOSS}.{setting}" for setting in good]))


def test_the_mask_family_settings_need_the_plugins_policy_loss_class(tmp_path, caplog):
    """verl's own PolicyLossConfig refuses keys it lacks when a worker builds it: the driver says which target takes
    them; for a loss mode not the plugin's they are not read, and a warning says so."""
    base = _overrides(tmp_path, mode="dppo_topk_tv") + [f"+{POLICY_LOSS}.dppo_kl_tau=0.01"]
    with pytest.raises(ValueError, match=rf"sets \['dppo_kl_tau'\], .*: set {re.escape(TARGET)}"):
        validate(tree(base + [f"{POLICY_LOSS}._target_=verl.workers.config.PolicyLossConfig"]))
    validate(tree(base + [TARGET]))
    validate(tree(base + [TARGET, f"{MODE_KEY}=vanilla"]))
    assert "['dppo_kl_tau']: read by the plugin's loss modes only, not by loss_mode='vanilla'" in caplog.text
