"""Model builders: the embedded tiny model/tokenizer and its supervised warm start."""

from dppo_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

__all__ = ["TinyModelConfig", "build_char_tokenizer", "build_tiny_model"]
