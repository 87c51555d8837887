"""Test-only setup that runs verl's own objects on a CPU machine (imported by the verl tests, needs verl).

What it changes, all through verl's public extension points, none of verl's code edited:

* :class:`CPUPlatform`, the ``verl.plugin.platform.PlatformBase`` of examples/verl_cpu_platform.py (device
  ``"cpu"``, gloo collectives, zeros for the memory queries of verl's logging), is installed with
  ``verl.plugin.platform.set_platform`` before the engine modules cache the device name (verl ships CUDA, ROCm and NPU
  platforms only; the FSDP engine otherwise stops at ``torch.cuda.set_device``).
* The FSDP engine is built directly (``FSDPEngineWithLMHead(...)``): ``EngineRegistry`` lists it for cuda/npu
  devices only.
* The tiny model is dppo_ext's own (``dppo_ext.models.tiny``, no download) with ``sdpa`` attention.

:func:`actor_batch` builds a micro-batch source the way verl's ``RayPPOTrainer._update_actor`` does (a ``DataProto``
of left-padded prompts and right-padded responses, ``to_tensordict``, ``left_right_2_no_padding``, the same
non-tensor flags) and :func:`train_flags` adds the keys ``TrainingWorker.train_batch`` injects.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from verl.plugin.platform import set_platform


def _example_platform_module():
    """examples/verl_cpu_platform.py, the CPU platform the end-to-end example runs verl with (one home for it).

    Imported without ``VERL_PLATFORM=cpu`` it only defines and registers the platform: none of its run-time bridges
    (gloo backend, engine registration, vLLM) is applied in the test process.
    """
    name = "verl_cpu_platform"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


CPUPlatform = _example_platform_module().CPUPlatform


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


def v1_sample_fields(batch: RolloutBatch) -> list[dict]:
    """Each sample's fields as verl's V1 agent loop stores them in TransferQueue.

    ``AgentLoopWorkerTQ._agent_loop_postprocess`` (verl/trainer/ppo/v1/agent_loop_tq.py): ``output.as_dict()`` of the
    single-turn ``AgentLoopOutput`` (with the plugin's change, the top-K as ``dppo_topk_ids`` / ``dppo_topk_logprobs``),
    then ``input_ids``, ``position_ids`` and ``loss_mask``. The V1 trainer later adds ``advantages`` and
    ``old_log_probs`` per sample.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.model import compute_position_id_with_mask

    fields = []
    for b in range(len(batch.responses)):
        prompt = batch.prompts[b][batch.prompt_mask[b].bool()]
        n = int(batch.response_mask[b].sum())
        extra = {"dppo_topk": batch.topk[b]} if batch.topk is not None else {}
        output = AgentLoopOutput(
            prompt_ids=prompt.tolist(),
            response_ids=batch.responses[b, :n].tolist(),
            response_mask=[1] * n,
            response_logprobs=batch.rollout_log_probs[b, :n].tolist(),
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields=extra,
        )
        field = output.as_dict()
        input_ids = torch.cat([field["prompts"], field["responses"]])
        field["input_ids"] = input_ids
        field["position_ids"] = compute_position_id_with_mask(torch.ones_like(input_ids)[None])[0]
        field["loss_mask"] = field["response_mask"]
        field["advantages"] = batch.advantages[b, :n].clone()
        field["old_log_probs"] = batch.old_log_probs[b, :n].clone()
        fields.append(field)
    return fields


def v1_actor_batch(batch: RolloutBatch, *, temperature: float, calculate_entropy: bool = False):
    """The TensorDict the V1 trainer's ``update_actor`` hands to the actor: the samples' TransferQueue fields stacked
    by verl's ``list_of_dict_to_tensordict`` (nested per-token tensors), with ``_update_actor``'s flags."""
    from verl.utils import tensordict_utils as tu

    data = tu.list_of_dict_to_tensordict(v1_sample_fields(batch))
    tu.assign_non_tensor(
        data,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=len(batch.responses),
        compute_loss=True,
        temperature=temperature,
    )
    return data
