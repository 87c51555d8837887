"""Test-only setup that runs verl's own objects on a CPU machine (imported by the verl tests, needs verl).

What it changes, all through verl's public extension points, none of verl's code edited:

* :class:`CPUPlatform` is a ``verl.plugin.platform.PlatformBase`` whose device is ``"cpu"`` and whose collective
  backend is gloo, installed with ``verl.plugin.platform.set_platform`` before the engine modules cache the device
  name (verl ships CUDA, ROCm and NPU platforms only; the FSDP engine otherwise stops at ``torch.cuda.set_device``).
  Its ``device_module`` answers the memory queries of verl's logging with zeros.
* The FSDP engine is built directly (``FSDPEngineWithLMHead(...)``): ``EngineRegistry`` lists it for cuda/npu
  devices only.
* The tiny model is dppo_ext's own (``dppo_ext.models.tiny``, no download) with ``sdpa`` attention.

:func:`actor_batch` builds a micro-batch source the way verl's ``RayPPOTrainer._update_actor`` does (a ``DataProto``
of left-padded prompts and right-padded responses, ``to_tensordict``, ``left_right_2_no_padding``, the same
non-tensor flags) and :func:`train_flags` adds the keys ``TrainingWorker.train_batch`` injects.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import types
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from verl.plugin.platform import PlatformBase, set_platform


class CPUPlatform(PlatformBase):
    """verl's device abstraction pointed at the CPU (gloo collectives, no memory statistics)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = types.SimpleNamespace(
        memory_allocated=lambda *a: 0,
        memory_reserved=lambda *a: 0,
        max_memory_allocated=lambda *a: 0,
        max_memory_reserved=lambda *a: 0,
        mem_get_info=lambda *a: (0, 0),
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        current_device=lambda: "cpu",
        is_available=lambda: True,
        device_count=lambda: 1,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        set_device=lambda *a: None,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
    )

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield


def use_cpu_platform() -> None:
    set_platform(CPUPlatform())


def init_process_group() -> None:
    """A one-process gloo group (the FSDP engine asks torch.distributed for its rank and world size)."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config composed by hydra with ``overrides``, as ``verl.trainer.main_ppo`` reads it."""
    return copy.deepcopy(_compose(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple[str, ...]):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def actor_overrides(
    model_dir: str, loss_mode: str, *, use_remove_padding: bool, micro_batch_size: int = 2, bf16: bool = False
) -> list[str]:
    """The user's command-line overrides of a tiny CPU run (fsdp2, sdpa attention, no torch.compile)."""
    dtype = "bf16" if bf16 else "fp32"
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={use_remove_padding}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.optim.lr=0.01",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.total_training_steps=10",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={{param_dtype:{dtype},reduce_dtype:fp32,"
        "buffer_dtype:fp32}",
        "actor_rollout_ref.rollout.n=1",
    ]


def actor_config_for(loss_mode: str, **fields):
    """verl's actor config (``FSDPActorConfig``) for ``loss_mode``, with ``actor.<name>=<value>`` overrides."""
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    overrides += [f"actor_rollout_ref.actor.{name}={value}" for name, value in fields.items()]
    return omega_conf_to_dataclass(compose(overrides).actor_rollout_ref.actor)


def build_actor(config):
    """``(engine, actor_config)`` built as ``ActorRolloutRefWorker.init_model`` builds the actor, on the CPU.

    ``config`` is :func:`compose`'s result; the engine is verl's ``FSDPEngineWithLMHead``, initialised.
    """
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    model_config.model_type = "language_model"
    engine_config = actor_config.engine
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    engine_config.micro_batch_size_per_gpu = config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    engine = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    engine.initialize()
    return engine, actor_config


@dataclass
class RolloutBatch:
    """The padded tensors of a batch (``prompts`` left-padded, ``responses`` right-padded) and its top-K."""

    prompts: torch.Tensor  # [B, P]
    prompt_mask: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    rollout_log_probs: torch.Tensor  # [B, R]
    old_log_probs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    topk: Optional[list]  # B RolloutTopK (None entries allowed)


def actor_batch(batch: RolloutBatch, *, temperature: float, calculate_entropy: bool = False):
    """The TensorDict ``RayPPOTrainer._update_actor`` hands to the actor (verl's own conversion functions)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    attention_mask = torch.cat([batch.prompt_mask, (batch.response_mask > 0).long()], dim=1)
    input_ids = torch.cat([batch.prompts, batch.responses], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "prompts": batch.prompts,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "old_log_probs": batch.old_log_probs,
        "advantages": batch.advantages,
        "rollout_log_probs": batch.rollout_log_probs,
    }
    non_tensors = {}
    if batch.topk is not None:
        arr = np.empty(len(batch.topk), dtype=object)
        arr[:] = batch.topk
        non_tensors["dppo_topk"] = arr
    proto = DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": temperature, "multi_turn": False}
    )
    data = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(
        data,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=len(batch.responses),
        compute_loss=True,
    )
    return data


def train_flags(data, *, use_remove_padding: bool, micro_batch_size: int):
    """The keys ``TrainingWorker.train_batch`` injects before ``engine.train_batch``."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        data,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=4096,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
    )
    return data
