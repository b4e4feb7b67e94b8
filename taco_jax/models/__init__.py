"""Model families: GPT-2 (`gpt2.py`), Qwen2.5 / Qwen3 (`qwen.py`)."""

from taco_jax.models.gpt2 import GPT, GPTConfig
from taco_jax.models.gpt2 import PRESETS as GPT_PRESETS
from taco_jax.models.qwen import PRESETS as QWEN_PRESETS
from taco_jax.models.qwen import Qwen, QwenConfig

#: Every named preset, GPT and Qwen.
PRESETS = {**GPT_PRESETS, **QWEN_PRESETS}

__all__ = ["GPT", "GPTConfig", "PRESETS", "Qwen", "QwenConfig", "get_config", "make_model"]


def get_config(name: str, **overrides):
    """A named preset (see `PRESETS`) with field overrides. Raises ValueError for an unknown name."""
    import dataclasses

    if name not in PRESETS:
        raise ValueError(f"model={name!r} is not a known preset; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def make_model(cfg, ctx=None, *, rngs, tensor_size: int = 1):
    """The model for a config (`GPTConfig` or `QwenConfig`); `tensor_size` = the tensor axis it will run on."""
    if isinstance(cfg, QwenConfig):
        return Qwen(cfg, ctx, rngs=rngs, tensor_size=tensor_size)
    if isinstance(cfg, GPTConfig):
        return GPT(cfg, ctx, rngs=rngs)
    raise ValueError(f"no model for config type {type(cfg).__name__}")
