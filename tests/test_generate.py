"""Logits and generation from loaded weights (`taco_jax.models.load_hf`, `generate`): greedy decoding
equals `transformers`' `generate` on the same weights (committed fixtures), sampling is seeded and
restricted to the top k, and bad requests are named."""

import pathlib

import numpy as np
import pytest

from taco_jax.models import InferenceModel, generate, load_hf

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, params = load_hf(FIXTURES / name)
    assert isinstance(model, InferenceModel)
    golden = np.load(FIXTURES / name / "golden.npz")
    np.testing.assert_allclose(np.asarray(model.logits(params, golden["ids"])), golden["logits"], atol=1e-4)
    prompt = golden["ids"][:, :4]
    got = generate(model, params, prompt, 12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, attn_implementation="eager").float()
    hf.generation_config.eos_token_id = None  # generate all 12 tokens, as taco_jax does
    mask = torch.ones(prompt.shape, dtype=torch.long)
    want = hf.eval().generate(torch.from_numpy(prompt).long(), attention_mask=mask, max_new_tokens=12,
                              do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(got, want)
    assert got.shape == (2, 16) and got.dtype == np.int32


def test_sampling_is_seeded_and_top_k_restricted():
    model, params = load_hf(FIXTURES / "qwen3")
    prompt = np.array([5, 17, 42], np.int32)
    greedy = generate(model, params, prompt, 8)
    assert greedy.shape == (11,)
    np.testing.assert_array_equal(generate(model, params, prompt, 8, temperature=1.0, top_k=1, seed=3), greedy)
    a = generate(model, params, prompt, 8, temperature=1.5, seed=1)
    np.testing.assert_array_equal(a, generate(model, params, prompt, 8, temperature=1.5, seed=1))
    assert not np.array_equal(a, generate(model, params, prompt, 8, temperature=1.5, seed=2))
    # top_k=3: every sampled token is among the 3 most likely of its step
    s = generate(model, params, prompt, 8, temperature=2.0, top_k=3, seed=0)
    logits = np.asarray(model.logits(params, s[None]))[0]
    for pos in range(3, 11):
        assert s[pos] in np.argsort(logits[pos - 1])[-3:]


def test_bad_requests_are_named():
    model, params = load_hf(FIXTURES / "gpt2")
    with pytest.raises(ValueError, match="exceeds the model's block_size=64"):
        generate(model, params, np.zeros(10, np.int32), 60)
    with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 99\)"):
        generate(model, params, np.array([99]), 1)
    with pytest.raises(ValueError, match="T >= 1"):
        generate(model, params, np.zeros((1, 0), np.int32), 1)
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, params, np.zeros(2, np.int32), 1, temperature=-1)
    for name, bad in (("temperature", float("nan")), ("top_k", -2), ("max_new_tokens", -1)):
        with pytest.raises(ValueError, match=f"^{name}={bad} must be a finite number >= 0$"):
            generate(model, params, np.zeros(2, np.int32), **{"max_new_tokens": 1, name: bad})
