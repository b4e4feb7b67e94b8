"""Hugging Face `transformers` checkpoint interchange (safetensors): GPT-2, Qwen2.5, Qwen3.

`load_checkpoint(dir)` reads a local checkpoint directory (`config.json` + `model.safetensors`, or shards listed by
`model.safetensors.index.json`) into this package's model; `save_hf(dir, cfg, params)` writes one that
`transformers.AutoModelForCausalLM.from_pretrained(dir)` loads. Nothing is downloaded.

Layouts (HF -> taco_jax, global shapes; D hidden, H / K query / KV heads, hd head size, F MLP):
- GPT-2 (`GPT2LMHeadModel`, `Conv1D` stores [in, out]): `c_attn.weight` [D, 3D] -> qkv kernel
  [D, 3, H, hd] (q, k, v blocks, heads contiguous); `c_attn.bias` [3D] -> [3, H, hd];
  `attn.c_proj.weight` [D, D] -> [H, hd, D]; `mlp.c_fc` / `mlp.c_proj` as stored; LayerNorm
  weight/bias -> scale/bias; `wte` / `wpe` as stored; `lm_head` tied to `wte` (not stored).
- Qwen2 / Qwen3 (`nn.Linear` stores [out, in]): q/k/v `weight` [N·hd, D] -> kernel [D, N, hd] (transposed), bias
  [N·hd] -> [N, hd]; `o_proj.weight` [D, H·hd] -> [H, hd, D]; gate/up [F, D] -> [D, F]; down [D, F] -> [F, D];
  RMSNorm (and Qwen3's q_norm / k_norm) weight -> scale; `lm_head.weight` [V, D] -> kernel [D, V] when untied.
- Vocabulary padding (`vocab_multiple`, Megatron's make_vocab_size_divisible_by × tp): padded
  rows are zeros on import and dropped on export.

Sources: `transformers` `models/gpt2/modeling_gpt2.py`, `models/qwen2/modeling_qwen2.py`,
`models/qwen3/modeling_qwen3.py`; safetensors format (8-byte little-endian header length, JSON
header of dtype / shape / data_offsets, raw little-endian data)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import struct

import ml_dtypes
import numpy as np

from taco_jax.models.base import CausalLMConfig
from taco_jax.models.gpt2 import GPTConfig
from taco_jax.models.qwen import QwenConfig

#: HF `architectures[0]` -> family handled here.
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}

# GPT-2 checkpoints of older transformers versions store the causal-mask buffers; they are not parameters.
_GPT2_BUFFERS = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


# --- config.json <-> model config


def read_config(path) -> dict:
    """The `config.json` of an HF checkpoint directory. Raises ValueError if it is missing or unreadable."""
    f = pathlib.Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path!s} is not a Hugging Face checkpoint directory: no config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e


def architecture(hf: dict) -> str:
    """'gpt2' | 'qwen2' | 'qwen3' for an HF config dict. Raises ValueError naming an unknown architecture."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise ValueError(f"architectures={archs} (model_type={hf.get('model_type')!r}) is not supported; "
                     f"known: {sorted(ARCHITECTURES)}")


def _require(hf: dict, key: str, want, default=None):
    got = hf.get(key, default)
    if got != want:
        raise ValueError(f"config.json {key}={got!r} is not supported (taco_jax implements {key}={want!r})")


def _rope_theta(hf: dict) -> float:
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = rp.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"config.json rope_type={kind!r} is not supported (only the default RoPE)")
    return float(rp.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def config_from_hf(hf, *, vocab_multiple: int = 1, dtype: str = "float32") -> GPTConfig | QwenConfig:
    """Model config of an HF checkpoint (a directory, or its `config.json` as a dict), its vocabulary
    padded to a multiple of `vocab_multiple`. Raises ValueError naming the config key and value of an
    unknown architecture or a setting taco_jax does not implement."""
    if not isinstance(hf, dict):
        hf = read_config(hf)
    arch = architecture(hf)
    if arch == "gpt2":
        _require(hf, "activation_function", "gelu_new")
        _require(hf, "layer_norm_epsilon", 1e-5)
        _require(hf, "scale_attn_weights", True, True)
        _require(hf, "scale_attn_by_inverse_layer_idx", False, False)
        _require(hf, "tie_word_embeddings", True, True)
        d = hf["n_embd"]
        inner = hf.get("n_inner") or 4 * d
        if inner % d:
            raise ValueError(f"config.json n_inner={inner} is not a multiple of n_embd={d}")
        return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                         n_head=hf["n_head"], n_embd=d, mlp_ratio=inner // d,
                         init_std=hf.get("initializer_range", 0.02), dtype=dtype, vocab_multiple=vocab_multiple)
    _require(hf, "hidden_act", "silu")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=True is not supported (full causal attention only)")
    if arch == "qwen3" and hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=True is not supported for Qwen3 (no o_proj bias here)")
    heads = hf["num_attention_heads"]
    return QwenConfig(
        vocab_size=hf["vocab_size"], emb_dim=hf["hidden_size"], mlp_dim=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rope_theta=_rope_theta(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6), qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tie_word_embeddings=hf.get("tie_word_embeddings", False), block_size=hf["max_position_embeddings"],
        init_std=hf.get("initializer_range", 0.02), dtype=dtype, vocab_multiple=vocab_multiple)


def architecture_label(cfg: CausalLMConfig) -> str:
    """The model's family and sizes in one string, e.g. "qwen3(layers=2, hidden=32, heads=4, kv_heads=2,
    head_dim=16, mlp=64, vocab=99, context=64)" (what a run from `--init-from` records as its model)."""
    if cfg.family == "gpt2":
        return (f"gpt2(layers={cfg.n_layer}, hidden={cfg.n_embd}, heads={cfg.n_head}, "
                f"mlp={cfg.mlp_ratio * cfg.n_embd}, vocab={cfg.vocab_size}, context={cfg.block_size})")
    family = "qwen3" if cfg.qk_norm else "qwen2"
    return (f"{family}(layers={cfg.num_layers}, hidden={cfg.emb_dim}, heads={cfg.num_heads}, "
            f"kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, mlp={cfg.mlp_dim}, vocab={cfg.vocab_size}, "
            f"context={cfg.block_size}"
            f"{', tied' if cfg.tie_word_embeddings else ''})")


def hf_config(cfg: CausalLMConfig) -> dict:
    """The `config.json` dict `transformers` builds this model from (float32, eager attention)."""
    if cfg.family == "gpt2":
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size,
                    n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_inner=cfg.mlp_ratio * cfg.n_embd, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    initializer_range=cfg.init_std, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    scale_attn_weights=True, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                    dtype="float32")
    qwen3 = cfg.qk_norm
    if qwen3 == cfg.qkv_bias or (not qwen3 and cfg.head_dim * cfg.num_heads != cfg.emb_dim):
        raise ValueError(f"QwenConfig(qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, head_dim={cfg.head_dim}) is "
                         f"neither a Qwen2 (bias, no QK-norm, head_dim = D/H) nor a Qwen3 (QK-norm, no bias) model")
    return dict(architectures=["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
                model_type="qwen3" if qwen3 else "qwen2", vocab_size=cfg.vocab_size, hidden_size=cfg.emb_dim,
                intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_theta=cfg.rope_theta,
                tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, use_sliding_window=False,
                initializer_range=cfg.init_std, attention_dropout=0.0, dtype="float32")


# --- parameter map


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: HF tensor `name` of shape `hf_shape` <-> model pure-dict `path` of `shape`.

    model = pad((hf.T if transpose else hf).reshape(unpadded shape)) along `vocab_axis`."""

    name: str
    hf_shape: tuple[int, ...]
    path: tuple
    shape: tuple[int, ...]  # model shape, padded
    transpose: bool = False
    vocab_axis: int | None = None
    vocab_size: int = 0

    def to_model(self, a: np.ndarray) -> np.ndarray:
        a = a.T if self.transpose else a
        if self.vocab_axis is None:
            return a.reshape(self.shape)
        unpadded = list(self.shape)
        unpadded[self.vocab_axis] = self.vocab_size
        a = a.reshape(unpadded)
        pad = [(0, 0)] * a.ndim
        pad[self.vocab_axis] = (0, self.shape[self.vocab_axis] - self.vocab_size)
        return np.pad(a, pad)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        if self.vocab_axis is not None:
            a = np.take(a, np.arange(self.vocab_size), axis=self.vocab_axis)
        if self.transpose:
            return a.reshape(self.hf_shape[::-1]).T
        return a.reshape(self.hf_shape)


def param_map(cfg: CausalLMConfig) -> list[Entry]:
    """Every parameter of `cfg`'s model with its HF tensor name (no prefix-free variants) and layout."""
    e = []
    if cfg.family == "gpt2":
        d, h, hd, f, v = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.mlp_ratio * cfg.n_embd, cfg.vocab_size
        pv = cfg.padded_vocab_size
        e.append(Entry("transformer.wte.weight", (v, d), ("wte", "embedding"), (pv, d), vocab_axis=0, vocab_size=v))
        e.append(Entry("transformer.wpe.weight", (cfg.block_size, d), ("wpe",), (cfg.block_size, d)))
        for i in range(cfg.n_layer):
            p, n = ("h", i), f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                e.append(Entry(n + ln + ".weight", (d,), (*p, ln, "scale"), (d,)))
                e.append(Entry(n + ln + ".bias", (d,), (*p, ln, "bias"), (d,)))
            e += [Entry(n + "attn.c_attn.weight", (d, 3 * d), (*p, "attn", "qkv", "kernel"), (d, 3, h, hd)),
                  Entry(n + "attn.c_attn.bias", (3 * d,), (*p, "attn", "qkv", "bias"), (3, h, hd)),
                  Entry(n + "attn.c_proj.weight", (d, d), (*p, "attn", "proj", "kernel"), (h, hd, d)),
                  Entry(n + "attn.c_proj.bias", (d,), (*p, "attn", "proj", "bias"), (d,)),
                  Entry(n + "mlp.c_fc.weight", (d, f), (*p, "mlp", "fc", "kernel"), (d, f)),
                  Entry(n + "mlp.c_fc.bias", (f,), (*p, "mlp", "fc", "bias"), (f,)),
                  Entry(n + "mlp.c_proj.weight", (f, d), (*p, "mlp", "proj", "kernel"), (f, d)),
                  Entry(n + "mlp.c_proj.bias", (d,), (*p, "mlp", "proj", "bias"), (d,))]
        e.append(Entry("transformer.ln_f.weight", (d,), ("ln_f", "scale"), (d,)))
        e.append(Entry("transformer.ln_f.bias", (d,), ("ln_f", "bias"), (d,)))
        return e
    d, h, k, hd, f, v = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    pv = cfg.padded_vocab_size
    e.append(Entry("model.embed_tokens.weight", (v, d), ("embed_tokens", "embedding"), (pv, d), vocab_axis=0,
                   vocab_size=v))
    for i in range(cfg.num_layers):
        p, n = ("layers", i), f"model.layers.{i}."
        a = (*p, "self_attn")
        e.append(Entry(n + "input_layernorm.weight", (d,), (*p, "input_layernorm", "scale"), (d,)))
        e.append(Entry(n + "post_attention_layernorm.weight", (d,), (*p, "post_attention_layernorm", "scale"), (d,)))
        for proj, heads in (("q_proj", h), ("k_proj", k), ("v_proj", k)):
            e.append(Entry(n + f"self_attn.{proj}.weight", (heads * hd, d), (*a, proj, "kernel"), (d, heads, hd),
                           transpose=True))
            if cfg.qkv_bias:
                e.append(Entry(n + f"self_attn.{proj}.bias", (heads * hd,), (*a, proj, "bias"), (heads, hd)))
        e.append(Entry(n + "self_attn.o_proj.weight", (d, h * hd), (*a, "o_proj", "kernel"), (h, hd, d),
                       transpose=True))
        if cfg.qk_norm:
            e.append(Entry(n + "self_attn.q_norm.weight", (hd,), (*a, "q_norm", "scale"), (hd,)))
            e.append(Entry(n + "self_attn.k_norm.weight", (hd,), (*a, "k_norm", "scale"), (hd,)))
        m = (*p, "mlp")
        e += [Entry(n + "mlp.gate_proj.weight", (f, d), (*m, "gate_proj", "kernel"), (d, f), transpose=True),
              Entry(n + "mlp.up_proj.weight", (f, d), (*m, "up_proj", "kernel"), (d, f), transpose=True),
              Entry(n + "mlp.down_proj.weight", (d, f), (*m, "down_proj", "kernel"), (f, d), transpose=True)]
    e.append(Entry("model.norm.weight", (d,), ("norm", "scale"), (d,)))
    if not cfg.tie_word_embeddings:
        e.append(Entry("lm_head.weight", (v, d), ("lm_head", "kernel"), (d, pv), transpose=True, vocab_axis=1,
                       vocab_size=v))
    return e


# --- safetensors files


class _Tensors:
    """The tensors of a checkpoint directory, read lazily (memory-mapped) by name."""

    def __init__(self, path):
        path = pathlib.Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path!s} holds no *.safetensors file")
        self.where: dict[str, tuple[pathlib.Path, dict, int]] = {}
        for file in files:
            if not file.is_file():
                raise ValueError(f"{file} is listed in model.safetensors.index.json but missing")
            with open(file, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (file, info, 8 + n)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        file, info, base = self.where[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, not one of {sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        a = np.memmap(file, dtype=dt, mode="r", offset=base + start, shape=(end - start) // dt.itemsize)
        return a.reshape(info["shape"])


def _resolve_names(cfg, tensors: _Tensors) -> dict[str, str]:
    """Map expected names (`param_map`) to the names stored: GPT-2 checkpoints may lack the `transformer.` prefix."""
    stored = tensors.names()
    if cfg.family == "gpt2" and "transformer.wte.weight" not in stored and "wte.weight" in stored:
        return {e.name: e.name.removeprefix("transformer.") for e in param_map(cfg)}
    return {e.name: e.name for e in param_map(cfg)}


def _check_names(cfg, tensors: _Tensors, names: dict[str, str]) -> None:
    stored = tensors.names()
    missing = sorted(n for n in names.values() if n not in stored)
    tied = {"lm_head.weight"} if cfg.tied_embeddings else set()
    extra = sorted(n for n in stored - set(names.values()) - tied
                   if not (cfg.family == "gpt2" and _GPT2_BUFFERS.match(n.removeprefix("transformer."))))
    if missing or extra:
        raise ValueError(f"checkpoint tensors do not match the {type(cfg).__name__} model: missing {missing[:8]}"
                         f"{' …' if len(missing) > 8 else ''} ({len(missing)}), unexpected {extra[:8]}"
                         f"{' …' if len(extra) > 8 else ''} ({len(extra)})")
    for e in param_map(cfg):
        got = tensors.shape(names[e.name])
        if got != e.hf_shape:
            raise ValueError(f"tensor {names[e.name]!r} has shape {got}, expected {e.hf_shape} for this config")
    for n in tied & stored:  # a stored tied head must be the embedding, else it would be silently dropped
        emb = names["transformer.wte.weight" if cfg.family == "gpt2" else "model.embed_tokens.weight"]
        if tensors.shape(n) != tensors.shape(emb) or not np.array_equal(tensors.get(n), tensors.get(emb)):
            raise ValueError(f"tensor {n!r} differs from {emb!r} but tie_word_embeddings is set: the checkpoint "
                             f"has an untied LM head")


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# --- public API


def load_params(path, cfg: CausalLMConfig, *, shardings=None, stacked_key: str | None = None) -> dict:
    """The parameters stored in HF checkpoint `path`, as the model's pure dict (float32).

    cfg: the model config (`config_from_hf`; its `vocab_multiple` sets the padding).
    shardings: optional pytree of `jax.sharding.Sharding`: each device receives only its shard; the
      host holds one memory-mapped tensor (or stacked layer parameter) at a time.
    stacked_key: return the pipeline layout (`parallel.staged.StagedModel`).
    Returns: numpy arrays (no shardings) or `jax.Array`s.
    Raises ValueError for missing or unexpected tensors, a shape mismatch (naming the tensor and
    both shapes), an unsupported dtype, or a stored tied LM head that differs from the embedding."""
    import jax

    tensors = _Tensors(path)
    names = _resolve_names(cfg, tensors)
    _check_names(cfg, tensors, names)
    host: dict = {}
    for e in param_map(cfg):
        _set(host, e.path, e)
    if stacked_key is not None:
        layers = host[stacked_key]
        host[stacked_key] = jax.tree.map(lambda *es: es, *[layers[i] for i in range(len(layers))],
                                         is_leaf=lambda x: isinstance(x, Entry))

    def build(entries, sharding=None):
        def value():
            if isinstance(entries, Entry):
                return entries.to_model(np.asarray(tensors.get(names[entries.name]), np.float32))
            return np.stack([e.to_model(np.asarray(tensors.get(names[e.name]), np.float32)) for e in entries])

        a = value()
        if sharding is None:
            return a
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    is_leaf = lambda x: isinstance(x, (Entry, tuple))  # noqa: E731
    if shardings is None:
        return jax.tree.map(build, host, is_leaf=is_leaf)
    return jax.tree.map(build, host, shardings, is_leaf=is_leaf)


def load_checkpoint(path, *, vocab_multiple: int = 1, dtype: str = "float32", shardings=None,
                    stacked_key: str | None = None):
    """(model config, parameters) of the HF checkpoint directory `path` (see `config_from_hf`, `load_params`)."""
    cfg = config_from_hf(path, vocab_multiple=vocab_multiple, dtype=dtype)
    return cfg, load_params(path, cfg, shardings=shardings, stacked_key=stacked_key)


#: Files of a checkpoint folder that `save_hf(..., source=DIR)` copies: the tokenizer and generation settings.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")


#: The end-of-text token of this package's tokenizers (`data.shakespeare.EOT`): the default
#: `eos_token_id` of `save_hf` with a `tokenizer`.
END_OF_TEXT = "<|endoftext|>"


def _to_host(a) -> np.ndarray:
    """A parameter as a float32 numpy array; a global array spread over processes is gathered
    (`multihost_utils.process_allgather`: a collective, every process must call it in the same order)."""
    import jax

    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True), np.float32)
    return np.asarray(a, np.float32)


def _param(params: dict, path: tuple, stacked_key: str | None):
    """The parameter at model-layout `path` of `params`; in the pipeline layout (`stacked_key`), layer `path[1]`'s
    slice of the stacked leaf (`_layer`). Raises KeyError / IndexError / TypeError when it is absent."""
    stacked = stacked_key is not None and path[0] == stacked_key
    node = params
    for k in (path[:1] + path[2:]) if stacked else path:
        node = node[k]
    return _layer(node, path[1]) if stacked else node


def _layer(a, i: int):
    """Layer `i` of a stacked leaf `a` [L, ...]: a numpy slice, or for an array on a mesh the slice cut where it lives,
    sharded as `a` without its layer axis (only that one layer moves). Raises IndexError for i outside [0, L)."""
    import jax
    from jax.sharding import NamedSharding

    if not 0 <= i < a.shape[0]:
        raise IndexError(f"layer {i} of a stack of {a.shape[0]}")
    if not isinstance(a, jax.Array) or not isinstance(a.sharding, NamedSharding):
        return a[i]
    return _layer_slicer(NamedSharding(a.sharding.mesh, jax.sharding.PartitionSpec(*a.sharding.spec[1:])))(a, i)


@functools.lru_cache(maxsize=32)
def _layer_slicer(sharding):
    import jax

    return jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), out_shardings=sharding)


#: The file of an export that says what wrote it (`save_hf(..., record=...)`; `transformers` ignores it): for
#: `taco-jax train --export-hf`, the training step of the weights and the run folder (`read_record`).
EXPORT_RECORD = "taco_jax_export.json"


def read_record(path) -> dict | None:
    """The `EXPORT_RECORD` of export folder `path` (e.g. {"step": 150, "steps": 2000, "preempted": True,
    "run": "/abs/runs/qc"}); None when it has none or it is not a JSON object."""
    try:
        record = json.loads((pathlib.Path(path) / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _umask() -> int:
    """This process's file-creation mask: Linux's /proc line (read without changing it), else set and restored."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_hf(path, cfg: CausalLMConfig, params: dict, *, base_config: dict | None = None,
            source=None, tokenizer=None, eos_token_id: int | None = None,
            stacked_key: str | None = None, record: dict | None = None) -> pathlib.Path:
    """Writes `config.json` + `model.safetensors` (float32, HF layout, vocabulary padding dropped) to
    `path`, which `transformers.AutoModelForCausalLM.from_pretrained(path)` loads, with a tokenizer:
    `source`'s `TOKENIZER_FILES` when that folder has a `tokenizer.json`, else `tokenizer` (a
    `tokenizers` JSON file) with a `tokenizer_config.json`.

    params: the model's pure dict, numpy or (sharded) jax arrays, gathered one tensor at a time
      (multi-process: every process calls this, process 0 writes). stacked_key: pipeline layout.
    base_config: a source `config.json` whose non-architecture keys are kept.
    eos_token_id: the tokenizer's end-of-text id (default: `tokenizer`'s `END_OF_TEXT`), written as bos/eos where
      `base_config` has none, in tokenizer_config.json, and in a generation_config.json unless `source` has one.
    record: JSON-ready facts about the weights, written last as `EXPORT_RECORD` (marking a complete
      export). Files get mode 0666 less the umask.
    Raises ValueError if a parameter is missing or has another shape than `cfg` gives."""
    import jax
    from safetensors.numpy import save_file

    out = pathlib.Path(path)
    writer = jax.process_index() == 0
    tensors = {}
    for e in param_map(cfg):
        try:
            node = _param(params, e.path, stacked_key)
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"parameter {'/'.join(map(str, e.path))} is missing (for {e.name!r})") from err
        if tuple(node.shape) != e.shape:
            raise ValueError(f"parameter {'/'.join(map(str, e.path))} has shape {tuple(node.shape)}, "
                             f"expected {e.shape}")
        a = _to_host(node)
        if writer:
            tensors[e.name] = np.ascontiguousarray(e.to_hf(a))
    if not writer:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / EXPORT_RECORD).unlink(missing_ok=True)  # an earlier export's: not these weights
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o666 & ~_umask())  # safetensors writes 0600; the other files 0666 - umask
    keep = {k: v for k, v in (base_config or {}).items()
            if k not in ("rope_scaling", "torch_dtype", "quantization_config")}
    merged = {**keep, **hf_config(cfg)}
    merged.update({k: keep[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in keep})
    src = pathlib.Path(source) if source else None
    if eos_token_id is None and tokenizer and not (src and (src / "tokenizer.json").is_file()):
        from tokenizers import Tokenizer

        eos_token_id = Tokenizer.from_file(str(tokenizer)).token_to_id(END_OF_TEXT)
    ids = {k: eos_token_id if merged.get(k) is None else merged[k] for k in ("bos_token_id", "eos_token_id")}
    merged.update(ids)
    (out / "config.json").write_text(json.dumps(merged, indent=2))
    _write_tokenizer(out, src, tokenizer, eos_token_id)
    if not (src and (src / "generation_config.json").is_file()) and ids["eos_token_id"] is not None:
        (out / "generation_config.json").write_text(json.dumps(ids, indent=2))
    if record is not None:
        (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2))
    return out


def _write_tokenizer(out: pathlib.Path, src: pathlib.Path | None, tokenizer, eos_token_id: int | None) -> None:
    import shutil

    if src is not None and (src / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        return
    if src is not None and (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    if tokenizer:
        from tokenizers import Tokenizer

        shutil.copyfile(tokenizer, out / "tokenizer.json")
        eot = Tokenizer.from_file(str(tokenizer)).id_to_token(eos_token_id) if eos_token_id is not None else None
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", **({"bos_token": eot, "eos_token": eot} if eot else {})}
        (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
