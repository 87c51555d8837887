"""The DPPO paper's stability sanity test at laptop scale (docs/sanity.md).

``python -m experiments.sanity`` (from the repository root) trains the embedded tiny model on the
embedded arithmetic task once per (condition, method, seed) with the reference trainer, collects
each run's per-step metrics into one data file, and draws one figure per arm and the tables with
confidence intervals and the verdicts of the rules fixed before the runs. ``--report-only`` redraws
them from the committed data alone; ``--quick`` is the CI smoke test.

Modules: ``conditions`` (what runs), ``sweep`` (workers, resuming, collection), ``host`` (where it
ran), ``stats`` (summaries, intervals, the rules), ``report`` and ``figures`` (the output),
``history`` (the earlier sweeps' report), ``staleness`` and ``collapse`` (the two pre-registered
experiments; ``counts``: their exact tests on counts), ``cli``. This package is part of the repository, not of
the installed ``dppo_ext`` wheel.
"""

from .cli import build_parser, main

__all__ = ["build_parser", "main"]
