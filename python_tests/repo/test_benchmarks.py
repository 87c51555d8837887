"""The benchmark harness's own behaviour (not its figures): where results go, what the speed records carry,
and the pytest-benchmark suite's reach."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from dppo_testing import child_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench_loss(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_loss

    return bench_loss


def test_quick_run_never_writes_into_the_committed_results(bench_loss):
    committed = BENCH / "results"
    assert Path(bench_loss.parse_args([]).out_dir) == committed
    quick = Path(bench_loss.parse_args(["--quick"]).out_dir)
    assert quick == BENCH.parent / "artifacts" / "bench_loss_quick"
    assert committed not in quick.parents and quick != committed
    assert bench_loss.parse_args(["--quick", "--out-dir", "elsewhere"]).out_dir == "elsewhere"


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=child_env(**env), capture_output=True, text=True, timeout=600, cwd=BENCH.parent
    )


@pytest.mark.slow
def test_speed_records_carry_gbps_and_copy_multiples(tmp_path):
    """Forward, backward and in-place get GB/s and a multiple of a copy pass timed in the same run; the Markdown
    has the table the results page is taken from, naming the host's SIMD level."""
    proc = _run(
        [
            "benchmarks/bench_loss.py",
            "--quick",
            "--sections",
            "speed",
            "--modes",
            "binary_tv",
            "--dtypes",
            "float32",
            "--contenders",
            "fused,fused_inplace",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench_loss.json").read_text())
    recs = {r["contender"]: r for r in results["records"] if r["section"] == "speed"}
    assert set(recs) == {"fused", "fused_inplace"}
    logits_bytes = recs["fused"]["N"] * recs["fused"]["V"] * 4
    for rec in recs.values():
        assert len(rec["copy_reps_ms"]) == len(rec["total_reps_ms"]) >= 2  # one copy pass before every timed step
        for phase, passes in (("fwd", 1), ("bwd", 2), ("total", 3)):
            seconds = rec[f"{phase}_ms"] * 1e-3
            assert rec[f"{phase}_GBps"] == pytest.approx(passes * logits_bytes / seconds / 1e9)
            assert rec[f"{phase}_x_copy"] == pytest.approx(rec[f"{phase}_ms"] / rec["copy_ms"])
    table = (tmp_path / "README_table.md").read_text()
    assert "### Against a copy pass" in table
    assert f"widest SIMD {results['machine']['cpu_simd']}" in table
    assert "| binary_tv | float32 |" in table.split("### Against a copy pass")[1]


@pytest.mark.slow
def test_pytest_benchmark_suite_collects_outside_the_test_suite():
    """The pytest-benchmark suite covers every op contender x mode x dtype x phase, the copy pass and the
    fused-linear paths; the default test run (testpaths) never collects it."""
    proc = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "benchmarks/"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert sum("test_bench_loss.py::test_dppo_loss[" in i for i in ids) == 4 * 2 * 4 * 3
    assert sum("test_bench_loss.py::test_copy_pass[" in i for i in ids) == 2
    assert sum("test_bench_fused_linear.py::test_fused_linear[" in i for i in ids) == 2 * 4 * 2 + 2  # + bf16 f32sums
    config = tomllib.loads((BENCH.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert config["testpaths"] == ["python_tests"]
    assert not list((BENCH.parent / "python_tests").rglob("test_bench_*.py"))


@pytest.mark.slow
def test_pytest_benchmark_suite_runs(tmp_path):
    """A tiny run of both pytest-benchmark files (timing disabled): every selected case passes its checks."""
    proc = _run(
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            "benchmarks/",
            "-k",
            "(binary_tv and float32 and fused) or copy_pass or (float32 and fused_linear) or fused_f32sums",
        ],
        DPPO_BENCH_N="16",
        DPPO_BENCH_V="512",
        DPPO_BENCH_FL_N="16",
        DPPO_BENCH_FL_H="8",
        DPPO_BENCH_FL_V="256",
        DPPO_BENCH_ROUNDS="1",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 2 * 3 + 2 + 4 * 2 + 2, proc.stdout[-2000:]


@pytest.mark.slow
def test_fused_linear_accuracy_script(tmp_path):
    """benchmarks/fused_linear_accuracy.py at a tiny size: the logits path and both accumulation dtypes are
    measured against float64, every error is positive and finite (bf16 rounding exists) and within 3x the logits
    path's own, and the chunks are the ones asked for."""
    proc = _run(
        [
            str(BENCH / "fused_linear_accuracy.py"),
            "--n",
            "96",
            "--hidden",
            "16",
            "--vocab",
            "300",
            "--chunk-sizes",
            "16",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "fused_linear_accuracy.json").read_text())["rows"]
    assert [r["path"] for r in rows] == ["logits path", "fused, bf16 sums (default)", "fused, float32 sums"]
    base = rows[0]["weight_rel_fro"]
    assert 0 < base < 0.05
    for r in rows[1:]:
        assert r["chunk_rows"] == 16 and r["chunks"] == 6
        assert 0 < r["weight_rel_fro"] <= 3 * base, r
        assert 0 < r["hidden_rel_fro"] <= 3 * rows[0]["hidden_rel_fro"], r


@pytest.fixture
def bench_liger(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_liger_gpu

    return bench_liger_gpu


def test_liger_comparison_times_ours_and_names_what_could_not_run(bench_liger, tmp_path):
    """On the CPU the comparison times both of our paths on the same inputs (their weight gradients agree: one loss
    computed two ways), names Liger's Triton loss unavailable with the reason, and fails only when told Liger is
    required."""
    out = tmp_path / "liger.json"
    args = ["--device", "cpu", "--shapes", "2x5x16x48", "--dtype", "fp32", "--warmup", "0", "--repeats", "2"]
    args += ["--contenders", "dppo_fused_linear", "dppo_logits", "liger_triton", "--json", str(out)]
    assert bench_liger.main(args) == 0
    (shape,) = json.loads(out.read_text())["shapes"]
    assert (shape["N"], shape["H"], shape["V"]) == (10, 16, 48)
    recs = {r["contender"]: r for r in shape["results"]}
    for name in ("dppo_fused_linear", "dppo_logits"):
        assert len(recs[name]["step_reps_ms"]) == 2 and recs[name]["step_ms"] > 0
    assert recs["dppo_fused_linear"]["loss"] == pytest.approx(recs["dppo_logits"]["loss"], rel=1e-5)
    assert shape["weight_grad_rel_diff"]["dppo"] < 1e-5
    assert "CUDA only" in recs["liger_triton"]["unavailable"]
    assert bench_liger.main([*args, "--require-liger"]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_liger_comparison_without_cuda_says_so(bench_liger, tmp_path, capsys):
    out = tmp_path / "liger.json"
    assert bench_liger.main(["--json", str(out)]) == 0
    assert "no CUDA device here: nothing timed" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}


def test_liger_comparison_refuses_a_malformed_shape(bench_liger, capsys):
    with pytest.raises(SystemExit):
        bench_liger.parse_args(["--shapes", "4x512x32768"])
    assert "a shape is BxTxHxV" in capsys.readouterr().err


def test_family_runs_table_reads_run_folders(monkeypatch, tmp_path):
    """The family plot's table: first and last evaluation, step means, the wall time from summary.json, a dash for a
    metric the run does not record; a folder that is not a run is refused with what it lacks."""
    monkeypatch.syspath_prepend(str(BENCH))
    import plot_family_runs

    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": 0, "eval_acc": 0.1},
        {"step": 1, "masked_frac": 0.02, "mismatch_mean": 1e-7},
        {"step": 2, "masked_frac": 0.04, "mismatch_mean": 3e-7, "eval_acc": 0.25},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"loss": "ipo", "wall_s": 600.4, "train_s": 500.2}))
    (row,) = plot_family_runs.table([plot_family_runs.load_run(str(run))]).splitlines()[2:]
    assert row == "| `ipo` | 10.0 % -> 25.0 % (step 0 -> 2) | 3.00 % | — | 2.0e-07 | 600 s (500 s) |"
    assert plot_family_runs.load_run(f"renamed={run}")[0] == "renamed"
    (run / "summary.json").unlink()
    with pytest.raises(SystemExit, match=r"no summary.json in .*run \(expected a trainer run folder"):
        plot_family_runs.load_run(str(run))
