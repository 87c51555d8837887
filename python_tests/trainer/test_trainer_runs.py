"""A run is never lost: the reference trainer's run folder, lock, checkpoints, metrics file and
load errors. No vLLM: direct calls on a tiny model, and short HF-engine runs.

Each test sets up the misuse or fault a user meets (a rerun into the same --out, two trainers on
one folder, a crash during a save or a metrics write, a damaged file) and checks the result
against what was on disk before: the earlier run is intact, or the error names the file and the
flag to use.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch

from dppo_ext.tasks import DataFormatError, load_jsonl_problems
from dppo_ext.trainer.cli import parse_config
from dppo_ext.trainer.config import TrainConfig

# ---------------------------------------------------------------- helpers


def _tiny_run_config(out: Path, **overrides) -> TrainConfig:
    settings = dict(
        out=str(out),
        engine="hf",
        max_operand=9,
        num_eval=16,
        warm_start_problems=60,
        warm_start_steps=20,
        steps=2,
        prompts_per_step=6,
        group_size=4,
        num_minibatches=2,
        eval_every=2,
        eval_samples=1,
        save_every=1,
        max_new_tokens=4,
        lr=1e-3,
        threads=1,
        seed=5,
        warm_start_label_smoothing=0.0,
    )
    settings.update(overrides)
    return TrainConfig(**settings).validate()


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory):
    """(model, tokenizer, optimizer) of a tiny Llama, with one AdamW step taken (non-empty state)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_ext.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 4, 5]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, tokenizer, optimizer


def _save(out: Path, parts, step: int, **kwargs) -> Path:
    from dppo_ext.trainer.checkpoint import save_checkpoint

    model, tokenizer, optimizer = parts
    return save_checkpoint(
        out,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        step=step,
        sampler={"rng": None, "order": [step]},
        elapsed_s=float(step),
        **kwargs,
    )


def _to_legacy(checkpoint: Path, name: str) -> Path:
    """Turn a checkpoint-<step> folder into a folder of the earlier layout (no manifest)."""
    from dppo_ext.trainer.run_folder.files import CHECKPOINT_RECORD

    legacy = checkpoint.with_name(name)
    checkpoint.rename(legacy)
    (legacy / CHECKPOINT_RECORD).unlink()
    return legacy


# ---------------------------------------------------------------- --out: refused unless --resume / --overwrite


def test_rerun_into_a_non_empty_out_is_refused_and_changes_nothing(tmp_path: Path, capsys):
    from dppo_ext.train import main, run
    from dppo_ext.trainer.run_folder.files import RunError

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.25}\n')
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(
        RunError,
        match=r"is not empty \(it holds metrics\.jsonl, notes\.txt\) and has no dppo-run\.json"
        r".* a fresh run needs an empty folder\. Nothing was changed\. Pass an empty or new --out",
    ):
        run(_tiny_run_config(out), progress=False)
    assert main(["--out", str(out), "--engine", "hf", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "dppo-train: error:" in err and "dppo-run.json" in err and "Traceback" not in err
    assert _snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt"]
    # a folder that holds a run of this trainer (its manifest): --resume or --overwrite is the way
    run(_tiny_run_config(tmp_path / "done", steps=1, warm_start_steps=2), progress=False)
    before = _snapshot(tmp_path / "done")
    with pytest.raises(
        RunError,
        match=r"already holds a run \(its dppo-run\.json lists .*checkpoint-1.*\): "
        r"pass --resume to continue it, --overwrite to delete what it wrote",
    ):
        run(_tiny_run_config(tmp_path / "done", steps=1, warm_start_steps=2), progress=False)
    assert _snapshot(tmp_path / "done") == before


def test_out_that_is_a_file_is_refused(tmp_path: Path):
    from dppo_ext.train import run
    from dppo_ext.trainer.run_folder.files import RunError

    (tmp_path / "f").write_text("x")
    with pytest.raises(RunError, match="exists and is not a folder"):
        run(_tiny_run_config(tmp_path / "f"), progress=False)


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ValueError, match="--resume and --overwrite contradict each other"):
        parse_config(["--resume", "--overwrite"])


# ---------------------------------------------------------------- one writer per --out

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from dppo_ext.trainer.run_folder.lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
def test_second_trainer_on_the_same_out_is_refused_with_the_holders_pid(tmp_path: Path):
    from dppo_ext.train import run
    from dppo_ext.trainer.run_folder.files import RunError
    from dppo_ext.trainer.run_folder.lock import RunLock

    out = tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (out / "config.json").write_text("{}")  # in use is what matters, not that it is non-empty
        for config in (
            _tiny_run_config(out),
            _tiny_run_config(out, resume=True),
            _tiny_run_config(out, overwrite=True),
        ):
            with pytest.raises(RunError, match=rf"another dppo-train \(pid {holder.pid} on host .*\) holds its lock"):
                run(config, progress=False)
        # a crash (SIGKILL: no cleanup code runs) releases the lock: flock belongs to the open file
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with RunLock(out) as lock:
            assert lock.held
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    with RunLock(out):
        with pytest.raises(RunError, match=rf"pid {os.getpid()}"):
            RunLock(out).acquire()


def test_a_filesystem_without_flock_warns_and_runs(tmp_path: Path, monkeypatch, caplog):
    import errno

    from dppo_ext.trainer.run_folder import lock, open_run_folder

    def unsupported(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock.fcntl, "flock", unsupported)
    with caplog.at_level(logging.WARNING), open_run_folder(tmp_path / "nfs", resume=False, overwrite=False) as run:
        assert run.lock.held
    assert "does not support flock); make sure only one trainer writes" in caplog.text


# ---------------------------------------------------------------- checkpoints


def test_checkpoints_are_step_numbered_and_save_total_limit_keeps_the_newest(tmp_path: Path, tiny_parts):
    from dppo_ext.trainer.checkpoint import find_resume_checkpoint, list_checkpoints, load_trainer_state

    for step in (1, 2, 3):
        _save(tmp_path, tiny_parts, step, save_total_limit=2)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # no temporaries left
    newest = find_resume_checkpoint(tmp_path)
    assert newest.name == "checkpoint-3" and load_trainer_state(newest)["step"] == 3
    model = tiny_parts[0]
    saved = _weights(newest / "model")
    assert all(torch.equal(saved[name], p.detach()) for name, p in model.named_parameters())
    _save(tmp_path, tiny_parts, 4, save_total_limit=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3, 4]


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, tiny_parts, monkeypatch):
    from dppo_ext.trainer import checkpoint as ckpt
    from dppo_ext.trainer.run_folder import open_run_folder

    with open_run_folder(tmp_path, resume=False, overwrite=False) as folder:  # a run folder, with its manifest
        folder.commit()
    _save(tmp_path, tiny_parts, 1, save_total_limit=1)
    before = _snapshot(tmp_path / "checkpoint-1")

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt.torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, tiny_parts, 2, save_total_limit=1)
    monkeypatch.undo()
    # the half-written step 2 is invisible, step 1 untouched and still what --resume takes
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert ckpt.find_resume_checkpoint(tmp_path).name == "checkpoint-1"
    assert _snapshot(tmp_path / "checkpoint-1") == before
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-2")]
    assert leftovers
    # the next run on the folder clears the dead writer's temporary once it starts (holding the lock)
    with open_run_folder(tmp_path, resume=True, overwrite=False) as folder:
        assert leftovers == [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-2")]
        folder.commit()
        assert not any(p.name.startswith(".checkpoint-2") for p in tmp_path.iterdir())
    assert _snapshot(tmp_path / "checkpoint-1") == before


def test_resume_takes_the_newest_complete_checkpoint_and_reports_a_damaged_one(tmp_path: Path, tiny_parts):
    from dppo_ext.trainer.checkpoint import CheckpointError, find_resume_checkpoint
    from dppo_ext.trainer.run_folder.files import CHECKPOINT_RECORD

    _save(tmp_path, tiny_parts, 2)
    newest = _save(tmp_path, tiny_parts, 4)
    (newest / CHECKPOINT_RECORD).unlink()  # a folder someone copied in without finishing
    with pytest.raises(
        CheckpointError, match=r"checkpoint-4.* no checkpoint\.json .*move checkpoint-4 out of .* checkpoint-2"
    ):
        find_resume_checkpoint(tmp_path)
    shutil.move(str(newest), str(tmp_path.parent / "moved-away"))
    assert find_resume_checkpoint(tmp_path).name == "checkpoint-2"


def test_truncated_trainer_state_is_named(tmp_path: Path, tiny_parts):
    from dppo_ext.trainer.checkpoint import STATE_FILE, CheckpointError, find_resume_checkpoint, load_trainer_state

    ckpt = _save(tmp_path / "new", tiny_parts, 3)
    state = ckpt / STATE_FILE
    full = state.read_bytes()
    state.write_bytes(full[: len(full) // 2])
    with pytest.raises(
        CheckpointError,
        match=rf"{STATE_FILE}' is truncated: {len(full) // 2} bytes, the checkpoint recorded {len(full)}",
    ):
        find_resume_checkpoint(tmp_path / "new")
    # the earlier layout has no manifest: torch.load's failure is reported with the file's name
    legacy = _to_legacy(_save(tmp_path / "old", tiny_parts, 3), "checkpoint")
    (legacy / STATE_FILE).write_bytes(full[: len(full) // 2])
    with pytest.raises(CheckpointError, match=rf"{STATE_FILE}' cannot be read: it is truncated or corrupt"):
        load_trainer_state(legacy)


def test_corrupt_weights_are_named(tmp_path: Path, tiny_parts):
    from dppo_ext.trainer.checkpoint import MODEL_DIR, CheckpointError, check_model_folder, find_resume_checkpoint

    ckpt = _save(tmp_path / "new", tiny_parts, 3)
    weights = ckpt / MODEL_DIR / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in a tensor: loads fine, wrong weights
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is corrupt: its content differs from the SHA-256"):
        find_resume_checkpoint(tmp_path / "new")
    # without a manifest (earlier layout, or a --model folder) a damaged header or a cut file is caught
    folder = _save(tmp_path / "old", tiny_parts, 3) / MODEL_DIR
    target = folder / "model.safetensors"
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors': corrupt or truncated safetensors weights"):
        check_model_folder(folder)
    target.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors': corrupt or truncated safetensors weights"):
        check_model_folder(folder)


def test_checkpoints_of_the_earlier_layout_are_found(tmp_path: Path, tiny_parts, caplog):
    from dppo_ext.trainer.checkpoint import NoCheckpointError, find_resume_checkpoint

    # today's trainer killed between the two renames of its swap: only checkpoint.old (and .tmp) exist
    _to_legacy(_save(tmp_path, tiny_parts, 50), "checkpoint.old")
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(tmp_path).name == "checkpoint.old"
    assert "earlier single-checkpoint layout (step 50)" in caplog.text
    _to_legacy(_save(tmp_path, tiny_parts, 100), "checkpoint.tmp")
    assert find_resume_checkpoint(tmp_path).name == "checkpoint.tmp"
    _to_legacy(_save(tmp_path, tiny_parts, 75), "checkpoint")
    assert find_resume_checkpoint(tmp_path).name == "checkpoint.tmp"  # the highest step wins
    _save(tmp_path, tiny_parts, 101)
    assert find_resume_checkpoint(tmp_path).name == "checkpoint-101"
    with pytest.raises(NoCheckpointError, match=r"no complete checkpoint in .*checkpoint-<step>/ .*--overwrite"):
        find_resume_checkpoint(tmp_path / "empty")


# ---------------------------------------------------------------- metrics.jsonl


def test_fresh_metrics_writer_never_truncates_an_existing_file(tmp_path: Path):
    from dppo_ext.trainer.metrics import MetricsFormatError, MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval_acc": 0.5}\n')
    with pytest.raises(MetricsFormatError, match="already holds records of an earlier run"):
        MetricsWriter(path)
    assert path.read_text() == '{"step": 0, "eval_acc": 0.5}\n'


def test_metrics_are_appended_one_line_per_record(tmp_path: Path):
    from dppo_ext.trainer.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 0, "eval_acc": 0.5})
    assert path.read_text() == '{"step": 0, "eval_acc": 0.5}\n'  # on disk before the next record
    writer.write({"step": 1, "loss": math.nan})
    assert path.read_text().splitlines() == ['{"step": 0, "eval_acc": 0.5}', '{"step": 1, "loss": null}']
    assert read_metrics(path) == [{"step": 0, "eval_acc": 0.5}, {"step": 1, "loss": None}]


def test_resume_drops_a_cut_off_last_line_and_later_records(tmp_path: Path, caplog):
    from dppo_ext.trainer.metrics import DROPPED_FILE, MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in range(5)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "rew')  # crash mid-write
    with caplog.at_level(logging.WARNING):
        writer = MetricsWriter(path, resume_step=3)
    assert "dropped a cut-off last line" in caplog.text and "1 record(s) of steps after" in caplog.text
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert [json.loads(x)["step"] for x in (tmp_path / DROPPED_FILE).read_text().splitlines()] == [4]
    writer.write({"step": 4, "reward": 0.9})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    # a complete last record without its newline is kept, and the next one starts a new line
    path.write_text(lines[0] + "\n" + lines[1])
    MetricsWriter(path, resume_step=1).write({"step": 2})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_corrupt_metrics_line_is_named(tmp_path: Path):
    from dppo_ext.trainer.metrics import MetricsFormatError, MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n')
    with pytest.raises(MetricsFormatError, match=r"metrics\.jsonl:2: invalid JSON"):
        read_metrics(path)
    with pytest.raises(MetricsFormatError, match=r"metrics\.jsonl:2: invalid JSON"):
        MetricsWriter(path, resume_step=2)
    path.write_text('{"step": 0}\n{"step": 1, "x')
    with pytest.raises(MetricsFormatError, match=r"metrics\.jsonl:2: cut off"):
        read_metrics(path)


# ---------------------------------------------------------------- data, model folder, flags


def test_data_that_is_not_utf8_names_file_and_line(tmp_path: Path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\u00e9?", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_jsonl_problems(path)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9?", "answer": "2"}\n'.encode())
    assert load_jsonl_problems(bom)[0].prompt == "caf\u00e9?"


def test_model_folder_without_a_model_is_named(tmp_path: Path):
    from dppo_ext.train import run
    from dppo_ext.trainer.run_folder.files import RunError

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(20)))
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    (empty / "README.md").write_text("notes")
    config = _tiny_run_config(tmp_path / "out", model=str(empty), data=str(data), num_eval=4)
    with pytest.raises(RunError, match=r"--model '.*not_a_model' holds no model: no config\.json"):
        run(config, progress=False)
    (empty / "config.json").write_text("{}")
    with pytest.raises(RunError, match=r"--model '.*not_a_model' holds no model weights"):
        run(config, progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_reported_before_out_is_touched(tmp_path: Path):
    from dppo_ext.models.tiny import build_tiny_model
    from dppo_ext.train import run
    from dppo_ext.trainer.run_folder.files import RunError

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "\xff", "answer": 1}\n')
    model = build_tiny_model(tmp_path / "m", seed=0)  # 17-token vocabulary
    out = tmp_path / "out"
    with pytest.raises(DataFormatError, match=r"d\.jsonl:2: not valid UTF-8"):
        run(_tiny_run_config(out, model=str(model), data=str(data), num_eval=1), progress=False)
    assert not out.exists()
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(20)))
    config = _tiny_run_config(out, model=str(model), data=str(data), num_eval=4, loss="dppo_topk_kl", top_k=18)
    with pytest.raises(RunError, match=r"--top-k=18 exceeds the vocabulary of .* \(17 tokens\)"):
        run(config, progress=False)
    assert not out.exists()  # the run created the folder during its set-up, and removed it again


_FLOAT_FLAGS = [
    name for name, kind in typing.get_type_hints(TrainConfig).items() if kind is float or kind == typing.Optional[float]
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", _FLOAT_FLAGS)
def test_every_float_flag_must_be_finite(name: str, value: float):
    flag = name.replace("_", "-")
    with pytest.raises(ValueError, match=rf"--{flag} must be a finite number, got {value}"):
        TrainConfig(**{name: value}).validate()
    with pytest.raises(ValueError, match=rf"--{flag} must be a finite number"):
        parse_config([f"--{flag}={value}"])


def test_float_flags_are_all_covered():
    assert {"lr", "warm_start_lr", "temperature", "delta_low", "max_grad_norm", "vllm_gpu_memory_utilization"} <= set(
        _FLOAT_FLAGS
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"seed": -1}, r"--seed must be in \[0, 2\*\*32\)"),
        ({"seed": 2**32}, r"--seed must be in \[0, 2\*\*32\)"),
        ({"save_total_limit": -1}, r"--save-total-limit must be >= 0"),
        ({"max_new_tokens": 300, "max_model_len": 256}, r"--max-new-tokens=300 leaves no room for the prompt"),
        ({"tiny_hidden": 130}, r"--tiny-hidden=130 gives the embedded model 2 head\(s\) of 65 dims"),
        ({"tiny_hidden": 20}, r"--tiny-hidden=20 gives the embedded model 1 head\(s\) of 20 dims"),
        ({"warm_start_label_smoothing": 1.0}, r"--warm-start-label-smoothing must be in \[0, 1\)"),
        ({"lr": "1e-4"}, r"--lr must be float, got '1e-4' \(str\)"),
        ({"steps": 2.5}, r"--steps must be int, got 2\.5 \(float\)"),
        ({"steps": True}, r"--steps must be int, got True \(bool\)"),
        ({"adv_std": 1}, r"--adv-std must be bool, got 1 \(int\)"),
        ({"delta_low": "0.2"}, r"--delta-low must be float or None"),
    ],
)
def test_int_ranges_and_types(overrides, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**overrides).validate()


def test_a_setting_the_run_cannot_use_is_one_error_line_not_a_traceback(tmp_path: Path, capsys):
    """A plain ValueError from the run's set-up (here: more held-out problems than the task has)
    ends the CLI with status 2 and the message, before anything is written."""
    from dppo_ext.train import main

    out = tmp_path / "run"
    argv = ["--out", str(out), "--engine", "hf", "--steps", "1", "--max-operand", "9", "--num-eval", "100000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"dppo-train: error: num_eval=100000 .* \(--log-level debug shows where it was raised\)", err), err
    assert not out.exists() or not any(out.iterdir())


def test_resume_treats_a_verl_alias_as_the_same_loss():
    """``--loss dppo_tv`` is verl's name of ``dppo_binary_tv``: resuming with the other name is
    not a changed setting, while another loss still is."""
    from dppo_ext.trainer.resume import resume_config_changes

    saved = _tiny_run_config("/tmp/unused", loss="dppo_tv").to_dict()
    assert resume_config_changes(saved, _tiny_run_config("/tmp/unused", loss="dppo_binary_tv")) == []
    assert resume_config_changes(saved, _tiny_run_config("/tmp/unused", loss="dppo_tv")) == []
    assert resume_config_changes(saved, _tiny_run_config("/tmp/unused", loss="dppo_binary_kl")) == [
        "--loss 'dppo_tv' -> 'dppo_binary_kl'"
    ]
    assert (
        resume_config_changes({**saved, "loss": "dppo_kl"}, _tiny_run_config("/tmp/unused", loss="dppo_binary_kl"))
        == []
    )


# ---------------------------------------------------------------- whole runs (HF engine)


def test_overwrite_replaces_the_previous_run_and_resume_refuses_changed_settings(tmp_path: Path):
    from dppo_ext.train import run
    from dppo_ext.trainer.checkpoint import find_resume_checkpoint, list_checkpoints, load_trainer_state
    from dppo_ext.trainer.metrics import read_metrics
    from dppo_ext.trainer.run_folder.files import RunError

    out = tmp_path / "run"
    run(_tiny_run_config(out, steps=3, save_total_limit=2, warm_start_steps=2), progress=False)
    assert [s for s, _ in list_checkpoints(out)] == [2, 3]
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)

    # resuming with settings that change what is trained is refused, naming each flag
    with pytest.raises(
        RunError, match=r"settings differ .*--lr 0\.001 -> 0\.002; --seed 5 -> 6\. .*--overwrite to start over"
    ):
        run(_tiny_run_config(out, steps=4, resume=True, lr=2e-3, seed=6, warm_start_steps=2), progress=False)
    assert _snapshot(out) == before

    # --overwrite: a fresh run, nothing of the old one mixed in; files the trainer does not own stay
    run(_tiny_run_config(out, steps=1, seed=6, overwrite=True, warm_start_steps=2), progress=False)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert json.loads((out / "config.json").read_text())["seed"] == 6
    assert [s for s, _ in list_checkpoints(out)] == [1]
    assert load_trainer_state(find_resume_checkpoint(out))["step"] == 1
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


def test_resume_refuses_changed_data(tmp_path: Path):
    from dppo_ext.models.tiny import build_tiny_model
    from dppo_ext.train import run
    from dppo_ext.trainer.run_folder.files import RunError

    model = build_tiny_model(tmp_path / "m", seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(20)))
    out = tmp_path / "out"
    settings = dict(model=str(model), data=str(data), num_eval=4, steps=1, prompts_per_step=4, group_size=2)
    run(_tiny_run_config(out, **settings), progress=False)
    before = _snapshot(out)
    data.write_text(data.read_text().replace('"answer": 7', '"answer": 8'))  # same path, one answer fixed
    with pytest.raises(RunError, match=r"--resume: --data '.*d\.jsonl' changed since the run started"):
        run(_tiny_run_config(out, **dict(settings, steps=2), resume=True), progress=False)
    assert _snapshot(out) == before


def test_a_crash_while_plotting_keeps_the_previous_plot(tmp_path: Path, monkeypatch):
    import matplotlib.figure

    from dppo_ext.trainer.plotting import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "eval_acc": 0.1}\n{"step": 1, "eval_acc": 0.2, "loss": 0.5}\n')
    png = plot_metrics(metrics, tmp_path / "metrics.png")
    before = png.read_bytes()
    assert before.startswith(b"\x89PNG")

    def dies(self, target, *args, **kwargs):
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as handle:
                handle.write(b"\x89PNG partial")
        else:
            target.write(b"\x89PNG partial")
        raise KeyboardInterrupt("killed while saving the plot")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", dies)
    with pytest.raises(KeyboardInterrupt):
        plot_metrics(metrics, png)
    assert png.read_bytes() == before


def test_embedded_model_rebuild_is_atomic(tmp_path: Path, monkeypatch):
    from dppo_ext.tasks import make_arithmetic_task
    from dppo_ext.trainer import embedded_model

    config = _tiny_run_config(tmp_path / "out", warm_start_steps=2)
    task = make_arithmetic_task(max_operand=9, num_eval=16, num_sft=60, seed=5)
    folder = tmp_path / "base_model"
    embedded_model.prepare_embedded_model(folder, config, task)
    before = _snapshot(folder)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed during the warm start")

    monkeypatch.setattr(embedded_model, "supervised_warm_start", dies)
    with pytest.raises(KeyboardInterrupt):
        embedded_model.prepare_embedded_model(
            folder, _tiny_run_config(tmp_path / "out", warm_start_steps=3, tiny_layers=1), task
        )
    # the folder still holds the model its warm_start.json describes, so reusing it is right
    assert _snapshot(folder) == before
    monkeypatch.undo()
    assert embedded_model.prepare_embedded_model(folder, config, task) == folder
    assert _snapshot(folder) == before
