"""A tiny character-level Llama model and tokenizer, built in-process from a config.

The embedded default task (arithmetic) needs no download: the tokenizer is a character-level
``tokenizers`` WordLevel model over a small alphabet plus special tokens, wrapped in
``PreTrainedTokenizerFast``; the model is a ``LlamaForCausalLM`` built from a ``LlamaConfig``.
Both are written with ``save_pretrained`` so the folder loads with ``from_pretrained`` and with
vLLM like any Hugging Face checkpoint.

``vocab_size`` pads the vocabulary with tokens ``<r0>``, ``<r1>``, ... that no text encodes to
(the pre-tokenizer splits text into single characters) and that decode to themselves, so a
response holding one is never a number: a tail of rare, always-wrong tokens, which a warm start
with label smoothing gives a small probability each.

Prompts are plain text (no chat template). Encoding prepends ``<s>``; a response ends with
``</s>``. Example: ``"12+7="`` -> ``[<s>, 1, 2, +, 7, =]``, response ``"19</s>"``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
ARITHMETIC_ALPHABET = "0123456789+-="
RARE_TOKEN = "<r{}>"  # the padding tokens of a padded vocabulary

# vLLM's CPU attention backend rejects small head sizes (16 failed, 32 and 64 work).
MIN_HEAD_DIM = 32


def tiny_heads(hidden: int) -> int:
    """Attention heads of the embedded tiny model of width ``hidden`` (64-dim heads, at least one)."""
    return max(1, hidden // 64)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Llama model.

    Attributes:
        hidden_size: model width; ``hidden_size / num_heads`` must be >= 32 (vLLM CPU backend).
        num_layers: number of decoder layers.
        num_heads: attention heads (also the key/value heads: plain multi-head attention).
        intermediate_size: MLP width.
        max_position_embeddings: longest prompt + response in tokens.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 64

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyModelConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"TinyModelConfig.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim < MIN_HEAD_DIM:
            raise ValueError(
                f"TinyModelConfig head_dim = hidden_size / num_heads = {head_dim} is below {MIN_HEAD_DIM}; "
                "vLLM's CPU attention backend rejects it: use fewer heads or a wider model"
            )


def build_char_tokenizer(alphabet: str = ARITHMETIC_ALPHABET, vocab_size: int = 0):
    """Build a character-level ``PreTrainedTokenizerFast`` over ``alphabet`` plus special tokens.

    Ids: ``<pad>=0, <s>=1, </s>=2, <unk>=3``, then the alphabet characters in order, then (when
    ``vocab_size`` exceeds that count) the rare tokens ``<r0>, <r1>, ...`` up to ``vocab_size`` ids.
    Encoding splits text into single characters and prepends ``<s>``; decoding joins tokens with no
    separator.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string of distinct characters, got {alphabet!r}")
    if any(ch.isspace() for ch in alphabet):
        raise ValueError(f"alphabet must not contain whitespace, got {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    if vocab_size and vocab_size < len(vocab):
        raise ValueError(
            f"vocab_size={vocab_size} is below the {len(vocab)} tokens of the alphabet and the special "
            "tokens; pass 0 (no padding) or a larger size"
        )
    for i in range(max(0, vocab_size - len(vocab))):
        vocab[RARE_TOKEN.format(i)] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    config: TinyModelConfig | None = None,
    alphabet: str = ARITHMETIC_ALPHABET,
    seed: int = 0,
    vocab_size: int = 0,
) -> Path:
    """Build a randomly initialised tiny Llama model + tokenizer and save them to ``out_dir``.

    Args:
        out_dir: folder to write (created if missing); afterwards it holds ``config.json``,
            ``model.safetensors``, ``generation_config.json`` and the tokenizer files.
        config: model shape (default ``TinyModelConfig()``: hidden 128, 2 layers, 2 heads of 64).
        alphabet: characters the tokenizer knows besides the special tokens.
        seed: seed for the weight initialisation (the same seed gives the same weights).
        vocab_size: pad the vocabulary with rare tokens to this many ids (0 = no padding).

    Returns:
        ``Path(out_dir)``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = config or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(alphabet, vocab_size)
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama_config)
    model.generation_config.do_sample = True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("built tiny model %s (%s) in %s", asdict(config), f"vocab={len(tokenizer)}", out)
    return out
