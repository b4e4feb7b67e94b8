"""Model families: GPT-2 (`gpt2.py`)."""

from taco_jax.models.gpt2 import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "get_config"]


def get_config(name: str, **overrides):
    """A named preset (see `PRESETS`) with field overrides. Raises ValueError for an unknown name."""
    import dataclasses

    if name not in PRESETS:
        raise ValueError(f"model={name!r} is not a known preset; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
