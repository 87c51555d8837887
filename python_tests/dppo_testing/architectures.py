"""Tiny random models of the architectures users train, built from their transformers Config classes.

Every model has hidden size 128, 2 decoder layers, heads of at least 32 dims (vLLM's CPU attention backend rejects
smaller ones), the embedded character tokenizer of :mod:`dppo_ext.models.tiny` and its special-token ids, and is
written with ``save_pretrained`` so that both ``from_pretrained`` and vLLM load the folder. Each keeps what sets its
architecture apart in a weight sync or a forward: tied or untied LM head, QKV bias (Qwen2), q/k norms (Qwen3,
OLMo2), Llama-3 rope scaling, Gemma's scaled embeddings, Gemma2's attention and final soft-capping and sliding
window, Gemma3's local/global layers, Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` checkpoint tensors, OLMo2
(served by vLLM's Transformers backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dppo_ext.models.tiny import build_char_tokenizer


@dataclass(frozen=True)
class Architecture:
    """One tiny model: ``name`` (test id), the transformers config class and its settings; ``init_std``: the
    standard deviation of its random weights (transformers' ``initializer_range``), ten times transformers' 0.02
    for peaked next-token distributions (log-probs not all near ``-log(V)``, so a stale tensor moves them
    visibly), five times for Gemma2 and Gemma3, whose scaled embeddings and extra norms would otherwise put almost
    all mass on one token (entropy 0.03-0.07 nats at temperature 2)."""

    name: str
    config_class: str
    settings: dict[str, Any] = field(default_factory=dict)
    tied: bool = False
    init_std: float = 0.2


_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("qwen2_tied", "Qwen2Config", dict(tie_word_embeddings=True), tied=True),
        Architecture("qwen2_untied", "Qwen2Config", dict(tie_word_embeddings=False)),
        Architecture("qwen3", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), tied=True),
        Architecture(
            "llama3_tied",
            "LlamaConfig",
            dict(
                tie_word_embeddings=True,
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=32,
                ),
            ),
            tied=True,
        ),
        Architecture("gemma", "GemmaConfig", dict(head_dim=32, tie_word_embeddings=True), tied=True),
        Architecture(
            "gemma2",
            "Gemma2Config",
            dict(
                head_dim=32,
                query_pre_attn_scalar=32,
                sliding_window=16,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                tie_word_embeddings=True,
            ),
            tied=True,
            init_std=0.1,
        ),
        Architecture(
            "gemma3_text",
            "Gemma3TextConfig",
            dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True),
            tied=True,
            init_std=0.1,
        ),
        Architecture("mistral", "MistralConfig", dict(head_dim=32, sliding_window=None, tie_word_embeddings=False)),
        Architecture("phi3", "Phi3Config", dict(tie_word_embeddings=False)),
        Architecture("olmo2", "Olmo2Config", dict(tie_word_embeddings=False)),
    )
}


def build_architecture(name: str, out_dir: str | Path, *, seed: int = 0, init_std: float | None = None) -> Path:
    """Write the tiny random model ``name`` of :data:`ARCHITECTURES` and the embedded tokenizer to ``out_dir``
    (``init_std``: None = the architecture's)."""
    import transformers

    arch = ARCHITECTURES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = getattr(transformers, arch.config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=arch.init_std if init_std is None else init_std,
        dtype="float32",
        **{**_SHAPE, **arch.settings},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if arch.tied != bool(getattr(model.config, "tie_word_embeddings", False)):
        raise AssertionError(f"{name}: tie_word_embeddings={model.config.tie_word_embeddings}, expected {arch.tied}")
    model.generation_config.do_sample = True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
