"""Hugging Face checkpoint interchange: golden logits of tiny `transformers` models (committed under
tests/fixtures/hf/, written by tests/fixtures/make_hf_fixtures.py), unsharded and on tensor=4 and
stage=2,tensor=2 meshes with the weights loaded straight into the mesh sharding; round trip; errors."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.collectives import CommPolicy
from taco_jax.models import count_params, hf, make_model
from taco_jax.train.step import make_steps

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MODELS = ("gpt2", "qwen2", "qwen3")
TOL = 1e-4  # max abs, float32


def _golden(name):
    g = np.load(FIXTURES / name / "golden.npz")
    return g["ids"], g["logits"]


def _merge(graphdef, state, params):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    return nnx.merge(graphdef, st)


def _cross_entropy(logits, ids):  # float64 mean next-token loss of the golden logits (targets = ids rolled)
    z = np.asarray(logits, np.float64)
    tgt = np.roll(ids, -1, axis=1)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return float(np.mean(lse - np.take_along_axis(z, tgt[..., None], -1)[..., 0]))


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_unsharded(name):
    cfg, params = hf.load_checkpoint(FIXTURES / name)
    ids, want = _golden(name)
    graphdef, state = nnx.split(make_model(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    got = np.asarray(jax.jit(lambda p, x: _merge(graphdef, state, p)(x))(params, jnp.asarray(ids)))
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


def _head_logits(model, x):
    if hasattr(model, "logits"):  # Qwen
        return model.logits(x)
    return model.wte.attend(model.ctx.enter(model.ln_f(x)))  # GPT-2: final LayerNorm, tied head


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("axes", [dict(data=2, tensor=4), dict(data=2, stage=2, tensor=2)])
def test_logits_match_transformers_on_mesh(name, axes):
    """Weights loaded into the mesh sharding (`make_array_from_callback`), vocabulary 99 padded
    Megatron-style to 128 × tp rows: logits equal the golden ones (padded columns dropped) and the
    mesh's loss equals the cross-entropy of the golden logits. tensor=4 replicates the 2 KV heads."""
    tp = axes["tensor"]
    mesh = Mesh(np.asarray(jax.devices()).reshape(tuple(axes.values())), tuple(axes))
    cfg = hf.config_from_hf(FIXTURES / name, vocab_multiple=128 * tp)
    assert cfg.padded_vocab_size == 128 * tp and count_params(cfg) == _n_stored(name)
    pipelined = "stage" in axes
    steps = make_steps(cfg, mesh, CommPolicy.none(), microbatches=2 if pipelined else 1)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), steps.specs)
    params = hf.load_params(FIXTURES / name, cfg, shardings=shardings,
                            stacked_key=steps.staged.layer_key if pipelined else None)
    leaf = jax.tree.leaves(params)[0]
    assert leaf.sharding == jax.tree.leaves(shardings)[0]
    ids, want = _golden(name)

    def local(p, x):
        if not pipelined:
            return _merge(steps.graphdef, steps.abstract_state, p)(x)
        sm = steps.staged  # each stage applies its layers in turn (the pipeline's math, one microbatch)
        outer = sm.outer(p)
        h = sm.embed(outer, x)
        stage = jax.lax.axis_index("stage")
        for s in range(mesh.shape["stage"]):
            h = jax.lax.psum(jnp.where(stage == s, sm.stage_forward(p[sm.layer_key], h), 0), "stage")
        return _head_logits(outer, h)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(steps.specs, P("data")),
                               out_specs=P("data", None, "tensor"), check_vma=False))
    got = np.asarray(fn(params, jnp.asarray(ids)))
    assert got.shape[-1] == cfg.padded_vocab_size
    assert np.all(got[..., cfg.vocab_size:] == np.finfo(np.float32).min)  # padding: no probability
    assert np.abs(got[..., :cfg.vocab_size] - want).max() <= TOL, np.abs(got[..., :cfg.vocab_size] - want).max()
    batch = jnp.asarray(np.concatenate([ids, ids]))  # 2 sequences per data shard (2 microbatches), same mean
    loss = float(jax.jit(steps.loss)(params, batch, jnp.roll(batch, -1, axis=1)))
    np.testing.assert_allclose(loss, _cross_entropy(want, ids), rtol=1e-5)


def _n_stored(name):
    from safetensors import safe_open

    n = 0
    for f in (FIXTURES / name).glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as fh:
            n += sum(int(np.prod(fh.get_slice(k).get_shape())) for k in fh.keys())
    return n


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_identical(name, tmp_path):
    """import -> export -> import: identical parameters, and the exported tensors equal the stored ones
    bit for bit (padding dropped on export; sharded input written as one file)."""
    from safetensors.numpy import load_file

    cfg, params = hf.load_checkpoint(FIXTURES / name, vocab_multiple=64)
    hf.save_hf(tmp_path, cfg, params)
    cfg2, params2 = hf.load_checkpoint(tmp_path, vocab_multiple=64)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    exported = load_file(str(tmp_path / "model.safetensors"))
    original = {}
    for f in (FIXTURES / name).glob("*.safetensors"):
        original.update(load_file(str(f)))
    assert exported.keys() == original.keys()
    for k, v in original.items():
        np.testing.assert_array_equal(exported[k], v, err_msg=k)


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_errors_name_the_tensor_and_shapes(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy("qwen2", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    w = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        hf.load_checkpoint(d)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": w[:, :16]}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(64, 16\), expected "
                                         r"\(64, 32\)"):
        hf.load_checkpoint(d)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": w, "model.extra.weight": w},
              str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['model.extra.weight'\]"):
        hf.load_checkpoint(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not supported"):
        hf.load_checkpoint(d)
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_checkpoint(tmp_path / "nowhere")


def test_stored_tied_head_must_equal_embedding(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy("gpt2", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": tensors["transformer.wte.weight"]}, str(d / "model.safetensors"))
    hf.load_checkpoint(d)  # a stored copy of the tied head is accepted
    save_file({**tensors, "lm_head.weight": tensors["transformer.wte.weight"] + 1}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'transformer.wte.weight'"):
        hf.load_checkpoint(d)


@pytest.mark.parametrize("name", MODELS)
def test_transformers_loads_the_export(name, tmp_path):
    """`transformers` (dev extra; skipped without it) loads the export and reproduces the golden logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, params = hf.load_checkpoint(FIXTURES / name, vocab_multiple=256)
    hf.save_hf(tmp_path, cfg, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    ids, want = _golden(name)
    with torch.no_grad():
        got = model(torch.from_numpy(ids).long()).logits.numpy()
    assert np.abs(got - want).max() <= TOL


def test_gpt2_hub_naming_without_prefix_and_mask_buffers(tmp_path):
    """The `gpt2` hub checkpoint stores `wte.weight`, `h.0.…` (no `transformer.` prefix) and each layer's
    causal-mask buffer `h.N.attn.bias` [1, 1, P, P]: same parameters, buffers skipped."""
    from safetensors.numpy import load_file, save_file

    d = _copy("gpt2", tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(d / "model.safetensors")).items()}
    tensors.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 64, 64), np.float32)) for i in range(2)})
    save_file(tensors, str(d / "model.safetensors"))
    _, want = hf.load_checkpoint(FIXTURES / "gpt2")
    _, got = hf.load_checkpoint(d)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_bfloat16_checkpoint_is_read_exactly(tmp_path):
    """Published Qwen checkpoints are bf16 (numpy has no bf16: read through ml_dtypes): each value is
    the bf16 number stored, widened to float32 exactly. The file is written by hand (safetensors format)."""
    import ml_dtypes
    from safetensors.numpy import load_file

    d = _copy("qwen3", tmp_path)
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (d / "model.safetensors.index.json").unlink()
    header, blobs, offset = {}, [], 0
    for k, v in sorted(tensors.items()):
        b = v.astype(ml_dtypes.bfloat16).tobytes()
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    _, want = hf.load_checkpoint(FIXTURES / "qwen3")
    _, got = hf.load_checkpoint(d)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, w.astype(ml_dtypes.bfloat16).astype(np.float32)),
                 got, want)
