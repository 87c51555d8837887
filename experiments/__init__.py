"""Experiments run with this repository's trainer; not part of the installed ``dppo_ext`` package."""
