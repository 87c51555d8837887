"""Vocabulary-parallel DPPO on 1, 2 and 4 CPU processes (gloo): peak memory per rank, step time, communication.

Every rank holds the logits of ``V / W`` vocabulary columns (``[N, V / W]``) and computes the loss and the
gradient of its slice. Contenders, on the same inputs:

- ``vocab_parallel``: ``dppo_loss(..., vocab_parallel_group=)`` (statistics, one all-gather of ``4 + K`` numbers
  per row, the epilogue; a local backward).
- ``vocab_parallel_inplace``: the same with ``inplace_backward=True`` (the gradient overwrites the slice).
- ``gather_logits``: what a user does without it: all-gather the ``[N, V]`` logits on every rank, run
  ``dppo_loss`` on them, keep this rank's columns of the gradient.

With ``--fused-linear`` the contenders start from hidden states ``[N, H]`` (replicated) and this rank's LM-head rows
``[V / W, H]`` instead:

- ``fused_linear_vocab_parallel``: ``fused_linear_dppo_loss(..., vocab_parallel_group=)`` (no logits, no whole head;
  the hidden-state gradient is all-reduced in backward).
- ``fused_linear_gather_head``: all-gather the ``[V, H]`` head on every rank, run ``fused_linear_dppo_loss`` on it,
  keep this rank's rows of the weight gradient.

Measured, per rank: the peak resident memory of one (second, warm) forward+backward step beyond what was live
before it
(VmHWM reset through /proc/self/clear_refs, glibc returning every freed block >= 64 KiB; see
benchmarks/benchlib/peak_memory.py), the median wall time of the warm steps (a step ends when the slowest rank
ends: the maximum over ranks is reported), and every torch.distributed collective the step called, with the
bytes it received. On a 2-core machine W = 4 oversubscribes the cores: the time column shows the scaling
shape of the work per rank, not a speed-up.

    python benchmarks/bench_vocab_parallel.py [--rows 1024 --vocab 65536 --dtype bfloat16 --mode binary_tv]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from benchlib.inputs import DTYPES, deltas_for, make_inputs  # noqa: E402
from benchlib.machine import machine_info  # noqa: E402
from benchlib.peak_memory import MALLOC_ENV, PeakMeter  # noqa: E402

CONTENDERS = ("vocab_parallel", "vocab_parallel_inplace", "gather_logits")
FUSED_CONTENDERS = ("fused_linear_vocab_parallel", "fused_linear_gather_head")
MIB = 1024**2


class CollectiveLog:
    """Counts every torch.distributed collective the wrapped region calls, and the bytes each rank receives."""

    WRAPPED = (
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "all_reduce",
        "reduce_scatter_tensor",
        "broadcast",
    )

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._orig = {}

    def __enter__(self) -> "CollectiveLog":
        for name in self.WRAPPED:
            if not hasattr(dist, name):  # all_gather_single: torch >= 2.13
                continue
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(*args, _name=name, _orig=orig, **kw):
                first = args[0] if args else next(iter(kw.values()))
                tensors = first if isinstance(first, (list, tuple)) else [first]
                self.calls.append((_name, sum(t.numel() * t.element_size() for t in tensors)))
                return _orig(*args, **kw)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def rank_main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from dppo_ext import dppo_loss

    dtype = DTYPES[args.dtype]
    inp = make_inputs(args.rows, args.vocab, args.topk, args.mode, dtype, "cpu", seed=0)
    per = -(-args.vocab // world)
    lo, hi = rank * per, min((rank + 1) * per, args.vocab)
    offsets = [min(r * per, args.vocab) for r in range(world + 1)]
    pristine = inp.logits.detach()[:, lo:hi].clone()
    del inp.logits  # only this rank's slice stays resident
    delta_low, delta_high = deltas_for(args.mode)
    topk = {"topk_ids": inp.topk_ids, "topk_logprobs": inp.topk_logprobs} if inp.topk_ids is not None else {}
    kw = dict(mode=args.mode, delta_low=delta_low, delta_high=delta_high, **topk)

    def run_logits(name: str, local: torch.Tensor) -> None:
        if name == "gather_logits":
            parts = [torch.empty(args.rows, b - a, dtype=dtype) for a, b in zip(offsets, offsets[1:])]
            padded = [torch.empty(args.rows, per, dtype=dtype) for _ in range(world)]
            mine = torch.zeros(args.rows, per, dtype=dtype)
            mine[:, : hi - lo] = local.detach()
            dist.all_gather(padded, mine)
            for p, q in zip(parts, padded):
                p.copy_(q[:, : p.shape[1]])
            full = torch.cat(parts, dim=1).requires_grad_(True)
            del parts, padded, mine
            loss, _ = dppo_loss(full, inp.tokens, inp.rollout_logprobs, inp.advantages, **kw)
            (grad,) = torch.autograd.grad(loss, full)
            grad = grad[:, lo:hi].clone()
        else:
            loss, _ = dppo_loss(
                local,
                inp.tokens,
                inp.rollout_logprobs,
                inp.advantages,
                **kw,
                vocab_parallel_group=dist.group.WORLD,
                vocab_offsets=offsets,
                inplace_backward=name == "vocab_parallel_inplace",
            )
            loss.backward()
            grad = local.grad
        assert grad.shape == (args.rows, hi - lo)

    results = {}
    if args.fused_linear:
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(args.rows, args.hidden, generator=gen).to(dtype)
        w_local = (torch.randn(hi - lo, args.hidden, generator=gen) / args.hidden**0.5).to(dtype)
        valid = torch.ones(args.rows, dtype=torch.bool)

        def run_fused(name: str, local: torch.Tensor) -> None:
            from dppo_ext import fused_linear_dppo_loss

            h = hidden.clone().requires_grad_(True)
            if name == "fused_linear_gather_head":
                padded = [torch.empty(per, args.hidden, dtype=dtype) for _ in range(world)]
                mine = torch.zeros(per, args.hidden, dtype=dtype)
                mine[: hi - lo] = local.detach()
                dist.all_gather(padded, mine)
                full = torch.cat([p[: b - a] for p, a, b in zip(padded, offsets, offsets[1:])]).requires_grad_(True)
                del padded, mine
                loss, _ = fused_linear_dppo_loss(
                    h, full, inp.tokens, inp.rollout_logprobs, inp.advantages, response_mask=valid, **kw
                )
                loss.backward()
                grad = full.grad[lo:hi].clone()
            else:
                loss, _ = fused_linear_dppo_loss(
                    h,
                    local,
                    inp.tokens,
                    inp.rollout_logprobs,
                    inp.advantages,
                    response_mask=valid,
                    **kw,
                    vocab_parallel_group=dist.group.WORLD,
                    vocab_offsets=offsets,
                )
                loss.backward()
                grad = local.grad
            assert grad.shape == (hi - lo, args.hidden) and h.grad is not None

        def fresh() -> torch.Tensor:
            """This rank's LM-head rows (a fresh leaf per step)."""
            return w_local.clone().requires_grad_(True)

        contenders, run = FUSED_CONTENDERS, run_fused
    else:

        def fresh() -> torch.Tensor:
            """This rank's logits, as a model would hand them over (the in-place contender consumes them)."""
            return pristine.clone().requires_grad_(True)

        contenders, run = CONTENDERS, run_logits

    for name in contenders:
        run(name, fresh())  # first call: one-time costs (dispatcher, gloo buffers, thread pools) stay out
        local = fresh()
        dist.barrier()
        with CollectiveLog() as log, PeakMeter("cpu") as meter:
            run(name, local)
        peak = meter.delta
        times = []
        for _ in range(args.warmup + args.repeat):
            local = fresh()
            dist.barrier()
            t0 = time.perf_counter()
            run(name, local)
            times.append(time.perf_counter() - t0)
            del local
        step = torch.tensor([statistics.median(times[args.warmup :])], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        peaks = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        results[name] = {
            "peak_mib_max_rank": peaks.item() / MIB,
            "peak_mib_rank0": peak / MIB,
            "step_s": step.item(),
            "collectives": [c[0] for c in log.calls],
            "received_bytes": sum(c[1] for c in log.calls),
        }
    if rank == 0:
        Path(args.result).write_text(json.dumps({"world": world, "local_vocab": hi - lo, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace, result: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        **MALLOC_ENV,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        __file__,
        "--rank-worker",
        "--result",
        str(result),
        "--rows",
        str(args.rows),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--mode",
        args.mode,
        "--topk",
        str(args.topk),
        "--warmup",
        str(args.warmup),
        "--repeat",
        str(args.repeat),
        "--hidden",
        str(args.hidden),
    ]
    if args.fused_linear:
        cmd.append("--fused-linear")
    procs = [
        subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"W={world} rank failed ({p.returncode}):\n{log[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--mode", default="binary_tv")
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--fused-linear", action="store_true", help="hidden states + sharded LM head contenders")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H (--fused-linear)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_vocab_parallel.json")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args)
        return
    from dppo_ext.contract import TOPK_MODES
    from dppo_ext.vocab_parallel import gathered_bytes_per_row

    k = args.topk if args.mode in TOPK_MODES else 0
    rows = []
    for world in args.worlds:
        res = launch(world, args, args.out.with_suffix(f".w{world}.tmp.json"))
        args.out.with_suffix(f".w{world}.tmp.json").unlink()
        for name, r in res["results"].items():
            rows.append(
                {
                    "world": world,
                    "contender": name,
                    "local_vocab": res["local_vocab"],
                    **r,
                    "received_bytes_per_row": r["received_bytes"] / args.rows,
                    "stated_bytes_per_row": gathered_bytes_per_row(world, k, DTYPES[args.dtype])
                    if name.startswith("vocab_parallel")
                    else None,
                }
            )
    info = machine_info("cpu")
    simd = sorted(set(open("/proc/cpuinfo").read().split()) & {"avx2", "avx512f"})
    out = {"config": vars(args) | {"out": str(args.out), "result": None}, "machine": info, "simd": simd, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(
        f"N={args.rows} V={args.vocab} {args.dtype} mode={args.mode} (K={k}); CPU {info['cpu_model']} "
        f"({os.cpu_count()} cores, SIMD {'+'.join(simd) or 'none'}), load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'W':>2} {'contender':<28} {'V/W':>6} {'peak MiB/rank':>14} {'step s':>8} {'collectives/step':<34} "
        f"{'recv B/row':>11}"
    )
    for r in rows:
        calls = ", ".join(f"{c}" for c in r["collectives"]) or "-"
        print(
            f"{r['world']:>2} {r['contender']:<28} {r['local_vocab']:>6} {r['peak_mib_max_rank']:>14.1f} "
            f"{r['step_s']:>8.3f} {str(len(r['collectives'])) + ': ' + calls:<34} "
            f"{r['received_bytes_per_row']:>11.0f}"
        )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
