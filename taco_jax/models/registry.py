"""The model class of each family, and `make_model` (one place that maps a config to its module)."""

from taco_jax.models.base import CausalLM, CausalLMConfig
from taco_jax.models.gpt2 import GPT
from taco_jax.models.qwen import Qwen

#: The model class of each family (`CausalLMConfig.family`).
MODELS: dict[str, type[CausalLM]] = {"gpt2": GPT, "qwen": Qwen}


def make_model(cfg: CausalLMConfig, ctx=None, *, rngs, tensor_size: int = 1) -> CausalLM:
    """The model of `cfg`'s family (`MODELS`); `tensor_size` = the tensor axis it will run on.
    Raises ValueError for a config that is not a `CausalLMConfig` of a known family."""
    family = getattr(cfg, "family", None)
    if family not in MODELS:
        raise ValueError(f"no model for config type {type(cfg).__name__} (family {family!r}; known: {sorted(MODELS)})")
    return MODELS[family](cfg, ctx, rngs=rngs, tensor_size=tensor_size)
