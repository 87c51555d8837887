"""The benchmark harness's own behaviour (not its figures): where results go."""

from __future__ import annotations

from pathlib import Path

import pytest

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

