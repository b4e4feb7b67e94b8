"""Which codec each communication site uses: one frozen, hashable policy (COCCL-style per role/op)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from taco_jax import kernels  # noqa: F401  (registers the kernel backends and wire codecs the policy resolves to)
from taco_jax.codec import NONE, TACO, CodecConfig
from taco_jax.codec.dispatch import resolve_codec
from taco_jax.collectives.compressed import ALGORITHMS, REDUCE_DOMAINS  # `psum`'s algorithm and reduce_domain

#: Tensor-axis sites (TACO spec §1): RowParallel output all-reduce ("g" forward), ColumnParallel
#: input all-reduce ("f" backward), sequence-parallel all-gather and reduce-scatter.
TENSOR_SITES = ("ar_fwd", "ar_bwd", "all_gather", "reduce_scatter")
#: Other axes (paper §4): data-parallel gradient synchronisation and pipeline send/recv.
OTHER_SITES = ("dp_grads", "pp_send")
SITES = TENSOR_SITES + OTHER_SITES
#: Version tag of policy files (`CommPolicy.to_json` / `from_json`).
POLICY_FORMAT = "taco_jax.policy/1"


@dataclasses.dataclass(frozen=True)
class CommPolicy:
    """Codec per tensor-parallel communication site, plus a size threshold.

    Attributes:
      ar_fwd, ar_bwd, all_gather, reduce_scatter, dp_grads, pp_send: the codec of each site (`TENSOR_SITES`, `SITES`;
        all_gather: forward of gather and backward of scatter; pp_send: activations forward, gradients backward).
      all_reduce_algorithm: "two_shot" or "one_shot" (`compressed.psum`).
      min_bytes: messages below this many uncompressed bytes use the exact collective; "auto"
        until resolved before tracing (`taco_jax.perf.resolve_min_bytes`).
      reduce_domain, chunks: `compressed.psum`'s, for the two-shot all-reduce.
    Raises: ValueError for an unknown algorithm or reduce_domain, chunks neither "auto" nor an
      integer >= 1, or a negative threshold.
    """

    ar_fwd: CodecConfig = NONE
    ar_bwd: CodecConfig = NONE
    all_gather: CodecConfig = NONE
    reduce_scatter: CodecConfig = NONE
    dp_grads: CodecConfig = NONE
    pp_send: CodecConfig = NONE
    all_reduce_algorithm: str = "two_shot"
    min_bytes: int | str = 0
    reduce_domain: str = "signal"
    chunks: int | str = 1

    def __post_init__(self):
        if self.reduce_domain not in REDUCE_DOMAINS:
            raise ValueError(f"reduce_domain={self.reduce_domain!r} is not supported; choose one of {REDUCE_DOMAINS}")
        if self.chunks != "auto" and not (isinstance(self.chunks, int) and not isinstance(self.chunks, bool)
                                          and self.chunks >= 1):
            raise ValueError(f"chunks={self.chunks!r} must be 'auto' or an integer >= 1")
        if self.all_reduce_algorithm not in ALGORITHMS:
            raise ValueError(
                f"all_reduce_algorithm={self.all_reduce_algorithm!r} is not supported; "
                f"choose one of {ALGORITHMS}"
            )
        if self.min_bytes != "auto" and not (isinstance(self.min_bytes, int) and self.min_bytes >= 0):
            raise ValueError(f"min_bytes={self.min_bytes!r} must be an integer >= 0 or 'auto'")
        for site in SITES:
            if not isinstance(getattr(self, site), CodecConfig):
                raise ValueError(f"{site}={getattr(self, site)!r} must be a CodecConfig")

    def codec_for(self, site: str, x) -> CodecConfig:
        """The codec for a message `x` at `site` (with `site` set, for `nonfinite="error"`), or the exact
        codec (kind "none", the site codec's `transport`) if `x` is below `min_bytes`."""
        if site not in SITES:
            raise ValueError(f"site={site!r} is not one of {SITES}")
        if self.min_bytes == "auto":
            raise ValueError("min_bytes='auto' is unresolved; resolve it before tracing "
                             "(taco_jax.perf.resolve_min_bytes)")
        nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        codec = getattr(self, site)
        if nbytes < self.min_bytes and codec.kind != "none":
            codec = NONE if codec.transport == NONE.transport else dataclasses.replace(NONE, transport=codec.transport)
        if codec.nonfinite == "error" and not codec.site:
            codec = dataclasses.replace(codec, site=site)
        return codec

    def resolve_backends(self, platform: str | None = None, *, n_devices: int = 1,
                         transport: str = "auto") -> CommPolicy:
        """A copy whose codecs are concrete (`codec.dispatch.resolve_codec` on `platform`, default
        jax's); run once before tracing, after `jax.distributed` is initialized (it decides an "auto"
        transport). Raises: ValueError naming the site whose backend, wire or transport cannot run here."""
        new = {}
        for site in SITES:
            try:
                new[site] = resolve_codec(getattr(self, site), platform, n_devices=n_devices,
                                          transport=transport)
            except ValueError as e:
                raise ValueError(f"site {site}: {e}") from e
        return dataclasses.replace(self, **new)

    def with_sites(self, sites: dict) -> CommPolicy:
        """A copy with the codecs of `sites` ({site: CodecConfig or dict of codec fields}) replaced.
        Raises: ValueError naming an unknown site or a bad codec entry."""
        new = {}
        for site, codec in sites.items():
            if site not in SITES:
                raise ValueError(f"site={site!r} is not one of {SITES}")
            if not isinstance(codec, CodecConfig):
                codec = CodecConfig.from_dict(codec, where=f"site {site!r}")
            new[site] = codec
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict:
        """JSON-ready form: {"format", "sites": {site: codec fields}, "all_reduce_algorithm", "min_bytes",
        "reduce_domain", "chunks"}."""
        return {"format": POLICY_FORMAT, "sites": {s: getattr(self, s).to_dict() for s in SITES},
                "all_reduce_algorithm": self.all_reduce_algorithm, "min_bytes": self.min_bytes,
                "reduce_domain": self.reduce_domain, "chunks": self.chunks}

    @classmethod
    def from_dict(cls, d: dict, *, base: CommPolicy | None = None, where: str = "policy") -> CommPolicy:
        """Policy from a dict shaped like `to_dict` (only "sites" required; unknown top-level keys
        are metadata). Absent sites and settings keep `base`'s (default: exact). Format: docs/training.md.
        Raises: ValueError naming the file (`where`) and the unknown site or bad codec field."""
        base = base or cls()
        if not isinstance(d, dict) or not isinstance(d.get("sites"), dict):
            raise ValueError(f"{where}: expected a JSON object with a 'sites' object ({{site: codec fields}}), "
                             f"sites being among {SITES}")
        fmt = d.get("format", POLICY_FORMAT)
        if fmt != POLICY_FORMAT:
            raise ValueError(f"{where}: format={fmt!r} is not supported; expected {POLICY_FORMAT!r}")
        for site in d["sites"]:
            if site not in SITES:
                raise ValueError(f"{where}: site={site!r} is not one of {SITES}")
        kw = {k: d[k] for k in ("all_reduce_algorithm", "min_bytes", "reduce_domain", "chunks") if k in d}
        try:
            return dataclasses.replace(base.with_sites(d["sites"]), **kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e

    @classmethod
    def from_json(cls, path, *, base: CommPolicy | None = None) -> CommPolicy:
        """Reads a policy file written by `to_json` or `taco-jax calibrate` (see `from_dict`)."""
        path = pathlib.Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"policy file {str(path)!r}: cannot read it as JSON ({e})") from e
        return cls.from_dict(d, base=base, where=f"policy file {str(path)!r}")

    def to_json(self, path, **metadata) -> pathlib.Path:
        """Writes `to_dict()` (plus `metadata` keys) to `path` as strict JSON.
        Raises: ValueError for a non-finite float in `metadata`."""
        path = pathlib.Path(path)
        path.write_text(json.dumps({**self.to_dict(), **metadata}, indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def none(cls) -> CommPolicy:
        """Every collective exact (`lax.psum` / `lax.all_gather` / `lax.psum_scatter`)."""
        return cls()

    @classmethod
    def taco(cls, codec: CodecConfig = TACO, **kwargs) -> CommPolicy:
        """The same TACO codec on every tensor-axis site (the paper's setting)."""
        return cls(ar_fwd=codec, ar_bwd=codec, all_gather=codec, reduce_scatter=codec, **kwargs)

