"""What the plugin could and could not install in this process (shared by the plugin and the loss)."""

from __future__ import annotations

__all__ = ["SUPPORTED_VERL", "check_installed", "failures", "installed", "record"]

# The verl releases the plugin is tested against (it changes verl internals); the `verl` extra pins the same.
SUPPORTED_VERL = "==0.9.1"
_failures: list[str] = []
_done: set[str] = set()


def record(module: str, error: str | None) -> None:
    """Note that the change of ``module`` was installed (``error`` None) or failed with ``error``."""
    if error is None:
        _done.add(module)
    else:
        _failures.append(f"dppo_ext could not change {module}: {error}")


def failures() -> tuple[str, ...]:
    return tuple(_failures)


def installed() -> frozenset[str]:
    """The verl modules the plugin has changed so far in this process."""
    return frozenset(_done)


def check_installed() -> None:
    """Raise ``RuntimeError`` when a change of the plugin failed to install (the messages say which)."""
    if _failures:
        raise RuntimeError(
            "dppo_ext's verl plugin is not fully installed: "
            + "; ".join(_failures)
            + f". It supports verl {SUPPORTED_VERL} (pip install 'dppo_ext[verl]')."
        )
