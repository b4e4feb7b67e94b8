"""Which codec each communication site uses: one frozen, hashable policy (COCCL-style per role/op)."""

from __future__ import annotations

import dataclasses

import numpy as np

from taco_jax.codec import NONE, TACO, CodecConfig

#: Tensor-axis sites (TACO spec §1): RowParallel output all-reduce ("g" forward), ColumnParallel
#: input all-reduce ("f" backward), sequence-parallel all-gather and reduce-scatter.
TENSOR_SITES = ("ar_fwd", "ar_bwd", "all_gather", "reduce_scatter")
#: Other axes (paper §4): data-parallel gradient synchronisation and pipeline send/recv.
OTHER_SITES = ("dp_grads", "pp_send")
SITES = TENSOR_SITES + OTHER_SITES
ALL_REDUCE_ALGORITHMS = ("two_shot", "one_shot")


@dataclasses.dataclass(frozen=True)
class CommPolicy:
    """Codec per tensor-parallel communication site, plus a size threshold.

    Attributes:
      ar_fwd: codec of the forward all-reduce after RowParallel layers (Megatron "g").
      ar_bwd: codec of the backward all-reduce before ColumnParallel layers (Megatron "f").
      all_gather: codec of sequence-parallel all-gathers (forward of gather, backward of scatter).
      reduce_scatter: codec of sequence-parallel reduce-scatters.
      dp_grads: codec of the data-parallel gradient all-reduce (reduce-scatter + all-gather).
      pp_send: codec of pipeline stage-to-stage send/recv (forward activations and backward
        gradients).
      all_reduce_algorithm: "two_shot" (all-to-all reduce-scatter + all-gather; two
        quantizations) or "one_shot" (all-gather of the whole message; one quantization).
      min_bytes: messages smaller than this (uncompressed bytes) use the exact collective.

    Raises:
      ValueError: for an unknown algorithm or a negative threshold.
    """

    ar_fwd: CodecConfig = NONE
    ar_bwd: CodecConfig = NONE
    all_gather: CodecConfig = NONE
    reduce_scatter: CodecConfig = NONE
    dp_grads: CodecConfig = NONE
    pp_send: CodecConfig = NONE
    all_reduce_algorithm: str = "two_shot"
    min_bytes: int = 0

    def __post_init__(self):
        if self.all_reduce_algorithm not in ALL_REDUCE_ALGORITHMS:
            raise ValueError(
                f"all_reduce_algorithm={self.all_reduce_algorithm!r} is not supported; "
                f"choose one of {ALL_REDUCE_ALGORITHMS}"
            )
        if self.min_bytes < 0:
            raise ValueError(f"min_bytes={self.min_bytes} must be >= 0")
        for site in SITES:
            if not isinstance(getattr(self, site), CodecConfig):
                raise ValueError(f"{site}={getattr(self, site)!r} must be a CodecConfig")

    def codec_for(self, site: str, x) -> CodecConfig:
        """The codec for a message `x` at `site`, or NONE if `x` is below `min_bytes`."""
        if site not in SITES:
            raise ValueError(f"site={site!r} is not one of {SITES}")
        nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        return NONE if nbytes < self.min_bytes else getattr(self, site)

    @classmethod
    def none(cls) -> CommPolicy:
        """Every collective exact (`lax.psum` / `lax.all_gather` / `lax.psum_scatter`)."""
        return cls()

    @classmethod
    def taco(cls, codec: CodecConfig = TACO, **kwargs) -> CommPolicy:
        """The same TACO codec on every tensor-axis site (the paper's setting)."""
        return cls(ar_fwd=codec, ar_bwd=codec, all_gather=codec, reduce_scatter=codec, **kwargs)


def policy_from_name(comm: str, **codec_kwargs) -> CommPolicy:
    """CLI helper: "none" or "taco" (codec fields from `codec_kwargs`)."""
    if comm == "none":
        return CommPolicy.none()
    if comm == "taco":
        return CommPolicy.taco(CodecConfig(**codec_kwargs))
    raise ValueError(f"comm={comm!r} is not supported; choose 'none' or 'taco'")
