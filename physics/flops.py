"""Training FLOPs per token: the one definition train.py's MFU, the planner's, the dry
run's (it prints the planner's estimate) and the benchmarks' are all counted in."""

from __future__ import annotations


def flops_per_token(*, params: int, embedding: int, tied_output: int, n_layers: int, dim: int,
                    seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 * W + 12 * L * h * s, where W are
    the weights a token is multiplied by: ``params`` (the whole model's, a tied weight once;
    a mixture of experts' active ones) less its ``embedding`` tables, which are lookups, plus
    ``tied_output``: an embedding table tied to the output layer is also that layer's matmul
    (its size; 0 when the output layer has its own weight, which ``params`` holds already).

    6 per weight: 2 for the forward multiply-add, 4 for the two backward matmuls (input
    and weight gradients). 12 * L * h * s is the attention-score (QK^T) and
    attention-value (PV) matmuls, 2 * 2 * h * s forward times 3 for forward + backward,
    counted over the full s x s matrix *without* halving for the causal mask -- the
    convention MFU numbers are usually quoted in. Whole-model counts, not one rank's shard.
    """
    # Accounting as in PaLM (appendix B) and Chinchilla: activation recomputation is not
    # counted, so MFU measures useful model FLOPs, not hardware FLOPs.
    return 6.0 * (params - embedding + tied_output) + 12.0 * n_layers * dim * seq_len
