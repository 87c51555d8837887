"""What keeps a transformers policy and an in-process vLLM engine computing the same function.

* :func:`policy_attn_implementation`: the attention implementation the trainer's model must be loaded with.
  vLLM applies attention-logit soft-capping where the config asks for it (Gemma2's ``attn_logit_softcapping``);
  transformers' SDPA and flash kernels ignore it, so log pi and log mu differ (2e-4 on issue 26's warm-started
  tiny Gemma2, 1.9e-6 with eager attention). Only transformers' eager attention applies it.
* :func:`engine_private_model_classes`: vLLM serves architectures it has no implementation of (OLMo2, OLMo3,
  Phi-1/2, GPT-NeoX, Starcoder2, SmolLM3 ...) through its Transformers backend, which builds the transformers base
  model class (``Olmo2Model``) and decorates that class in place for torch.compile (new bases, ``__init__`` and
  ``__call__``). A trainer model of the same class created afterwards then fails (``Current vLLM config is not
  set``) and one created before calls the patched ``__call__``. While the engine starts, the base model class is
  replaced, where transformers' auto classes look it up, by a private subclass; vLLM decorates that one and the
  process keeps the original.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["engine_private_model_classes", "policy_attn_implementation", "policy_load_kwargs"]

# Config fields of attention features that only transformers' eager attention implements.
EAGER_ONLY_ATTENTION = ("attn_logit_softcapping",)


def policy_attn_implementation(config: Any) -> str | None:
    """``"eager"`` when ``config`` (a transformers config) uses an attention feature only eager attention
    implements (:data:`EAGER_ONLY_ATTENTION`), else None (transformers' default)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if any(getattr(text, name, None) for name in EAGER_ONLY_ATTENTION):
        return "eager"
    return None


def policy_load_kwargs(model_path: str) -> dict[str, Any]:
    """Extra ``from_pretrained`` keyword arguments that make the trainer's model compute what vLLM samples from."""
    from transformers import AutoConfig

    implementation = policy_attn_implementation(AutoConfig.from_pretrained(model_path))
    if implementation is None:
        return {}
    logger.info(
        "loading %s with attn_implementation=%r: its config soft-caps attention logits, as vLLM does",
        model_path,
        implementation,
    )
    return {"attn_implementation": implementation}


def attention_hint(model: Any) -> str:
    """A note for the sync guard's error when ``model`` runs another attention than its config needs, else ''."""
    config = getattr(model, "config", None)
    wanted = policy_attn_implementation(config) if config is not None else None
    used = getattr(config, "_attn_implementation", None)
    if wanted is None or used == wanted:
        return ""
    return (
        f" (the trainer's model runs attn_implementation={used!r}, which ignores its config's attention "
        f"soft-capping; vLLM applies it: load the model with attn_implementation={wanted!r})"
    )


@contextlib.contextmanager
def engine_private_model_classes(hf_config: Any) -> Iterator[None]:
    """While the block starts a vLLM engine for ``hf_config``, transformers' auto classes hand out a private
    subclass of the architecture's base model class, so that vLLM's Transformers backend patches that subclass and
    not the class the trainer's model uses. A no-op for architectures without a base model class."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        base = MODEL_MAPPING[type(hf_config)]
    except (KeyError, ValueError):
        yield
        return
    package = importlib.import_module(base.__module__.rsplit(".", 1)[0])
    if getattr(package, base.__name__, None) is not base:
        yield
        return
    private = type(base.__name__, (base,), {"__module__": base.__module__, "__doc__": base.__doc__})
    setattr(package, base.__name__, private)
    try:
        yield
    finally:
        setattr(package, base.__name__, base)
    if any(b.__name__ == "TorchCompileWithNoGuardsWrapper" for b in base.__mro__):
        logger.warning(
            "vLLM patched the transformers class %s itself; trainer models of that class may fail", base.__qualname__
        )
