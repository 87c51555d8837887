"""The verl plugin: importing this module installs dppo_ext's loss modes into verl (verl imports it for you).

``pip install dppo_ext[verl]`` declares this module as a ``verl.plugins`` entry point, which ``import verl`` loads
in every process (the driver, the actor workers, the rollout servers). It changes nothing until verl imports the
module concerned (:mod:`dppo_ext.integrations.verl.import_hooks`), and then:

* ``verl.utils.config``: ``validate_config``, which ``verl.trainer.main_ppo`` calls on the composed config in the
  driver before Ray starts, also checks the plugin's settings (:func:`dppo_ext.integrations.verl.config.validate`);
* ``verl.trainer.ppo.core_algos``: registers ``dppo_topk_tv`` / ``dppo_topk_kl`` as policy losses, so verl's
  config checks know the names; these registry entries only raise (with the reason) if verl ever calls them, which
  happens when the engine path below was not taken (verl's distillation loss, a non-FSDP engine);
* ``verl.workers.engine_workers``: the actor's loss becomes :func:`dppo_ext.integrations.verl.loss.ppo_loss`
  (verl's own ``ppo_loss`` for every loss mode but ``dppo_topk_tv``, ``dppo_topk_kl``, ``dppo_tv``, ``dppo_kl``);
* ``verl.workers.engine.fsdp.transformer_impl``: ``FSDPEngineWithLMHead.forward_step`` marks the micro-batches of
  those modes so that the engine hands the logits to the loss (verl's top-K distillation path), skips its own
  log-prob and entropy passes over the vocabulary, and refuses the setups the loss does not support;
* ``verl.workers.rollout.vllm_rollout.vllm_async_server``: the vLLM server returns the top-K log-probs
  (:mod:`dppo_ext.integrations.verl.rollout`);
* ``verl.experimental.agent_loop.agent_loop``: ``AgentLoopOutput.as_dict``, which the V1 trainer's agent loop
  (``AgentLoopWorkerTQ``) stores into TransferQueue, turns the top-K into two per-token tensors of the sample
  (:mod:`dppo_ext.integrations.verl.rollout`), where the legacy agent loop carries it in ``non_tensor_batch``.

A change that cannot be installed (a verl release whose internals differ) is logged at ERROR level and makes the
plugin's loss modes raise that error when a run asks for them; runs with other loss modes are unaffected. This
module itself imports only the standard library, ``packaging`` and three small modules of this package, so that
verl's plugin loader (which reports a failing plugin at debug level only) has nothing to swallow; dppo_ext's
native library is loaded by the first loss call.
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) turns the plugin off.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ._status import SUPPORTED_VERL, check_installed, installed, record
from .config import check_mask_settings, validate
from .import_hooks import when_imported

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_VERL", "TOPK_LOSS_MODES", "check_installed", "install", "installed"]

TOPK_LOSS_MODES = ("dppo_topk_tv", "dppo_topk_kl")


def _guarded(name: str, patch: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    """``patch`` that never raises into verl's import: a failure is logged and kept for ``check_installed``."""

    def run(module: ModuleType) -> None:
        try:
            patch(module)
        except Exception as exc:  # a verl release whose internals differ: say so, keep verl importable
            record(name, f"{type(exc).__name__}: {exc}")
            logger.error(
                "dppo_ext could not change %s (%s: %s); in this process the plugin's loss modes (%s, and "
                "dppo_tv/dppo_kl on the FSDP engine) raise this error when a run asks for them",
                name,
                type(exc).__name__,
                exc,
                ", ".join(TOPK_LOSS_MODES),
            )
        else:
            record(name, None)

    return run


def _registry_entry(name: str) -> Callable[..., Any]:
    def unavailable(*args: Any, **kwargs: Any):
        check_installed()
        raise RuntimeError(
            f"verl called the policy loss {name!r} through its registry, that is with the log-probs only: dppo_ext "
            "computes it from the logits inside verl's FSDP engine (actor strategy fsdp or fsdp2), which this run "
            "does not use or bypassed (verl's distillation loss is not supported together with it); see docs/verl.md"
        )

    unavailable.__dppo_ext__ = True
    return unavailable


def _patch_core_algos(module: ModuleType) -> None:
    for name in TOPK_LOSS_MODES:
        if name not in module.POLICY_LOSS_REGISTRY:
            module.register_policy_loss(name)(_registry_entry(name))


def _patch_engine_workers(module: ModuleType) -> None:
    from . import loss

    if module.ppo_loss is not loss.ppo_loss:
        module.ppo_loss = loss.ppo_loss


def _plugin_mode(loss_function: Any) -> str | None:
    """The plugin's loss mode ``loss_function`` computes, or None (a ``partial(ppo_loss, config=actor_config)``)."""
    from . import loss

    if not (isinstance(loss_function, functools.partial) and loss_function.func is loss.ppo_loss):
        return None
    mode = loss.loss_mode(loss_function.keywords["config"])
    return mode if mode in loss.VERL_MODES else None


def _patch_fsdp_engine(module: ModuleType) -> None:
    from verl.utils import tensordict_utils as tu

    from . import loss

    engine_cls = module.FSDPEngineWithLMHead
    forward_step = engine_cls.forward_step
    if getattr(forward_step, "__dppo_ext__", False):
        return

    @functools.wraps(forward_step)
    def dppo_forward_step(self, micro_batch, loss_function, forward_only):
        mode = _plugin_mode(loss_function)
        if mode is not None:
            check_installed()
            unsupported = [
                (
                    tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False),
                    "actor_rollout_ref.model.use_fused_kernels=True (the fused kernels never form the logits)",
                ),
                (self.pad_to_length, "engine pad_to_length=True"),
                (self.use_ulysses_sp, "ulysses_sequence_parallel_size > 1"),
            ]
            for flag, what in unsupported:
                if flag:
                    raise RuntimeError(f"loss_mode={mode} (dppo_ext) does not support {what}; see docs/verl.md")
            wants_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
            tu.assign_non_tensor(
                micro_batch,
                **{loss.ENTROPY_FLAG: bool(wants_entropy)},
                calculate_entropy=False,
                distillation_use_topk=True,
                distillation_only=True,
            )
            if check_mask_settings(loss_function.keywords["config"].policy_loss).logits_dtype == "float32":
                # the old-log-prob pass and the update alike: both come through here with the actor's config
                import torch

                from dppo_ext.models.lm_head import widened_head

                with widened_head(self.module, torch.float32):
                    return forward_step(self, micro_batch, loss_function, forward_only)
        return forward_step(self, micro_batch, loss_function, forward_only)

    dppo_forward_step.__dppo_ext__ = True
    engine_cls.forward_step = dppo_forward_step


def _patch_vllm_server(module: ModuleType) -> None:
    from .rollout import patch_vllm_server

    patch_vllm_server(module)


def _patch_agent_loop(module: ModuleType) -> None:
    from .rollout import patch_agent_loop_output

    patch_agent_loop_output(module)


def _patch_validate_config(module: ModuleType) -> None:
    validate_config = module.validate_config
    if getattr(validate_config, "__dppo_ext__", False):
        return

    @functools.wraps(validate_config)
    def validate_with_dppo(config, *args: Any, **kwargs: Any):
        validate(config)
        return validate_config(config, *args, **kwargs)

    validate_with_dppo.__dppo_ext__ = True
    module.validate_config = validate_with_dppo


def install() -> None:
    """Register the changes (idempotent; :mod:`dppo_ext.integrations.verl.plugin` calls it on import)."""
    try:
        verl_version = Version(version("verl"))
    except PackageNotFoundError:
        verl_version = None
    if verl_version is not None and verl_version not in SpecifierSet(SUPPORTED_VERL):
        logger.warning("dppo_ext's verl plugin is tested with verl %s, this is verl %s", SUPPORTED_VERL, verl_version)
    for name, patch in (
        ("verl.utils.config", _patch_validate_config),
        ("verl.trainer.ppo.core_algos", _patch_core_algos),
        ("verl.workers.engine_workers", _patch_engine_workers),
        ("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine),
        ("verl.workers.rollout.vllm_rollout.vllm_async_server", _patch_vllm_server),
        ("verl.experimental.agent_loop.agent_loop", _patch_agent_loop),
    ):
        when_imported(name, _guarded(name, patch))


install()
