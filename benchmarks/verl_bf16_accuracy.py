"""How far the bf16 logits gradients of verl's binary DPPO losses are from exact: the plugin's vs verl's own.

Both paths take the same bfloat16 logits ``[1, N, V]`` of one micro-batch built with verl's own objects (verl's
``DataProto`` -> ``left_right_2_no_padding``, prompts and responses of different lengths) and compute the loss of
``dppo_tv`` / ``dppo_kl`` and its gradient with respect to the logits:

- ``plugin``: ``dppo_ext.integrations.verl.loss.ppo_loss`` (the fused op on the bf16 logits, float32 inside, the
  gradient rounded once to bf16, written into the logits' buffer);
- ``verl``: verl's engine path on a machine without flash-attn: ``verl.utils.torch_functional.logprobs_from_logits``
  on the bf16 logits (verl's row-by-row ``log_softmax``, bf16 log-probs), then verl's ``ppo_loss`` with its own
  ``compute_policy_loss_dppo_tv`` / ``_kl``;
- ``verl_fp32_logprobs``: the same verl loss on float32 log-probs of the same bf16 logits
  (``logprobs_from_logits(logits.float())``), the precision flash-attn's cross-entropy gives verl's engine on a GPU
  (its kernel is not run here: this is the same arithmetic in PyTorch, not flash-attn itself).

The reference is verl's own loss in float64 on the same (exactly upcast) inputs. Per path:

    relative error    = ||g - g64|| / ||g64||             (Frobenius norm over the whole [N, V] gradient)
    rounding steps    = |g - g64| / ulp_bf16(g64)         (largest over the elements, and their mean)
    correctly rounded = fraction of elements equal to g64 rounded to bf16

and the loss's relative error and the tokens whose mask differs from float64's. The sampled tokens' logits are
raised by U(0, 8) so that their probabilities span what a policy samples (not only the 1/V of random logits); the
anchor log-probs are the float64 log-probs plus N(0, 0.3^2) noise.

Needs verl (CI's .venv-verl)::

    python benchmarks/verl_bf16_accuracy.py                     # V = 1024 and 32768, 3 seeds each
    python benchmarks/verl_bf16_accuracy.py --vocab 151936 --seeds 1

Prints a table and writes ``--out`` (default benchmarks/results/verl_bf16_accuracy.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_tests", "integrations"))
sys.path.insert(0, os.path.join(ROOT, "python_tests"))

import verl_cpu  # noqa: E402  (the test helpers that build verl's own micro-batches)
from dppo_testing import bf16_ulp  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402
from verl.workers.utils.losses import ppo_loss as verl_ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

import dppo_ext.integrations.verl.plugin  # noqa: E402,F401  (installs the hooks, as verl's entry point does)
from dppo_ext.integrations.verl import loss as vloss  # noqa: E402

MODES = {"dppo_tv": 0.05, "dppo_kl": 0.01}  # threshold per mode (verl's clip_ratio_low = clip_ratio_high)
PATHS = ("plugin", "verl", "verl_fp32_logprobs")


def make_case(vocab: int, seed: int, mode: str):
    """(config, data, bf16 logits [1, N, V]) for one micro-batch of 8 sequences."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = 8, 24, 48
    prompt_lens = torch.randint(8, p + 1, (b,), generator=g).tolist()
    response_lens = torch.randint(16, r + 1, (b,), generator=g).tolist()
    prompts, prompt_mask = torch.zeros(b, p, dtype=torch.long), torch.zeros(b, p, dtype=torch.long)
    responses, response_mask = torch.zeros(b, r, dtype=torch.long), torch.zeros(b, r, dtype=torch.long)
    for i in range(b):
        prompts[i, p - prompt_lens[i] :] = torch.randint(4, vocab, (prompt_lens[i],), generator=g)
        prompt_mask[i, p - prompt_lens[i] :] = 1
        responses[i, : response_lens[i]] = torch.randint(4, vocab, (response_lens[i],), generator=g)
        response_mask[i, : response_lens[i]] = 1
    advantages = torch.randn(b, 1, generator=g).expand(b, r) * response_mask
    zeros = torch.zeros(b, r)
    config = verl_cpu.actor_config_for(
        mode, clip_ratio_low=MODES[mode], clip_ratio_high=MODES[mode], clip_ratio_c=4.0, loss_agg_mode="token-mean"
    )

    def batch(old: torch.Tensor):
        rb = verl_cpu.RolloutBatch(prompts, prompt_mask, responses, response_mask, old, old, advantages, None)
        data = verl_cpu.actor_batch(rb, temperature=1.0)
        tu.assign_non_tensor(
            data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), **{vloss.ENTROPY_FLAG: False}
        )
        return data

    data = batch(zeros)
    labels = torch.roll(data["input_ids"].values(), shifts=-1)
    n = labels.numel()
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[torch.arange(n), labels] += 8 * torch.rand(n, generator=g)
    logits = logits.to(torch.bfloat16)
    logp64 = torch.log_softmax(logits.double(), -1).gather(-1, labels[:, None]).squeeze(-1)
    old = (no_padding_2_padding(logp64, data).float() + 0.3 * torch.randn(b, r, generator=g)).clamp(max=0)
    return config, batch(old * response_mask), logits[None], labels


def plugin_path(config, data, logits):
    leaf = logits.clone().requires_grad_(True)
    source = leaf * 1  # the LM head's output: an op's result, so the plugin writes the gradient into it
    outputs = vloss.ppo_loss(config, student_logits=source, data=data)
    offsets = data["input_ids"].offsets()
    model_output = {k: torch.nested.nested_tensor_from_jagged(v.squeeze(0), offsets) for k, v in outputs.items()}
    loss, metrics = vloss.ppo_loss(config, model_output=model_output, data=data)
    loss.backward()
    # the op's mask is 1 where the gradient is kept (docs/contract.md): masked = not kept, on response tokens
    mask = (
        ~no_padding_2_padding(outputs["dppo_mask"].squeeze(0), data).bool()
        & data.select("response_mask").to_padded_tensor()["response_mask"].bool()
    )
    return loss.detach().double(), leaf.grad.double(), mask


def verl_path(config, data, logits, labels, upcast=None):
    # float64: the leaf itself is float64 (a bf16 leaf would round the reference gradient to bf16)
    leaf = (logits.double() if upcast == torch.float64 else logits.clone()).requires_grad_(True)
    x = leaf.squeeze(0) if upcast is None else leaf.squeeze(0).to(upcast)
    log_probs = logprobs_from_logits(x, labels)
    nested = torch.nested.nested_tensor_from_jagged(log_probs, data["input_ids"].offsets())
    loss, _ = verl_ppo_loss(config, {"log_probs": nested}, data)
    loss.backward()
    return loss.detach().double(), leaf.grad.double(), log_probs.detach()


def masked_tokens_verl(config, data, log_probs) -> torch.Tensor:
    """[B, R] bool: the response tokens verl's formula masks, given the packed log-probs its loss read (its
    formula recomputed, in their dtype)."""
    lp = no_padding_2_padding(log_probs, data)
    padded = data.select("old_log_probs", "advantages", "response_mask").to_padded_tensor()
    old, adv = padded["old_log_probs"].to(lp.dtype), padded["advantages"]
    prob, old_prob = lp.exp(), old.exp()
    delta = MODES[vloss.loss_mode(config)]
    if vloss.loss_mode(config) == "dppo_tv":
        pos, neg = (prob - old_prob) <= delta, (prob - old_prob) >= -delta
    else:
        kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos, neg = (kl <= delta) | (prob <= old_prob), (kl <= delta) | (prob >= old_prob)
    return ~torch.where(adv > 0, pos, neg) & padded["response_mask"].bool()


def errors(loss, grad, loss64, grad64) -> dict:
    diff = (grad - grad64).abs()
    nz = grad64 != 0
    steps = diff[nz] / bf16_ulp(grad64[nz])
    return {
        "loss_rel_err": float((loss - loss64).abs() / loss64.abs()),
        "grad_rel_err": float(diff.norm() / grad64.norm()),
        "max_rounding_steps": float(steps.max()),
        "mean_rounding_steps": float(steps.mean()),
        "correctly_rounded": float((grad == grad64.to(torch.bfloat16).double()).double().mean()),
    }


def run(vocabs: list[int], seeds: int) -> list[dict]:
    rows = []
    for vocab in vocabs:
        for mode in MODES:
            for seed in range(seeds):
                config, data, logits, labels = make_case(vocab, seed, mode)
                loss64, grad64, log_probs64 = verl_path(config, data, logits, labels, upcast=torch.float64)
                mask64 = masked_tokens_verl(config, data, log_probs64)
                results = {}
                loss, grad, mask = plugin_path(config, data, logits)
                results["plugin"] = {**errors(loss, grad, loss64, grad64), "mask_flips": int((mask != mask64).sum())}
                for name, upcast in (("verl", None), ("verl_fp32_logprobs", torch.float32)):
                    loss, grad, log_probs = verl_path(config, data, logits, labels, upcast=upcast)
                    flips = int((masked_tokens_verl(config, data, log_probs) != mask64).sum())
                    results[name] = {**errors(loss, grad, loss64, grad64), "mask_flips": flips}
                tokens = int(data.select("response_mask").to_padded_tensor()["response_mask"].sum())
                masked = int(mask64.sum())
                rows.append(
                    {"vocab": vocab, "mode": mode, "seed": seed, "tokens": tokens, "masked64": masked, **results}
                )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="1024,32768", help="comma-separated vocabulary sizes")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "verl_bf16_accuracy.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = run([int(v) for v in args.vocab.split(",")], args.seeds)
    header = f"{'V':>7} {'mode':8} {'seed':>4} {'path':19} {'grad rel err':>12} {'max steps':>9} {'mean steps':>10}"
    header += f" {'corr. rounded':>13} {'loss rel err':>12} {'mask flips':>10} {'masked':>8}"
    print(header)
    for row in rows:
        for path in PATHS:
            e = row[path]
            print(
                f"{row['vocab']:>7} {row['mode']:8} {row['seed']:>4} {path:19} {e['grad_rel_err']:12.3e}"
                f" {e['max_rounding_steps']:9.2f} {e['mean_rounding_steps']:10.3f} {e['correctly_rounded']:13.4f}"
                f" {e['loss_rel_err']:12.2e} {e['mask_flips']:>5}/{row['tokens']} {row['masked64']:>8}"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
