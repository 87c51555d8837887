"""Data-parallel DPPO training on one fixed global batch; run alone or under ``accelerate launch``.

    python dp_train.py --out one.json                                         # 1 process, whole batch
    accelerate launch --multi_gpu --num_processes 2 dp_train.py --out two.json  # 2 CPU processes (gloo)

The model is a tiny Llama with tied input/output embeddings built from a config (no download). Its forward
runs the backbone and the DPPO loss (fused-linear by default, ``--path logits`` for the logits op), so DDP or
FSDP see an ordinary forward. Each process takes a contiguous slice of the global batch; the loss is the token
mean over the *global* batch (local token sum / global token count x world size, because DDP averages the
gradients), so every process count yields the same loss and the same update. ``--fsdp`` shards the model with
FSDP2 (``fully_shard`` on every decoder layer and the root) instead of DDP.

Rank 0 writes JSON: the global loss of every step and a float64 fingerprint of the final weights; every rank
contributes its own fingerprint so the test can check they are in sync.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from accelerate import Accelerator
from clean_exit import exit_after
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from dppo_ext import dppo_loss_per_row, fused_linear_dppo_loss_per_row

logger = logging.getLogger("dp_train")

VOCAB, HIDDEN, PROMPT, RESPONSE, BATCH = 61, 64, 5, 7, 8


class PolicyWithDPPO(nn.Module):
    """Tiny causal LM whose forward returns the per-token DPPO loss ``[B, RESPONSE]`` of the response tokens."""

    def __init__(self, path: str) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=32,
            tie_word_embeddings=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lm = LlamaForCausalLM(config)
        self.path = path
        self.head_weight_types: set[str] = set()  # the LM-head weight's type as the loss sees it (FSDP check)

    def forward(self, input_ids, tokens, rollout_logprobs, advantages):
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state[:, PROMPT - 1 : -1]
        hidden = hidden.reshape(-1, HIDDEN)
        weight = self.lm.get_output_embeddings().weight
        self.head_weight_types.add(type(weight.data).__name__)
        args = (tokens.reshape(-1), rollout_logprobs.reshape(-1), advantages.reshape(-1))
        if self.path == "fused":
            out = fused_linear_dppo_loss_per_row(hidden, weight, *args, mode="binary_tv", chunk_size=5)
        else:
            out = dppo_loss_per_row(hidden @ weight.t(), *args, mode="binary_tv")
        return out.loss.view(tokens.shape)


def global_batch() -> dict[str, torch.Tensor]:
    """The fixed global batch: ``BATCH`` sequences, padding (-100) in the last tokens of some responses."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, PROMPT + RESPONSE), generator=g)
    tokens = input_ids[:, PROMPT:].clone()
    lengths = torch.randint(2, RESPONSE + 1, (BATCH,), generator=g)
    tokens[torch.arange(RESPONSE)[None, :] >= lengths[:, None]] = -100
    rollout = -torch.rand(BATCH, RESPONSE, generator=g) * 5.0
    advantages = torch.randn(BATCH, 1, generator=g).expand(BATCH, RESPONSE).contiguous()
    return {"input_ids": input_ids, "tokens": tokens, "rollout_logprobs": rollout, "advantages": advantages}


def fingerprint(model: nn.Module) -> list[float]:
    """Per-parameter float64 sums and sums of squares (full tensors; FSDP2 shards are gathered)."""
    values = []
    for _, p in sorted(model.named_parameters()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        t = t.detach().double()
        values += [t.sum().item(), (t * t).sum().item()]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--path", choices=("fused", "logits"), default="fused")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    if BATCH % world:
        raise ValueError(f"BATCH={BATCH} must be divisible by the number of processes, got {world}")
    model = PolicyWithDPPO(args.path)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.lm.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if args.fsdp:
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)

    batch = global_batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    local = {k: v[rows] for k, v in batch.items()}
    global_tokens = float((batch["tokens"] != -100).sum())
    losses = []
    for _ in range(args.steps):
        per_token = model(**local)
        local_sum = per_token.sum()
        # DDP/FSDP average gradients over processes: scale the local sum so the average is the global mean.
        loss = local_sum * world / global_tokens
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = accelerator.reduce(local_sum.detach(), reduction="sum")
        losses.append(total.item() / global_tokens)
        logger.info("rank %d step %d global loss %.6f", rank, len(losses), losses[-1])

    inner = accelerator.unwrap_model(model)
    stored_type = type(inner.lm.get_output_embeddings().weight.data).__name__
    prints = accelerator.gather(torch.tensor([fingerprint(inner)], dtype=torch.float64))
    if accelerator.is_main_process:
        result = {
            "world": world,
            "losses": losses,
            "fingerprints": prints.tolist(),
            "stored_head_weight_type": stored_type,
            "loss_head_weight_types": sorted(inner.head_weight_types),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    exit_after(accelerator.wait_for_everyone)  # not gloo's teardown: see clean_exit.py


if __name__ == "__main__":
    main()
