"""The weight-sync rule shared by the reference trainer's vLLM engine and the TRL integration.

A trainer holds a transformers model; vLLM holds its own implementation of the same architecture, whose
``load_weights`` takes (Hugging Face checkpoint name, tensor) pairs. What to send is decided once per engine from
the loaded vLLM model itself (:func:`plan_weight_sync`, run on the worker that holds it), never from a list of
architecture names:

* every name the trainer offers (its parameters and persistent buffers, plus the names a tied tensor is known by:
  ``lm_head.weight`` next to ``model.embed_tokens.weight``) goes through the vLLM model's own checkpoint-name
  mapper (``hf_to_vllm_mapper``: renamed modules, q/k/v and gate/up shards stacked into ``qkv_proj`` /
  ``gate_up_proj``) and, failing that, its ``packed_modules_mapping``; it is sent when it lands on a parameter or
  buffer of the vLLM model. A name that lands nowhere is dropped when it is another name of a tensor that is sent
  (vLLM's Gemma2 computes logits from the embedding and has no ``lm_head`` module), or when it is a buffer the
  trainer does not train; any other is an error.
* a tied LM head is sent under both names whenever the vLLM model has both, so the layer that holds the head is
  reloaded too (vLLM's CPU backend computes logits from a packed copy of the head made when that layer loads);
* every vLLM parameter must receive a tensor, and a stacked one all of its shards (a fused checkpoint tensor such
  as Phi-3's ``qkv_proj`` counts as all of them); shapes are checked where vLLM keeps the parameter unpacked.

The plan is checked before anything reaches vLLM, because vLLM's in-place reload first moves every layer to the
meta device: an error part-way would leave an engine that can no longer run. Should vLLM still fail while
loading, :func:`load_weights_into_vllm` reloads the engine's checkpoint from disk so the engine stays usable, and
raises.

:mod:`dppo_ext.rollout.sync_guard` then checks every sync end to end.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dppo_ext.rollout.vllm_logging import install_benign_warning_filters, note_buffer_only_layers

logger = logging.getLogger(__name__)

__all__ = [
    "SyncPlan",
    "WeightSyncError",
    "load_weights_into_vllm",
    "plan_weight_sync",
    "trainer_aliases",
    "vllm_sync_plan",
]


class WeightSyncError(ValueError):
    """The trainer's weights cannot be, or were not, carried into the vLLM engine (the message says which)."""


def trainer_aliases(model: torch.nn.Module, rename: Callable[[str], str] = str) -> dict[str, str]:
    """``{other name: first name}`` for every tensor of ``model`` known by more than one name (a tied LM head:
    ``{"lm_head.weight": "model.embed_tokens.weight"}``); ``rename`` maps module names to checkpoint names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = rename(name)
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


@dataclass(frozen=True)
class SyncPlan:
    """What one engine receives: the architecture, and for every trainer name the names it is sent under."""

    architecture: str
    sends: Mapping[str, tuple[str, ...]]
    dropped: tuple[str, ...] = ()
    # vLLM parameter name -> the trainer name whose value it holds (the ones the guard's diagnosis can compare).
    comparable: Mapping[str, str] = field(default_factory=dict)

    @property
    def num_tensors(self) -> int:
        """How many (name, tensor) pairs one sync sends."""
        return sum(len(names) for names in self.sends.values())


_UNRESOLVED = object()


def plan_weight_sync(
    vllm_model: torch.nn.Module,
    names: Sequence[str],
    *,
    shapes: Mapping[str, Sequence[int]],
    aliases: Mapping[str, str],
    trained: Iterable[str],
) -> SyncPlan:
    """Decide what to send to ``vllm_model`` (the loaded vLLM model, on its worker); raise before any loading.

    Args:
        vllm_model: the engine's model (``LLM.apply_model`` hands it over).
        names: the checkpoint names the trainer streams, each once.
        shapes: their shapes.
        aliases: other names of streamed tensors (:func:`trainer_aliases`), ``{alias: streamed name}``.
        trained: the names among ``names`` that are parameters (the others are buffers).

    Raises:
        WeightSyncError: a trainer parameter has no place in the vLLM model, a vLLM parameter (or one shard of a
            stacked one) would get no tensor, or a shape differs; the message names the parameter and the
            architecture.
    """
    arch = type(vllm_model).__name__
    params = dict(vllm_model.named_parameters(remove_duplicate=False))
    targets = {**dict(vllm_model.named_buffers(remove_duplicate=False)), **params}
    mapper = getattr(vllm_model, "hf_to_vllm_mapper", None)
    packed: Mapping[str, Sequence[str]] = getattr(vllm_model, "packed_modules_mapping", None) or {}
    trained = set(trained)
    note_buffer_only_layers(
        type(m).__name__
        for m in vllm_model.modules()
        if not m._parameters and any(b is not None for b in m._buffers.values())
    )

    def resolve(name: str) -> Any:
        mapped = mapper.map_name(name) if mapper is not None else name
        if mapped is None:
            return None  # the model's own mapper ignores it
        if mapped in targets:
            return mapped
        for packed_name, shards in packed.items():
            for shard in shards:
                candidate = mapped.replace(f".{shard}.", f".{packed_name}.")
                if candidate != mapped and candidate in targets:
                    return candidate
        return _UNRESOLVED

    sends: dict[str, list[str]] = {name: [] for name in names}
    # (name to try, streamed name whose tensor it carries): the streamed names, then the other names of their
    # tensors that the stream lacks (a tied head in a stream of named_parameters()).
    candidates = [(name, name) for name in names] + [
        (alias, source) for alias, source in aliases.items() if source in sends and alias not in sends
    ]
    resolved = {name: resolve(name) for name, _ in candidates}
    canonical = {name: aliases.get(name, name) for name, _ in candidates}
    placed = {canonical[name] for name, _ in candidates if resolved[name] not in (None, _UNRESOLVED)}
    landed: dict[str, list[tuple[str, str]]] = {}  # vLLM name -> (sent name, streamed trainer name)
    dropped: list[str] = []
    unplaced: list[str] = []
    for name, source in candidates:
        target = resolved[name]
        if target is _UNRESOLVED and name == source and source in trained and canonical[name] not in placed:
            unplaced.append(name)
        elif target is None or target is _UNRESOLVED:
            # ignored by the model's mapper, another name of a tensor that is sent (vLLM ties it itself), or a
            # buffer nobody trains (the engine keeps the checkpoint's)
            dropped.append(name)
        else:
            sends[source].append(name)
            landed.setdefault(target, []).append((name, source))
    if unplaced:
        raise WeightSyncError(
            f"the trainer model's parameter(s) {unplaced[:5]} have no counterpart in vLLM's {arch} (after its "
            f"checkpoint-name mapping); the trainer model and the engine's checkpoint must be the same architecture. "
            f"vLLM's {arch} has e.g. {sorted(params)[:5]}"
        )
    # A vLLM parameter tied to a loaded one under a name no trainer name reaches: send the tensor under the vLLM
    # name too when the mapper keeps that name, so that the layer holding it reloads (and repacks) as well.
    by_id: dict[int, list[str]] = {}
    for name, param in params.items():
        by_id.setdefault(id(param), []).append(name)
    for name in params:
        tied = [other for other in by_id[id(params[name])] if other in landed]
        if name not in landed and tied and resolve(name) == name:
            source = landed[tied[0]][0][1]
            sends[source].append(name)
            landed[name] = [(name, source)]
    missing = [name for name in params if not any(other in landed for other in by_id[id(params[name])])]
    if missing:
        raise WeightSyncError(
            f"vLLM's {arch} parameter(s) {missing[:5]} would get no tensor from the trainer model (it streams e.g. "
            f"{list(names)[:5]}); the engine would keep its old values there"
        )
    tp = _tensor_parallel_size()
    comparable: dict[str, str] = {}
    for target, pairs in landed.items():
        if target not in params:
            continue
        leaf = _module_leaf(target)
        got = sorted({_module_leaf(sent) for sent, _ in pairs})
        if leaf in packed and got != [leaf]:  # shards of a stacked parameter
            if sorted(packed[leaf]) != got:
                raise WeightSyncError(
                    f"vLLM's {arch} parameter {target!r} stacks {list(packed[leaf])}, but the trainer model sends "
                    f"only {got} for it ({[sent for sent, _ in pairs]})"
                )
            continue
        source = pairs[0][1]
        shape, vshape = tuple(shapes[source]), _loaded_shape(vllm_model, target, params[target])
        if tp == 1 and vshape is not None:
            if len(vshape) != len(shape) or vshape[1:] != shape[1:] or shape[:1] > vshape[:1]:
                raise WeightSyncError(
                    f"the trainer model's {source!r} has shape {list(shape)}, vLLM's {arch} parameter {target!r} "
                    f"{list(vshape)}: the trainer model and the engine's checkpoint differ in size"
                )
        if params[target].numel() > 0:
            comparable[target] = source
    return SyncPlan(
        architecture=arch,
        sends={name: tuple(dict.fromkeys(targets_)) for name, targets_ in sends.items() if targets_},
        dropped=tuple(dropped),
        comparable=comparable,
    )


def _loaded_shape(model: torch.nn.Module, name: str, param: torch.Tensor) -> tuple[int, ...] | None:
    """The shape ``param`` had when vLLM loaded it (its CPU backend repacks linear weights and leaves an empty
    parameter: vLLM's reload keeps the loaded shape in its layer metadata), or None when unknown."""
    if param.numel() > 0:
        return tuple(param.shape)
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        module_name, _, param_name = name.rpartition(".")
        info = LAYERWISE_INFO.get(model.get_submodule(module_name))
        meta = info.restore_metadata[0].get(param_name) if info is not None else None
    except (ImportError, AttributeError):
        return None
    return None if meta is None else tuple(meta.shape)


def _module_leaf(name: str) -> str:
    """``"model.layers.0.self_attn.q_proj.weight"`` -> ``"q_proj"``."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def _tensor_parallel_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, RuntimeError):
        return 1


def vllm_sync_plan(
    llm: Any,
    names: Sequence[str],
    shapes: Mapping[str, Sequence[int]],
    aliases: Mapping[str, str],
    trained: Iterable[str],
) -> SyncPlan:
    """:func:`plan_weight_sync` run on the worker(s) of ``llm`` (a ``vllm.LLM``); every worker must agree."""
    plans = llm.apply_model(
        functools.partial(
            plan_weight_sync, names=list(names), shapes=dict(shapes), aliases=dict(aliases), trained=list(trained)
        )
    )
    plan = plans[0]
    if any(p != plan for p in plans[1:]):
        raise WeightSyncError(f"vLLM's workers disagree on what {plan.architecture} loads: {plans}")
    logger.debug("weight sync plan for %s: %d tensors, dropped %s", plan.architecture, plan.num_tensors, plan.dropped)
    return plan


def plan_stream(
    plan: SyncPlan, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (trainer name, tensor) as the engine receives them: each under the names of ``plan``, floating
    tensors in ``dtype`` (an engine in a narrower dtype would round them on load anyway, with a warning each)."""
    dropped = set(plan.dropped)
    for name, tensor in weights:
        targets = plan.sends.get(name)
        if targets is None:
            if name in dropped:
                continue
            raise WeightSyncError(
                f"the trainer model streamed {name!r}, which the weight-sync plan for "
                f"{plan.architecture} does not know (its names changed since the plan was made)"
            )
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        for target in targets:
            yield target, tensor


def load_weights_into_vllm(
    llm: Any, plan: SyncPlan, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> None:
    """Stream ``weights`` through ``plan`` into ``llm`` by vLLM's in-place reload; reset its prefix cache.

    Should vLLM fail part-way, the engine's own checkpoint is reloaded from disk (vLLM would otherwise keep the
    layers it had not reached on the meta device) and :class:`WeightSyncError` raised.
    """
    install_benign_warning_filters()
    try:
        llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": plan_stream(plan, weights, dtype), "is_checkpoint_format": True},
        )
    except Exception as err:
        path = llm.llm_engine.model_config.model
        logger.error(
            "weight sync into vLLM's %s failed (%r); reloading the engine's checkpoint %s", plan.architecture, err, path
        )
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": None, "is_checkpoint_format": True})
            llm.reset_prefix_cache()
        except Exception as second:
            raise WeightSyncError(
                f"weight sync into vLLM's {plan.architecture} failed: {err!r}, and reloading its checkpoint "
                f"{path!r} failed too ({second!r}): the engine cannot run any more; create a new one"
            ) from err
        raise WeightSyncError(
            f"weight sync into vLLM's {plan.architecture} failed: {err!r}. The engine was reloaded from its "
            f"checkpoint {path!r}, so it runs, with the weights it started with"
        ) from err
    llm.reset_prefix_cache()
