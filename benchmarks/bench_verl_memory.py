"""Measured memory of top-K DPPO from bf16 logits inside verl: dppo_ext vs the paper fork's way vs verl's distillation.

Every path takes the same inputs (``bench_common.make_inputs``: N rows of bf16 logits over V = 151936, the
LM head's output, with sampled tokens, rollout log-probs, advantages and the rollout's top-K), computes one loss
and its gradient with respect to the logits, and runs in a fresh process, where the step's peak resident memory
beyond the inputs is measured (the kernel's VmHWM, reset just before the step; ``bench_common.PeakMeter``). The
gradient ``[N, V]`` bf16 counts (it is part of the step), except where it is written into the logits' buffer.

- ``dppo_ext_inplace``: what the verl plugin runs (``dppo_ext.integrations.verl.loss``): the fused op on the
  logits, top-K KL against the rollout's top-K, the gradient written into the logits (``inplace_backward``).
- ``dppo_ext``: the same op, gradient in a new buffer.
- ``fork_eager`` / ``fork_compiled``: the fork's way (sail-sg/Stable-RL, ``dp_actor`` + ``compute_topk_kl``),
  written here after its algorithm: the top-K KL under ``no_grad`` from a float32 copy of the logits and a full
  float32 log-softmax (eager, and with ``torch.compile`` as the fork decorates it), the sampled tokens' log-probs
  with gradient from verl's ``logprobs_from_logits`` (on a machine without flash-attn: verl's row-by-row
  log-softmax), then the DPPO loss.
- ``verl_distill`` / ``verl_distill_chunked``: the loss of verl's top-K distillation path, verl's own
  ``compute_forward_kl_topk`` (``use_chunked_topk`` off, verl's default, and on), with the rollout's top-K in the
  teacher's place: what verl computes where logits and a top-K meet today (not the DPPO loss; shown for scale).

    python benchmarks/bench_verl_memory.py                      # N=1024, V=151936, K=20 (verl needed for 4 paths)
    python benchmarks/bench_verl_memory.py --n 512 --paths dppo_ext,dppo_ext_inplace

Writes ``--out`` (default benchmarks/results/bench_verl_memory.json) and a bar chart next to it (.png).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import types

import torch

from dppo_ext.contract import LOG_RATIO_CLAMP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

log = logging.getLogger("bench_verl_memory")

PATHS = ("dppo_ext_inplace", "dppo_ext", "fork_eager", "fork_compiled", "verl_distill", "verl_distill_chunked")
NEEDS_VERL = ("fork_eager", "fork_compiled", "verl_distill", "verl_distill_chunked")
# verl's defaults where the plugin reads them: clip_ratio_low/high (the thresholds), clip_ratio_c (the cap).
DELTA, RATIO_CAP = 0.05, 3.0


def _fork_topk_divergence(logits, topk_ids, topk_logprobs):
    """The fork's top-K KL and TV (its algorithm: float32 copy, full log-softmax, top-K plus the rest bucket)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    q_log = log_q.gather(-1, topk_ids)
    q = q_log.exp()
    p = topk_logprobs.exp()
    p_rest = (1.0 - p.sum(-1)).clamp(min=1e-12)
    q_rest = (1.0 - q.sum(-1)).clamp(min=1e-12)
    kl = (p * (topk_logprobs - q_log)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    tv = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    return kl, tv


def _dppo_from_logp(logp, divergence, inp):
    """The DPPO policy-gradient loss (token-mean) from the sampled tokens' log-probs and a divergence per row."""
    mu_log = inp.rollout_logprobs
    pi, mu = logp.detach().exp(), mu_log.exp()
    adv = inp.advantages
    masked = torch.where(adv > 0, (divergence > DELTA) & (pi > mu), (divergence > DELTA) & (pi < mu))
    weight = torch.exp((logp.detach() - mu_log).clamp(max=LOG_RATIO_CLAMP)).clamp(max=RATIO_CAP)
    return (-adv * weight * (~masked).float() * logp).mean()


def build(path: str):
    """``(make_logits, loss)``: how the path sees the logits leaf, and its loss from the inputs."""
    if path in ("dppo_ext", "dppo_ext_inplace"):
        import dppo_ext

        inplace = path == "dppo_ext_inplace"

        def dppo(inp):
            logits = bc._AsLayerOutput.apply(inp.logits) if inplace else inp.logits
            out = dppo_ext.dppo_loss_per_row(
                logits,
                inp.tokens,
                inp.rollout_logprobs,
                inp.advantages,
                topk_ids=inp.topk_ids,
                topk_logprobs=inp.topk_logprobs,
                mode="topk_kl",
                temperature=1.0,
                delta_low=DELTA,
                delta_high=DELTA,
                ratio_cap=RATIO_CAP,
                compute_entropy=False,
                inplace_backward=inplace,
            )
            return out.loss.mean()

        return dppo
    if path in ("fork_eager", "fork_compiled"):
        from verl.utils.torch_functional import logprobs_from_logits

        divergence = torch.no_grad()(_fork_topk_divergence)
        if path == "fork_compiled":
            divergence = torch.compile(divergence, fullgraph=True)

        def fork(inp):
            kl, _ = divergence(inp.logits, inp.topk_ids, inp.topk_logprobs)
            logp = logprobs_from_logits(inp.logits, inp.tokens)
            return _dppo_from_logp(logp, kl, inp)

        return fork
    if path in ("verl_distill", "verl_distill_chunked"):
        from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk

        config = types.SimpleNamespace(
            distillation_loss=types.SimpleNamespace(
                use_chunked_topk=path == "verl_distill_chunked", chunked_topk_chunk_size=4096, log_prob_min_clamp=-10.0
            )
        )

        def distill(inp):
            n = inp.logits.shape[0]
            offsets = torch.tensor([0, n])
            teacher_lp = torch.nested.nested_tensor_from_jagged(inp.topk_logprobs, offsets)
            teacher_ids = torch.nested.nested_tensor_from_jagged(inp.topk_ids, offsets)
            out = compute_forward_kl_topk(inp.logits.unsqueeze(0), teacher_lp, teacher_ids, config, "thd")
            return out["distillation_losses"].mean()

        return distill
    raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


def child(args: argparse.Namespace) -> None:
    """One path in this (fresh) process: warm-up, measured step, timed steps; prints one JSON line."""
    torch.manual_seed(0)
    inp = bc.make_inputs(args.n, args.v, args.k, "topk_kl", torch.bfloat16, "cpu")
    loss_fn = build(args.path)
    pristine = inp.logits.detach().clone() if args.path == "dppo_ext_inplace" else None
    times = []
    peak = None
    for rep in range(1 + args.repeats):
        if pristine is not None:
            bc.restore_logits(inp.logits, pristine)
        with bc.PeakMeter("cpu") as meter:
            t0 = time.perf_counter()
            (grad,) = torch.autograd.grad(loss_fn(inp), [inp.logits])
            elapsed = time.perf_counter() - t0
        del grad
        if rep == 0:
            continue  # warm-up (compilation, first-touch); its peak is not the step's
        peak = meter.delta if peak is None else max(peak, meter.delta)
        times.append(elapsed)
    logits_bytes = inp.logits.numel() * inp.logits.element_size()
    print(
        json.dumps(
            {
                "path": args.path,
                "n": args.n,
                "v": args.v,
                "k": args.k,
                "extra_mib": peak / bc.MIB,
                "logits_mib": logits_bytes / bc.MIB,
                "time_ms": 1e3 * statistics.median(times),
                "time_reps_ms": [1e3 * t for t in times],
            }
        )
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1024, help="rows (response tokens) N")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary V (Qwen2.5/Qwen3)")
    parser.add_argument("--k", type=int, default=20, help="top-K of the rollout")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per path after one warm-up")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_verl_memory.json"))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per path")
    parser.add_argument("--path", help=argparse.SUPPRESS)  # set in the child process
    return parser.parse_args(argv)


def plot(results: list[dict], out_png: str) -> None:
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no chart (the JSON has every figure)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["path"] for r in results]
    ax.barh(names, [r["extra_mib"] for r in results], color="#4c72b0")
    ax.invert_yaxis()
    logits = results[0]["logits_mib"]
    ax.axvline(logits, color="grey", ls="--", lw=1)
    ax.text(logits, -0.55, " size of the logits", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel("measured peak memory beyond the inputs, MiB (forward + backward)")
    ax.set_title(
        f"top-K DPPO from bf16 logits, N={results[0]['n']}, V={results[0]['v']}, K={results[0]['k']} (CPU)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.path:
        child(args)
        return 0
    paths = [p for p in args.paths.split(",") if p]
    try:
        import verl  # noqa: F401
    except ImportError:
        skipped = [p for p in paths if p in NEEDS_VERL]
        if skipped:
            log.warning("verl is not installed: skipping %s (pip install 'dppo_ext[verl]')", ", ".join(skipped))
        paths = [p for p in paths if p not in NEEDS_VERL]
    results = []
    for path in paths:
        rc, out, err = bc.run_child(
            [
                os.path.abspath(__file__),
                "--path",
                path,
                "--n",
                str(args.n),
                "--v",
                str(args.v),
                "--k",
                str(args.k),
                "--repeats",
                str(args.repeats),
            ],
            args.timeout,
        )
        if rc != 0:
            log.error("%s failed (rc %d):\n%s", path, rc, err[-3000:])
            continue
        result = json.loads(out.strip().splitlines()[-1])
        results.append(result)
        log.info(
            "%-22s extra %8.1f MiB (%.2fx the logits)  fwd+bwd %8.1f ms",
            path,
            result["extra_mib"],
            result["extra_mib"] / result["logits_mib"],
            result["time_ms"],
        )
    if not results:
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        settings = dict(vars(args), out=os.path.relpath(args.out))
        json.dump({"machine": bc.machine_info("cpu"), "settings": settings, "results": results}, fh, indent=2)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
