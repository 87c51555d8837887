"""Data-parallel training with the DPPO loss under ``accelerate launch``: 2 CPU processes, gloo.

* DDP (fused-linear path, tied embeddings): the global loss of every step equals one process on the same global
  batch, and the weights after the steps equal it too and are identical on both ranks.
* FSDP2 (``fully_shard``): the LM-head weight is stored sharded (a DTensor) and the fused-linear loss sees the
  gathered full tensor inside the forward; losses and final weights again equal one process.
* TRL: DPPOGRPOTrainer trains a tiny local model for two steps on two processes; weights change and stay in sync.

``accelerate launch --cpu`` starts a single process in accelerate 1.x, so the launches use ``--multi_gpu``
(torchrun underneath) and the scripts ask accelerate for the CPU (``Accelerator(cpu=True)``, ``use_cpu=True``),
which selects MULTI_CPU with gloo. Each launch takes ~30-60 s on two cores.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from dppo_testing import DIST_ENV  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "dist_scripts"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV and not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def launch(script: str, args: list[str], out: Path, processes: int = 2, timeout: int = 300) -> dict:
    """Run ``script`` with ``accelerate launch`` on ``processes`` CPU processes (1: plain python); read its JSON."""
    if processes == 1:
        cmd = [sys.executable, str(SCRIPTS / script)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(_free_port()),
            str(SCRIPTS / script),
        ]
    # Own session: on a timeout the whole tree goes (the launcher and its ranks), not only the launcher.
    proc = subprocess.Popen(
        [*cmd, *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=str(out.parent),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(out.read_text())


def _assert_same_run(single: dict, multi: dict, rtol: float = 1e-5) -> None:
    assert multi["world"] == 2 and single["world"] == 1
    for step, (a, b) in enumerate(zip(single["losses"], multi["losses"])):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-7), f"step {step}: 1 process {a} vs 2 processes {b}"
    rank0, rank1 = multi["fingerprints"]
    assert rank0 == rank1, "weights differ between ranks"
    for i, (a, b) in enumerate(zip(single["fingerprints"][0], rank0)):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-5), f"weight fingerprint {i}: {a} vs {b}"


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "one.json"
    return launch("dp_train.py", [], out, processes=1)


@pytest.mark.slow
def test_ddp_two_processes_match_one(single_process, tmp_path):
    multi = launch("dp_train.py", [], tmp_path / "ddp.json")
    _assert_same_run(single_process, multi)
    assert single_process["losses"][0] != single_process["losses"][-1], "the steps must change the loss"


@pytest.mark.slow
def test_fsdp2_sharded_lm_head_matches_one(single_process, tmp_path):
    multi = launch("dp_train.py", ["--fsdp"], tmp_path / "fsdp.json")
    assert multi["stored_head_weight_type"] == "DTensor", "FSDP2 must store the tied LM head sharded"
    assert multi["loss_head_weight_types"] == ["Tensor"], "the fused loss must see the gathered full weight"
    _assert_same_run(single_process, multi)


@pytest.mark.slow
def test_trl_trainer_two_processes(tmp_path):
    pytest.importorskip("trl")
    import torch  # noqa: F401  (dppo_ext needs torch loaded first)

    from dppo_ext.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    result = launch("trl_train.py", ["--model", str(model_dir), "--steps", "2"], tmp_path / "trl.json", timeout=400)
    assert result["world"] == 2
    assert result["changed"] == result["num_params"], "every parameter must be updated"
    rank0, rank1 = result["fingerprints"]
    assert rank0 == rank1, "weights differ between ranks"
    steps = [h for h in result["log_history"] if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["loss"]) for h in steps)
    assert all(h["dppo/num_tokens"] > 0 and "dppo/masked_frac" in h for h in steps)
