"""How verl finds and loads the plugin, and how it fails: loudly, never by silently dropping the loss modes.

* The ``verl.plugins`` entry point declared in pyproject.toml is loaded by ``import verl`` itself (a subprocess
  sees dppo_ext as an installed distribution with exactly that entry point): the loss modes are in verl's policy
  loss registry and the actor's loss is the plugin's. With verl's ``VERL_USE_EXTERNAL_PLUGINS=none`` (the plugin
  absent) asking for ``dppo_topk_tv`` fails with verl's "Unsupported loss mode".
* A verl whose internals differ (here: the FSDP engine class removed before the plugin loads) gets an ERROR log
  and the loss modes raise that error when used.
* The registry entries raise when verl calls them with log-probs only (verl's distillation loss, other engines),
  and the engine hook refuses the setups the loss does not support.

Skipped when verl is not installed.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("verl")

import verl_cpu  # noqa: E402

verl_cpu.use_cpu_platform()

from dppo_testing import child_env  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

import dppo_ext.integrations.verl.plugin as plugin  # noqa: E402
from dppo_ext.integrations.verl import loss as vloss  # noqa: E402
from dppo_ext.integrations.verl.rollout import topk_from_rollout_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def installed_as_distribution(tmp_path: Path) -> Path:
    """A folder that makes ``importlib.metadata`` see dppo_ext with the entry points of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project["entry-points"]
    assert "verl.plugins" in groups, "pyproject.toml declares no verl.plugins entry point"
    dist = tmp_path / "dppo_ext-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dppo_ext\nVersion: 0.0.0\n")
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    site = installed_as_distribution(tmp_path)
    environ = child_env(**env)
    environ["PYTHONPATH"] = f"{site}:{environ['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.slow
def test_import_verl_loads_the_entry_point(tmp_path):
    result = run_python(
        """
        import verl
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
        import verl.workers.engine_workers as engine_workers
        print("registered", all(name in POLICY_LOSS_REGISTRY for name in ("dppo_topk_tv", "dppo_topk_kl")))
        print("loss", engine_workers.ppo_loss.__module__)
    """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "registered True" in result.stdout
    assert "loss dppo_ext.integrations.verl.loss" in result.stdout


@pytest.mark.slow
def test_without_the_plugin_verl_refuses_the_modes(tmp_path):
    result = run_python(
        """
        import verl
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        import verl.workers.engine_workers as engine_workers
        print("loss", engine_workers.ppo_loss.__module__)
        get_policy_loss_fn("dppo_topk_tv")
    """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert result.returncode != 0
    assert "loss verl.workers.utils.losses" in result.stdout
    assert "Unsupported loss mode: dppo_topk_tv" in result.stderr


@pytest.mark.slow
def test_a_change_that_cannot_be_installed_is_reported_and_raised(tmp_path):
    result = run_python(
        """
        import verl  # the entry point is switched off, the plugin is imported below, after the change
        import verl.workers.engine.fsdp.transformer_impl as impl
        del impl.FSDPEngineWithLMHead  # a verl release without this class
        import dppo_ext.integrations.verl.plugin  # its hooks run at once on the modules already imported
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        get_policy_loss_fn("dppo_topk_kl")()
    """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert result.returncode != 0
    assert "ERROR" in result.stderr and "could not change verl.workers.engine.fsdp.transformer_impl" in result.stderr
    assert "RuntimeError: dppo_ext's verl plugin is not fully installed" in result.stderr


def test_registry_entries_raise_when_verl_calls_them_with_log_probs():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    for name in plugin.TOPK_LOSS_MODES:
        with pytest.raises(RuntimeError, match="computes it from the logits inside verl's FSDP engine"):
            get_policy_loss_fn(name)(old_log_prob=None, log_prob=None, advantages=None, response_mask=None)


def _engine_stub(pad_to_length=False, use_ulysses_sp=False):
    return types.SimpleNamespace(pad_to_length=pad_to_length, use_ulysses_sp=use_ulysses_sp)


@pytest.mark.parametrize(
    "setup, match",
    [
        (dict(fused=True), "use_fused_kernels"),
        (dict(pad_to_length=True), "pad_to_length"),
        (dict(use_ulysses_sp=True), "ulysses_sequence_parallel_size"),
    ],
)
def test_engine_hook_refuses_unsupported_setups(setup, match):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    assert getattr(FSDPEngineWithLMHead.forward_step, "__dppo_ext__", False)
    micro_batch = TensorDict({}, batch_size=[0])
    tu.assign_non_tensor(micro_batch, use_fused_kernels=setup.pop("fused", False))
    loss_fn = functools.partial(vloss.ppo_loss, config=verl_cpu.actor_config_for("dppo_topk_tv"))
    with pytest.raises(RuntimeError, match=match):
        FSDPEngineWithLMHead.forward_step(_engine_stub(**setup), micro_batch, loss_fn, False)


def test_engine_hook_marks_only_the_plugins_micro_batches():
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    seen = {}

    def forward_step(self, micro_batch, loss_function, forward_only):
        seen["distillation_use_topk"] = tu.get_non_tensor_data(micro_batch, "distillation_use_topk", None)
        return "ran"

    for loss_fn in (
        functools.partial(verl_ppo_loss, config=verl_cpu.actor_config_for("dppo_topk_tv")),
        functools.partial(vloss.ppo_loss, config=verl_cpu.actor_config_for("vanilla")),
    ):
        assert _call_wrapper(forward_step, TensorDict({}, batch_size=[0]), loss_fn) == "ran"
        assert seen["distillation_use_topk"] is None
    micro_batch = TensorDict({}, batch_size=[0])
    tu.assign_non_tensor(micro_batch, calculate_entropy=True)
    loss_fn = functools.partial(vloss.ppo_loss, config=verl_cpu.actor_config_for("dppo_topk_tv"))
    assert _call_wrapper(forward_step, micro_batch, loss_fn) == "ran"
    assert seen["distillation_use_topk"] is True
    assert tu.get_non_tensor_data(micro_batch, "distillation_only", None) is True
    assert tu.get_non_tensor_data(micro_batch, "calculate_entropy", None) is False  # the op computes it instead
    assert tu.get_non_tensor_data(micro_batch, vloss.ENTROPY_FLAG, None) is True


def _call_wrapper(inner, micro_batch, loss_fn):
    """The plugin's forward_step wrapper around ``inner`` (a fresh class, so verl's engine class is untouched)."""
    fake_module = types.SimpleNamespace(FSDPEngineWithLMHead=type("Engine", (), {"forward_step": inner}))
    plugin._patch_fsdp_engine(fake_module)
    return fake_module.FSDPEngineWithLMHead.forward_step(_engine_stub(), micro_batch, loss_fn, False)


@pytest.mark.parametrize("value", [0, -3, "5", 2.0, True])
def test_bad_topk_setting_is_named(value):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.custom\.dppo_topk must be an int >= 1"):
        topk_from_rollout_config({"custom": {"dppo_topk": value}})


def test_topk_setting_from_verls_rollout_config():
    from verl.utils.config import omega_conf_to_dataclass

    name = "actor_rollout_ref.rollout.name=vllm"
    config = verl_cpu.compose([name, "+actor_rollout_ref.rollout.custom.dppo_topk=7"])
    assert topk_from_rollout_config(omega_conf_to_dataclass(config.actor_rollout_ref.rollout)) == 7
    plain = verl_cpu.compose([name])
    assert topk_from_rollout_config(omega_conf_to_dataclass(plain.actor_rollout_ref.rollout)) == 0


# ---- config-time validation (verl's validate_config, in the driver before Ray starts) ---------------------------

TOPK_RUN = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk_tv",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.name=vllm",
    "+actor_rollout_ref.rollout.custom.dppo_topk=4",
    "actor_rollout_ref.actor.clip_ratio_low=0.15",
    "actor_rollout_ref.actor.clip_ratio_high=0.15",
]


def _with(overrides: list[str], *changes: str) -> list[str]:
    """``overrides`` with each ``key=value`` of ``changes`` replacing the same key (or added); ``~key`` drops it."""
    keys = {c.split("=", 1)[0].lstrip("+~") for c in changes}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in keys]
    return kept + [c for c in changes if not c.startswith("~")]


def test_a_valid_topk_config_and_a_config_without_the_plugin_pass():
    from dppo_ext.integrations.verl.config import validate

    # vLLM's max_logprobs=-1 means no cap: any K passes
    validate(
        verl_cpu.compose(
            _with(
                TOPK_RUN,
                "+actor_rollout_ref.rollout.custom.dppo_topk=64",
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=-1",
            )
        )
    )
    validate(verl_cpu.compose(TOPK_RUN))
    validate(verl_cpu.compose(["actor_rollout_ref.actor.strategy=fsdp2"]))  # vanilla PPO: nothing to check
    validate(verl_cpu.compose(_with(TOPK_RUN, "algorithm.rollout_correction.bypass_mode=True")))  # V1 keeps the mode


@pytest.mark.parametrize(
    "changes, match",
    [
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk_TV"], r"loss_mode='dppo_topk_TV'.*'dppo_topk_tv'"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_topk"], r"loss_mode='dppo_topk' is not a DPPO loss mode"),
        (["+actor_rollout_ref.rollout.custom.dppo_topk=0"], r"custom\.dppo_topk must be an int >= 1.*got 0"),
        (["+actor_rollout_ref.rollout.custom.dppo_topk=abc"], r"custom\.dppo_topk must be an int >= 1.*got 'abc'"),
        (["+actor_rollout_ref.rollout.custom.dppo_topk=2.5"], r"custom\.dppo_topk must be an int >= 1.*got 2\.5"),
        (
            ["+actor_rollout_ref.rollout.custom.dppo_topk=25"],
            r"dppo_topk=25 is more than vLLM returns \(max_logprobs=20\)",
        ),
        (
            ["+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=lots"],
            r"engine_kwargs\.vllm\.max_logprobs must be an int >= 0 .* or -1 \(no cap\), got 'lots'",
        ),
        (
            ["+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=-2"],
            r"engine_kwargs\.vllm\.max_logprobs must be an int >= 0 .*got -2",
        ),
        (
            ["~actor_rollout_ref.rollout.custom.dppo_topk"],
            r"needs the rollout's top-K log-probs: set \+actor_rollout_ref\.rollout\.custom\.dppo_topk=K",
        ),
        (
            ["actor_rollout_ref.actor.clip_ratio_low=null", "actor_rollout_ref.actor.clip_ratio=null"],
            r"clip_ratio_low is None and so is its fallback actor_rollout_ref\.actor\.clip_ratio",
        ),
        (["actor_rollout_ref.actor.clip_ratio_high=-0.1"], r"clip_ratio_high must be a finite number >= 0.*got -0\.1"),
        (
            ["actor_rollout_ref.actor.clip_ratio_high=null", "actor_rollout_ref.actor.clip_ratio=nan"],
            r"actor\.clip_ratio \(the fallback of actor_rollout_ref\.actor\.clip_ratio_high.*got nan",
        ),
        (["actor_rollout_ref.actor.clip_ratio_c=0"], r"clip_ratio_c must be a number > 0.*got 0"),
        (["actor_rollout_ref.rollout.name=sglang"], r"needs verl's vLLM rollout.*got name='sglang'"),
        (["actor_rollout_ref.actor.strategy=megatron"], r"strategy=fsdp or fsdp2\), got strategy='megatron'"),
        (["actor_rollout_ref.model.use_fused_kernels=True"], r"does not support actor_rollout_ref\.model\.use_fused"),
        (
            ["algorithm.rollout_correction.bypass_mode=True", "trainer.use_v1=False"],
            r"bypass_mode=True with the legacy trainer \(trainer\.use_v1=False\) replaces",
        ),
    ],
)
def test_bad_settings_are_refused_by_name_at_config_time(changes, match):
    from dppo_ext.integrations.verl.config import validate

    with pytest.raises(ValueError, match=match):
        validate(verl_cpu.compose(_with(TOPK_RUN, *changes)))


def test_the_loss_names_a_missing_threshold():
    """Issue 29 row 10: clip_ratio_low=None with clip_ratio=None used to raise a TypeError naming no setting."""
    config = verl_cpu.actor_config_for("dppo_tv", clip_ratio_low="null", clip_ratio="null")
    with pytest.raises(ValueError, match=r"clip_ratio_low is None and so is its fallback"):
        vloss.settings(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, message",
    [
        (
            "+actor_rollout_ref.rollout.custom.dppo_topk=0",
            "actor_rollout_ref.rollout.custom.dppo_topk must be an int >= 1",
        ),
        # issue 38 row 4: our own name passed with a warning and failed after 188 s
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=binary_tv",
            "loss_mode='binary_tv' is dppo_ext's name, not a verl loss mode: in verl the plugin computes it as "
            "loss_mode=dppo_tv",
        ),
    ],
)
def test_main_ppo_refuses_a_bad_setting_before_ray_starts(tmp_path, change, message):
    """The documented command: ``python -m verl.trainer.main_ppo`` stops in verl's validate_config, before
    ``ray.init``, with the plugin's message (verl alone accepts these configs and fails at the first update)."""
    site = installed_as_distribution(tmp_path)
    environ = child_env()
    environ["PYTHONPATH"] = f"{site}:{environ['PYTHONPATH']}"
    overrides = _with(TOPK_RUN, change)
    result = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert "ray init kwargs" not in result.stdout


@pytest.mark.parametrize(
    "mode, workers", [("dppo_topk_tv", 1), ("dppo_topk_kl", 1), ("dppo_tv", 1), ("dppo_kl", 1), ("dppo_topk_tv", 2)]
)
def test_the_example_command_passes_verls_config_checks(tmp_path, mode, workers):
    """examples/verl_dppo.py's overrides (CPU and GPU recipes, every mode, one and two data-parallel workers) compose
    with verl's ppo_trainer config and pass verl's validate_config with the plugin's checks, as main_ppo runs them
    before Ray starts (validate_config runs verl's batch-size checks with n_gpus, ActorConfig.validate included)."""
    import importlib.util

    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    spec = importlib.util.spec_from_file_location("verl_dppo", ROOT / "examples" / "verl_dppo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for device in ("cpu", "gpu"):
        args = example.build_parser().parse_args(["--device", device, "--mode", mode, "--workers", str(workers)])
        config = verl_cpu.compose(
            example.overrides(tmp_path / "model", tmp_path / "t.parquet", tmp_path / "v.parquet", args)
        )
        assert getattr(validate_config, "__dppo_ext__", False)
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        assert config.trainer.use_v1 and config.actor_rollout_ref.actor.policy_loss.loss_mode == mode
        assert config.trainer.n_gpus_per_node == workers
        topk = OmegaConf.select(config, "actor_rollout_ref.rollout.custom.dppo_topk")
        assert topk == (4 if mode.startswith("dppo_topk") else None)
        # what train_mini_batch (verl/workers/engine_workers.py) asserts on each data-parallel rank
        mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
        assert mini % workers == 0
        assert (mini // workers) % config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 0


def test_example_parses_verls_console_step_lines():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_dppo", ROOT / "examples" / "verl_dppo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    step, metrics = example.parse_step_line(
        "(TaskRunnerV1 pid=1) step:2 - actor/pg_loss:-0.125 - actor/dppo_masked_frac:0.0625 - timing_s/gen:1.5"
    )
    assert step == 2 and metrics == {"actor/pg_loss": -0.125, "actor/dppo_masked_frac": 0.0625, "timing_s/gen": 1.5}
    assert example.parse_step_line("no step here") is None
