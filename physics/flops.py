"""Training FLOPs per token: what train.py's MFU and the planner's MFU are both counted in."""

from __future__ import annotations


def flops_per_token(num_params: int, num_embedding_params: int, n_layers: int, dim: int,
                    seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 * (N - N_embedding) + 12 * L * h * s.

    6 per weight: 2 for the forward multiply-add, 4 for the two backward matmuls (input
    and weight gradients). The embedding table is a lookup, not a matmul, so it is left
    out; the output projection is a matmul and stays in N (a tied one too: pass only the
    embeddings that are lookups alone). 12 * L * h * s is the
    attention-score (QK^T) and attention-value (PV) matmuls, 2 * 2 * h * s forward times 3
    for forward + backward, counted over the full s x s matrix *without* halving for the
    causal mask -- the convention MFU numbers are usually quoted in.
    Pass the whole model's counts (global, not one rank's shard).
    """
    # Accounting as in PaLM (appendix B) and Chinchilla: activation recomputation is not
    # counted, so MFU measures useful model FLOPs, not hardware FLOPs.
    return 6.0 * (num_params - num_embedding_params) + 12.0 * n_layers * dim * seq_len
