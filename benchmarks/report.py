"""Turn a bench_loss.json into the published artefacts: CSV, PNG plot, Markdown tables, checks.

    python benchmarks/report.py benchmarks/results/bench_loss.json   # regenerate from a saved run

The Markdown (``README_table.md``) states the machine (with its SIMD level) and the command the figures came
from; docs/results.md and the README's headline table are taken from it. Every number in it is read from the
JSON, none is computed apart from ratios of measured figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from typing import Optional

GIB = 1024**3
MIB = 1024**2
# The figures the project states (README, docs/results.md), checked against every run.
SPEED_TARGET_EAGER = 4.0  # fused fwd+bwd at least this many times faster than the eager reference
SPEED_TARGET_COMPILE = 2.0  # ... and than torch.compile of it
COPY_TARGET = {"float32": 3.0, "bfloat16": 6.0}  # fused fwd+bwd within this many copy passes of the logits
COPY_TARGET_INPLACE = {"float32": 2.5}  # in-place fwd+bwd within this many copy passes
MEMORY_TARGET_RATIO = 1 / 20
INPLACE_TARGET_WHOLE = 1.02
CHECK_SPEED_MODES = ("binary_tv", "topk_kl")
CHECK_SPEED_SIZE = {"N": 2048, "V": 32768}
CHECK_MEMORY_POINT = {"N": 4096, "V": 151936, "dtype": "bfloat16", "mode": "topk_kl"}
CPU_CONTENDERS = ("fused", "fused_inplace", "eager", "compile")
STYLE = {
    "fused": ("tab:blue", "o", "-"),
    "fused_inplace": ("tab:cyan", "s", "--"),
    "eager": ("tab:red", "^", "-"),
    "compile": ("tab:orange", "v", "-"),
    "liger_grpo": ("tab:green", "D", "-"),
    "liger_grpo_inplace": ("tab:olive", "d", "--"),
}
PAGE = 4096  # extra memory below one page is drawn at one page on the log axis
METER_RESOLUTION = 64 * 1024  # the CPU meter's resolution (docs/benchmarks.md)


def _ok(records: list[dict], **match) -> list[dict]:
    return [r for r in records if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def _one(records: list[dict], **match) -> Optional[dict]:
    found = _ok(records, **match)
    return found[0] if found else None


def checks(results: dict) -> dict:
    """The stated figures next to the measured records (None where not run)."""
    records = results["records"]
    speed = []
    for mode in CHECK_SPEED_MODES:
        for dtype in ("float32", "bfloat16"):
            fused = _one(records, section="speed", contender="fused", mode=mode, dtype=dtype)
            if fused is None:
                continue
            row = {
                "mode": mode,
                "dtype": dtype,
                "N": fused["N"],
                "V": fused["V"],
                "fused_ms": fused["total_ms"],
                "at_stated_size": all(fused[k] == v for k, v in CHECK_SPEED_SIZE.items()),
            }
            inplace = _one(records, section="speed", contender="fused_inplace", mode=mode, dtype=dtype)
            for key, rec, targets in (("copy", fused, COPY_TARGET), ("copy_inplace", inplace, COPY_TARGET_INPLACE)):
                if rec is not None and "total_x_copy" in rec:
                    row[f"x_{key}"] = rec["total_x_copy"]
                    if dtype in targets:
                        row[f"pass_{key}"] = rec["total_x_copy"] <= targets[dtype]
            for other, target in (("eager", SPEED_TARGET_EAGER), ("compile", SPEED_TARGET_COMPILE)):
                rec = _one(records, section="speed", contender=other, mode=mode, dtype=dtype)
                if rec is not None:
                    row[f"{other}_ms"] = rec["total_ms"]
                    row[f"speedup_vs_{other}"] = rec["total_ms"] / fused["total_ms"]
                    row[f"pass_vs_{other}"] = row[f"speedup_vs_{other}"] >= target
            speed.append(row)
    memory = None
    mem_records = _ok(records, section="memory")
    if mem_records:
        first = mem_records[0]
        point = {k: first[k] for k in ("mode", "dtype", "N", "V")}
        at = {r["contender"]: r for r in _ok(records, section="memory", **point)}
        memory = dict(point, at_stated_size=point == CHECK_MEMORY_POINT)
        if "fused" in at and "eager" in at:
            memory["fused_extra_bytes"] = at["fused"]["extra_bytes"]
            memory["eager_extra_bytes"] = at["eager"]["extra_bytes"]
            memory["fused_extra_ratio_to_naive"] = at["fused"]["extra_bytes"] / at["eager"]["extra_bytes"]
            memory["pass_fused_extra"] = memory["fused_extra_ratio_to_naive"] <= MEMORY_TARGET_RATIO
        if "fused_inplace" in at:
            memory["inplace_whole_peak_ratio"] = at["fused_inplace"]["whole_peak_ratio"]
            memory["pass_inplace_whole"] = memory["inplace_whole_peak_ratio"] <= INPLACE_TARGET_WHOLE
        cpu_times = {c: at[c]["total_ms"] for c in CPU_CONTENDERS if c in at}
        if cpu_times:
            fastest = min(cpu_times, key=cpu_times.get)
            memory["total_ms"] = cpu_times
            memory["fastest"] = fastest
            memory["pass_fused_fastest"] = (
                None
                if "fused" not in cpu_times
                else all(cpu_times["fused"] < t for c, t in cpu_times.items() if c not in ("fused", "fused_inplace"))
            )
    return {"speed": speed, "memory": memory}


def _mib(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x / MIB:,.1f}" if abs(x) >= 10 * MIB else f"{x / MIB:.3f}"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:,.1f}" if x >= 10 else f"{x:.2f}")


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("**PASS**" if ok else "**FAIL**")


def markdown(results: dict) -> str:
    """The results section: machine + command, speed tables, memory table, scaling, checks."""
    m, cfg, records = results["machine"], results["config"], results["records"]
    lines = ["## Benchmarks: fused DPPO loss vs the naive full-vocabulary loss", ""]
    simd = ""
    if "gpu" not in m and m.get("cpu_simd"):
        simd = f", widest SIMD {m['cpu_simd']}"
        if m.get("dppo_ext_cpu_capability"):
            simd += f", dppo_ext CPU kernels: {m['dppo_ext_cpu_capability']}"
    dev = m.get("gpu", f"{m['cpu_model']}{simd}, {m['cpu_count']} cores ({m['torch_threads']} torch threads)")
    load = ", ".join(f"{x:.1f}" for x in m["loadavg_start"])
    load_end = ", ".join(f"{x:.1f}" for x in m.get("loadavg_end", ()))
    lines += [
        f"Taken on **{dev}**, {m['mem_total_gib']} GiB RAM, torch {m['torch']}, Python {m['python']}, "
        f"dppo_ext {m.get('dppo_ext')} (commit {m.get('git_commit') or 'uncommitted'}), {m['date_utc']}; "
        f"load average {load} at start, {load_end} at end.",
        f"Command: `{m['command']}` (wall time {m.get('wall_s', '?')} s); token-mean loss, "
        f"compute_entropy={cfg.get('entropy', True)}, thresholds = the API's per-mode defaults. "
        "Every figure below is in `benchmarks/results/bench_loss.json` / `.csv`; method in `docs/benchmarks.md`.",
        "",
    ]
    speed = _ok(records, section="speed")
    if speed:
        n, v, k = speed[0]["N"], speed[0]["V"], cfg["topk"]
        lines += [
            f"### Speed: N={n} rows, V={v}, K={k} (top-K modes), milliseconds, median of {cfg['repeats']} steps "
            f"(fused) or {cfg.get('baseline_repeats', cfg['repeats'])} steps (eager, compile) after {cfg['warmup']} "
            "warm-up",
            "",
            "| mode | dtype | fused fwd | fused bwd | fused fwd+bwd | fused in-place fwd+bwd | eager fwd+bwd "
            "| compile fwd+bwd | speedup vs eager | speedup vs compile | max abs grad diff vs eager |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for mode in cfg["modes"]:
            for dtype in cfg["dtypes"]:
                get = {c: _one(records, section="speed", contender=c, mode=mode, dtype=dtype) for c in STYLE}
                f = get["fused"]
                total = {c: (r["total_ms"] if r else None) for c, r in get.items()}
                su_e = total["eager"] / total["fused"] if f and total["eager"] else None
                su_c = total["compile"] / total["fused"] if f and total["compile"] else None
                grad_diff = f.get("check_grad_max_abs_diff_vs_eager") if f else None
                lines.append(
                    f"| {mode} | {dtype} | {_ms(f and f['fwd_ms'])} | {_ms(f and f['bwd_ms'])} | {_ms(total['fused'])} "
                    f"| {_ms(total['fused_inplace'])} | {_ms(total['eager'])} | {_ms(total['compile'])} "
                    f"| {'-' if su_e is None else f'{su_e:.1f}x'} | {'-' if su_c is None else f'{su_c:.1f}x'} "
                    f"| {'-' if grad_diff is None else format(grad_diff, '.1e')} |"
                )
        liger = _ok(records, section="speed", contender="liger_grpo")
        if liger:
            lines += [
                "",
                "Liger Kernel's Triton GRPO loss (ratio clip, no DPPO divergence) on the same logits: "
                + "; ".join(f"{r['dtype']} {_ms(r['total_ms'])} ms" for r in liger if r["mode"] == cfg["modes"][0]),
            ]
        lines += [""] + _bandwidth_lines(records, cfg)
    mem = _ok(records, section="memory")
    if mem:
        r0 = mem[0]
        lines += [
            f"### Memory: N={r0['N']}, V={r0['V']}, {r0['dtype']}, {r0['mode']} (measured peak of one loss step, "
            "fresh process per contender)",
            "",
            "| contender | extra beyond inputs + returned grad (MiB) | ratio to naive | returned grad (MiB) "
            "| whole step peak / inputs | fwd+bwd (ms) |",
            "|---|--:|--:|--:|--:|--:|",
        ]
        for r in mem:
            ratio = r.get("extra_ratio_to_naive")
            lines.append(
                f"| {r['contender']} | {_mib(r['extra_bytes'])} | {'-' if ratio is None else f'{ratio:.3g}'} "
                f"| {_mib(r['grad_bytes'])}{' (written into the logits)' if r.get('grad_aliases_logits') else ''} "
                f"| {r['whole_peak_ratio']:.3f} | {_ms(r['total_ms'])} |"
            )
        lines.append(f"\nInputs (logits + per-row tensors): {_mib(r0['inputs_bytes'])} MiB.\n")
    for axis, fixed_name, fixed in (("N", "V", cfg["scaling_fixed_v"]), ("V", "N", cfg["scaling_fixed_n"])):
        rows = _ok(records, section="scaling", axis=axis)
        if not rows:
            continue
        contenders = [c for c in STYLE if any(r["contender"] == c for r in rows)]
        lines += [
            f"### Scaling with {axis} ({fixed_name}={fixed}, {cfg['scaling_dtype']}, {cfg['scaling_mode']}): "
            "extra memory beyond inputs + returned grad (MiB) / fwd+bwd (ms; "
            f"{cfg.get('scaling_repeats', 1)} warm step(s) after the measured one)",
            "",
            f"| {axis} | " + " | ".join(contenders) + " |",
            "|--:|" + "--:|" * len(contenders),
        ]
        for value in sorted({r[axis] for r in rows}):
            cells = []
            for c in contenders:
                r = _one(rows, contender=c, **{axis: value})
                cells.append("-" if r is None else f"{_mib(r['extra_bytes'])} / {_ms(r['total_ms'])}")
            lines.append(f"| {value} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _check_lines(results)
    if results.get("validation"):
        parts = [
            f"{v['pattern']}: {v['measured_bytes'] / GIB:.3f} GiB"
            for v in results["validation"]
            if "measured_bytes" in v
        ]
        lines += ["", "Peak-memory method check (expected 1.000 GiB each): " + "; ".join(parts) + "."]
    lines += ["", "![time and extra memory vs N and vs V](benchmarks/results/bench_loss.png)", ""]
    return "\n".join(lines)


def _bandwidth_lines(records: list[dict], cfg: dict) -> list[str]:
    """The fused op against one copy pass of the logits timed in the same run (before every step)."""
    rows = [r for r in _ok(records, section="speed") if r["contender"] in ("fused", "fused_inplace") and "copy_ms" in r]
    if not rows:
        return []
    n, v = rows[0]["N"], rows[0]["V"]
    lines = [
        f"### Against a copy pass: N={n}, V={v}, each phase's achieved GB/s (forward reads the logits once, backward "
        "reads them and writes the gradient) and its time as a multiple of one read+write pass over the logits "
        "(`dst.copy_(logits)` into an existing buffer, timed just before every step)",
        "",
        "| mode | dtype | copy pass ms (GB/s) | fwd GB/s (x copy) | bwd GB/s (x copy) | fwd+bwd x copy "
        "| in-place bwd GB/s (x copy) | in-place fwd+bwd x copy |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for mode in cfg["modes"]:
        for dtype in cfg["dtypes"]:
            f = _one(rows, contender="fused", mode=mode, dtype=dtype)
            ip = _one(rows, contender="fused_inplace", mode=mode, dtype=dtype)
            if f is None and ip is None:
                continue
            ref = f or ip

            def gbx(r: Optional[dict], phase: str) -> str:
                return "-" if r is None else f"{r[f'{phase}_GBps']:.1f} ({r[f'{phase}_x_copy']:.2f}x)"

            lines.append(
                f"| {mode} | {dtype} | {_ms(ref['copy_ms'])} ({ref['copy_GBps']:.1f}) | {gbx(f, 'fwd')} | "
                f"{gbx(f, 'bwd')} | {'-' if f is None else format(f['total_x_copy'], '.2f') + 'x'} | "
                f"{gbx(ip, 'bwd')} | "
                f"{'-' if ip is None else format(ip['total_x_copy'], '.2f') + 'x'} |"
            )
    lines.append("")
    return lines


def _check_lines(results: dict) -> list[str]:
    acc = results.get("checks") or {}
    lines = ["### Checks: the stated figures against this run", ""]
    off_size = " (not the stated size)"
    for row in acc.get("speed", []):
        parts = [
            f"- N={row['N']}, V={row['V']}{'' if row['at_stated_size'] else off_size}, {row['mode']}, "
            f"{row['dtype']}, fwd+bwd: fused {_ms(row['fused_ms'])} ms"
        ]
        for other, target in (("eager", SPEED_TARGET_EAGER), ("compile", SPEED_TARGET_COMPILE)):
            if f"speedup_vs_{other}" in row:
                parts.append(
                    f"{row[f'speedup_vs_{other}']:.1f}x vs {other} (stated >= {target:g}x) "
                    f"{_verdict(row[f'pass_vs_{other}'])}"
                )
        for key, what, targets in (("copy", "fused", COPY_TARGET), ("copy_inplace", "in-place", COPY_TARGET_INPLACE)):
            if f"x_{key}" in row and row["dtype"] in targets:
                parts.append(
                    f"{what} {row[f'x_{key}']:.2f}x a copy pass (stated <= {targets[row['dtype']]:g}x) "
                    f"{_verdict(row[f'pass_{key}'])}"
                )
        lines.append("; ".join(parts))
    mem = acc.get("memory")
    if mem:
        where = f"N={mem['N']}, V={mem['V']}, {mem['dtype']}, {mem['mode']}{'' if mem['at_stated_size'] else off_size}"
        if "fused_extra_ratio_to_naive" in mem:
            lines.append(
                f"- {where}: fused extra memory {_mib(mem['fused_extra_bytes'])} MiB vs naive "
                f"{_mib(mem['eager_extra_bytes'])} MiB = 1/{1 / max(mem['fused_extra_ratio_to_naive'], 1e-9):.0f} "
                f"(stated <= 1/20) {_verdict(mem['pass_fused_extra'])}"
            )
        if "inplace_whole_peak_ratio" in mem:
            lines.append(
                f"- {where}: in-place whole step peak = {mem['inplace_whole_peak_ratio']:.4f} x inputs "
                f"(stated <= {INPLACE_TARGET_WHOLE}) {_verdict(mem['pass_inplace_whole'])}"
            )
        if "fastest" in mem:
            times = ", ".join(f"{c} {_ms(t)} ms" for c, t in mem["total_ms"].items())
            lines.append(
                f"- {where}: fastest CPU contender = {mem['fastest']} ({times}) {_verdict(mem['pass_fused_fastest'])}"
            )
    return lines


def _flat(record: dict) -> dict:
    return {k: (";".join(str(x) for x in v) if isinstance(v, (list, tuple)) else v) for k, v in record.items()}


def write_csv(results: dict, path: str) -> None:
    """One row per record (speed, memory and scaling cases), every field."""
    rows = [_flat(r) for r in results["records"]]
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_plot(results: dict, path: str) -> bool:
    """Time and extra memory vs N and vs V (log-log), one line per contender. False if nothing to plot."""
    rows = _ok(results["records"], section="scaling")
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    for col, (axis, fixed) in enumerate((("N", f"V={cfg['scaling_fixed_v']}"), ("V", f"N={cfg['scaling_fixed_n']}"))):
        for c, (color, marker, ls) in STYLE.items():
            pts = sorted((r[axis], r) for r in rows if r["axis"] == axis and r["contender"] == c)
            if not pts:
                continue
            xs = [x for x, _ in pts]
            axes[0, col].plot(xs, [r["total_ms"] for _, r in pts], color=color, marker=marker, ls=ls, label=c)
            axes[1, col].plot(
                xs,
                [max(r["extra_bytes"], PAGE) / MIB for _, r in pts],
                color=color,
                marker=marker,
                ls=ls,
                label=c,
                markersize=4 if c.endswith("inplace") else 7,
            )
        axes[0, col].set_title(f"fwd+bwd time vs {axis} ({fixed})")
        axes[0, col].set_ylabel("ms (median)")
        axes[1, col].set_title(f"extra memory beyond inputs + grad vs {axis} ({fixed})")
        axes[1, col].set_ylabel("MiB (measured peak; <= 4 KiB drawn at 4 KiB)")
        if results["machine"]["device"] == "cpu":
            axes[1, col].axhspan(
                PAGE / MIB / 2,
                METER_RESOLUTION / MIB,
                color="0.9",
                zorder=0,
                label="below the CPU meter's ~64 KiB resolution",
            )
        for row in (0, 1):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(
        f"DPPO loss, {cfg['scaling_mode']}, {cfg['scaling_dtype']}: {m.get('gpu', m['cpu_model'])}, "
        f"{m['torch_threads']} threads, torch {m['torch']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(results: dict, out_dir: str) -> list[str]:
    """Write bench_loss.json, bench_loss.csv, README_table.md and bench_loss.png into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("bench_loss.json", "bench_loss.csv", "README_table.md")]
    with open(paths[0], "w") as fh:
        json.dump(results, fh, indent=1)
    write_csv(results, paths[1])
    with open(paths[2], "w") as fh:
        fh.write(markdown(results))
    png = os.path.join(out_dir, "bench_loss.png")
    if write_plot(results, png):
        paths.append(png)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description="Regenerate the CSV, plot and Markdown table from a bench_loss.json")
    p.add_argument("json_path")
    p.add_argument("--out-dir", default=None, help="default: the JSON's folder")
    args = p.parse_args()
    with open(args.json_path) as fh:
        results = json.load(fh)
    results["checks"] = checks(results)
    for path in write_all(results, args.out_dir or os.path.dirname(os.path.abspath(args.json_path))):
        print(path)


if __name__ == "__main__":
    main()
