"""End a multi-process test script once its results are written, without torch's gloo teardown.

With torch 2.13 on CPU, tearing a gloo process group down can hang or abort a run that has finished: a gloo worker
thread still releasing the tensors of the last collective waits for the GIL, while the main thread holds the GIL
and joins that worker in ``~ProcessGroupGloo`` (when DDP's reducer is freed, in ``destroy_process_group``, or at
interpreter teardown). Seen here as both ranks deadlocked in ``std::thread::join`` under ``~Reducer`` (py-spy), and
in CI as both ranks aborting with "terminate called without an active exception". The scripts therefore meet at a
barrier after writing their results and leave with ``os._exit(0)``, which runs no destructors.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


def exit_after(barrier: Callable[[], object]) -> NoReturn:
    """Wait for every rank (``barrier``), flush stdout/stderr, and end the process with status 0."""
    barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
