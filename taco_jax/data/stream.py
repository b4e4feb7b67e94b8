"""The one training data stream (`TokenStream`) and the validation windows, over any 1-D token array:
Shakespeare's in-memory ids or the memory-mapped `train.bin` / `val.bin` of `taco-jax prepare-data`.

A training batch is `batch_size` random windows of `seq_len + 1` tokens (inputs and targets shifted
by one), their starts drawn from numpy's PCG64 generator seeded with `seed`: the same seed gives the
same windows whatever the mesh or the number of processes. In a multi-process run every process
draws the starts of the whole batch (a few integers) but reads the tokens of its own devices' rows
only (`global_batch`), so a memory-mapped file is never read whole.
"""

from __future__ import annotations

import numpy as np


def _check_batch_args(tokens: np.ndarray, batch_size: int, seq_len: int) -> np.ndarray:
    tokens = np.asarray(tokens)  # a np.memmap stays a view of the file (no copy)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if batch_size <= 0:
        raise ValueError(f"{batch_size=} must be positive")
    if seq_len <= 0:
        raise ValueError(f"{seq_len=} must be positive")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"tokens (length {len(tokens)}) must be longer than {seq_len=}")
    return tokens


class TokenStream:
    """Infinite stream of random training windows of `tokens` (int array [n], e.g. a np.memmap),
    deterministic given `seed`. `next(stream)` -> (inputs, targets), int32 numpy [batch_size,
    seq_len], targets = inputs shifted left by one; `stream.next(sharding)` -> the same as global
    `jax.Array`s (`global_batch`). `position` counts the batches drawn; `state()` / `restore(state)`
    save and continue the stream for checkpoints.
    Raises ValueError for tokens that are not 1-D or not longer than `seq_len`, or a non-positive
    `batch_size` / `seq_len`.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int):
        self.tokens = _check_batch_args(tokens, batch_size, seq_len)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rng = np.random.default_rng(seed)
        self.position = 0

    def starts(self) -> np.ndarray:
        """The next batch's window starts, int64 [batch_size] in [0, len(tokens) - seq_len)."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        self.position += 1
        return starts

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        window = self.tokens[self.starts()[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return window[:, :-1], window[:, 1:]

    def next(self, sharding):
        """The next batch as global arrays on `sharding` (see `global_batch`)."""
        return global_batch(self.tokens, self.starts(), self.seq_len, sharding)

    def state(self) -> dict:
        return {"position": self.position, "bit_generator": self.rng.bit_generator.state}

    def restore(self, state: dict) -> None:
        """Continues the stream from `state()`. Raises ValueError for a state of another generator."""
        bg = state["bit_generator"]
        if bg.get("bit_generator") != type(self.rng.bit_generator).__name__:
            raise ValueError(f"data RNG state of {bg.get('bit_generator')!r}, expected "
                             f"{type(self.rng.bit_generator).__name__!r}")
        self.rng.bit_generator.state = bg
        self.position = int(state["position"])


def global_batch(tokens, starts, seq_len: int, sharding):
    """(inputs, targets) int32 [len(starts), seq_len] as global arrays on `sharding`: row i is the
    window `tokens[starts[i] : starts[i] + seq_len + 1]`, split into inputs and targets shifted by one.
    Only rows on this process's devices are read (`jax.make_array_from_callback`)."""
    import jax

    offsets = np.arange(seq_len + 1)
    shape = (len(starts), seq_len)

    def part(shift):
        def rows(index):
            r, c = index if len(index) == 2 else (index[0], slice(None))
            return tokens[np.asarray(starts)[r][:, None] + offsets[shift:shift + seq_len][c]].astype(np.int32)
        return jax.make_array_from_callback(shape, sharding, rows)

    return part(0), part(1)


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, *, max_batches: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed, non-overlapping windows from the start of `tokens` (validation): window i has inputs
    tokens[i*seq_len : (i+1)*seq_len] and targets shifted by one. Returns at most `max_batches`
    (inputs, targets), int32 [batch_size, seq_len]; a final partial batch is dropped.
    """
    tokens = _check_batch_args(tokens, batch_size, seq_len)
    if max_batches is not None and max_batches <= 0:
        raise ValueError(f"{max_batches=} must be positive or None")
    n_batches = (len(tokens) - 1) // seq_len // batch_size
    if n_batches == 0:
        raise ValueError(f"tokens (length {len(tokens)}) too short for one batch of {batch_size=} x {seq_len=}")
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    n = n_batches * batch_size * seq_len
    x = tokens[:n].astype(np.int32).reshape(n_batches, batch_size, seq_len)
    y = tokens[1 : n + 1].astype(np.int32).reshape(n_batches, batch_size, seq_len)
    return [(x[i], y[i]) for i in range(n_batches)]
