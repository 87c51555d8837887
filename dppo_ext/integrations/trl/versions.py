"""The TRL and vLLM releases the integration is written and tested against, checked before TRL is imported.

Only ``packaging`` and the standard library: importing this module imports neither TRL nor vLLM.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "SUPPORTED_TRL",
    "TESTED_TRL",
    "TESTED_VLLM",
    "check_trl_version",
    "import_trl",
    "tested_vllm_warning_silenced",
]

# TRL releases this integration supports (it overrides GRPOTrainer internals) and the one it is tested with.
SUPPORTED_TRL = SpecifierSet(">=1.16.0,<1.17.0")
TESTED_TRL = "1.16.0"
# The vLLM release this integration is tested with (requirements/cpu.txt). TRL 1.16 lists vLLM 0.22-0.31 only; with
# this release its generation path works and its colocate weight sync is replaced by ours
# (generation.VLLMWeightSync).
TESTED_VLLM = "0.32.0"
# TRL's warning, each time it checks for vLLM, that the installed vLLM is outside its list (five times while its
# generation module is imported, once more when a trainer starts vLLM).
_TRL_VLLM_WARNING = (
    rf"TRL currently supports vLLM versions from 0\.22\.0 to 0\.31\.0\. "
    rf"You have version {re.escape(TESTED_VLLM)} "
)


def check_trl_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` (a TRL version string) is in ``SUPPORTED_TRL``."""
    if Version(version) not in SUPPORTED_TRL:
        raise ImportError(
            f"dppo_ext.integrations.trl supports trl{SUPPORTED_TRL} (tested with {TESTED_TRL}) because it overrides "
            f"GRPOTrainer internals, but trl {version} is installed. Install a supported release: "
            f"pip install 'trl=={TESTED_TRL}'"
        )


def import_trl() -> ModuleType:
    """``import trl``, after checking that it is installed in a supported release (a clear ``ImportError`` else)."""
    try:
        import trl
    except ImportError as exc:  # pragma: no cover - exercised only without trl
        raise ImportError(f"dppo_ext.integrations.trl needs TRL: pip install 'trl=={TESTED_TRL}' accelerate") from exc
    check_trl_version(trl.__version__)
    return trl


@contextlib.contextmanager
def tested_vllm_warning_silenced() -> Iterator[None]:
    """Inside the block, TRL's "supports vLLM 0.22-0.31" warning is dropped for ``TESTED_VLLM`` exactly.

    Any other vLLM version still warns, and so does a check for vLLM outside the block. Only this one filter is
    added and removed again: ``warnings.catch_warnings`` would also undo the filters that the libraries imported
    inside the block install for themselves.
    """
    warnings.filterwarnings("ignore", message=_TRL_VLLM_WARNING, category=UserWarning)
    entry = warnings.filters[0]
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)
