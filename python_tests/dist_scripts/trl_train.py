"""A few DPPOGRPOTrainer steps on a tiny local model; run alone or under ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 trl_train.py --model DIR --out result.json

The reward counts the character ``1`` in the completion (any signal will do: the test checks plumbing, not
learning). Rank 0 writes JSON: TRL's log history, how many parameters changed, and every rank's float64
weight fingerprint (to check the processes stay in sync).
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from clean_exit import exit_after
from datasets import Dataset
from transformers import AutoTokenizer

from dppo_ext.integrations.trl import DPPOGRPOConfig, DPPOGRPOTrainer


def count_ones(completions: list[str], **_: object) -> list[float]:
    """Reward: number of '1' characters in each completion."""
    return [float(c.count("1")) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="folder from dppo_ext.models.tiny.build_tiny_model")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--output-dir", default=None, help="trainer output_dir (default: next to --out)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--path", choices=("fused", "logits"), default="fused")
    parser.add_argument("--mode", default="binary_tv", help="dppo_mode")
    parser.add_argument("--topk", type=int, default=0, help="dppo_topk (top-K modes)")
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM in colocate mode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(32)]})
    config = DPPOGRPOConfig(
        output_dir=args.output_dir or args.out + ".trainer",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=args.steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dppo_fused_linear=args.path == "fused",
        dppo_mode=args.mode,
        dppo_topk=args.topk,
        use_vllm=args.vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_enable_sleep_mode=False,
    )
    trainer = DPPOGRPOTrainer(
        model=args.model, reward_funcs=count_ones, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    changed = sum(not torch.equal(before[name], p.detach()) for name, p in params.items())
    fingerprint = torch.tensor(
        [
            [
                v
                for name in sorted(params)
                for v in (params[name].double().sum().item(), params[name].double().norm().item())
            ]
        ],
        dtype=torch.float64,
    )
    prints = trainer.accelerator.gather(fingerprint)
    if trainer.accelerator.is_main_process:
        result = {
            "world": trainer.accelerator.num_processes,
            "log_history": trainer.state.log_history,
            "changed": changed,
            "num_params": len(params),
            "fingerprints": prints.tolist(),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    exit_after(trainer.accelerator.wait_for_everyone)  # not gloo's teardown: see clean_exit.py


if __name__ == "__main__":
    main()
