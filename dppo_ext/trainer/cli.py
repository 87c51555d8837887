"""The trainer's command line: one ``--flag`` per ``TrainConfig`` field (its type, default, help and choices), so
the dataclass in :mod:`dppo_ext.trainer.config` is the single place that defines the CLI."""

from __future__ import annotations

import argparse
import typing

from dppo_ext.trainer.config import TrainConfig, config_fields, flag_name, inner_type

__all__ = ["build_parser", "parse_config"]


def build_parser() -> argparse.ArgumentParser:
    """An ``argparse`` parser with one flag per ``TrainConfig`` field."""
    parser = argparse.ArgumentParser(
        prog="dppo-train",
        description="Reference RL trainer: vLLM (or transformers) rollouts, GRPO group advantages, DPPO loss.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(TrainConfig)
    for name, f in config_fields().items():
        kind = hints[name]
        kwargs: dict = {"default": f.default, "help": f.metadata["help"], "dest": name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = inner_type(kind)[0]
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(f"--{flag_name(name)}", **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse command-line flags into a validated ``TrainConfig``."""
    args = build_parser().parse_args(argv)
    return TrainConfig(**vars(args)).validate()
