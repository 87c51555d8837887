"""Load user problems from JSONL: one ``{"prompt": str, "answer": str|number}`` object per line.

The file must be UTF-8 (a leading byte-order mark is accepted). Blank lines are skipped;
anything else that is not such an object, or a line that is not UTF-8, fails fast with
``file:line`` and what was wrong. Extra keys are ignored.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from dppo_ext.tasks.base import Problem, Task


class DataFormatError(ValueError):
    """A JSONL data file is malformed; the message names ``file:line`` and the problem."""


def load_jsonl_problems(path: str | Path) -> list[Problem]:
    """Read problems from a JSONL file.

    Args:
        path: file with one JSON object per line holding ``"prompt"`` (non-empty string) and
            ``"answer"`` (string, int or finite float).

    Returns:
        The problems in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        DataFormatError: a line is not UTF-8, not valid JSON, not an object, or lacks / mistypes a field;
            the message starts with ``path:line:``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (expected a JSONL file)")
    problems = []
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataFormatError(
                    f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise DataFormatError(
                    f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(record).__name__}"
                )
            missing = [key for key in ("prompt", "answer") if key not in record]
            if missing:
                raise DataFormatError(f"{where}: missing key(s) {missing}; each line needs 'prompt' and 'answer'")
            prompt, answer = record["prompt"], record["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataFormatError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise DataFormatError(f"{where}: 'answer' must be a string or number, got {answer!r}")
            if isinstance(answer, float) and not math.isfinite(answer):
                raise DataFormatError(f"{where}: 'answer' must be finite, got {answer!r}")
            if isinstance(answer, float) and answer.is_integer():
                answer = int(answer)
            answer = str(answer)
            if not answer.strip():
                raise DataFormatError(f"{where}: 'answer' must not be empty")
            problems.append(Problem(prompt=prompt, answer=answer))
    if not problems:
        raise DataFormatError(f"{path}: no problems found (the file is empty)")
    return problems


def load_jsonl_task(
    path: str | Path,
    *,
    eval_path: str | Path | None = None,
    num_eval: int = 200,
    verifier: str = "auto",
    seed: int = 0,
) -> Task:
    """Build a task from JSONL data.

    Args:
        path: training problems.
        eval_path: held-out problems; when None, ``num_eval`` problems are split off ``path``
            (after a seeded shuffle).
        num_eval: size of the split-off held-out set (ignored with ``eval_path``).
        verifier: one of ``dppo_ext.tasks.base.VERIFIERS``.
        seed: shuffle seed for the split.
    """
    problems = load_jsonl_problems(path)
    if eval_path is not None:
        return Task(name=Path(path).stem, train=problems, eval=load_jsonl_problems(eval_path), verifier=verifier)
    if not 1 <= num_eval < len(problems):
        raise ValueError(
            f"num_eval={num_eval} must be in [1, {len(problems)}) to split a held-out set off {path} "
            f"({len(problems)} problems); pass an eval file instead"
        )
    shuffled = list(problems)
    random.Random(seed).shuffle(shuffled)
    return Task(name=Path(path).stem, train=shuffled[num_eval:], eval=shuffled[:num_eval], verifier=verifier)
