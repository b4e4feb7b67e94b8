"""The model class of each family, `make_model` (one place that maps a config to its module), and
which presets are published models (`PUBLISHED`)."""

from taco_jax.models.base import CausalLM, CausalLMConfig
from taco_jax.models.gpt2 import GPT
from taco_jax.models.qwen import Qwen

#: Presets that are published models (GPT-2 small / medium, Qwen2.5, Qwen3; `PRESETS`): a run keeps their own vocabulary
#: and context (`TrainConfig.vocab_size`). The other presets are CPU-sized and take their vocabulary from the tokenizer.
PUBLISHED = ("gpt2-124m", "gpt2-350m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-1.7b",
             "qwen3-4b", "qwen3-8b")

#: The model class of each family (`CausalLMConfig.family`).
MODELS: dict[str, type[CausalLM]] = {"gpt2": GPT, "qwen": Qwen}


def make_model(cfg: CausalLMConfig, ctx=None, *, rngs, tensor_size: int = 1) -> CausalLM:
    """The model of `cfg`'s family (`MODELS`); `tensor_size` = the tensor axis it will run on.
    Raises ValueError for a config that is not a `CausalLMConfig` of a known family."""
    family = getattr(cfg, "family", None)
    if family not in MODELS:
        raise ValueError(f"no model for config type {type(cfg).__name__} (family {family!r}; known: {sorted(MODELS)})")
    return MODELS[family](cfg, ctx, rngs=rngs, tensor_size=tensor_size)
