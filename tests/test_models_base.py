"""The config interface both model families expose (`models.base.CausalLMConfig`): its parameter
count against the model's own parameter tree for every preset, the per-layer sizes the cost model
reads, and the family dispatch of `make_model`."""

import dataclasses

import jax
import pytest
from flax import nnx

from taco_jax import perf
from taco_jax.models import MODELS, PRESETS, CausalLMConfig, count_params, get_config, make_model

pytestmark = pytest.mark.fast


def _tree(cfg) -> dict:
    """The model's parameters as a pure dict of ShapeDtypeStructs (allocates nothing)."""
    return nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))), nnx.Param)[1])


def _size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


#: Every preset; those deeper than 24 layers (a second or more of tracing each) run in `make test` only.
VARIANTS = [pytest.param(name, {}, marks=[pytest.mark.slow] * (get_config(name).n_layers > 24))
            for name in sorted(PRESETS)] + [
    ("gpt2-tiny", dict(mlp_ratio=2, vocab_multiple=384)),
    ("qwen2.5-tiny", dict(tie_word_embeddings=False, vocab_multiple=384)),
    ("qwen3-tiny", dict(tie_word_embeddings=False, vocab_size=1000, vocab_multiple=128)),
]


@pytest.mark.parametrize(("name", "overrides"), VARIANTS)
def test_n_params_is_the_parameter_tree_without_vocabulary_padding(name, overrides):
    cfg = get_config(name, **overrides)
    pad = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model * (1 if cfg.tied_embeddings else 2)
    assert cfg.n_params() == _size(_tree(cfg)) - pad
    assert count_params(cfg) == perf.param_count(cfg) == cfg.n_params()


@pytest.mark.parametrize("name", ["gpt2-tiny", "qwen2.5-tiny", "qwen3-tiny"])
def test_layer_sizes_are_one_layers_kernels_and_the_rest(name):
    cfg = get_config(name, mlp_ratio=2) if name.startswith("gpt") else get_config(name)
    layer = _tree(cfg)[MODELS[cfg.family].pipeline_layers][0]
    kernels = _size([v for p, v in jax.tree_util.tree_flatten_with_path(layer)[0] if p[-1].key == "kernel"])
    matmul, other, _ = cfg.param_sizes()
    assert kernels == matmul == cfg.layer_matmul_params
    assert _size(layer) - kernels == other


def test_interface_values_of_both_families():
    gpt, qwen = get_config("gpt2-124m"), get_config("qwen2.5-7b")
    assert (gpt.family, gpt.n_layers, gpt.d_model, gpt.attn_width, gpt.tied_embeddings) == ("gpt2", 12, 768, 768, True)
    assert (qwen.family, qwen.n_layers, qwen.d_model, qwen.attn_width, qwen.tied_embeddings) == (
        "qwen", 28, 3584, 28 * 128, False)
    assert isinstance(gpt, CausalLMConfig) and isinstance(qwen, CausalLMConfig)


def test_validation_runs_on_construction_and_replace():
    with pytest.raises(ValueError, match="vocab_multiple=0 must be positive"):
        get_config("qwen3-tiny", vocab_multiple=0)
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        dataclasses.replace(get_config("gpt2-tiny"), dtype="float16")


def test_make_model_and_perf_refuse_an_object_that_is_not_a_model_config():
    with pytest.raises(ValueError, match="no model for config type dict"):
        make_model({"n_layer": 2}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cfg of type dict is not a model config"):
        perf.param_count({"n_layer": 2})
