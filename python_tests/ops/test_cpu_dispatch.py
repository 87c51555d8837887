"""Run-time choice of the CPU kernels' instruction set (csrc/cpu/dispatch.h).

The CPU kernel file is compiled once per instruction set (default, AVX2, AVX-512 on x86-64) and
the running CPU picks one, so a library built on an AVX-512 machine runs on an AVX2-only one.
These tests force every level this CPU can run (DPPO_CPU_CAPABILITY, read once per process, so
each level runs in a child process) and check it against the reference with the op's own oracle
tests; they check the override's errors, and they check in the compiled library that no code
outside the per-ISA builds uses AVX instructions (which would crash an older CPU even at the
"default" level).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dppo_ext
from dppo_ext import _native

REPO = Path(__file__).resolve().parents[2]
LEVELS = ("default", "avx2", "avx512")
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _host_level() -> str:
    """The best level this CPU supports, from /proc/cpuinfo (independently of the library)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "default"
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "default"


HOST = _host_level()
RUNNABLE = LEVELS[: LEVELS.index(HOST) + 1]


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DPPO_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _run_child(code: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=_child_env(**extra), capture_output=True, text=True, timeout=300, cwd=REPO
    )


# Runs in a child: the chosen level, and the op's forward/backward on inputs that cross every
# vector width (V = 4099) in float32 and bfloat16, as raw float64 values for the parent.
_PROBE = r"""
import json, sys, torch
sys.path.insert(0, "python_tests")
from dppo_ext import _native
from dppo_testing import sample_inputs
from dppo_ext import dppo_loss_per_row
res = {"level": _native.library.cpu_capability, "compiled": _native.library.cpu_capabilities}
for dtype in (torch.float32, torch.bfloat16):
    inputs = sample_inputs("cpu", dtype, "topk_tv", "v4099", seed=5)
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = dppo_loss_per_row(**dict(inputs, logits=logits))
    (out.loss.sum() + out.entropy.sum()).backward()
    res[str(dtype)] = {"loss": out.loss.double().tolist(), "lse": out.lse.double().tolist(),
                       "entropy": out.entropy.double().tolist(), "grad": logits.grad.double().flatten().tolist()}
print(json.dumps(res))
"""


def _probe(level: str) -> dict:
    proc = _run_child(_PROBE, DPPO_CPU_CAPABILITY=level)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_build_info_reports_levels():
    lib = _native.library
    assert lib.cpu_capabilities.split(",") == (list(LEVELS) if X86 else ["default"])
    assert dppo_ext.cpu_capability == lib.cpu_capability  # the public name of the level in use
    if os.environ.get("DPPO_CPU_CAPABILITY"):
        assert lib.cpu_capability == os.environ["DPPO_CPU_CAPABILITY"].lower()
    else:
        # The best level compiled and supported, lowered to torch's own choice.
        torch_level = torch.backends.cpu.get_cpu_capability().lower()
        want = min(LEVELS.index(HOST), LEVELS.index(torch_level) if torch_level in LEVELS else 0)
        assert lib.cpu_capability == LEVELS[want]


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="per-ISA builds exist on x86-64 only")
def test_each_level_runs_its_own_code():
    """Each forced level is the one that runs: default and AVX2 use different exp() code
    (at::vec's scalar fallback vs cpu/row_simd.h's vexp), so their float32 outputs differ in the last bits, while both
    stay within the op's tolerance of the float64 reference (checked by the oracle test below)."""
    results = {level: _probe(level) for level in RUNNABLE}
    for level, res in results.items():
        assert res["level"] == level
    if "avx2" in results:
        a, b = results["default"][str(torch.float32)], results["avx2"][str(torch.float32)]
        assert a["grad"] != b["grad"] or a["lse"] != b["lse"], "default and avx2 gave bit-identical results"
        for key in ("loss", "lse", "entropy"):
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_forced_level_matches_reference(level):
    """The op's forward and backward oracle tests (vs dppo_ext.reference), CPU cases that cross
    the vector widths, all modes and dtypes, with DPPO_CPU_CAPABILITY forcing this level."""
    if level not in RUNNABLE:
        pytest.skip(f"this CPU does not support {level} (best: {HOST})")
    select = (
        "cpu and (v129 or v4099 or noncontig or extreme) and "
        "(test_forward_matches_reference or test_backward_matches_reference_autograd)"
    )
    check = f"import dppo_ext._native as n, sys; sys.exit(0 if n.library.cpu_capability == {level!r} else 3)"
    proc = _run_child(check, DPPO_CPU_CAPABILITY=level)
    assert proc.returncode == 0, f"the child did not run at {level}: {proc.stderr[-2000:]}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "python_tests/ops/test_dppo_op.py",
            "-k",
            select,
        ],
        env=_child_env(DPPO_CPU_CAPABILITY=level),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"\b(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 150, proc.stdout[-2000:]  # 4 cases x 4 dtypes x 6 modes x 2


# Runs in a child: the backward op with grad_target = -1, lse = 0 and T = 1 writes exp(z_j) into every column
# but the target's, so it shows the kernels' vector exp (cpu/row_simd.h vexp) element by element.
_EXP_PROBE = r"""
import json, torch
from dppo_ext import _native
special = torch.tensor([0.0, -1e-7, -0.3466, 0.3466 - 0.6932, -86.0, -87.0, -100.0, -1e30, -float("inf"), float("nan")])
z = torch.cat([special, torch.linspace(-86.0, 0.0, 400_000), -torch.rand(100_000) * 4]).float()
z = torch.cat([torch.tensor([0.0]), z, torch.zeros(31)])  # column 0 is the target; whole SIMD steps after it
g = torch.ops.dppo.dppo_loss_backward(-torch.ones(1), None, z[None], torch.zeros(1, dtype=torch.long),
                                      torch.zeros(1), None, 1.0)[0]
print(json.dumps({"level": _native.library.cpu_capability, "z": z[1:].tolist(), "exp": g[1:].tolist()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_vector_exp_within_3_ulp(level):
    """The exp of the forward's sums and the backward (cpu/row_simd.h vexp) is within 3 ulp of exp in float64
    over [-86, 0], exp(0) is exactly 1, -inf and anything below ~-86.6 give 0 (the flush), NaN stays NaN."""
    if level not in RUNNABLE:
        pytest.skip(f"this CPU does not support {level} (best: {HOST})")
    proc = _run_child(_EXP_PROBE, DPPO_CPU_CAPABILITY=level)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["level"] == level
    z = torch.tensor(res["z"], dtype=torch.float32)
    got = torch.tensor(res["exp"], dtype=torch.float32)
    ref = torch.exp(z.double())
    assert got[0] == 1.0
    assert got[7] == 0.0 and got[8] == 0.0 and torch.isnan(got[9])  # -1e30, -inf, NaN
    assert 0.0 <= got[6] < 1e-37  # -100: flushed (or a denormal at the default level's libm exp)
    inside = (z >= -86.0) & (z <= 0.0)
    ulp = torch.nextafter(ref.float(), torch.tensor(float("inf"))).double() - ref.float().double()
    err = ((got.double() - ref).abs() / ulp)[inside]
    assert float(err.max()) <= 3.0, f"max {float(err.max()):.1f} ulp at z = {float(z[inside][err.argmax()])}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sse9", r"DPPO_CPU_CAPABILITY must be one of default, avx2, avx512 \(or unset\), got 'sse9'"),
        ("avx512", r"DPPO_CPU_CAPABILITY=avx512, but this CPU does not support it \(best: avx2\)"),
    ],
)
def test_bad_override_is_a_clear_import_error(value, message):
    if value == "avx512" and HOST != "avx2":
        pytest.skip("needs an AVX2 CPU without AVX-512")
    proc = _run_child("import dppo_ext; dppo_ext.dppo_loss", DPPO_CPU_CAPABILITY=value)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: dppo_ext._C: "), proc.stderr[-2000:]
    assert re.search(message, last), last


# The ISA namespace in a mangled name: dppo::AVX2 / at::vec::AVX512 are spelled 4AVX2 / 6AVX512
# (the first time they appear, also inside template arguments).
_ISA_NAME = re.compile(r"(?<![0-9])(4AVX2|6AVX512)")
# A VEX/EVEX-encoded instruction: a ymm/zmm register, or an xmm-form AVX mnemonic (v-prefixed).
_AVX_INSN = re.compile(r"%[yz]mm\d|\bv(?!erw|err)[a-z0-9]+\s.*%xmm\d|\bv(?!erw|err)[a-z]{3,}\s*$")
_REF = re.compile(r"<([^<>@+]+)(?:@plt)?(?:\+0x[0-9a-f]+)?>")


@pytest.mark.slow
@pytest.mark.skipif(
    not X86 or shutil.which("objdump") is None or shutil.which("readelf") is None,
    reason="needs x86-64, objdump and readelf",
)
def test_no_avx_reachable_from_baseline_code():
    """No code that runs at the default level uses AVX. AVX code must sit in an AVX2/AVX512 build
    (its C++ name carries dppo::AVX2, at::vec::AVX512, ...) or be a function that only such code
    refers to (an inline function of a torch header that only the AVX-512 build emitted out of
    line, say). If baseline code called a copy that an ISA build emitted (the linker keeps one
    copy of each inline function), a pre-AVX2 CPU would crash even at the default level."""
    so = _native.library.__file__
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    relocs = subprocess.run(["readelf", "-Wr", so], capture_output=True, text=True, timeout=60, check=True).stdout
    address_taken = {
        m.split()[4] for m in relocs.splitlines() if len(m.split()) > 4 and ("GLOB_DAT" in m or "R_X86_64_64" in m)
    }
    avx: dict[str, str] = {}  # function -> its first AVX instruction
    referrers: dict[str, set[str]] = {}
    name = ""
    for line in dis.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
            continue
        if not name:
            continue
        if _AVX_INSN.search(line):
            avx.setdefault(name, line.strip())
        for target in _REF.findall(line):
            if target != name:
                referrers.setdefault(target, set()).add(name)
    isa_code = {f for f in avx if _ISA_NAME.search(f)}
    assert len(isa_code) > 10, "found (almost) no AVX code at all: the per-ISA builds are missing or the check is blind"
    unsafe = {
        f: i
        for f, i in avx.items()
        if f not in isa_code
        and (f.split("@")[0] in address_taken or any(not _ISA_NAME.search(r) for r in referrers.get(f, ())))
    }
    assert not unsafe, f"{len(unsafe)} AVX functions reachable from baseline code: " + "; ".join(
        f"{f} ({i}; referred to by {sorted(referrers.get(f, []))[:3]})" for f, i in list(unsafe.items())[:5]
    )
