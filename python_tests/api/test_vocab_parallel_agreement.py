"""Vocabulary-parallel preconditions: a broken one raises on every rank, never a rank-local crash, hang or loss.

In 2 and 3 gloo processes (``dist_scripts/vocab_parallel_agreement_worker.py``), rank 1 alone passes fewer rows,
one changed per-row input (tokens, response mask, advantages, rollout log-probs, top-K ids or log-probs, anchor),
another setting, a changed row or a NaN in the fused path's replicated ``hidden``, bf16 ``hidden`` and head rows
where the others pass fp32 (the dtype the backward's all-reduce would meet), or input that fails its own checks:
every rank must raise, the mismatches with the same message naming what differs, the local failures with the
failing rank's own error there and a message naming that rank everywhere else; settings equal in value but spelled
differently (``1`` and ``1.0``) agree; a correct call afterwards still works. In process: ``vocab_offsets`` without
a group is refused, and the call-header fingerprint is deterministic and sees a one-bit change.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dppo_testing import sample_inputs

from dppo_ext import DPPOLoss, FusedLinearDPPOLoss, dppo_loss, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row
from dppo_ext._agreement import fingerprint

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "dist_scripts" / "vocab_parallel_agreement_worker.py"

# scenario -> (what rank 1 raises, what every other rank raises): (exception type, message regex).
_SAME = "vocab-parallel loss: "
EXPECTED = {
    "rows": ("ValueError", _SAME + "the ranks of vocab_parallel_group passed different row counts N"),
    "rows_derived_offsets": ("ValueError", _SAME + "the ranks of vocab_parallel_group passed different row counts N"),
    "tokens": ("ValueError", _SAME + r"tokens \(or response_mask.*\) differ between the ranks.*rank\(s\) \[1\]"),
    "tokens_derived_offsets": ("ValueError", _SAME + r"tokens \(or response_mask.*\) differ between the ranks"),
    "advantages": ("ValueError", _SAME + r"advantages differ between the ranks.*rank\(s\) \[1\]"),
    "rollout_logprobs": ("ValueError", _SAME + r"rollout_logprobs differ between the ranks"),
    "topk_ids": ("ValueError", _SAME + r"topk_ids differ between the ranks"),
    "topk_logprobs": ("ValueError", _SAME + r"topk_logprobs differ between the ranks"),
    "anchor_logprobs": ("ValueError", _SAME + r"anchor_logprobs differ between the ranks"),
    "response_mask": ("ValueError", _SAME + r"tokens \(or response_mask, which marks the ignored tokens\) differ"),
    "settings": (
        "ValueError",
        _SAME + r"the ranks of vocab_parallel_group passed different loss settings: delta_low \(rank 0: 0\.2, rank 1: "
        r"0\.3[,)]",
    ),
    "settings_tensor": (
        "ValueError",
        _SAME + r"the ranks of vocab_parallel_group passed different loss settings: temperature \(rank 0: 0\.7, "
        r"rank 1: 0\.699999988\d*[,)]",
    ),
    "fused_tokens": ("ValueError", _SAME + r"tokens \(or response_mask.*\) differ between the ranks"),
    "fused_rows": ("ValueError", _SAME + "the ranks of vocab_parallel_group passed different row counts N"),
    "fused_hidden_row": ("ValueError", _SAME + r"hidden differs between the ranks.*rank\(s\) \[1\]"),
    "fused_hidden_nan": ("ValueError", _SAME + r"hidden differs between the ranks.*rank\(s\) \[1\]"),
    "fused_hidden_dtype": ("ValueError", _SAME + r".*different dtypes \(rank 0: torch.float32, rank 1: torch.bfloat16"),
}
# Settings spelled differently but equal in value (temperature=1 and 1.0, ratio_cap=10 and 10.0): every rank agrees.
AGREE = ("settings_by_value", "settings_tensor_by_value", "fused_settings_by_value")
LOCAL = {  # rank 1's own error; the others name rank 1
    "local_shape_error": ("ValueError", r"advantages must have shape"),
    "local_dtype_error": ("TypeError", r"tokens must have dtype Long"),
    "local_fused_error": ("ValueError", r"weight must be 2-D \[V, H\] with H=6"),
    "local_settings_error": ("ValueError", r"mode must be one of .* got 'bogus'"),
    "local_empty_slice": ("ValueError", r"must hold at least one vocabulary column.*this rank got 0"),
}
PEER = ("RuntimeError", _SAME + r"rank\(s\) \[1\] of vocab_parallel_group raised an error in their own checks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agreement_workers(world: int, out_dir: Path, only: str = "", timeout: int = 240) -> tuple[list, list[str]]:
    """Every rank's results (None for a rank that wrote none) and logs; the ranks are killed (process group and
    all) if they outlive ``timeout``, so that a hang fails the test instead of leaving processes behind."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "python_tests")]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
    )
    procs = []
    for rank in range(world):
        out = out_dir / f"rank{rank}.json"
        cmd = [sys.executable, str(WORKER), "--out", str(out)] + (["--only", only] if only else [])
        procs.append(
            (
                subprocess.Popen(
                    cmd,
                    env=dict(env, RANK=str(rank)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                ),
                out,
            )
        )
    results, logs = [], []
    try:
        for proc, out in procs:
            try:
                log, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                log = f"timed out after {timeout} s"
            logs.append(f"exit {proc.returncode}: {log[-4000:]}")
            results.append(json.loads(out.read_text()) if out.exists() else None)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results, logs


def _by_name(result: dict | None) -> dict:
    return {} if result is None else {r["name"]: r for r in result["results"]}


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_every_rank_raises_when_one_rank_differs(world, tmp_path):
    results, logs = run_agreement_workers(world, tmp_path)
    got = [_by_name(r) for r in results]
    problems = []
    for name in [*EXPECTED, *LOCAL, *AGREE, "correct_call_after"]:
        for rank in range(world):
            outcome = got[rank].get(name)
            if outcome is None:
                problems.append(f"{name}: rank {rank} reported nothing (it crashed or hung)")
                continue
            if name == "correct_call_after" or name in AGREE:
                want = None
            elif name in EXPECTED:
                want = EXPECTED[name]
            else:
                want = LOCAL[name] if rank == 1 else PEER
            if want is None:
                if outcome["raised"] is not None:
                    problems.append(f"{name}: rank {rank} raised {outcome['raised']}: {outcome['message'][:300]}")
            elif outcome["raised"] != want[0] or not re.search(want[1], outcome["message"]):
                problems.append(
                    f"{name}: rank {rank} got {outcome['raised']}: {outcome['message'][:300]!r}, "
                    f"expected {want[0]} matching {want[1]!r}"
                )
        if name in EXPECTED and all(name in g for g in got):
            messages = {g[name]["message"] for g in got}
            if len(messages) != 1:
                problems.append(f"{name}: the ranks raised different messages: {sorted(messages)}")
    assert not problems, "\n".join(problems) + "\n\nlogs:\n" + "\n".join(logs)
    for name in (*AGREE, "correct_call_after"):
        losses = {g[name]["loss"] for g in got}
        assert len(losses) == 1 and all(torch.isfinite(torch.tensor(x)) for x in losses), (name, losses)


# ---- in process: no group ----------------------------------------------------------------------------


def _flat_inputs():
    inputs = sample_inputs("cpu", torch.float32, "binary_tv", "v129")
    return inputs["logits"][:, :50], inputs["tokens"].clamp(max=49), inputs["rollout_logprobs"], inputs["advantages"]


_NO_GROUP = r"vocab_offsets=\[0, 50, 129\] was given but vocab_parallel_group is None.*this rank's vocabulary columns"


def test_vocab_offsets_without_a_group_is_refused():
    """Offsets with no group (e.g. ``vocab_parallel_group=torch.distributed.group.WORLD`` before the process group
    exists, which is None) would compute the loss over the local columns as if they were the whole vocabulary."""
    logits, tokens, rollout, adv = _flat_inputs()
    with pytest.raises(ValueError, match=_NO_GROUP):
        dppo_loss(logits, tokens, rollout, adv, vocab_offsets=[0, 50, 129])
    with pytest.raises(ValueError, match=_NO_GROUP):
        dppo_loss(logits, tokens, rollout, adv, vocab_parallel_group=None, vocab_offsets=[0, 50, 129])
    with pytest.raises(ValueError, match=_NO_GROUP):
        DPPOLoss(vocab_offsets=[0, 50, 129])(logits, tokens, rollout, adv)
    hidden, weight = torch.randn(tokens.shape[0], 4), torch.randn(50, 4)
    with pytest.raises(ValueError, match=_NO_GROUP):
        fused_linear_dppo_loss(hidden, weight, tokens, rollout, adv, vocab_offsets=[0, 50, 129])
    with pytest.raises(ValueError, match=_NO_GROUP):
        fused_linear_dppo_loss_per_row(hidden, weight, tokens, rollout, adv, vocab_offsets=[0, 50, 129])
    with pytest.raises(ValueError, match=_NO_GROUP):
        FusedLinearDPPOLoss(vocab_offsets=[0, 50, 129])(hidden, weight, tokens, rollout, adv)


def test_narrow_logits_without_a_group_raise_on_a_foreign_token_id():
    """What a slice alone can reveal: a token id beyond its columns is out of range (the op's own check)."""
    inputs = sample_inputs("cpu", torch.float32, "binary_tv", "v129")
    with pytest.raises(IndexError, match=r"tokens must hold ids in \[0, V=50\)"):
        dppo_loss(
            inputs["logits"][:, :50],
            inputs["tokens"].clamp(min=0) + 49,
            inputs["rollout_logprobs"],
            inputs["advantages"],
        )


def test_fingerprint_is_deterministic_and_sees_one_bit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen)
    cpu = torch.device("cpu")
    assert fingerprint(x, cpu).item() == fingerprint(x.clone(), cpu).item()
    assert fingerprint(x, cpu).item() == fingerprint(torch.stack([x, x], 1)[:, 0], cpu).item()  # a strided view
    flipped = x.clone()
    flipped.view(torch.int32)[1234] ^= 1  # one bit of one float
    assert fingerprint(flipped, cpu).item() != fingerprint(x, cpu).item()
    swapped = x.clone()
    swapped[[0, 1]] = x[[1, 0]]  # the same values in another order
    assert fingerprint(swapped, cpu).item() != fingerprint(x, cpu).item()
    assert fingerprint(x.double(), cpu).item() != fingerprint(x, cpu).item()  # the dtype counts
    assert fingerprint(x.view(64, 64), cpu).item() != fingerprint(x, cpu).item()  # and the shape
    assert fingerprint(None, cpu).item() != fingerprint(torch.zeros(0), cpu).item()
