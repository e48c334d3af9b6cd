"""Norms at the seams of a decoder layer."""

from __future__ import annotations

import mlx.core as mx


def residual_norm(residual: mx.array, branch: mx.array, branch_weight, next_weight: mx.array,
                  branch_eps: float, next_eps: float) -> tuple[mx.array, mx.array]:
    """The seam between two branches of a decoder layer:

        sum    = residual + rms(branch, branch_eps) * branch_weight   (branch_weight given:
                                                                        a sandwich post-norm)
        sum    = residual + branch                                    (branch_weight None)
        normed = rms(sum, next_eps) * next_weight

    residual, branch: float32 [..., hidden]; weights: float32 [hidden]. Returns (sum, normed).
    MLX's own ops on every backend: a fused kernel for this seam measured slower on the H200
    (bench/RESULTS.md, session 3), so it did not replace them.
    """
    branch = branch.astype(mx.float32)
    if branch_weight is not None:
        branch = mx.fast.rms_norm(branch, branch_weight, branch_eps)
    total = residual + branch
    return total, mx.fast.rms_norm(total, next_weight, next_eps)
