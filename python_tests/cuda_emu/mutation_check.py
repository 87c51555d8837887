"""Mutation check of the CUDA-emulator tests: plant known bugs into a copy of the kernels headers
and assert that the emulated test grid catches every one of them.

For each mutant: copy csrc/ to a temporary folder, replace one exact piece of a kernels header
(csrc/cuda/*.cuh; the piece must occur exactly once, so a refactor of the header makes this script fail
loudly instead of planting nothing), build
the emulator from the copy, run test_cuda_emu.py's tests of that header against it (stopping at the
first failure) and require the failure output to show the expected symptom. A mutant that compiles
and passes the tests is a hole in the harness.

    python python_tests/cuda_emu/mutation_check.py [--only NAME ...] [--tsan] [--keep] [--jobs N]

--tsan also runs the missing-__syncthreads mutants under ThreadSanitizer (thread mode) and requires
a data-race report from each. Exit status 0 only when every mutant was caught.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import emu_build  # noqa: E402

COMMON = "cuda/common.cuh"
FORWARD = "cuda/dppo_loss_forward_kernels.cuh"
BACKWARD = "cuda/dppo_loss_backward_kernels.cuh"
VP_HEADER = "cuda/vocab_parallel_kernels.cuh"
ENTRY = "cuda/entry_points.cuh"


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    old: str
    new: str
    variant: str  # how the tests run against it: fiber | asan | tsan | traffic
    expect: str  # a regex the failing run's output must contain
    select: str = "match_reference"  # pytest -k: which tests run against it
    header: str = FORWARD  # the kernels header (under csrc/) it is planted in
    also: tuple[tuple[str, str, str], ...] = ()  # further (header, old, new) pieces of the same bug


WRONG_VALUES = r"forward \w+: \d+/\d+ off|mask differs away from a threshold|backward .*: \d+ off"
VP_WRONG_VALUES = r"vocab-parallel (stats|forward) [\w -]+: \d+/\d+ off|mask differs away from a threshold"
VP_SELECT = "vocab_parallel_emulated_kernels_match_reference"

MUTANTS = [
    Mutant(
        "no-syncthreads",
        "block reduction reads the other warps' partials without __syncthreads",
        "    sm[2][warp] = st.wsum;\n  }\n  __syncthreads();\n",
        "    sm[2][warp] = st.wsum;\n  }\n",
        "fiber",
        WRONG_VALUES,
        header=COMMON,
    ),
    Mutant(
        "split-range+1",
        "each vocabulary split reads one 16-byte vector past its share (double counting)",
        "  const int64_t ve = vb + per < nvec ? vb + per : nvec;\n  EntState<acc_t> st = empty_state<acc_t>();",
        "  const int64_t ve = vb + per + 1 < nvec ? vb + per + 1 : nvec;\n  EntState<acc_t> st = empty_state<acc_t>();",
        "fiber",
        WRONG_VALUES,
    ),
    Mutant(
        "butterfly-stops-at-2",
        "the warp butterfly stops before offset 1 (lanes merge only half the warp)",
        "  for (int off = kWarp / 2; off > 0; off /= 2) {\n    EntState<acc_t> o;",
        "  for (int off = kWarp / 2; off > 1; off /= 2) {\n    EntState<acc_t> o;",
        "fiber",
        WRONG_VALUES,
        header=COMMON,
    ),
    Mutant(
        "lane-mask-0x7fffffff",
        "the shuffle's member mask leaves out lane 31",
        "    o.mx = __shfl_xor_sync(0xffffffffu, st.mx, off);",
        "    o.mx = __shfl_xor_sync(0x7fffffffu, st.mx, off);",
        "fiber",
        r"__shfl_xor_sync: lane \d+ (calls it with|reads lane \d+, which) mask 0x7fffffff",
        header=COMMON,
    ),
    # Seen twice: by AddressSanitizer past the end of a contiguous tensor, and by the NaN gaps of a
    # strided buffer (which ASan cannot see), each on its own.
    Mutant(
        "backward-tail-v+1 (asan)",
        "the last split's scalar tail of the backward writes one element past the row",
        "  if (s == n_split - 1) backward_scalars(in, out, head + nvec * kVec, v, rg);",
        "  if (s == n_split - 1) backward_scalars(in, out, head + nvec * kVec, v + 1, rg);",
        "asan",
        r"AddressSanitizer: heap-buffer-overflow",
        "match_reference and contig",
        BACKWARD,
    ),
    Mutant(
        "backward-tail-v+1 (gaps)",
        "the same, on rows with gaps between them",
        "  if (s == n_split - 1) backward_scalars(in, out, head + nvec * kVec, v, rg);",
        "  if (s == n_split - 1) backward_scalars(in, out, head + nvec * kVec, v + 1, rg);",
        # The out-of-place gradient is contiguous: there the extra element lands on the next row's first gradient
        # (a NaN read from the input's gap), which the backward check sees before the in-place one's gap test.
        "fiber",
        r"wrote into the gaps between rows|" + WRONG_VALUES,
        "match_reference and strided",
        BACKWARD,
    ),
    Mutant(
        "finish-skips-splits",
        "the finishing kernel's threads stride over 2 x 128 splits (splits 128..255 lost)",
        "  for (int64_t s = threadIdx.x; s < n_split; s += kFinishThreads) {",
        "  for (int64_t s = threadIdx.x; s < n_split; s += 2 * kFinishThreads) {",
        "fiber",
        WRONG_VALUES,
    ),
    Mutant(
        "misaligned-head",
        "the unaligned head is computed for 8-byte instead of 16-byte vectors",
        "  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(scalar_t));",
        "  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) % 8) / sizeof(scalar_t));",
        "fiber",
        r"is not 16-byte aligned",
        header=COMMON,
    ),
]
# The vocabulary-parallel kernels (vocab_parallel_kernels.cuh), against their own tests.
MUTANTS += [
    Mutant(
        "vp-no-syncthreads",
        "vp_block_reduce reads the other warps' partials without __syncthreads",
        "  if (lane == 0) smem[warp] = x;\n  __syncthreads();\n",
        "  if (lane == 0) smem[warp] = x;\n",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        COMMON,
    ),
    Mutant(
        "vp-owned-target<=",
        "a rank takes the first column of the next rank's slice for its own target",
        "(a >= start && a < start + v)",
        "(a >= start && a <= start + v)",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        VP_HEADER,
    ),
    Mutant(
        "vp-target-in-other",
        "the non-target sum keeps the sampled token's term (j != al exclusion dropped)",
        "      if (j != al) sum += e;\n",
        "      sum += e;\n",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        VP_HEADER,
    ),
    Mutant(
        "vp-topk-id<=",
        "a rank gathers the top-K id just past its slice as its own",
        "(id >= 0 && id < v)",
        "(id >= 0 && id <= v)",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        VP_HEADER,
    ),
]
# One per blind spot the grid once had: each compiles, passes the grid as it was before that coverage existed
# (run with --tests <that version> --select match_reference to see it), and is caught by the coverage named.
MUTANTS += [
    # -inf logits inside a vector (make_inputs' row 6), entropy on: exp(-inf) * -inf = 0 * -inf = NaN.
    Mutant(
        "entropy-no-floor (fwd)",
        "the forward's entropy moment uses s - max unfloored: a -inf logit gives 0 * -inf",
        "        const acc_t x = std::fmax(scale_logit(static_cast<acc_t>(pk[u].v[k]), inv_t) - cm, "
        "shift_floor<acc_t>());",
        "        const acc_t x = scale_logit(static_cast<acc_t>(pk[u].v[k]), inv_t) - cm;",
        "fiber",
        WRONG_VALUES,
    ),
    Mutant(
        "entropy-no-floor (bwd)",
        "the backward's entropy term uses log p unfloored: a -inf logit gives 0 * -inf",
        "      const acc_t l = std::fmax(scale_logit(z, inv_t) - lse, shift_floor<acc_t>());",
        "      const acc_t l = scale_logit(z, inv_t) - lse;",
        "fiber",
        WRONG_VALUES,
        header=BACKWARD,
    ),
    # Shares whose length ends in the last quarter of a round (test_vector_loop_residues).
    Mutant(
        "unrolled-loop-bound<=",
        "the forward's unrolled loop runs while its last vector is <= the share's end: "
        "one thread reads one vector past its share when the share ends in the round's last quarter",
        "  for (; vi + (kUnroll - 1) * nthr < ve; vi += kUnroll * nthr) {\n    Pack<scalar_t> pk[kUnroll];\n"
        "    bool has_target",
        "  for (; vi + (kUnroll - 1) * nthr <= ve; vi += kUnroll * nthr) {\n    Pack<scalar_t> pk[kUnroll];\n"
        "    bool has_target",
        "fiber",
        WRONG_VALUES,
        "vector_loop_residues",
    ),
    # More rows than one epilogue block (test_vocab_parallel_more_rows_than_one_block).
    Mutant(
        "vp-epilogue-row=threadIdx",
        "the vocabulary-parallel epilogue indexes rows by threadIdx.x alone "
        "(rows past the first block are never written)",
        "  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;",
        "  const int64_t i = threadIdx.x;",
        "fiber",
        VP_WRONG_VALUES,
        "more_rows_than_one_block",
        VP_HEADER,
    ),
    # Row offsets past 2^31 elements (test_row_offsets_beyond_2_31_elements).
    Mutant(
        "row-offset-int32",
        "the backward forms its input row's offset i * ld in 32 bits",
        "  const scalar_t* in = p.logits + i * p.ld_in;",
        "  const scalar_t* in = p.logits + static_cast<int32_t>(i * p.ld_in);",
        "fiber",
        r"Segmentation fault|" + WRONG_VALUES,
        "beyond_2_31",
        BACKWARD,
    ),
    # Tolerances from the precision: a bf16 gradient rounded toward zero is off by up to one ulp (2^-7
    # relative), which the old bound of 2e-2 of the row's largest gradient let through; half an ulp does not.
    Mutant(
        "bf16-grad-round-toward-zero",
        "the backward's bf16 gradient is truncated to its top 16 bits (round "
        "toward zero, as __float2bfloat16_rz) instead of rounded to nearest",
        "      for (int k = 0; k < kVec; ++k) o.v[k] = static_cast<scalar_t>(rg.nontarget(static_cast<acc_t>("
        "pk[u].v[k])));",
        "      for (int k = 0; k < kVec; ++k) {\n"
        "        acc_t g = rg.nontarget(static_cast<acc_t>(pk[u].v[k]));\n"
        "        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {\n"
        "          uint32_t bits;\n          std::memcpy(&bits, &g, 4);\n          bits &= 0xffff0000u;\n"
        "          std::memcpy(&g, &bits, 4);\n        }\n"
        "        o.v[k] = static_cast<scalar_t>(g);\n      }",
        "fiber",
        WRONG_VALUES,
        header=BACKWARD,
    ),
]
# The blind spots of the grid before the 2^32, vocabulary-parallel -inf, FMA contraction and launch policy
# coverage (issue 29): each passes the grid without that coverage and is caught with it.
MUTANTS += [
    # Rows past 2^32 elements (test_row_offsets_beyond_2_31_and_2_32_elements: rows 4 to 6).
    Mutant(
        "row-offset-uint32",
        "the backward forms its input row's offset i * ld in 32 unsigned bits",
        "  const scalar_t* in = p.logits + i * p.ld_in;",
        "  const scalar_t* in = p.logits + static_cast<uint32_t>(i * p.ld_in);",
        "fiber",
        r"Segmentation fault|" + WRONG_VALUES,
        "beyond_2_31",
        BACKWARD,
    ),
    # -inf logits mixed into a rank's slice with the entropy on (vp_inputs' row 4): exp(-inf) * -inf = NaN.
    Mutant(
        "vp-entropy-no-floor",
        "the vocabulary-parallel statistics use s - max unfloored in the entropy moment",
        "      if (with_ent) x = x > shift_floor<acc_t>() ? x : shift_floor<acc_t>();\n",
        "",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        VP_HEADER,
    ),
    # nvcc contracts a plain product into the subtraction that follows (an FMA): the max logit then gives
    # x = z * inv_t - round(z * inv_t) != 0, the rounding error of a 1e30 logit, exp() of which overflows.
    # Only the contracting (plain) build of the emulator sees it.
    Mutant(
        "scale-logit-plain-multiply",
        "scale_logit multiplies with a plain * instead of __fmul_rn (contracted into an FMA by nvcc)",
        "float scale_logit(float z, float inv_t) { return __fmul_rn(z, inv_t); }",
        "float scale_logit(float z, float inv_t) { return z * inv_t; }",
        "fiber",
        WRONG_VALUES,
        "match_reference and huge",
        COMMON,
    ),
    # The launch policy's split over N, V and SM counts (test_launch_policy_follows_its_rule): rounding
    # target / N down launches fewer blocks than its rule where ceil(target / N), not the work, sets the split.
    Mutant(
        "policy-split-rounds-down",
        "the launch policy's blocks per row round target / N down",
        "  const int64_t wanted = (target_blocks + n - 1) / n;",
        "  const int64_t wanted = target_blocks / n;",
        "fiber",
        r"(forward|backward) N=\d+ V=\d+ SMs=\d+: want split",
        "split_override_sets or launch_policy",
        "cuda/launch_policy.cuh",
    ),
]
# The blind spots of the traffic step and the ASan subset before the edges' shape (V = 26403: heads and tails in
# every dtype, shares of a full unrolled round, backward at split 3) and the ASan residues (issue 29): each
# passes the old traffic step and ASan subset, and moves no value the fiber grid compares.
TRAFFIC_LOGITS = r'stream\["logits"\]\["load'
TRAFFIC_BACKWARD_LOADS = r'src\["load"\] == src\["load_unique"\]'
TRAFFIC_BACKWARD_STORES = r'dst\["store"\] == dst\["store_unique"\]'
MUTANTS += [
    # The unrolled loop's over-read: at the residues where the last row's last block ends its loop at the body's
    # end, the round past the share reads (and in the backward writes) past the tensor.
    Mutant(
        "unrolled-loop-bound<= (asan)",
        "as unrolled-loop-bound<=, seen by AddressSanitizer past the end of the last row",
        "  for (; vi + (kUnroll - 1) * nthr < ve; vi += kUnroll * nthr) {\n    Pack<scalar_t> pk[kUnroll];\n"
        "    bool has_target",
        "  for (; vi + (kUnroll - 1) * nthr <= ve; vi += kUnroll * nthr) {\n    Pack<scalar_t> pk[kUnroll];\n"
        "    bool has_target",
        "asan",
        r"AddressSanitizer: heap-buffer-overflow",
        "vector_loop_residues",
    ),
    # A row's head read as the aligned 16-byte vector that ends where its body begins, the elements before the
    # row masked off: the values are the same, the reads are not (V = 1000 rows have no head).
    Mutant(
        "forward-head-aligned-down (traffic)",
        "the one-block forward reads a row's unaligned head as one aligned-down 16-byte vector (bytes before the "
        "row loaded and masked off)",
        "  add_scalars<kEntropy>(st, row, 0, head, a, p.inv_t);\n  add_scalars<kEntropy>(st, row, head + nvec",
        "  if (head > 0 && threadIdx.x == 0) {\n"
        "    const Pack<scalar_t> hp = load_ro(row + head - kVec);\n"
        "    for (int64_t k = kVec - head; k < kVec; ++k) {\n"
        "      if (k - (kVec - head) == a) continue;\n"
        "      st = merge_state<kEntropy>(st, EntState<acc_t>{scale_logit(static_cast<acc_t>(hp.v[k]), p.inv_t), "
        "acc_t(1), acc_t(0)});\n"
        "    }\n"
        "  }\n"
        "  add_scalars<kEntropy>(st, row, head + nvec",
        "traffic",
        TRAFFIC_LOGITS,
        "traffic_forward",
    ),
    # The unrolled loop (never reached at V = 1000) takes the target's logit from global memory again instead
    # of from the vector it has just loaded: the same value, one extra read per row.
    Mutant(
        "backward-unrolled-target-reread (traffic)",
        "the backward's unrolled loop reads the target logit again from memory instead of its loaded vector",
        "          if (j0 + k == ab) o.v[k] = static_cast<scalar_t>(rg.target(static_cast<acc_t>(pk[u].v[k])));",
        "          if (j0 + k == ab) o.v[k] = static_cast<scalar_t>(rg.target(static_cast<acc_t>(in_body[ab])));",
        "traffic",
        TRAFFIC_BACKWARD_LOADS,
        "traffic_backward",
        BACKWARD,
    ),
    # Zeros are zeros: every block of a padding row writes the whole row, which only the store count shows,
    # and only at split > 1 (the old traffic step's backward ran at split 1).
    Mutant(
        "backward-padding-every-split (traffic)",
        "every block of a padding row zeroes the row's whole body, not its share",
        "    for (int64_t vi = vb + threadIdx.x; vi < ve; vi += blockDim.x) store_stream(",
        "    for (int64_t vi = threadIdx.x; vi < nvec; vi += blockDim.x) store_stream(",
        "traffic",
        TRAFFIC_BACKWARD_STORES,
        "traffic_backward",
        BACKWARD,
    ),
]
# The blind spots of the grid before issue 37's coverage: each passes the grid without it (the emulator as it was and
# test_cuda_emu.py as it was) and is caught with it.
MUTANTS += [
    # The emulated device has a current stream of its own, and a launch on any other is refused.
    Mutant(
        "finish-on-default-stream",
        "the split forward's finishing kernel is launched on the default stream instead of the op's current stream",
        "dim3(kFinishThreads), stream, p,",
        "dim3(kFinishThreads), nullptr, p,",
        "fiber",
        r"not the current stream",
        header=ENTRY,
    ),
    # A kernel's reduction buffer declared static instead of __shared__: on a GPU one global array that every block
    # of the grid races on; the emulator used to poison (and so serialize) it as if it were shared memory.
    Mutant(
        "vp-smem-static-not-shared",
        "the vocabulary-parallel statistics' reduction buffer is a plain static, not __shared__",
        "  __shared__ acc_t smem[kVpThreads / kWarp];",
        "  static acc_t smem[kVpThreads / kWarp];",
        "fiber",
        r"not __shared__",
        VP_SELECT,
        VP_HEADER,
    ),
    # The register cap: each kernel's __launch_bounds__ against launch_policy.cuh's table (a source check: the
    # emulator defines __launch_bounds__ away, only ptxas sees it).
    Mutant(
        "forward-launch-bounds-swapped",
        "the one-block forward asks for the streaming kernels' 4 blocks per SM (a 64-register cap) also with the "
        "entropy, where the policy gives it 3 (85 registers; 64 spilled)",
        "__launch_bounds__(kThreads, (kForwardMinBlocks<scalar_t, kEntropy>))",
        "__launch_bounds__(kThreads, kStreamMinBlocks<scalar_t>)",
        "fiber",
        r"__launch_bounds__",
        "launch_bounds",
    ),
    Mutant(
        "policy-min-blocks-swapped",
        "the policy's blocks per SM of the one-block forward are swapped: 4 with the entropy, 3 without",
        "(kEntropy ? 3 : 4)",
        "(kEntropy ? 4 : 3)",
        "fiber",
        r"blocks per SM",
        "launch_bounds",
        "cuda/launch_policy.cuh",
    ),
    # The vocabulary-parallel epilogue in float: the top-K KL of a near-certain row (q_rest ~ 1e-10) is lost.
    Mutant(
        "vp-epilogue-in-float",
        "the vocabulary-parallel epilogue merges the ranks' statistics in the accumulation dtype, not double",
        "out.store(i, vp_merge_row<double, S>(stats",
        "out.store(i, vp_merge_row<S, S>(stats",
        "fiber",
        r"vocab-parallel topk_kl",
        "vocab_parallel and precision",
        VP_HEADER,
    ),
    # nvcc contracts the plain product into the subtraction (an FMA): at a logit of 1e30 the max column's shifted
    # logit is the product's rounding error, ~1e22, whose exp() overflows. (The grid without the 1e30 rows caught
    # this one too, in one row of one case; every 1e30 case catches it now.)
    Mutant(
        "vp-scale-logit-plain-multiply",
        "the vocabulary-parallel statistics scale a logit with a plain * (contracted into an FMA by nvcc)",
        "acc_t x = scale_logit(static_cast<acc_t>(z[j]), inv_t) - mx;",
        "acc_t x = static_cast<acc_t>(z[j]) * inv_t - mx;",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        VP_HEADER,
    ),
    # log p as s_a - lse: the same number, until the lse is 1e30 and its log-sum term is lost in its rounding (a row
    # whose token ties at a huge max gets log p = 0 for -log(ties)).
    Mutant(
        "vp-logp-from-lse",
        "the vocabulary-parallel epilogue forms log p as s_a - lse instead of (s_a - max) - log(total)",
        "  const T lp = xa_raw - log_total;",
        "  const T lp = s_a - lse;",
        "fiber",
        VP_WRONG_VALUES,
        VP_SELECT,
        "vocab_parallel_math.h",
    ),
    # Rows on grid.y, whose limit is 65,535: right for every batch under it.
    Mutant(
        "vp-rows-on-grid-y",
        "the vocabulary-parallel statistics put a batch's rows on grid.y (at most 65,535) instead of grid.x",
        "  __shared__ acc_t smem[kVpThreads / kWarp];\n  const int64_t i = blockIdx.x;",
        "  __shared__ acc_t smem[kVpThreads / kWarp];\n  const int64_t i = blockIdx.y;",
        "fiber",
        r"invalid grid",
        "65536",
        VP_HEADER,
        also=(
            (
                ENTRY,
                "vp_stats_kernel<scalar_t>, dim3(static_cast<unsigned>(in.n)), dim3(kVpThreads)",
                "vp_stats_kernel<scalar_t>, dim3(1, static_cast<unsigned>(in.n)), dim3(kVpThreads)",
            ),
        ),
    ),
    # Coalescing: each thread reads a contiguous chunk of the slice in the max pass: the same bytes, each once, at
    # many times the 32-byte sectors per warp request.
    Mutant(
        "vp-max-pass-chunked (traffic)",
        "the vocabulary-parallel statistics' max pass gives each thread a contiguous chunk of the slice "
        "(uncoalesced: the lanes of a warp read addresses a chunk apart)",
        "  for (int64_t j = threadIdx.x; j < v; j += kVpThreads) m = nan_max(m, static_cast<acc_t>(z[j]));",
        "  const int64_t chunk = (v + kVpThreads - 1) / kVpThreads;\n"
        "  for (int64_t j = threadIdx.x * chunk; j < v && j < (threadIdx.x + 1) * chunk; ++j) {\n"
        "    m = nan_max(m, static_cast<acc_t>(z[j]));\n  }",
        "traffic",
        r"sectors",
        "traffic_vocab_parallel",
        VP_HEADER,
    ),
]
# The mask direction: only the grid's symmetric cases run the symmetric branch of dppo_math.h's trust_mask.
MUTANTS += [
    Mutant(
        "symmetric-as-advantage",
        "the kernels' trust_mask ignores mask_direction='symmetric' and applies the advantage's side only",
        "  const bool invalid = settings.direction == MaskDirection::kSymmetric ? (up || down) : "
        "(adv > T(0) ? up : down);",
        "  const bool invalid = adv > T(0) ? up : down;",
        "fiber",
        WRONG_VALUES,
        header="dppo_math.h",
    ),
]
# Sampling replay (kept_ids): only the grid's kept cases run these lines, so only they can catch these.
MUTANTS += [
    Mutant(
        "replay-keeps-full-lse",
        "with kept_ids the forward keeps the whole row's lse (the output the backward reads) instead of the kept set's",
        "    lse = kr.lse;\n",
        "",
        "fiber",
        WRONG_VALUES,
    ),
    Mutant(
        "replay-bwd-skips-target",
        "the replay backward never writes the sampled token's column (left at the row's zero)",
        "    if (id < 0 || id >= p.v) continue;  // padding\n",
        "    if (id < 0 || id >= p.v || id == a) continue;  // padding\n",
        "fiber",
        WRONG_VALUES,
        header=BACKWARD,
    ),
]
TSAN_MUTANTS = [
    Mutant(
        "no-syncthreads (tsan)",
        "as no-syncthreads, seen by ThreadSanitizer",
        MUTANTS[0].old,
        MUTANTS[0].new,
        "tsan",
        r"ThreadSanitizer: data race",
        header=COMMON,
    ),
    # Fibers run a block's threads round robin, so every thread reads the previous reduction's shared
    # partials before warp 0 overwrites them: only OS threads under TSan can see this one.
    Mutant(
        "vp-no-syncthreads-before-reuse (tsan)",
        "vp_block_reduce overwrites the shared partials while other warps may still read the previous ones",
        "  __syncthreads();  // smem may still be read by a previous reduction\n",
        "",
        "tsan",
        r"ThreadSanitizer: data race",
        VP_SELECT,
        COMMON,
    ),
]


def plant(mutant: Mutant, dest: Path) -> Path:
    """A copy of csrc/ under dest with the mutant planted; returns the copy's csrc folder."""
    csrc = dest / "csrc"
    shutil.copytree(REPO / "csrc", csrc)
    for header, old, new in ((mutant.header, mutant.old, mutant.new), *mutant.also):
        path = csrc / header
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"mutant {mutant.name}: the piece to replace occurs {count} times in {header} "
                f"(expected once): update mutation_check.py to the header"
            )
        path.write_text(text.replace(old, new))
    return csrc


def run_tests(mutant: Mutant, csrc: Path, out_dir: Path, tests: Path, select: str | None) -> tuple[int, str]:
    variant = {"fiber": "plain"}.get(mutant.variant, mutant.variant)
    emu_build.build(variant, csrc, out_dir)
    env = dict(
        os.environ,
        DPPO_CUDA_EMU=mutant.variant,
        DPPO_CUDA_EMU_CSRC=str(csrc),
        DPPO_CUDA_EMU_OUT=str(out_dir),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("DPPO_CUDA_SPLIT", None)
    env.update(emu_build.sanitizer_env(variant))
    if mutant.variant == "tsan":
        env["OMP_NUM_THREADS"] = "1"
    cmd = emu_build.tsan_prefix() if mutant.variant == "tsan" else []
    # -s: a sanitizer reports on fd 2 and aborts; pytest's output capture would swallow the report.
    cmd += [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tests),
        "-k",
        select or mutant.select,
    ] + (["-s"] if variant != "plain" else [])
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--tsan", action="store_true", help="also the missing-__syncthreads mutants under TSan")
    ap.add_argument("--keep", action="store_true", help="keep the mutant trees and logs")
    ap.add_argument("--jobs", type=int, default=0, help="mutants at once (default: one per core)")
    ap.add_argument(
        "--tests",
        type=Path,
        default=HERE / "test_cuda_emu.py",
        help="the test file to run against each mutant (e.g. an older version of test_cuda_emu.py)",
    )
    ap.add_argument("--select", default=None, help="pytest -k expression for every mutant (default: each its own)")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.tsan:
        mutants += TSAN_MUTANTS
    work = Path(tempfile.mkdtemp(prefix="dppo_mutants_"))
    t_all = time.monotonic()

    def one(i: int, m: Mutant) -> bool:
        t0 = time.monotonic()
        folder = work / f"m{i}"
        csrc = plant(m, folder)
        try:
            rc, out = run_tests(m, csrc, folder / "build", args.tests.resolve(), args.select)
        except RuntimeError as e:  # the mutant did not compile: a broken mutation, not a catch
            rc, out = -1, str(e)
        (folder / "log.txt").write_text(out)
        # pytest exits 1 when tests failed; a sanitizer aborts the process (negative or 134 / 66).
        ran = rc != -1 and rc not in (0, 2, 3, 4, 5)
        caught = ran and re.search(m.expect, out) is not None
        status = "caught" if caught else ("NOT CAUGHT" if rc == 0 else f"NOT CAUGHT AS EXPECTED (exit {rc})")
        msg = f"[mutation] {m.name:24s} {status:12s} {time.monotonic() - t0:5.0f}s  ({m.why})"
        if not caught:
            msg += "\n" + "\n".join(out.splitlines()[-30:])
        print(msg, flush=True)
        return caught

    # Each mutant is a single-threaded build and test run: one per core.
    jobs = args.jobs or max(1, min(len(mutants), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda im: one(*im), enumerate(mutants)))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"[mutation] kept {work}")
    n_caught = sum(results)
    print(f"[mutation] {n_caught}/{len(results)} mutants caught in {time.monotonic() - t_all:.0f}s")
    sys.exit(0 if n_caught == len(results) else 1)


if __name__ == "__main__":
    main()
