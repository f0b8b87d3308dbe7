"""The layout-invariant data loader: windows of one token stream, batched by step.

The stream is cut into non-overlapping windows of seq_len + 1 tokens. Which windows make
up the global batch of step k depends only on (seed, k, global_batch_size), never on how
the job is laid out: each data-parallel rank takes a contiguous slice of that global
batch and splits it into micro-batches (training/data.py builds the stream; the prepared
"tokens" dataset, training/token_files.py, reads it from memory-mapped files instead).
"""

from __future__ import annotations

import torch

from meshtrain.training.config import ConfigError
from meshtrain.training.sft import IGNORE_INDEX


def split_documents(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int):
    """(inputs, labels, positions) of windows of a stream of documents joined by EOS, each
    document on its own ([training] document_masking for stdlib/text/tokens).

    A document starts after each EOS (the EOS ends the one before it, so predicting it
    is still trained) and at the window's first token (a document cut by the window
    start keeps its tail, counted from 0 as if it began there). Positions restart at 0
    at each start; the models turn them into a block-causal mask (models/documents.py).
    The label of an EOS input -- the next document's first token -- cannot be predicted
    from the document the mask confines it to, and no document run alone has it, so it
    is IGNORE_INDEX: the loss is then the mean over what is left (training/step.py)."""
    s = inputs.shape[-1]
    index = torch.arange(s).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    last_start = torch.where(starts, index, 0).cummax(dim=-1).values
    labels = labels.masked_fill(inputs == eos_id, IGNORE_INDEX)
    return inputs, labels, index - last_start


class DataLoader:
    """Random access to the batches of one data-parallel rank.

    Step k's global batch is windows ``order[k*G : (k+1)*G]`` of an endless stream of
    per-epoch permutations (one seeded from (seed, epoch) for each pass over the data).
    Rank r of D takes the r-th contiguous G/D of it, cut into ``grad_accum_steps``
    micro-batches of ``local_batch_size``. Ranks with the same dp_rank (a TP or PP
    group) get identical batches without talking to each other.
    ``eos_id``: the documents in each window are kept apart (`split_documents`), and a
    micro-batch is (inputs, labels, positions); None: one causal stream, as it is.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch_size: int,
                 local_batch_size: int, dp_rank: int, dp_size: int, seed: int, eos_id: int | None = None):
        per_step = dp_size * local_batch_size
        if local_batch_size < 1 or global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of dp_size * "
                f"local_batch_size = {dp_size} * {local_batch_size} = {per_step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.tokens = self._as_tokens(tokens)
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.local_batch_size, self.dp_rank, self.dp_size = local_batch_size, dp_rank, dp_size
        self.seed, self.eos_id = seed, eos_id
        self.num_windows = self._count_windows()
        if self.num_windows < global_batch_size:
            raise ConfigError(f"corpus too small: {self._size_words()}, fewer than one global batch of "
                              f"{global_batch_size}")
        self.position = 0  # the next step to read
        self._orders: dict[int, torch.Tensor] = {}

    # The in-memory token stream; training/token_files.py's loader keeps its files instead.
    _as_tokens = staticmethod(torch.as_tensor)

    def _count_windows(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)  # the tail that doesn't fit is dropped

    def _size_words(self) -> str:
        return f"{len(self.tokens)} tokens make {self.num_windows} windows of seq_len + 1 = {self.seq_len + 1}"

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_size * self.local_batch_size)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            # Mix seed and epoch into one 64-bit seed; distinct (seed, epoch) pairs stay distinct.
            g = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
            # G <= num_windows, so one batch spans at most two epochs: keep just two orders.
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = torch.randperm(self.num_windows, generator=g)
        return self._orders[epoch]

    def _window_ids(self, start: int, count: int) -> torch.Tensor:
        """Window indices at positions [start, start + count) of the endless stream."""
        ids = []
        while count > 0:
            epoch, offset = divmod(start, self.num_windows)
            n = min(count, self.num_windows - offset)
            ids.append(self._order(epoch)[offset:offset + n])
            start, count = start + n, count - n
        return torch.cat(ids)

    def _windows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = ids * (self.seq_len + 1)
        w = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return w[:, :-1], w[:, 1:]  # the label of each token is the next token of its window

    def _columns(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        columns = self._windows(ids)
        return columns if self.eos_id is None else split_documents(*columns, self.eos_id)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of ``step``, [G, seq_len] each (for reference runs)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._columns(self._window_ids(step * self.global_batch_size, self.global_batch_size))

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of ``step``: (inputs, labels), int64 [local_batch_size, seq_len]
        (packed documents add each input's position: training/sft_files.py)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per_rank = self.global_batch_size // self.dp_size
        ids = self._window_ids(step * self.global_batch_size + self.dp_rank * per_rank, per_rank)
        columns = self._columns(ids)  # inputs, labels (and positions: packed documents)
        self.position = step + 1
        return list(zip(*(c.split(self.local_batch_size) for c in columns)))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.batch(self.position)

    def state_dict(self) -> dict:
        # batch(step) is a pure function of these, so a resume needs only the position.
        # dp_size and local_batch_size are left out on purpose: a resume may change layout.
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "num_windows": self.num_windows}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("seed", "seq_len", "global_batch_size", "num_windows"):
            if sd[key] != getattr(self, key):
                raise ConfigError(f"data loader state has {key}={sd[key]} but this run has "
                                 f"{getattr(self, key)}; resuming would read different sequences")
        self.position = sd["position"]
