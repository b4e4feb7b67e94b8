"""Typed training configuration with presets' defaults and up-front validation."""

from __future__ import annotations

import dataclasses
import math

from taco_jax.codec import NONE, CodecConfig
from taco_jax.codec import config as codec_config
from taco_jax.collectives import CommPolicy
from taco_jax.models import GPTConfig, get_config
from taco_jax.parallel.mesh import parse_mesh
from taco_jax.parallel.pipeline import check_pipeline


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Every field is a CLI flag of `taco-jax train` (underscores -> dashes)."""

    model: str = "gpt2-tiny"  # preset name (taco_jax.models.PRESETS)
    comm: str = "taco"  # tensor-axis communication: "none" (exact) or "taco" (FP8 codec)
    mesh: str = "data=2,tensor=4"  # mesh axes and sizes; product = device count
    sequence_parallel: bool = False  # Megatron sequence parallelism on the tensor axis
    microbatches: int = 1  # pipeline microbatches per data shard (>= stages; > 1 without stages: accumulation)
    schedule: str = "gpipe"  # pipeline schedule: gpipe | 1f1b (parallel/pipeline.py)
    dp_comm: str = "none"  # data-axis gradient all-reduce codec: none | a codec kind (taco, int8, int4, ...)
    pp_comm: str = "none"  # stage-axis send/recv codec: none | a codec kind (taco, tah, int4, ...)
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # global batch (sequences); divided over the data axis
    seq_len: int = 128  # tokens per sequence
    vocab_size: int = 2048  # BPE vocabulary trained on the training plays
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = -1  # linear warmup steps; -1 = 10% of --steps
    weight_decay: float = 0.1  # on matrices only (not biases / LayerNorm)
    grad_clip: float = 1.0  # global-norm clipping
    seed: int = 0  # init and data order (same for every --comm)
    eval_every: int = 50  # steps between validation evaluations (and at the last step)
    eval_batches: int = 8  # validation batches per evaluation (fixed windows of held-out plays)
    # codec (used when comm == "taco")
    fmt: str = "e4m3"  # FP8 format: e4m3 | e5m2
    group_size: int = 128  # G: 32..512
    scale_layout: str = "dual"  # dual (two FP32 scales / group) | folded (one)
    algorithm: str = "two_shot"  # all-reduce: two_shot | one_shot
    min_bytes: int = 0  # messages below this many bytes stay uncompressed
    backend: str = "reference"  # taco group math: reference | pallas | triton | ffi | auto (taco_jax.kernels)
    codec_kind: str = "taco"  # codec kind: taco | fp8_tensor | fp8_group | int8 | int4 | tah (taco_jax.codec)
    group_axis: str = "hidden"  # groups along: hidden (contiguous channels) | token (one channel across tokens)
    nonfinite: str = "propagate"  # NaN/Inf in a message: propagate | zero | error (raise naming the site)
    policy_file: str = ""  # JSON policy (`taco-jax calibrate`); its per-site codecs override --comm's
    init_from: str = ""  # Hugging Face checkpoint dir (config.json + *.safetensors) to start from; sets the model
    export_hf: str = ""  # after training, write the parameters as a Hugging Face checkpoint dir (transformers loads it)
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary to a multiple of this × tensor size (Megatron)
    capture: int = 0  # record the TP messages of N steps (evenly spaced) to <out>/captures (train/capture.py)
    out: str = "runs/default"  # output folder

    def __post_init__(self):
        if self.comm not in ("none", "taco"):
            raise ValueError(f"comm={self.comm!r} is not supported; choose 'none' or 'taco'")
        if self.capture < 0:
            raise ValueError(f"capture={self.capture} must be >= 0 (number of steps to record)")
        for f in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not (self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps):
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be -1 (10% of steps) or in [0, steps={self.steps})"
            )
        axes = self.mesh_axes
        if self.batch_size % axes.get("data", 1):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by data={axes.get('data', 1)}")
        check_pipeline(self.model_config.n_layer, axes.get("stage", 1), self.microbatches, self.schedule)
        if self.capture and (axes.get("stage", 1) > 1 or self.microbatches > 1):
            raise ValueError(f"capture={self.capture} needs the unpipelined layout (stage=1, microbatches=1)")
        if self.batch_size % (axes.get("data", 1) * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by data × microbatches = "
                             f"{axes.get('data', 1)} × {self.microbatches}")
        if self.seq_len > self.model_config.block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={self.model_config.block_size}")
        self.model_config.check_tensor_parallel(axes.get("tensor", 1), sequence_parallel=self.sequence_parallel,
                                                seq_len=self.seq_len)
        _ = self.policy  # validates the codec fields

    @property
    def warmup(self) -> int:
        """Warmup steps actually used (`warmup_steps`, or 10% of `steps` when it is -1)."""
        return self.steps // 10 if self.warmup_steps == -1 else self.warmup_steps

    @property
    def mesh_axes(self) -> dict[str, int]:
        return parse_mesh(self.mesh)

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh_axes.values())

    @property
    def model_config(self) -> GPTConfig:
        """The model: `--init-from`'s config.json, else the preset with our tokenizer's vocabulary; its
        vocabulary padded to a multiple of make_vocab_size_divisible_by × tensor size (Megatron)."""
        multiple = self.make_vocab_size_divisible_by * self.mesh_axes.get("tensor", 1)
        if self.init_from:
            from taco_jax.models.hf import config_from_hf

            return config_from_hf(self.init_from, vocab_multiple=multiple)
        return get_config(self.model, vocab_size=self.vocab_size, vocab_multiple=multiple)

    @property
    def codec(self) -> CodecConfig:
        return CodecConfig(kind=self.codec_kind, fmt=self.fmt, group_size=self.group_size,
                           scale_layout=self.scale_layout, backend=self.backend, group_axis=self.group_axis,
                           nonfinite=self.nonfinite)

    def axis_codec(self, kind: str) -> CodecConfig:
        """Codec of the data / stage axis (`--dp-comm`, `--pp-comm`): NONE, or `kind` with this run's
        group size, FP8 format and non-finite policy, and Hadamard smoothing where the kind offers it."""
        if kind == "none":
            return NONE
        kw = dict(kind=kind, fmt=self.fmt, group_size=self.group_size, nonfinite=self.nonfinite)
        if kind in getattr(codec_config, "OPTIONAL_HADAMARD_KINDS", ()):
            kw["hadamard"] = True
        return CodecConfig(**kw)

    @property
    def policy(self) -> CommPolicy:
        if self.comm == "none":
            policy = CommPolicy.none()
        else:
            policy = CommPolicy.taco(self.codec, all_reduce_algorithm=self.algorithm, min_bytes=self.min_bytes)
        policy = dataclasses.replace(policy, dp_grads=self.axis_codec(self.dp_comm),
                                     pp_send=self.axis_codec(self.pp_comm))
        if self.policy_file:  # per-site codecs from `taco-jax calibrate` (unknown site -> ValueError)
            policy = dataclasses.replace(policy, all_reduce_algorithm=self.algorithm, min_bytes=self.min_bytes)
            policy = CommPolicy.from_json(self.policy_file, base=policy)
        if self.capture:
            policy = dataclasses.replace(policy, capture=True)
        return policy
