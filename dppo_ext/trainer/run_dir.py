"""The run folder (``--out``): who may write to it, what the trainer wrote there, when it may be
reused or cleared, and crash-safe writes.

Rules (the user's files are never the trainer's to delete):

- **the trainer records what it writes.** ``dppo-run.json``, the run manifest, lists every file and
  folder the trainer created in ``--out`` (``{"outputs": {name: "file" | "dir"}}``). A name is
  recorded before the output is created (a crash can leave a listed name missing, never an
  unlisted output) and dropped once it is deleted (checkpoint rotation). The manifest is written
  atomically. The lock file, the manifest itself and the trainer's temporaries
  (``.<output>.tmp-<pid>``, ``.checkpoint-<step>.deleting-<pid>``, ...) are its bookkeeping;
- **a fresh run needs an empty folder** (or a missing one; the lock file does not count).
  ``--resume`` continues the run the manifest describes. ``--overwrite`` deletes exactly what the
  manifest lists, and nothing else, before starting over (the one exception is ``base_model/``
  when the new run reuses it: the cache of the embedded warm start, kept when its settings match).
  A non-empty folder without a manifest is refused by all three, touching nothing: it was not
  written by this trainer. The one exception is ``--resume`` of a run written by a dppo-train
  older than the manifest (``adopt``: the caller recognises that trainer's outputs by their content);
- **one writer per folder**: ``RunLock`` holds an advisory ``fcntl.flock`` on
  ``<out>/.dppo-train.lock`` for the whole run; a second trainer gets an error naming the holder's
  pid. The kernel drops the lock when the holder exits or dies, so a crash never leaves it locked;
- **setup changes nothing**: until the run calls ``RunFolder.commit`` (its data loaded, its model
  built, its engine started, its checkpoint restored) it writes nothing into ``--out`` but the
  lock file, a manifest (only into a folder that was empty) and temporaries. A failure or Ctrl-C
  before that leaves ``--out`` as it was: a folder the run created is removed again (with any parent
  it created), an existing one keeps exactly its files, with their bytes (the lock file's content
  is restored). ``--overwrite`` deletes the previous run only at commit, so a run that cannot start
  leaves it intact. A process killed outright during setup (SIGKILL, power loss) leaves a manifest
  in state ``setup``: the next fresh run in that folder removes what it lists and the trainer's
  temporaries, and starts;
- every file the trainer writes whole is written to a temporary sibling, fsynced and renamed
  into place (``atomic_write_text``), so a crash leaves the old or the new version, never half.

Where each rule lives (the modules below, in ``dppo_ext.trainer``; this module re-exports their public names
from the import path they had before the split):

- ``errors``: ``RunError``;
- ``atomic_files``: ``atomic_write_bytes`` / ``atomic_write_text``, ``fsync_dir``, ``temporary_sibling``;
- ``run_lock``: ``RunLock`` and ``LOCK_FILE``;
- ``manifest``: ``dppo-run.json`` (``read_manifest``, ``record_output``, ``forget_output``);
- ``run_folder``: ``open_run_dir`` and ``RunFolder`` (plan, commit, ``--overwrite``, rollback);
- ``overlap``: ``check_out_apart`` (``--out`` apart from ``--model``, ``--data``, ``--eval-data``).
"""

from __future__ import annotations

from dppo_ext.trainer.atomic_files import (
    TEMPORARY_TAGS,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    temporary_sibling,
)
from dppo_ext.trainer.errors import RunError
from dppo_ext.trainer.manifest import (
    KINDS,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    SETUP,
    STARTED,
    forget_output,
    read_manifest,
    record_output,
)
from dppo_ext.trainer.overlap import check_out_apart
from dppo_ext.trainer.run_folder import EMBEDDED_MODEL_DIR, Adopt, RunFolder, open_run_dir
from dppo_ext.trainer.run_lock import LOCK_FILE, RunLock

__all__ = [
    "EMBEDDED_MODEL_DIR",
    "KINDS",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "SETUP",
    "STARTED",
    "TEMPORARY_TAGS",
    "Adopt",
    "RunError",
    "RunFolder",
    "RunLock",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_out_apart",
    "forget_output",
    "fsync_dir",
    "open_run_dir",
    "read_manifest",
    "record_output",
    "temporary_sibling",
]
