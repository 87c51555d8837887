"""What the vocab-parallel call header costs next to the forward it protects (``dppo_ext._agreement.Rendezvous``).

Every vocab-parallel forward first exchanges a fixed-size header per rank (row count, split, settings hash, a
bitwise fingerprint of each per-row input, a failure flag), so that ranks whose calls differ all raise the same
error instead of one rank aborting inside gloo or each returning another loss. This script measures, on W gloo
processes on this host (one thread each), the median of:

- ``fingerprint``: building this rank's header (the fingerprints of tokens, rollout log-probs, advantages and,
  for top-K modes, the top-K ids and log-probs; all device ops);
- ``fingerprint_hidden``: the same header as the fused path builds it, with the fingerprint of the replicated
  ``hidden [N, H]`` (``--hidden-size``, the dtype's) and the descriptor of the backward's all-reduce: side by
  side with ``fingerprint``, their difference is what ``hidden`` adds;
- ``exchange``: the header all-gather and every rank's check of every header (the forward's one host sync);
- ``forward``: the whole ``dppo_loss_per_row(..., vocab_parallel_group=)`` forward (no grad) that includes both.

Run: ``PYTHONPATH=. python benchmarks/bench_vocab_parallel_header.py --rows 4096 --local-vocab 32768``
(prints one JSON line per mode and dtype). CPU figures depend on the SIMD level: name it with the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from dppo_ext import dppo_loss_per_row
from dppo_ext._agreement import Rendezvous, call_header, check_agreement
from dppo_ext._rows import LossSettings, RowInputs
from dppo_ext._vocab_split import comm_device
from dppo_ext.vocab_parallel import even_vocab_offsets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _median(fn, warmup: int, repeat: int) -> float:
    times = []
    for _ in range(warmup + repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def _exchange(header: torch.Tensor, offsets: list[int], world: int) -> None:
    check_agreement(Rendezvous(None).exchange(header), offsets, world)


def _forward(logits: torch.Tensor, rows: RowInputs, mode: str, offsets: list[int]) -> None:
    with torch.no_grad():
        dppo_loss_per_row(
            logits, **rows._asdict(), mode=mode, vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets
        )


def rank_main(args: argparse.Namespace) -> None:

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n, v_local, k = args.rows, args.local_vocab, args.topk
    offsets = even_vocab_offsets(v_local * world, world)
    gen = torch.Generator().manual_seed(0)  # the same global rows on every rank
    tokens = torch.randint(0, v_local * world, (n,), generator=gen)
    rollout = -torch.rand(n, generator=gen) * 5
    adv = torch.randn(n, generator=gen)
    topk_ids = torch.randint(0, v_local * world, (n, k), generator=gen)
    topk_lp = -torch.rand(n, k, generator=gen) * 5
    hidden = {name: torch.randn(n, args.hidden_size, generator=gen).to(DTYPES[name]) for name in args.dtypes}
    for dtype_name in args.dtypes:
        logits = torch.randn(n, v_local, generator=torch.Generator().manual_seed(rank + 1)).to(DTYPES[dtype_name])
        for mode in ("binary_tv", "topk_kl"):
            top = {"topk_ids": topk_ids, "topk_logprobs": topk_lp} if mode == "topk_kl" else {}
            rows = RowInputs(tokens, rollout, adv, top.get("topk_ids"), top.get("topk_logprobs"))
            settings = LossSettings.resolve(mode, 1.0, None, None, 2.0, True)
            device = comm_device(None, logits.device)

            header = functools.partial(
                call_header, rows, n, v_local, torch.float32, offsets, settings, device, dtype=logits.dtype
            )
            reduced = [("grad_hidden", hidden[dtype_name].dtype, hidden[dtype_name].shape)]
            fused_header = functools.partial(header, reduced=reduced, hidden=hidden[dtype_name])
            exchange = functools.partial(_exchange, header(), offsets, world)
            forward = functools.partial(_forward, logits, rows, mode, offsets)
            res = {
                name: _median(fn, args.warmup, args.repeat) * 1e3
                for name, fn in (
                    ("fingerprint_ms", header),
                    ("fingerprint_hidden_ms", fused_header),
                    ("exchange_ms", exchange),
                    ("forward_ms", forward),
                )
            }
            if rank == 0:
                print(
                    json.dumps(
                        {
                            "world": world,
                            "rows": n,
                            "local_vocab": v_local,
                            "dtype": dtype_name,
                            "hidden_size": args.hidden_size,
                            "mode": mode,
                            "topk": k if top else 0,
                            **{a: round(b, 3) for a, b in res.items()},
                            "header_share_of_forward": round(
                                (res["fingerprint_ms"] + res["exchange_ms"]) / res["forward_ms"], 4
                            ),
                        }
                    ),
                    flush=True,
                )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown (python_tests/dist_scripts/clean_exit.py says why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--local-vocab", type=int, default=32768)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--hidden-size", type=int, default=4096, help="H of the fused path's hidden [N, H]")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        rank_main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.world), OMP_NUM_THREADS="1"
    )
    procs = [
        subprocess.Popen([sys.executable, *sys.argv, "--rank-process"], env=dict(env, RANK=str(r)))
        for r in range(args.world)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
