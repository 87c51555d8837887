"""A user's files are never destroyed: the trainer's run folder (``--out``), driven as a user drives
it (``dppo_ext.train.main`` with the CLI's flags, the HF engine and tiny settings; two tests run
``python -m dppo_ext.train`` itself to interrupt and kill it).

Every test compares the folder, byte for byte and symbolic link for symbolic link, with what was
there before: the user's own files (a ``config.json``, a ``summary.json``, a ``checkpoint/``, a
model folder, arbitrary files, links pointing outside) survive a fresh run, ``--resume``,
``--overwrite``, a failure during the set-up and a failure mid-run; the trainer deletes only what
its run manifest (``dppo-run.json``) says it wrote; a run that cannot start leaves ``--out`` as it
found it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dppo_testing import child_env

# The names the docs give (docs/run_folder.md), spelled out rather than imported: the tests state the contract.
LOCK_FILE = ".dppo-train.lock"
MANIFEST_FILE = "dppo-run.json"
FOLDER_ID_FILE = ".dppo-run-id"

# ---------------------------------------------------------------- helpers

TINY = {
    "--engine": "hf",
    "--max-operand": "9",
    "--num-eval": "16",
    "--warm-start-problems": "60",
    "--warm-start-steps": "2",
    "--steps": "2",
    "--prompts-per-step": "6",
    "--group-size": "4",
    "--num-minibatches": "2",
    "--eval-every": "2",
    "--eval-samples": "1",
    "--save-every": "1",
    "--max-new-tokens": "4",
    "--lr": "1e-3",
    "--threads": "1",
    "--seed": "5",
    "--warm-start-label-smoothing": "0",
    "--log-level": "warning",
}


def _argv(out: Path | str, *flags: str, **settings: str) -> list[str]:
    """The CLI's argv for a tiny run into ``out``: ``TINY`` with ``settings`` (``steps="3"`` -> ``--steps 3``)."""
    values = dict(TINY)
    values.update({"--" + k.replace("_", "-"): str(v) for k, v in settings.items()})
    return ["--out", str(out), *[x for kv in values.items() for x in kv], *flags]


def _main(argv: list[str]) -> int:
    from dppo_ext.train import main

    return main(argv)


def _tree(folder: Path) -> dict[str, tuple]:
    """Everything under ``folder`` without following links: path -> ("dir",) | ("file", bytes) | ("link", target)."""
    tree: dict[str, tuple] = {}
    if not folder.exists():
        return tree
    for root, dirs, files in os.walk(folder):  # a link to a folder is listed, never entered
        for name in dirs + files:
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                tree[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                tree[rel] = ("dir",)
            else:
                tree[rel] = ("file", path.read_bytes())
    return tree


def _part(tree: dict[str, tuple], tops: set[str]) -> dict[str, tuple]:
    """The entries of ``tree`` under the top-level names ``tops``."""
    return {rel: entry for rel, entry in tree.items() if rel.split("/")[0] in tops}


def _outputs(folder: Path) -> dict[str, str]:
    return json.loads((folder / MANIFEST_FILE).read_text())["outputs"]


def _assert_manifest_covers(folder: Path, users: set[str]) -> None:
    """Every entry of ``folder`` is the user's, bookkeeping, or listed in the manifest with its kind."""
    outputs = _outputs(folder)
    for path in folder.iterdir():
        if path.name in users or path.name in (LOCK_FILE, MANIFEST_FILE, FOLDER_ID_FILE):
            continue
        assert path.name in outputs, f"{path.name} is in --out but not in {MANIFEST_FILE}: {sorted(outputs)}"
        assert outputs[path.name] == ("dir" if path.is_dir() else "file"), path.name


def _outside(root: Path) -> Path:
    """A folder of the user's outside the run folder, which links inside the run folder point to."""
    outside = root / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "data.bin").write_bytes(bytes(range(256)))
    (outside / "sub" / "config.json").write_text('{"mine": true}')
    return outside


def _add_user_files(folder: Path, outside: Path) -> set[str]:
    """Files of the user's in a run folder, with names the trainer writes or used to delete; their top-level names."""
    (folder / "notes.txt").write_text("my notes")
    (folder / "mine").mkdir()
    (folder / "mine" / "eval.csv").write_bytes(b"a,b\n1,2\n")
    (folder / "checkpoint").mkdir()  # the earlier layout's name: the old --overwrite deleted it by name
    (folder / "checkpoint" / "README").write_text("my own notes on the checkpoints")
    (folder / "checkpoint.old").write_text("mine too")
    (folder / ".tmp-5-mine").write_text("looks like an old temporary, is not one")  # the old rule deleted .tmp-*
    (folder / ".base_model.backup").write_text("mine")  # ... and .base_model.*
    (folder / "config.json.orig").write_text("{}")
    (folder / "link_out").symlink_to(outside)
    (folder / "link_file").symlink_to(outside / "data.bin")
    (folder / "link_config").symlink_to(outside / "sub" / "config.json")
    return {
        "notes.txt",
        "mine",
        "checkpoint",
        "checkpoint.old",
        ".tmp-5-mine",
        ".base_model.backup",
        "config.json.orig",
        "link_out",
        "link_file",
        "link_config",
    }


def _data_file(path: Path, n: int = 20) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(n)))
    return path


class EngineFailed(RuntimeError):
    pass


def _engine_fails(*args, **kwargs):
    raise EngineFailed("the rollout engine could not start")


def _fail_at_call(monkeypatch, k: int) -> None:
    """The k-th RL step of this process (1-based) raises: a crash mid-run."""
    from dppo_ext.trainer import loop

    original = loop.Trainer.train_step
    calls = []

    def train_step(self):
        calls.append(1)
        if len(calls) == k:
            raise EngineFailed("crashed mid-run")
        return original(self)

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A complete 2-step run (checkpoint-1, checkpoint-2, base_model, ...); copy it before changing it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert _main(_argv(out)) == 0
    return out


def _copy_run(finished_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, symlinks=True)
    return out


# ---------------------------------------------------------------- a run folder with the user's files in it

PATHS = [
    "fresh",
    "resume",
    "overwrite",
    "resume-setup-failure",
    "overwrite-setup-failure",
    "resume-mid-run-failure",
    "overwrite-mid-run-failure",
    "resume-steps-below",
    "resume-steps-equal",
]


@pytest.mark.parametrize("path", PATHS)
def test_the_users_files_in_a_run_folder_survive_every_path(path, finished_run, tmp_path, monkeypatch, capsys):
    """The user put files of their own into a run's folder (names the trainer writes or once deleted by name,
    links to their files outside). Whatever the next command does, those stay byte for byte, and so does what
    the links point to; where the command fails before it starts, the whole folder does."""
    out = _copy_run(finished_run, tmp_path)
    users = _add_user_files(out, _outside(tmp_path))
    before, outside_before = _tree(out), _tree(tmp_path / "outside")
    mode, _, what = path.partition("-")
    flags = {"fresh": [], "resume": ["--resume"], "overwrite": ["--overwrite"]}[mode]
    steps = {"resume": "4" if what == "mid-run-failure" else "3", "overwrite": "3", "fresh": "2"}[mode]
    if what == "setup-failure":
        monkeypatch.setattr("dppo_ext.trainer.training_run.make_rollout_engine", _engine_fails)
    if what == "mid-run-failure":
        _fail_at_call(monkeypatch, 2)
    if what == "steps-below":
        steps = "1"
    if what == "steps-equal":
        steps = "2"

    rc = None
    if what in ("setup-failure", "mid-run-failure"):
        with pytest.raises(EngineFailed):
            _main(_argv(out, *flags, steps=steps))
    else:
        rc = _main(_argv(out, *flags, steps=steps))
    err = capsys.readouterr().err

    after = _tree(out)
    assert _part(after, users) == _part(before, users)
    assert _tree(tmp_path / "outside") == outside_before
    if path in ("fresh", "resume-setup-failure", "overwrite-setup-failure", "resume-steps-below", "resume-steps-equal"):
        assert after == before  # refused, failed before it started, or nothing to do: the folder is as it was
    if rc is not None:
        assert rc == (2 if path in ("fresh", "resume-steps-below") else 0), err
    if path == "fresh":
        assert "already holds a run" in err
    if path == "resume-steps-below":
        assert "is already at step 2, and a resumed run cannot go back; nothing was changed" in err
    _assert_manifest_covers(out, users)
    if path == "resume":
        assert "checkpoint-3/trainer_state.pt" in after
    if path == "overwrite":
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert (out / "checkpoint-3").is_dir() and not (out / "checkpoint-1").exists()
    if path == "overwrite-mid-run-failure":
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]  # the new run's; the old ones gone


def test_a_folder_of_the_users_own_files_is_refused_untouched(tmp_path, capsys):
    """A folder that holds no run of this trainer, but files with the names it writes (the folder is a model
    folder: its config.json; a summary.json, a checkpoint/ that looks like the earlier layout, a metrics.jsonl),
    is refused by a fresh run, --resume and --overwrite alike, and nothing in it changes (no lock file either)."""
    from dppo_ext.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "mine", seed=0)
    (folder / "summary.json").write_text('{"steps": 12, "note": "my summary"}')
    (folder / "checkpoint" / "model").mkdir(parents=True)
    (folder / "checkpoint" / "trainer_state.pt").write_bytes(b"not a trainer state")
    (folder / "checkpoint" / "model" / "config.json").write_text("{}")
    (folder / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.5}\n')
    (folder / "base_model").mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "link_out").symlink_to(_outside(tmp_path))
    before, outside_before = _tree(folder), _tree(tmp_path / "outside")
    outcomes = []
    for flags in ([], ["--resume"], ["--overwrite"]):
        outcomes.append((flags, _main(_argv(folder, *flags)), capsys.readouterr().err))
        assert _tree(folder) == before, flags
        assert _tree(tmp_path / "outside") == outside_before
    for flags, rc, err in outcomes:
        assert rc == 2 and "has no dppo-run.json" in err and "othing was changed" in err, (flags, err)
        assert "Traceback" not in err


def test_out_overlapping_an_input_is_refused_before_anything_is_written(tmp_path, capsys):
    """--out equal to, inside or containing --model, --data or --eval-data (also spelled through a link or '..')
    is refused before anything is written: the model in --model keeps its config.json (--model M --out M
    --overwrite used to replace it with the run's and leave a model that no longer loads)."""
    from dppo_ext.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", seed=0)
    (tmp_path / "d").mkdir()
    data = _data_file(tmp_path / "d" / "train.jsonl")
    evals = _data_file(tmp_path / "d" / "eval.jsonl", n=6)
    (tmp_path / "link_to_m").symlink_to(model)
    common = ("--model", str(model), "--data", str(data), "--eval-data", str(evals), "--num-eval", "4")
    cases = [
        (model, ["--overwrite"], "is --model"),
        (tmp_path / "link_to_m", ["--overwrite"], "is --model"),
        (tmp_path / "d" / ".." / "m", [], "is --model"),
        (model / "run", [], "lies inside --model"),
        (tmp_path, ["--overwrite"], "contains --model"),
        (tmp_path / "d", ["--overwrite"], "contains --data"),
        (Path(os.path.relpath(tmp_path / "d", Path.cwd())), [], "contains --data"),
    ]
    before = _tree(tmp_path)
    for out, flags, relation in cases:
        rc = _main(_argv(out, *common, *flags))
        err = capsys.readouterr().err
        assert _tree(tmp_path) == before, out
        assert rc == 2, out
        assert f"--out {str(out)!r} {relation}" in err and "pass an --out that is apart from --model" in err, err
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(model).vocab_size == 17  # still the model it was


# ---------------------------------------------------------------- a run that fails during its set-up


def _tiny_model(tmp_path: Path) -> Path:
    from dppo_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path / "inputs" / "model", seed=0)  # 17-token vocabulary, no chat template


def _setup_failure(name: str, tmp_path: Path, monkeypatch) -> tuple[list[str], int | type[BaseException]]:
    """(flags, the exit status or exception) of one way a run fails before it starts training."""
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    if name == "data without --model":  # the case: it left a lock, config.json, inputs.json, a model folder
        return ["--data", str(_data_file(inputs / "d.jsonl")), "--num-eval", "4"], 2
    if name == "malformed --data":
        (inputs / "bad.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": \n')
        return ["--model", str(_tiny_model(tmp_path)), "--data", str(inputs / "bad.jsonl"), "--num-eval", "1"], 2
    if name == "--model without weights":
        (inputs / "empty_model").mkdir()
        (inputs / "empty_model" / "config.json").write_text("{}")
        data = _data_file(inputs / "d.jsonl")
        return ["--model", str(inputs / "empty_model"), "--data", str(data), "--num-eval", "4"], 2
    if name == "--top-k above --model's vocabulary":
        return [
            "--model",
            str(_tiny_model(tmp_path)),
            "--data",
            str(_data_file(inputs / "d.jsonl")),
            "--num-eval",
            "4",
            "--loss",
            "dppo_topk_kl",
            "--top-k",
            "18",
        ], 2
    if name == "--top-k above the embedded model's vocabulary":  # known only once the warm start has built it
        return ["--loss", "dppo_topk_kl", "--top-k", "18"], 2
    if name == "--prompt-format chat without a chat template":  # found when the trainer is built
        return ["--prompt-format", "chat"], 2
    if name == "the engine fails to start":
        monkeypatch.setattr("dppo_ext.trainer.training_run.make_rollout_engine", _engine_fails)
        return [], EngineFailed
    if name == "Ctrl-C during the warm start":

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr("dppo_ext.trainer.embedded_model.supervised_warm_start", interrupted)
        return [], 130
    if name == "Ctrl-C while the engine starts":

        def interrupted_engine(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr("dppo_ext.trainer.training_run.make_rollout_engine", interrupted_engine)
        return [], 130
    if name == "--resume without a checkpoint":
        return ["--resume"], 2
    raise AssertionError(name)


SETUP_FAILURES = [
    "data without --model",
    "malformed --data",
    "--model without weights",
    "--top-k above --model's vocabulary",
    "--top-k above the embedded model's vocabulary",
    "--prompt-format chat without a chat template",
    "the engine fails to start",
    "Ctrl-C during the warm start",
    "Ctrl-C while the engine starts",
    "--resume without a checkpoint",
]


@pytest.mark.parametrize("state", ["missing", "empty"])
@pytest.mark.parametrize("failure", SETUP_FAILURES)
def test_a_run_that_fails_during_setup_leaves_out_as_it_found_it(failure, state, tmp_path, monkeypatch, capsys):
    """A folder that did not exist does not exist afterwards (nor the parents the run created); an empty one
    stays empty (no lock file, no manifest); so the same command, corrected, is not refused as 'not empty'."""
    flags, expected = _setup_failure(failure, tmp_path, monkeypatch)
    top = tmp_path / "runs"
    out = top / "a" / "b" if state == "missing" else top
    if state == "empty":
        top.mkdir()
    if isinstance(expected, int):
        assert _main(_argv(out, *flags)) == expected
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("dppo-train: "), err
    else:
        with pytest.raises(expected):
            _main(_argv(out, *flags))
    if state == "missing":
        assert not top.exists(), sorted(p.name for p in top.rglob("*"))
    else:
        assert top.is_dir() and list(top.iterdir()) == []
    if failure == "Ctrl-C during the warm start":  # corrected (nothing interrupts it now): the same command runs
        monkeypatch.undo()
        assert _main(_argv(out, steps="1")) == 0


def test_an_overwrite_that_cannot_start_keeps_the_previous_run(finished_run, tmp_path, capsys):
    """--overwrite deletes the previous run only once the new one has started: a typo'd flag (here a --top-k
    the model cannot return, found after the warm start) leaves the previous run whole."""
    out = _copy_run(finished_run, tmp_path)
    before = _tree(out)
    assert _main(_argv(out, "--overwrite", "--loss", "dppo_topk_kl", "--top-k", "18", warm_start_steps="3")) == 2
    assert "--top-k=18 exceeds the vocabulary" in capsys.readouterr().err
    assert _tree(out) == before


def _start_cli(out: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """``python -m dppo_ext.train`` into ``out`` with a warm start long enough to interrupt; wait until it builds."""
    log = tmp_path / f"cli-{time.monotonic_ns()}.err"
    argv = [sys.executable, "-m", "dppo_ext.train", *_argv(out, warm_start_steps="1000000")]
    with open(log, "wb") as err:
        # SIGINT at its default in the child, as in a terminal: a shell that starts a job in the background (`cmd &`
        # in a script) has it ignored, the child inherits that, and Python then installs no KeyboardInterrupt
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=child_env(),
            cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    deadline = time.monotonic() + 180
    while not (out.is_dir() and any(p.name.startswith(".base_model.tmp-") for p in out.iterdir())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the CLI did not start its warm start: {log.read_text()}")
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the warm start
    return proc, log


@pytest.mark.slow
def test_the_cli_interrupted_or_killed_during_the_warm_start_leaves_a_folder_the_same_command_accepts(tmp_path):
    """Ctrl-C (SIGINT) of the real CLI during the warm start: status 130, one line, no traceback, and the folder
    it created is gone. Killed outright (SIGKILL: no cleanup runs), it leaves a manifest in state 'setup' and
    its temporary, and the same command run again clears them and trains."""
    from dppo_ext.train import run
    from dppo_ext.trainer.cli import parse_config

    out = tmp_path / "run"
    proc, log = _start_cli(out, tmp_path)
    proc.send_signal(signal.SIGINT)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the CLI did not stop within 120 s of SIGINT: {log.read_text()}") from None
    assert status == 130
    err = log.read_text()
    assert "dppo-train: interrupted" in err and "Traceback" not in err, err
    assert not out.exists()

    proc, log = _start_cli(out, tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted([LOCK_FILE, MANIFEST_FILE, FOLDER_ID_FILE, f".base_model.tmp-{proc.pid}"]), left
    assert json.loads((out / MANIFEST_FILE).read_text())["state"] == "setup"
    killed = _tree(out)
    assert _main(_argv(out, "--resume")) == 2  # nothing to continue: it never trained
    assert _tree(out) == killed
    run(parse_config(_argv(out, steps="1")), progress=False)  # same command (a short warm start)
    assert not any(p.name.startswith(".base_model.tmp-") for p in out.iterdir())
    _assert_manifest_covers(out, set())


# ---------------------------------------------------------------- --resume --steps


def test_resume_with_steps_below_the_checkpoint_is_an_error_that_changes_nothing(finished_run, tmp_path, capsys):
    out = _copy_run(finished_run, tmp_path)
    before = _tree(out)
    assert _main(_argv(out, "--resume", steps="1")) == 2
    err = capsys.readouterr().err
    assert "--resume --steps 1: the newest checkpoint" in err and "checkpoint-2' is already at step 2" in err
    assert "Pass --steps 2 or more to continue it" in err and "--overwrite to train 1 steps from the start" in err
    assert _tree(out) == before


def test_resume_to_the_checkpoints_step_trains_nothing(finished_run, tmp_path, capsys, monkeypatch):
    """--steps equal to the newest checkpoint's step: a finished run (summary.json reports those steps) is a
    no-op, status 0, nothing written; a run that stopped after its last save but before its summary gets its
    summary and plot from its records, without starting an engine or training."""
    out = _copy_run(finished_run, tmp_path)
    before = _tree(out)
    # proves no engine is started
    monkeypatch.setattr("dppo_ext.trainer.training_run.make_rollout_engine", _engine_fails)
    assert _main(_argv(out, "--resume", steps="2")) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _tree(out) == before

    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    (out / "metrics.png").unlink()
    with (out / "metrics.jsonl").open("a") as handle:  # a step logged after the last save, then the crash
        handle.write('{"step": 3, "reward": 0.5}\n')
    assert _main(_argv(out, "--resume", steps="2")) == 0
    finished = json.loads((out / "summary.json").read_text())
    assert {k: finished[k] for k in ("steps", "start_acc", "end_acc", "loss")} == {
        k: summary[k] for k in ("steps", "start_acc", "end_acc", "loss")
    }
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert (out / "metrics.dropped.jsonl").read_text() == '{"step": 3, "reward": 0.5}\n'
    _assert_manifest_covers(out, set())


# ---------------------------------------------------------------- the manifest


def test_the_manifest_lists_every_output_and_overwrite_removes_exactly_those(tmp_path):
    """Through checkpoint rotation, a resume that moves records aside and TensorBoard events, the manifest
    lists every file and folder the trainer wrote and nothing it deleted; --overwrite then removes exactly
    those (keeping the warm start it reuses) and the user's file."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert _main(_argv(out, "--report-to", "tensorboard", save_total_limit="1")) == 0
    outputs = _outputs(out)
    assert "checkpoint-2" in outputs and "checkpoint-1" not in outputs and outputs["tensorboard"] == "dir"
    _assert_manifest_covers(out, set())
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "reward": 0.5}\n')  # logged after the last save: moved aside on resume
    assert _main(_argv(out, "--resume", "--report-to", "tensorboard", save_total_limit="1", steps="3")) == 0
    outputs = _outputs(out)
    assert {"checkpoint-3", "metrics.dropped.jsonl"} <= outputs.keys() and "checkpoint-2" not in outputs
    _assert_manifest_covers(out, set())
    assert sorted(p.name for p in out.iterdir() if p.name not in outputs) == sorted(
        [LOCK_FILE, MANIFEST_FILE, FOLDER_ID_FILE]
    )

    (out / "notes.txt").write_text("mine")
    base_model = _tree(out / "base_model")
    old = set(outputs) - {"base_model"}
    assert _main(_argv(out, "--overwrite", lr="2e-3", steps="1")) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert _tree(out / "base_model") == base_model  # the same warm start: reused, not rebuilt
    assert "metrics.dropped.jsonl" in old and not (out / "metrics.dropped.jsonl").exists()
    assert not (out / "tensorboard").exists() and not (out / "checkpoint-3").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    _assert_manifest_covers(out, {"notes.txt"})


def _manifest_files(folder: Path) -> dict[str, dict]:
    return json.loads((folder / MANIFEST_FILE).read_text())["files"]


def test_overwrite_keeps_the_users_file_inside_the_runs_own_model_folder(finished_run, tmp_path, capsys):
    """base_model/ is the trainer's (listed, every file of it recorded as soon as it is built): a file the user put
    inside it stops --overwrite, named, with nothing changed; once it is moved out, --overwrite replaces the folder."""
    out = _copy_run(finished_run, tmp_path)
    recorded = _manifest_files(out)
    assert "base_model/warm_start.json" in recorded and "base_model/model.safetensors" in recorded
    (out / "base_model" / "my_eval.md").write_text("accuracy by hand: 3/16")
    before = _tree(out)
    assert _main(_argv(out, "--overwrite", warm_start_steps="3")) == 2  # another warm start: base_model rebuilt
    err = capsys.readouterr().err
    assert "base_model" in err and "my_eval.md" in err and "nothing was changed" in err
    assert _tree(out) == before
    (out / "base_model" / "my_eval.md").rename(tmp_path / "my_eval.md")
    assert _main(_argv(out, "--overwrite", warm_start_steps="3")) == 0
    assert json.loads((out / "base_model" / "warm_start.json").read_text())["settings"]["warm_start_steps"] == 3


def test_resume_never_records_the_users_file_inside_a_runs_folder_as_the_runs(finished_run, tmp_path, capsys):
    """A file the user put in base_model/ before a --resume is not what the run wrote: the run's end does not
    record it, so a later --overwrite still refuses to delete it."""
    out = _copy_run(finished_run, tmp_path)
    (out / "base_model" / "notes.txt").write_text("mine")
    assert _main(_argv(out, "--resume", steps="3")) == 0
    recorded = _manifest_files(out)
    assert "base_model/notes.txt" not in recorded and "base_model/warm_start.json" in recorded
    assert _main(_argv(out, "--overwrite", warm_start_steps="3")) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (out / "base_model" / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_runs_folder_whose_files_were_never_recorded(finished_run, tmp_path, capsys):
    """A listed folder without a record of its files (an earlier dppo-train, or a run killed before its end) is
    not provably the trainer's: --overwrite says so and changes nothing."""
    out = _copy_run(finished_run, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("base_model/")}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = _tree(out)
    assert _main(_argv(out, "--overwrite", warm_start_steps="3")) == 2
    assert "recorded none of its files" in capsys.readouterr().err
    assert _tree(out) == before


def test_overwrite_never_follows_the_manifest_outside_the_folder_or_into_a_replaced_entry(
    finished_run, tmp_path, capsys
):
    out = _copy_run(finished_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    good = (out / MANIFEST_FILE).read_text()
    manifest["outputs"]["../victim.txt"] = "file"
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = _tree(tmp_path)
    assert _main(_argv(out, "--overwrite")) == 2
    assert "output name '../victim.txt' is not a plain name in the folder" in capsys.readouterr().err
    assert _tree(tmp_path) == before

    (out / MANIFEST_FILE).write_text(good)
    (out / "summary.json").unlink()
    (out / "summary.json").symlink_to(victim)  # the user replaced the trainer's file with a link to theirs
    before = _tree(tmp_path)
    assert _main(_argv(out, "--overwrite")) == 2
    assert "summary.json' is a symlink, but dppo-train wrote a file there" in capsys.readouterr().err
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------- runs of a dppo-train older than the manifest


def _older_run(finished_run: Path, tmp_path: Path) -> Path:
    """The finished run as a dppo-train before the manifest left it (the same files, no dppo-run.json)."""
    out = _copy_run(finished_run, tmp_path)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    return out


def test_resume_continues_a_run_of_an_older_trainer_and_adopts_only_its_outputs(finished_run, tmp_path, capsys):
    """A folder an older dppo-train wrote (no manifest): --overwrite refuses it untouched; --resume recognises
    that trainer's outputs by their content, records them, continues, and leaves the rest alone; from then on
    --overwrite removes exactly those."""
    out = _older_run(finished_run, tmp_path)
    users = _add_user_files(out, _outside(tmp_path))
    before = _tree(out)
    assert _main(_argv(out, "--overwrite")) == 2
    assert "has no dppo-run.json" in capsys.readouterr().err
    assert _tree(out) == before
    assert _main(_argv(out, "--resume", steps="3")) == 0
    assert _part(_tree(out), users) == _part(before, users)
    outputs = _outputs(out)
    assert set(outputs) == {
        "config.json",
        "inputs.json",
        "metrics.jsonl",
        "metrics.png",
        "summary.json",
        "base_model",
        "checkpoint-2",
        "checkpoint-3",
    }  # checkpoint-1 rotated away (--save-total-limit 2)
    _assert_manifest_covers(out, users)
    assert _main(_argv(out, "--overwrite", steps="1")) == 0
    assert _part(_tree(out), users) == _part(before, users)


@pytest.mark.parametrize("name", ["summary.json", "metrics.png", "inputs.json", "checkpoint-7"])
def test_resume_of_an_older_run_refuses_a_file_that_trainer_did_not_write(name, finished_run, tmp_path, capsys):
    """In a folder without a manifest, an entry with the name of one of the trainer's outputs that does not hold
    what the trainer writes there is the user's: --resume refuses (it would overwrite it) and changes nothing."""
    out = _older_run(finished_run, tmp_path)
    path = out / name
    if name.startswith("checkpoint-"):
        path.mkdir()
        (path / "weights.bin").write_bytes(b"my own")
    else:
        path.write_text("my own notes, not the trainer's")
    before = _tree(out)
    assert _main(_argv(out, "--resume", steps="3")) == 2
    err = capsys.readouterr().err
    assert f"{str(path)!r} is not what that trainer writes there" in err and "nothing was changed" in err, err
    assert _tree(out) == before


def test_resume_refuses_a_folder_whose_config_json_is_not_a_trainer_config(finished_run, tmp_path, capsys):
    out = _older_run(finished_run, tmp_path)
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 17}))
    before = _tree(out)
    assert _main(_argv(out, "--resume", steps="3")) == 2
    assert "not a run of an earlier dppo-train either (its config.json is not a dppo-train config)" in (
        capsys.readouterr().err
    )
    assert _tree(out) == before


# ---------------------------------------------------------------- a manifest speaks only for its own folder and files


def _users_run_files(folder: Path) -> dict[str, str]:
    """The user's own files under the names a run writes."""
    mine = {
        "config.json": '{"mine": true}\n',
        "summary.json": '{"accuracy": 0.99}\n',
        "metrics.jsonl": '{"step": 1, "mine": 1}\n',
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in mine.items():
        (folder / name).write_text(text)
    return mine


def test_a_manifest_copied_into_a_folder_of_the_users_files_speaks_for_nothing(finished_run, tmp_path, capsys):
    """Issue 29 row 4: ``dppo-run.json`` copied (or left) beside the user's config.json, summary.json and
    metrics.jsonl; --overwrite deleted and replaced them. The manifest was written for another folder: refused,
    naming it, and the folder is left byte for byte."""
    folder = tmp_path / "mine"
    mine = _users_run_files(folder)
    shutil.copy2(finished_run / MANIFEST_FILE, folder / MANIFEST_FILE)
    before = _tree(folder)
    assert _main(_argv(folder, "--overwrite")) == 2
    err = capsys.readouterr().err
    assert f"was written for the folder {str(finished_run.resolve())!r}" in err and "speaks for nothing" in err
    assert _tree(folder) == before
    assert {name: (folder / name).read_text() for name in mine} == mine


def test_overwrite_keeps_a_file_the_user_changed_after_the_run(finished_run, tmp_path, capsys, caplog):
    """A file the run wrote and the user edited since is not the run's any more: --overwrite refuses (the new run
    would write it again) and changes nothing; an output the new run does not rewrite is kept with a warning."""
    out = _copy_run(finished_run, tmp_path)
    (out / "summary.json").write_text('{"my": "edit"}\n')
    before = _tree(out)
    assert _main(_argv(out, "--overwrite")) == 2
    err = capsys.readouterr().err
    assert "summary.json" in err and "is not what the previous run wrote there" in err
    assert _tree(out) == before

    out = tmp_path / "second"
    assert _main(_argv(out, save_total_limit="1")) == 0
    (out / "metrics.dropped.jsonl").write_text("mine\n")  # a listed name the new run does not write
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["outputs"]["metrics.dropped.jsonl"] = "file"
    manifest["files"]["metrics.dropped.jsonl"] = {"size": 1, "sha256": "0" * 64}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert _main(_argv(out, "--overwrite", lr="2e-3", steps="1")) == 0
    assert (out / "metrics.dropped.jsonl").read_text() == "mine\n"
    assert "--overwrite: kept metrics.dropped.jsonl in" in caplog.text
    assert "metrics.dropped.jsonl" not in _outputs(out)  # no longer spoken for


def test_a_rerun_still_overwrites_its_own_files_after_a_rename(finished_run, tmp_path):
    """What the run wrote, unchanged, is still its own, in a copy of the whole folder and after a rename: the
    manifest records the folder's id, each file's size and SHA-256; --overwrite replaces them."""
    out = _copy_run(finished_run, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["format"] == 2 and len(manifest["run_id"]) == 32
    assert manifest["folder"]["id"] == (out / FOLDER_ID_FILE).read_text().strip()
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        data = (out / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    renamed = tmp_path / "renamed"
    out.rename(renamed)
    old_summary = (renamed / "summary.json").read_bytes()
    assert _main(_argv(renamed, "--overwrite", steps="1")) == 0
    after = json.loads((renamed / MANIFEST_FILE).read_text())
    assert after["run_id"] != manifest["run_id"] and after["folder"]["id"] == manifest["folder"]["id"]
    assert (renamed / "summary.json").read_bytes() != old_summary
    assert not (renamed / "checkpoint-2").exists()


# ---------------------------------------------------------------- the one rule, in process: every command, every
# interruption point (issue 37). The run folder's own layer (open_run_folder, commit, save_checkpoint with its
# rotation), driven without a model: a run's outputs are small files and checkpoints of a stand-in model.


class _StandIn:
    """What save_checkpoint needs of a model and a tokenizer: a save_pretrained that writes a file."""

    def save_pretrained(self, folder) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text('{"stand_in": true}')


def _save(out: Path, step: int, limit: int) -> Path:
    import torch

    from dppo_ext.trainer.checkpoint import save_checkpoint

    param = torch.nn.Parameter(torch.zeros(2))
    return save_checkpoint(
        out,
        model=_StandIn(),
        tokenizer=_StandIn(),
        optimizer=torch.optim.SGD([param], lr=0.1),
        step=step,
        sampler={},
        elapsed_s=0.0,
        save_total_limit=limit,
    )


def _layer_run(out: Path, *, resume: bool = False, overwrite: bool = False, steps=(1, 2), limit: int = 2) -> None:
    """One command at the run folder's layer: open, commit, write config.json, save ``steps`` with the rotation."""
    from dppo_ext.trainer.run_folder import open_run_folder
    from dppo_ext.trainer.run_folder.files import atomic_write_text

    with open_run_folder(out, resume=resume, overwrite=overwrite) as run:
        outputs = {"config.json": "file", "metrics.jsonl": "file", "events": "dir"}
        if not resume:
            outputs["inputs.json"] = "file"
        run.commit(outputs)
        atomic_write_text(out / "config.json", '{"run": true}')
        if not resume:
            atomic_write_text(out / "inputs.json", "{}")
        (out / "events").mkdir(exist_ok=True)  # a folder output beside the checkpoints (TensorBoard's)
        for step in steps:
            atomic_write_text(out / "events" / f"events.{step}", f"step {step}")
            _save(out, step, limit)


class _Interrupted(BaseException):
    """The injected interruption (a BaseException, as KeyboardInterrupt is)."""


class _Mutations:
    """Counts every delete, rename and atomic replace (the points where a run can be interrupted) and raises
    ``_Interrupted`` at the k-th; ``kill``: every later one fails too (a killed process cleans nothing up)."""

    def __init__(self, monkeypatch, fail_at: int | None = None, kill: bool = False) -> None:
        self.count, self.fail_at, self.kill, self.dead = 0, fail_at, kill, False
        for name in ("unlink", "rmdir", "rename", "replace"):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real):
        def mutation(*args, **kwargs):
            if self.dead:
                raise _Interrupted("killed")
            self.count += 1
            if self.count == self.fail_at:
                self.dead = self.kill
                raise _Interrupted(f"interrupted at mutation {self.count}")
            return real(*args, **kwargs)

        return mutation


def _seed_users_files(out: Path, outside: Path, inside_outputs: tuple[str, ...]) -> set[str]:
    """The user's own files of every kind in a run folder: plain files and folders named like run outputs, a file
    named like a checkpoint, links to outside files and folders, and the files ``inside_outputs`` (paths inside
    the run's own checkpoints or folder outputs). Returns the top-level names."""
    (out / "notes.txt").write_text("my notes")
    (out / "checkpoint-0").mkdir()  # a folder of the user's, named like an old checkpoint: the rotation's first pick
    (out / "checkpoint-0" / "notes.md").write_text("mine")
    (out / "checkpoint-0" / "checkpoint.json").write_text('{"files": {}}')
    (out / "checkpoint-7").write_text("a file named like a checkpoint")
    (out / "checkpoint-6").symlink_to(outside)  # a link to a folder, named like a checkpoint
    (out / "link_file").symlink_to(outside / "data.bin")
    (out / ".checkpoint-0.deleting-1").write_text("looks like a dead writer's temporary")
    users = {"notes.txt", "checkpoint-0", "checkpoint-7", "checkpoint-6", "link_file", ".checkpoint-0.deleting-1"}
    for inside in inside_outputs:
        (out / inside).write_text('{"acc": 0.5}')
    return users


def _users_part(out: Path, users: set[str], inside_outputs: tuple[str, ...]) -> dict:
    tree = _part(_tree(out), users)
    if inside_outputs:
        for inside in inside_outputs:
            path = out / inside
            tree[inside] = ("file", path.read_bytes()) if path.exists() else ("missing",)
    return tree


COMMANDS = {
    "resume": dict(resume=True, steps=(3, 4), limit=1),
    "overwrite": dict(overwrite=True, steps=(1, 2), limit=1),
}


def _run_with_interruptions(tmp_path, monkeypatch, command: str, kill: bool, inside_outputs: tuple[str, ...]) -> None:
    from dppo_ext.trainer.run_folder.files import RunError

    root = tmp_path / "base"
    outside = _outside(root)
    template = root / "run"
    _layer_run(template)
    users = _seed_users_files(template, outside, inside_outputs)
    before_outside = _tree(outside)
    before = _users_part(template, users, inside_outputs)
    k = 0
    while k < 300:  # each command has far fewer mutation points
        k += 1
        out = tmp_path / f"{command}-{k}"
        shutil.copytree(template, out, symlinks=True)
        with monkeypatch.context() as patch:
            mutations = _Mutations(patch, fail_at=k, kill=kill)
            try:
                _layer_run(out, **COMMANDS[command])
                finished = True
            except _Interrupted:
                finished = False
            except RunError:
                finished = True  # refused (or stopped at a name in the way): checked below like any outcome
        assert _users_part(out, users, inside_outputs) == before, f"{command}, interrupted at mutation {k}"
        assert _tree(outside) == before_outside
        # the next command can always finish or undo it: --resume continues a run that started, --overwrite
        # finishes an interrupted --overwrite; a refusal says which, never pointing back at the refused command
        # (only the user's file inside a checkpoint stops --overwrite, and it is named)
        advice = []
        for flags in (dict(resume=True, steps=(5,)), dict(overwrite=True, steps=(1,))):
            try:
                _layer_run(out, limit=1, **flags)
                break
            except RunError as err:
                advice.append(str(err))
        else:
            assert inside_outputs and all(Path(p).name in advice[-1] for p in inside_outputs), (command, k, advice)
        assert not any("pass --resume" in a for a in advice), (command, k, advice)
        assert _users_part(out, users, inside_outputs) == before, f"{command}, after the recovery of {k}"
        shutil.rmtree(out)
        if finished and mutations.count < k:
            break  # every mutation point of the command was interrupted once
    else:
        pytest.fail(f"{command} did not finish after {k} interruption points")
    assert k > 3 or (inside_outputs and command == "overwrite")  # refused before it changed anything


@pytest.mark.parametrize(
    "inside_outputs",
    [(), ("checkpoint-2/eval_results.json",), ("events/my_notes.json",)],
    ids=["users_files", "and_a_file_inside_a_checkpoint", "and_a_file_inside_a_folder_output"],
)
@pytest.mark.parametrize("kill", [False, True], ids=["sigint", "kill"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_users_files_survive_every_command_and_every_interruption_point(
    command, kill, inside_outputs, tmp_path, monkeypatch
):
    _run_with_interruptions(tmp_path, monkeypatch, command, kill, inside_outputs)


def _layer_folder(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    _layer_run(out)
    return out


def test_an_interrupted_overwrite_keeps_the_records_of_what_it_still_has_to_delete(tmp_path, monkeypatch):
    """Row 1: the manifest an interrupted --overwrite leaves still holds the size and SHA-256 of every file it has
    yet to delete, so the next --overwrite finishes (it was `files: {}`, and every command pointed at another)."""
    out = _layer_folder(tmp_path)
    (out / "notes.txt").write_text("mine")
    recorded = json.loads((out / MANIFEST_FILE).read_text())["files"]
    assert {"config.json", "inputs.json"} <= recorded.keys()
    with monkeypatch.context() as patch:
        _Mutations(patch, fail_at=3, kill=True)  # after two deletions
        with pytest.raises(_Interrupted):
            _layer_run(out, overwrite=True)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["state"] == "setup"
    left = [n for n, kind in manifest["outputs"].items() if kind == "file" and (out / n).exists()]
    assert left and all(manifest["files"][n] == recorded[n] for n in left)
    from dppo_ext.trainer.run_folder.files import RunError

    for flags in (dict(), dict(resume=True)):
        with pytest.raises(RunError, match="(?i)pass --overwrite again"):
            _layer_run(out, **flags)
    _layer_run(out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_writes_the_manifest_a_constant_number_of_times(tmp_path, monkeypatch):
    """Row 9: 2,000 listed names cost a few manifest writes, not one rewrite and fsync per name (quadratic: 20,000
    names took 493 s)."""
    from dppo_ext.trainer.run_folder import manifest as manifest_module
    from dppo_ext.trainer.run_folder import open_run_folder

    out = _layer_folder(tmp_path)
    data = json.loads((out / MANIFEST_FILE).read_text())
    data["outputs"].update({f"gone-{i}.txt": "file" for i in range(2_000)})
    (out / MANIFEST_FILE).write_text(json.dumps(data))
    writes = []
    real = manifest_module.atomic_write_text
    monkeypatch.setattr(manifest_module, "atomic_write_text", lambda *a: writes.append(1) or real(*a))
    with open_run_folder(out, resume=False, overwrite=True) as run:
        run.commit({"config.json": "file"})
    assert len(writes) <= 4, f"{len(writes)} manifest writes for 2,000 listed names"
    assert set(json.loads((out / MANIFEST_FILE).read_text())["outputs"]) == {"config.json"}


def test_the_rotation_deletes_only_checkpoints_this_run_wrote(tmp_path, caplog):
    """Rows 2, 3, 6: the user's checkpoint-1/ (not in the manifest), a checkpoint moved away and linked back, a
    plain file named checkpoint-3 in the way of a save: the rotation keeps the first two (warning), the save at
    step 3 is refused naming the file, and each is byte for byte what it was."""
    from dppo_ext.trainer.run_folder.files import RunError

    out = tmp_path / "run"
    _layer_run(out, steps=(2,))
    archive = tmp_path / "archive"
    shutil.move(out / "checkpoint-2", archive)
    (out / "checkpoint-2").symlink_to(archive)
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"my model")
    (out / "checkpoint-3").write_text("my notes")
    users = {"checkpoint-1", "checkpoint-2", "checkpoint-3"}
    before, archived = _part(_tree(out), users), _tree(archive)
    with pytest.raises(RunError, match=r"checkpoint-3' is in the way of the checkpoint of step 3: it is not a "):
        _layer_run(out, resume=True, steps=(3,), limit=1)
    _layer_run(out, resume=True, steps=(4, 5), limit=1)
    assert _part(_tree(out), users) == before and _tree(archive) == archived
    assert not (out / "checkpoint-4").exists() and (out / "checkpoint-5").is_dir()
    assert "kept" in caplog.text and "not in the run's dppo-run.json" in caplog.text and "is a link" in caplog.text


def test_overwrite_refuses_a_checkpoint_holding_a_file_it_did_not_write(tmp_path):
    """Row 5: an eval script's checkpoint-2/eval_results.json is not the trainer's: --overwrite names it and
    changes nothing."""
    from dppo_ext.trainer.run_folder.files import RunError

    out = _layer_folder(tmp_path)
    (out / "checkpoint-2" / "eval_results.json").write_text("{}")
    before = _tree(out)
    with pytest.raises(RunError, match=r"checkpoint-2' holds what dppo-train did not write there \(eval_results"):
        _layer_run(out, overwrite=True)
    assert _tree(out) == before


def test_the_lock_is_never_written_through_a_link_or_over_a_users_file(tmp_path):
    """Row 4: .dppo-train.lock as a link to the user's thesis, or a file of theirs by that name: refused, unchanged."""
    from dppo_ext.trainer.run_folder.files import RunError

    thesis = tmp_path / "thesis.tex"
    thesis.write_text("\\chapter{One}")
    for kind in ("link", "file"):
        out = tmp_path / kind
        out.mkdir()
        if kind == "link":
            (out / LOCK_FILE).symlink_to(thesis)
        else:
            (out / LOCK_FILE).write_text("my own lock notes, two lines\nof them\n")
        before = _tree(out)
        with pytest.raises(RunError, match="lock"):
            _layer_run(out)
        assert _tree(out) == before and thesis.read_text() == "\\chapter{One}"


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    """Row 7: run B's complete checkpoint-4 copied into run A's folder: --resume on A names it, changes nothing."""
    from dppo_ext.trainer.resume import check_written_by_this_run
    from dppo_ext.trainer.run_folder.files import RunError

    a, b = tmp_path / "a", tmp_path / "b"
    _layer_run(a, steps=(2,))
    _layer_run(b, steps=(4,))
    shutil.copytree(b / "checkpoint-4", a / "checkpoint-4")
    with pytest.raises(RunError, match=r"checkpoint-4' was not written by the run .*not in the run's dppo-run.json"):
        check_written_by_this_run(a, a / "checkpoint-4")
    check_written_by_this_run(a, a / "checkpoint-2")
    # listed (a hand-edited manifest), but its checkpoint.json names run B
    data = json.loads((a / MANIFEST_FILE).read_text())
    data["outputs"]["checkpoint-4"] = "dir"
    (a / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(RunError, match=r"its checkpoint.json names run [0-9a-f]{32}, and this folder holds run"):
        check_written_by_this_run(a, a / "checkpoint-4")


def test_resume_refuses_when_inputs_json_went_missing(tmp_path):
    """Row 8: inputs.json deleted (and the data changed): --resume cannot check the data, so it refuses, saying how
    to go on; with inputs.json there, a changed --data is refused as before."""
    from dppo_ext.trainer.config import TrainConfig
    from dppo_ext.trainer.resume import check_resume_config, data_fingerprints
    from dppo_ext.trainer.run_folder.files import RunError

    out = _layer_folder(tmp_path)
    data = _data_file(tmp_path / "train.jsonl")
    config = TrainConfig(data=str(data), out=str(out))
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    (out / "inputs.json").write_text(json.dumps(data_fingerprints(config)))
    check_resume_config(out, config)
    data.write_text(data.read_text() + data.read_text())
    with pytest.raises(RunError, match="--data .* changed since the run started"):
        check_resume_config(out, config)
    (out / "inputs.json").unlink()
    with pytest.raises(RunError, match=r"inputs.json', where the run recorded the SHA-256 .* is missing"):
        check_resume_config(out, config)


def test_resume_refuses_when_config_json_went_missing(tmp_path):
    """config.json deleted (and the data changed): without it neither the settings nor, before, the data were
    checked, and the run went on; --resume now refuses, saying how to go on."""
    from dppo_ext.trainer.config import TrainConfig
    from dppo_ext.trainer.resume import check_resume_config, data_fingerprints
    from dppo_ext.trainer.run_folder.files import RunError

    out = _layer_folder(tmp_path)
    data = _data_file(tmp_path / "train.jsonl")
    config = TrainConfig(data=str(data), out=str(out))
    (out / "inputs.json").write_text(json.dumps(data_fingerprints(config)))
    (out / "config.json").unlink()
    data.write_text(data.read_text() + data.read_text())
    with pytest.raises(RunError, match=r"config.json', where the run recorded its settings .* is missing"):
        check_resume_config(out, config)


def test_the_metrics_are_never_appended_through_a_link(tmp_path):
    """metrics.jsonl replaced by a link to the user's file: a resumed run refuses to append to it (it appended
    through the link), naming it; the user's file is unchanged."""
    from dppo_ext.trainer.metrics import MetricsWriter
    from dppo_ext.trainer.run_folder.files import RunError

    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"step": 0}\n')
    (tmp_path / "metrics.jsonl").symlink_to(mine)
    writer = MetricsWriter.__new__(MetricsWriter)
    writer.path = tmp_path / "metrics.jsonl"
    with pytest.raises(RunError, match=r"metrics.jsonl' is a symbolic link: the trainer appends only to its own"):
        writer.write({"step": 1})
    assert mine.read_text() == '{"step": 0}\n'


def test_a_temporary_is_removed_only_when_its_writer_is_dead(tmp_path, caplog):
    """A run removes the trainer temporaries a dead writer left (a checkpoint being written when it was killed),
    never one whose writer is still running (its pid in the name is a live process other than this one)."""
    out = _layer_folder(tmp_path)
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() else 2**22
    for pid in (dead, os.getppid()):
        (out / f".checkpoint-3.tmp-{pid}").mkdir()
        (out / f".checkpoint-3.tmp-{pid}" / "state.pt").write_bytes(b"half written")
    _layer_run(out, resume=True, steps=(3,), limit=0)
    assert not (out / f".checkpoint-3.tmp-{dead}").exists()
    assert (out / f".checkpoint-3.tmp-{os.getppid()}" / "state.pt").read_bytes() == b"half written"
    assert f"(pid {os.getppid()}) is still running" in caplog.text
