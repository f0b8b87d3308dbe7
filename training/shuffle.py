"""A seeded permutation of [0, n) that is computed, not stored.

The in-memory datasets shuffle with ``torch.randperm(num_windows)``: one int64 per window,
so a corpus of 1e8 windows would cost every rank ~0.8 GB just for the order. Here the
permutation is a function instead: ``permute(i, n, key)`` maps each position to a window
index, and any slice of the order costs only as much as the slice itself.

It is a Feistel network, the construction block ciphers use: split a number of 2b bits
into halves (L, R) and repeat (L, R) -> (R, L ^ F(R)). Each round is invertible whatever
F is, so the whole network is a bijection of [0, 4^b). F is a 64-bit integer hash of the
half and a round key, so the output looks random. To permute [0, n) rather than
[0, 4^b), a result that lands at or past n is sent through the network again ("cycle
walking"): following a cycle of a permutation from a point below n must come back below
n, so this is a bijection of [0, n) too. 4^b < 4n, so it takes fewer than four passes on
average.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # 4 already make a pseudo-random permutation; 2 more are nearly free
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int: round keys from (seed, epoch)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _hash(x: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (numpy wraps array arithmetic mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def round_keys(seed: int, epoch: int) -> list[int]:
    base = _mix(_mix(seed & _M64) ^ (epoch & _M64))
    return [_mix(base + r) for r in range(ROUNDS)]


def permute(positions, n: int, keys: list[int]) -> np.ndarray:
    """The images of ``positions`` (ints in [0, n)) under the permutation that ``keys`` pick."""
    x = np.asarray(positions, dtype=np.uint64).copy()
    if n <= 1:
        return x.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits hold every value below n
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    keys = [np.uint64(k) for k in keys]
    todo = np.ones(len(x), dtype=bool)
    while todo.any():
        v = x[todo]
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_hash(right ^ k) & mask)
        x[todo] = (left << shift) | right
        todo[todo] = x[todo] >= n  # walk on: only the values that fell outside [0, n)
    return x.astype(np.int64)
