"""The RL loop: rollouts -> rewards -> group advantages -> DPPO updates -> weight sync.

One step:
1. sample ``prompts_per_step`` training problems; the engine samples ``group_size`` responses
   each, with the log-prob (and optionally top-K log-probs) of every sampled token under
   ``log_softmax(logits / temperature)``;
2. rewards from the task's verifier; GRPO group advantages (one per sequence);
3. ``ppo_epochs`` passes over the batch in ``num_minibatches`` shuffled mini-batches (each
   optionally split into micro-batches for gradient accumulation); every mini-batch is one
   AdamW step on ``dppo_ext.dppo_loss(response logits, tokens, rollout log-probs, advantages,
   temperature=...)`` after gradient clipping. The op takes the raw logits: no
   full-vocabulary log-softmax is ever built in the training step;
4. the new weights are pushed into the rollout engine (``engine.sync_weights``); with
   ``rollout_lag = k`` the engine gets the trainer's weights of k steps ago instead
   (asynchronous RL: rollouts ``k + 1`` updates behind the trainer; ``dppo_ext.trainer.lag``).

Losses anchored on a recomputed policy (``minirl``, ``minirl_tis``; ``dppo_ext.trainer.losses``)
score the whole rollout batch once with the trainer's pre-update weights before the batch's first
optimizer step; those log-probs stay fixed for every epoch and mini-batch of that batch and are
the op's ``anchor_logprobs``.

With ``rollout_logit_noise = sigma`` the engine samples the rollouts (never the held-out evaluation) from
``softmax((z + sigma * eps) / T)`` and reports that ``mu`` (``dppo_ext.rollout.noise``); with ``rollout_weight_bits``
it rolls them out with fake-quantised weights (``dppo_ext.trainer.lag``): mismatches of a chosen size. With
``mechanism_metrics`` every step's record also holds the masking and post-update metrics of
``dppo_ext.trainer.mechanism`` (one extra no-grad pass over each mini-batch after its update).

Weight sync is measured, not assumed: the first mini-batch of every step runs before any update of that step, so the
op's ``|pi - mu|`` over it (``mismatch_mean`` / ``mismatch_max``) compares the engine's log-probs with the trainer's
own for exactly the same weights. It stays at rounding level (~1e-6 in float32) when the engine follows the trainer
and jumps to the size of an update when it does not. On top of that the vLLM engine's sync guard checks every sync
itself and stops the run when the engine's log-probs no longer follow the weights it was sent (``--sync-check``, on
by default; the record's ``sync_check_max``, ``sync_check_s`` and ``eval_sync_check_max``, the syncs around a lagged
or quantised run's evaluation). ``pg_pi_old`` feeds the op pi_old: its ``mismatch_mean`` is ``|pi - pi_old|``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dppo_ext.aggregation import micro_batch_scale
from dppo_ext.contract import NORM_AGG_MODES
from dppo_ext.rollout.base import RolloutEngine, RolloutSample
from dppo_ext.tasks.base import Problem, Task
from dppo_ext.trainer.advantages import group_advantages
from dppo_ext.trainer.batch import RolloutBatch, checked_logits_dtype, collate_rollouts, response_logits
from dppo_ext.trainer.checkpoint import load_trainer_state, save_checkpoint, set_rng_state
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.lag import RolloutLag
from dppo_ext.trainer.mechanism import MechanismStats, op_rows, token_logprobs
from dppo_ext.trainer.metrics import MetricsWriter
from dppo_ext.trainer.reporting import Reporter, make_reporter
from dppo_ext.trainer.sampler import PromptSampler
from dppo_ext.trainer.step_stats import StepStats

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 7_919  # eval rollouts use a fixed seed so every evaluation sees the same draws
STEP_SEED_STRIDE = 1_000_003


@dataclass
class EvalResult:
    """Held-out accuracy (mean reward over ``eval_samples`` draws per problem) and its cost."""

    accuracy: float
    response_len: float
    seconds: float
    # Under a lag: the sync guard's largest |log pi - log mu| over the evaluation's two syncs (current weights in,
    # lagged ones back); None without a lag or without a guard.
    sync_check_max: float | None = None


class Trainer:
    """Runs the RL loop for one model, task and rollout engine.

    Args:
        config: validated settings.
        model: the policy (transformers causal LM) on its training device, same weights as the engine.
        tokenizer: its tokenizer (prompt encoding, response decoding).
        task: training and held-out problems with their verifier.
        engine: rollout engine loaded with the same weights as ``model``.
        out_dir: run folder (metrics.jsonl, checkpoint-<step>/).
    """

    def __init__(
        self,
        config: TrainConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        task: Task,
        engine: RolloutEngine,
        out_dir: str | Path,
    ) -> None:
        from dppo_ext import dppo_loss

        self.logits_dtype = checked_logits_dtype(model, config.logits_dtype)  # a 16-bit model's float32 logits
        self._dppo_loss = dppo_loss
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.task = task
        self.engine = engine
        self.out_dir = Path(out_dir)
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.sampler = PromptSampler(len(task.train), config.seed)
        self.step = 0
        self.elapsed_before_s = 0.0
        self.use_chat = _use_chat_template(config.prompt_format, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._prompt_cache: dict[str, list[int]] = {}
        self.lag = RolloutLag(
            model, engine, config.rollout_lag, config.rollout_weight_bits, config.rollout_weight_group
        )
        if config.truncates_sampling and not config.sampling_replay:
            logger.warning("--no-sampling-replay: pi over the vocabulary, mu over the kept set: biased ratios")

    # ------------------------------------------------------------------ prompts and rewards
    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (plain, or wrapped in the tokenizer's chat template)."""
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            if self.use_chat:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt)["input_ids"]
            self._prompt_cache[prompt] = ids
        return ids

    def score(self, sample: RolloutSample, problem: Problem) -> float:
        """The task reward of one response (decoded with special tokens skipped)."""
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return self.task.reward(text, problem.answer)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Held-out accuracy of the current weights (through the engine: generation only).

        With ``rollout_lag`` the engine holds the weights of k steps ago: the current weights go into it for
        the evaluation and the lagged ones back after it, so the accuracy is the trained policy's.
        """
        start = time.perf_counter()
        problems = self.task.eval
        with self.lag.evaluation() as checks:
            groups = self.engine.generate(
                [self.encode_prompt(p.prompt) for p in problems],
                n=self.config.eval_samples,
                temperature=self.config.eval_temperature,
                max_tokens=self.config.max_new_tokens,
                seed=self.config.seed + EVAL_SEED_OFFSET,
            )
        measured = [c.max_diff for c in checks if c is not None]
        rewards = [self.score(s, p) for p, group in zip(problems, groups) for s in group]
        lengths = [len(s.response_ids) for group in groups for s in group]
        return EvalResult(
            accuracy=sum(rewards) / len(rewards),
            response_len=sum(lengths) / len(lengths),
            seconds=time.perf_counter() - start,
            sync_check_max=max(measured) if measured else None,
        )

    # ------------------------------------------------------------------ one step
    def rollout(self) -> tuple[list[RolloutSample], torch.Tensor, float]:
        """Sample a rollout batch; return (samples [P*G], rewards [P, G], seconds)."""
        cfg = self.config
        start = time.perf_counter()
        problems = [self.task.train[i] for i in self.sampler.draw(cfg.prompts_per_step)]
        groups = self.engine.generate(
            [self.encode_prompt(p.prompt) for p in problems],
            n=cfg.group_size,
            temperature=cfg.temperature,
            max_tokens=cfg.max_new_tokens,
            top_k=cfg.top_k if cfg.uses_topk else 0,
            seed=cfg.seed * STEP_SEED_STRIDE + (self.step + 1) * cfg.prompts_per_step * cfg.group_size,
            **({"logit_noise": cfg.rollout_logit_noise} if cfg.rollout_logit_noise else {}),
            **({"truncation": cfg.truncation()} if cfg.truncates_sampling else {}),
        )
        samples = [s for group in groups for s in group]
        rewards = torch.tensor([[self.score(s, p) for s in group] for p, group in zip(problems, groups)])
        return samples, rewards, time.perf_counter() - start

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``num_minibatches`` AdamW steps on ``batch``; return averaged metrics.

        The mismatch metrics (``mismatch_mean``, ``mismatch_max``, ...: ``step_stats.FIRST_BATCH``) come from the first
        mini-batch only, scored before this step's first optimizer step (the engine's and the trainer's weights agree).
        """
        cfg = self.config
        lr = cfg.lr * min(1.0, (self.step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        if cfg.uses_recompute_anchor:
            batch = replace(batch, anchor_logprobs=self.recompute_logprobs(batch))
        settings = cfg.loss_settings()
        generator = torch.Generator().manual_seed(cfg.seed * STEP_SEED_STRIDE + self.step)
        stats = StepStats()
        first = True
        mechanism = MechanismStats() if cfg.mechanism_metrics else None
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(batch.size, generator=generator)
            for mb_index in perm.chunk(min(cfg.num_minibatches, batch.size)):
                micro_size = cfg.micro_batch_size or mb_index.numel()
                micro_parts = mb_index.split(micro_size)
                mb_mask = batch.response_mask[mb_index]
                mb_tokens, mb_seqs = float(mb_mask.sum()), float(mb_mask.any(-1).sum())
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
                before: list[torch.Tensor] = []  # mechanism metrics: the micro-batches' log-probs before the step
                for part in micro_parts:
                    micro = batch.select(part).to(self.device)
                    share = float(micro_batch_scale(cfg.loss_agg_mode, micro.response_mask, mb_tokens, mb_seqs))
                    logits = response_logits(self.model, micro, self.logits_dtype)
                    # pg_pi_old: the op's weight pi / mu becomes pi / pi_old (the loss ignores the rollout mismatch)
                    on_old = cfg.weights_on_recompute
                    loss, metrics = self._dppo_loss(
                        logits,
                        micro.tokens,
                        micro.anchor_logprobs if on_old else micro.rollout_logprobs,
                        micro.advantages,
                        response_mask=micro.response_mask,
                        mode=cfg.mode,
                        topk_ids=micro.topk_ids,
                        topk_logprobs=micro.topk_logprobs,
                        anchor_logprobs=None if on_old else micro.anchor_logprobs,
                        kept_ids=micro.kept_ids,
                        temperature=cfg.temperature,
                        loss_agg_mode=cfg.loss_agg_mode,
                        loss_scale_factor=cfg.max_new_tokens if cfg.loss_agg_mode in NORM_AGG_MODES else None,
                        **settings,
                    )
                    if mechanism is not None:
                        rows, valid, mu, adv = op_rows(logits, micro, cfg.mode, cfg.temperature, settings)
                        mechanism.add_mask(rows.mask, valid, mu, adv, first=first)
                        if first:
                            mechanism.add_pre_update(rows.logp, valid, mu)
                        before.append(rows.logp)
                    (loss * share).backward()
                    mb_loss += float(loss.detach()) * share
                    stats.add_micro_batch(metrics, first=first)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                    if mechanism is not None:
                        mechanism.clipped_updates += int(grad_norm > cfg.max_grad_norm)
                        self._post_update_pass(batch, micro_parts, before, mechanism, settings)
                else:
                    # A NaN/inf gradient would poison the weights (and AdamW's moments) for good:
                    # skip this optimizer step and say so; the record keeps the non-finite loss.
                    logger.warning(
                        "step %d: non-finite gradient norm (%s, mini-batch loss %s); optimizer step skipped",
                        self.step,
                        grad_norm,
                        mb_loss,
                    )
                stats.add_optimizer_step(mb_loss, grad_norm, skipped=not math.isfinite(grad_norm))
                first = False
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        out = stats.record(lr)
        if mechanism is not None:
            out.update(mechanism.record())
        return out

    @torch.no_grad()
    def _post_update_pass(
        self,
        batch: RolloutBatch,
        parts: list[torch.Tensor],
        before: list[torch.Tensor],
        stats: MechanismStats,
        settings: dict[str, float],
    ) -> None:
        """Score the mini-batch just trained (``parts``: its micro-batches' rows; ``before``: their log-probs
        before the step) with the updated weights."""
        cfg = self.config
        for part, logp_old in zip(parts, before):
            micro = batch.select(part).to(self.device)
            rows, valid, mu, adv = op_rows(
                response_logits(self.model, micro, self.logits_dtype), micro, cfg.mode, cfg.temperature, settings
            )
            stats.add_post_update(rows.logp, logp_old, valid, mu, adv)

    @torch.no_grad()
    def recompute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The trainer's log-probs of ``batch``'s tokens under its current weights: ``[B, T]``
        float32 (0 on padding), scored in micro-batches of ``micro_batch_size`` (or whole)."""
        cfg = self.config
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        size = cfg.micro_batch_size or batch.size
        for part in torch.arange(batch.size).split(size):
            micro = batch.select(part).to(self.device)
            logp = token_logprobs(response_logits(self.model, micro, self.logits_dtype), micro, cfg.temperature)
            logp = torch.where(micro.response_mask, logp, torch.zeros_like(logp)).cpu()
            out[part, : logp.shape[1]] = logp
        return out

    def train_step(self) -> dict[str, Any]:
        """One RL step (rollout, advantages, update, weight sync); return its metrics record."""
        cfg = self.config
        samples, rewards, rollout_s = self.rollout()
        advantages = group_advantages(rewards, normalize_std=cfg.adv_std).reshape(-1)
        record: dict[str, Any] = {
            "step": self.step + 1,
            "reward": float(rewards.mean()),
            "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
            "zero_adv_groups": float((rewards.std(dim=1) == 0).float().mean()),
            "rollout_s": rollout_s,
        }
        keep = [i for i, a in enumerate(advantages.tolist()) if a != 0.0 or not cfg.drop_zero_adv]
        keep = [i for i in keep if samples[i].response_ids]
        update_start = time.perf_counter()
        if keep:
            batch = collate_rollouts(
                [samples[i] for i in keep],
                [float(advantages[i]) for i in keep],
                pad_id=self.pad_id,
                with_topk=cfg.uses_topk,
                with_kept=cfg.sampling_replay,
            )
            record.update(self.update(batch))
            record["update_s"] = time.perf_counter() - update_start
            record["sync_s"] = self.lag.sync()
            record.update(_sync_check_record(self.engine))
        else:
            # no update, but a lagged engine still moves one step along the trainer's history
            record.update(update_s=0.0, sync_s=self.lag.sync() if self.lag.steps else 0.0, optimizer_steps=0)
            if self.lag.steps:
                record.update(_sync_check_record(self.engine))
        record["trained_seqs"] = len(keep)
        self.step += 1
        return record

    # ------------------------------------------------------------------ checkpoints
    def save(self, elapsed_s: float) -> Path:
        """Checkpoint the current state to ``<out>/checkpoint-<step>`` (keeping ``save_total_limit``)."""
        return save_checkpoint(
            self.out_dir,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.optimizer,
            step=self.step,
            sampler=self.sampler.state_dict(),
            elapsed_s=elapsed_s,
            save_total_limit=self.config.save_total_limit,
        )

    def restore(self, checkpoint_dir: str | Path) -> None:
        """Load optimizer, sampler, RNG states and step from a checkpoint.

        The model weights must already come from ``<checkpoint>/model`` (and the engine too).
        With ``rollout_lag = k`` the lag window restarts there: the engine rolls out with the
        checkpoint's weights for the next k steps (the older weights are not checkpointed).
        """
        state = load_trainer_state(checkpoint_dir)
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed_before_s = float(state["elapsed_s"])

    # ------------------------------------------------------------------ the loop
    def run(self, *, progress: bool = True) -> dict[str, Any]:
        """Train up to ``config.steps`` steps (from ``self.step``); return the run summary.

        Writes ``metrics.jsonl`` (an eval-only record at step 0, then one record per step with
        ``eval_acc`` every ``eval_every`` steps and at the last step), the same records to the
        ``--report-to`` sink, and checkpoints.
        """
        cfg = self.config
        start = time.perf_counter()
        resumed = self.step > 0
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resumed else None)
        reporter = make_reporter(cfg.report_to, self.out_dir, resume_step=self.step if resumed else None)
        try:
            return self._run(writer, reporter, start, resumed, progress=progress)
        finally:
            reporter.close()

    def _run(
        self, writer: MetricsWriter, reporter: Reporter, start: float, resumed: bool, *, progress: bool
    ) -> dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.config
        if not resumed:
            result = self.evaluate()
            record = {
                "step": 0,
                **_eval_record(result),
            }
            writer.write(record)
            reporter.write(record)
            logger.info("held-out accuracy at start: %.3f", result.accuracy)
        bar = tqdm(total=cfg.steps, initial=self.step, desc="RL", disable=not progress, dynamic_ncols=True)
        last_acc = None
        while self.step < cfg.steps:
            record = self.train_step()
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                result = self.evaluate()
                record.update(_eval_record(result))
                last_acc = result.accuracy
            record["elapsed_s"] = self.elapsed_before_s + time.perf_counter() - start
            writer.write(record)
            reporter.write(record)
            postfix = {"reward": f"{record['reward']:.2f}", "mismatch": f"{record.get('mismatch_max', 0.0):.1e}"}
            if last_acc is not None:
                postfix["acc"] = f"{last_acc:.2f}"
            bar.set_postfix(postfix)
            bar.update(1)
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                self.save(self.elapsed_before_s + time.perf_counter() - start)
        bar.close()
        return {"steps": self.step, "elapsed_s": self.elapsed_before_s + time.perf_counter() - start}


def _sync_check_record(engine: RolloutEngine) -> dict[str, float]:
    """The sync guard's measurement of the sync just done (``sync_check_max``: the largest |log pi - log mu| on
    the stored sequence; ``sync_check_s``: its part of ``sync_s``), or nothing when the engine has no guard."""
    check = getattr(engine, "last_sync_check", None)
    return {} if check is None else {"sync_check_max": check.max_diff, "sync_check_s": check.seconds}


def _use_chat_template(prompt_format: str, tokenizer: Any) -> bool:
    if prompt_format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--prompt-format chat: the tokenizer has no chat template; use --prompt-format plain")
        return True
    return prompt_format == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _eval_record(result: EvalResult) -> dict[str, float]:
    """An evaluation's fields of a metrics record; ``eval_sync_check_max`` (the guard's measurement of the syncs
    around a lagged run's evaluation) only when there was one."""
    record = {"eval_acc": result.accuracy, "eval_response_len": result.response_len, "eval_s": result.seconds}
    if result.sync_check_max is not None:
        record["eval_sync_check_max"] = result.sync_check_max
    return record
