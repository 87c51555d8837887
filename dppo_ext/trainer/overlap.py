"""``--out`` apart from the inputs: the run folder may not be, contain or lie inside ``--model``, ``--data``
or ``--eval-data`` (the run would write among that input's files, and ``--overwrite`` delete them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dppo_ext.trainer.errors import RunError


def check_out_apart(out: str | Path, inputs: Mapping[str, str]) -> None:
    """Refuse an ``--out`` that is, contains or lies inside one of ``inputs`` (``{flag: path}``).

    Both sides are compared as resolved paths (symbolic links and ``..`` followed), so another
    spelling of the same folder is caught. Inputs that are not local paths (a hub id) are skipped.

    Raises:
        RunError: naming both flags, the paths and what to do; nothing is written.
    """
    out_real = Path(os.path.realpath(out))
    for flag, value in inputs.items():
        if not value or not os.path.lexists(value):
            continue
        real = Path(os.path.realpath(value))
        if real == out_real:
            relation = "is"
        elif real.is_relative_to(out_real):
            relation = "contains"
        elif out_real.is_relative_to(real):
            relation = "lies inside"
        else:
            continue
        spelled = (str(out_real), str(real)) != (str(out), str(value))
        resolved = f" (resolved: {str(out_real)!r} and {str(real)!r})" if spelled else ""
        raise RunError(
            f"--out {str(out)!r} {relation} {flag} {value!r}{resolved}: the run would write its outputs among that "
            f"input's files (and --overwrite delete them); pass an --out that is apart from --model, --data and "
            "--eval-data"
        )
