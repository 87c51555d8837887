"""Experiments built on the reference trainer (``python -m dppo_ext.experiments.<name>``)."""
