"""Shared pieces of the benchmark scripts, one job per module.

- ``inputs``: realistic logits and rollout tensors for a case (``make_inputs``).
- ``contenders``: the ways of computing the loss that the benchmarks compare (``build_contender``).
- ``timing``: one step with forward and backward timed apart, repeats, and the copy pass that every speed
  figure is measured against in the same run (``CopyPass``, GB/s, multiples of a copy).
- ``peak_memory``: measured peaks (CUDA allocator counters; on the CPU the resident set of a fresh process).
- ``machine``: the machine and software the figures came from, with the SIMD level.

The scripts in benchmarks/ put this folder on ``sys.path`` and import ``benchlib``; nothing in the installed
package depends on it.
"""
