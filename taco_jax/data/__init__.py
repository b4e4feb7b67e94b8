"""Datasets and batching: Shakespeare's plays as BPE tokens (`shakespeare.py`), your own corpus as
memory-mapped token files (`prepared.py`, `taco-jax prepare-data`), and the one training stream
over either (`stream.py`)."""

from taco_jax.data.prepared import (
    PreparedData,
    check_data,
    check_resumed_data,
    data_label,
    load_prepared,
    prepare_data,
    tokenizer_hash,
    training_data,
    vocab_size_of,
)
from taco_jax.data.shakespeare import (
    DEFAULT_VAL_PLAYS,
    EOT,
    TextDataset,
    available_plays,
    load_shakespeare,
)
from taco_jax.data.stream import TokenStream, eval_batches, global_batch

__all__ = [
    "DEFAULT_VAL_PLAYS",
    "EOT",
    "PreparedData",
    "TextDataset",
    "TokenStream",
    "available_plays",
    "check_data",
    "check_resumed_data",
    "data_label",
    "eval_batches",
    "global_batch",
    "load_prepared",
    "load_shakespeare",
    "prepare_data",
    "tokenizer_hash",
    "training_data",
    "vocab_size_of",
]
