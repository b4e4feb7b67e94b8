"""Typed training configuration with presets' defaults and up-front validation."""

from __future__ import annotations

import dataclasses
import math

from taco_jax.codec import CodecConfig
from taco_jax.collectives import CommPolicy
from taco_jax.models import GPTConfig, get_config
from taco_jax.parallel.mesh import parse_mesh


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Every field is a CLI flag of `taco-jax train` (underscores -> dashes)."""

    model: str = "gpt2-tiny"  # preset name (taco_jax.models.PRESETS)
    comm: str = "taco"  # tensor-axis communication: "none" (exact) or "taco" (FP8 codec)
    mesh: str = "data=2,tensor=4"  # mesh axes and sizes; product = device count
    sequence_parallel: bool = False  # Megatron sequence parallelism on the tensor axis
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # global batch (sequences); divided over the data axis
    seq_len: int = 128  # tokens per sequence
    vocab_size: int = 2048  # BPE vocabulary trained on the training plays
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30  # linear warmup
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
    backend: str = "reference"  # codec implementation
    out: str = "runs/default"  # output folder

    def __post_init__(self):
        if self.comm not in ("none", "taco"):
            raise ValueError(f"comm={self.comm!r} is not supported; choose 'none' or 'taco'")
        for f in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        axes = self.mesh_axes
        if "stage" in axes and axes["stage"] > 1:
            raise ValueError(f"mesh={self.mesh!r}: pipeline stages are not supported by this trainer yet")
        if self.batch_size % axes.get("data", 1):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by data={axes.get('data', 1)}")
        if self.seq_len > self.model_config.block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={self.model_config.block_size}")
        self.model_config.check_tensor_parallel(axes.get("tensor", 1), sequence_parallel=self.sequence_parallel,
                                                seq_len=self.seq_len)
        _ = self.policy  # validates the codec fields

    @property
    def mesh_axes(self) -> dict[str, int]:
        return parse_mesh(self.mesh)

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh_axes.values())

    @property
    def model_config(self) -> GPTConfig:
        return get_config(self.model, vocab_size=self.vocab_size)  # vocabulary = our tokenizer's

    @property
    def codec(self) -> CodecConfig:
        return CodecConfig(fmt=self.fmt, group_size=self.group_size, scale_layout=self.scale_layout,
                           backend=self.backend)

    @property
    def policy(self) -> CommPolicy:
        if self.comm == "none":
            return CommPolicy.none()
        return CommPolicy.taco(self.codec, all_reduce_algorithm=self.algorithm, min_bytes=self.min_bytes)
