"""Model families: GPT-2 (`gpt2.py`), Qwen2.5 / Qwen3 (`qwen.py`), on one causal-LM skeleton and
config interface (`base.py`: `CausalLM`, `CausalLMConfig`); HF checkpoints (`hf.py`); logits and
generation from loaded weights (`generate.py`: `model, params = load_hf(dir)`)."""

from taco_jax.models.base import CausalLM, CausalLMConfig
from taco_jax.models.generate import InferenceModel, generate, load_hf
from taco_jax.models.gpt2 import GPT, GPTConfig
from taco_jax.models.gpt2 import PRESETS as GPT_PRESETS
from taco_jax.models.qwen import PRESETS as QWEN_PRESETS
from taco_jax.models.qwen import Qwen, QwenConfig
from taco_jax.models.registry import MODELS, PUBLISHED, make_model

#: Every named preset, GPT and Qwen.
PRESETS = {**GPT_PRESETS, **QWEN_PRESETS}

__all__ = ["DECAY_BY_NAME", "GPT", "MODELS", "PRESETS", "PUBLISHED", "CausalLM", "CausalLMConfig", "GPTConfig",
           "InferenceModel", "Qwen", "QwenConfig", "count_params", "decays", "generate", "get_config", "load_hf",
           "make_model"]

#: Weight decay by what a parameter is (the last key of its path): kernels of every dense layer and
#: the embedding tables (token `embedding`, GPT-2's position table `wpe`) are decayed; biases and
#: norm scales never (GPT-2 / nanoGPT, Megatron `no_weight_decay_cond`, MaxText).
DECAY_BY_NAME = {"kernel": True, "embedding": True, "wpe": True, "bias": False, "scale": False}


def decays(path) -> bool:
    """Whether the parameter at `path` (a pytree key path or a tuple of names) gets weight decay, by
    its name (`DECAY_BY_NAME`), never by its rank (GPT-2's fused QKV bias [3, H, hd] is a bias); the
    same in the model's and the pipeline's layout.
    Raises: ValueError for a parameter name with no decay rule (a new parameter must be classified)."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    name = names[-1] if names else ""
    if name not in DECAY_BY_NAME:
        raise ValueError(f"parameter {'/'.join(names)!r} has no weight-decay rule (name {name!r}); "
                         f"known names: {sorted(DECAY_BY_NAME)}")
    return DECAY_BY_NAME[name]


def get_config(name: str, **overrides):
    """A named preset (see `PRESETS`) with field overrides. Raises ValueError for an unknown name."""
    import dataclasses

    if name not in PRESETS:
        raise ValueError(f"model={name!r} is not a known preset; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def count_params(cfg: CausalLMConfig) -> int:
    """Parameter count of `cfg`'s model without vocabulary padding (the published count):
    `cfg.n_params()`. Allocates nothing."""
    return cfg.n_params()
