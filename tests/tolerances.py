"""The tests' error bounds against the float64 reference, derived once.

Unit roundoff u (half an ulp of 1, the largest relative error of one
rounding to nearest): f16 (11 significant bits) u = 2^-11 ~ 4.9e-4, bf16
(8 bits) u = 2^-8 ~ 3.9e-3, f32 (24 bits) u = 2^-24 ~ 6.0e-8.

A tolerance that one test needs for a reason of its own stays beside that
test, with its reason (tests/test_numerics.py's LSE at scores of 1e8,
tests/test_kv_write.py's rotary embedding, ...).
"""

from __future__ import annotations

# Output: max |out - ref| / max |ref|, per input dtype.
#
# Inputs are exact in their dtype (the reference reads the same values in
# float64). The kernels compute the scores and accumulate P @ V and the
# row sum over keys in f32; two roundings to the input dtype remain: the
# unnormalized probabilities P = exp(s - m) (as ck_tile's, P is in q's
# dtype) and the output. The output is a convex combination of V rows
# (weights P / sum P), so rounding each weight by at most u moves it by at
# most u times the combination of |V| rows, and rounding the output moves
# it by u of itself: 2u ~ 1e-3 for f16, 2 x 2^-8 ~ 8e-3 for bf16, worst
# case. The bounds leave a factor of 2.5 to 5 for what this leaves out:
# the P error is relative to sum P|V| / sum P, which exceeds |out| where V
# rows of opposite signs cancel, and the f32 sums over keys and head dims
# round too (a few hundred to a few thousand terms here: errors of order
# sqrt(n) x 2^-24, far below the f16 and bf16 u). For f32 inputs P and the
# output stay f32 and only those sums remain: ~1e-6 here, bound 1e-5.
OUT_TOL = {"f16": 5e-3, "bf16": 2e-2, "f32": 1e-5}

# LSE: max |lse - ref_lse| over rows with a visible key, absolute (the LSE
# is a log: its error is absolute where the output's is relative).
#
# The online formulation (the GPU kernels' own, run on the CPU too) folds
# scale * log2(e) into Q in the input dtype, so each score carries one
# rounding to the input dtype, relative to its size (|s| <~ 5 here):
# f16 5 x 2^-11 ~ 2.5e-3, bound 5e-3; bf16 5 x 2^-8 ~ 2e-2, bound 3e-2.
# With f32 scores (f32 inputs, and the explicit formulation for every input
# dtype) the LSE is f32 arithmetic only: m + log(sum), sums over up to ~700
# keys and the split-KV merge, bound 1e-4.
LSE_TOL = {"f16": 5e-3, "bf16": 3e-2, "f32": 1e-4}
# The explicit formulation computes its scores in f32 whatever the input
# dtype: its LSE meets the f32 bound.
LSE_TOL_F32_SCORES = LSE_TOL["f32"]
