"""Datasets and batching: Shakespeare's plays as BPE tokens."""

from taco_jax.data.shakespeare import (
    DEFAULT_VAL_PLAYS,
    EOT,
    TextDataset,
    available_plays,
    batch_iterator,
    eval_batches,
    load_shakespeare,
)

__all__ = [
    "DEFAULT_VAL_PLAYS",
    "EOT",
    "TextDataset",
    "available_plays",
    "batch_iterator",
    "eval_batches",
    "load_shakespeare",
]
