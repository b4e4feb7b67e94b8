"""An α–β cost model of (compressed) collectives and of a 3D-parallel training step.

Units everywhere: seconds (s), bytes (B), FLOP, FLOP/s; bandwidths in bytes per second; a message size `nbytes` is
the uncompressed size of the whole message as one rank holds it (all-reduce: the tensor each rank contributes;
all-gather: the gathered tensor; reduce-scatter: the tensor before scattering; send: the tensor sent).

Collective times over `p` ranks on a `Link` (α: s per step, β: s per byte), ring / two-shot
(Thakur, Rabenseifner & Gropp 2005; nccl-tests' bus-bandwidth convention):

    all-reduce       2(p-1)·α + 2(p-1)/p · n·β
    all-gather       (p-1)·α + (p-1)/p · n·β
    reduce-scatter   (p-1)·α + (p-1)/p · n·β
    send             α + n·β

A compressing codec multiplies the moved bytes by its wire ratio r = wire bytes per element / message itemsize
(TACO, G=128, dual scales: 1.0625/4 = 0.266 for FP32, 0.531 for BF16) and adds the codec's own time (`CodecSpeed`: a
fixed cost per call plus bytes / throughput) of the work the algorithm does (`codec_bytes`): two-shot all-reduce
encodes n(1+1/p) and decodes 2n; all-gather encodes n/p and decodes n; reduce-scatter encodes n and decodes n; send
encodes n and decodes n. With `chunks` K > 1 (overlap of codec work and transfers) the model takes max(comm, codec)
+ min(comm, codec)/K, each chunk paying its α.

The step (Megatron-LM layout: Shoeybi et al. 2019, Narayanan et al. 2021) is `step_time`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from taco_jax.codec import NONE, CodecConfig
from taco_jax.collectives.policy import SITES, TENSOR_SITES, CommPolicy
from taco_jax.models import CausalLMConfig

#: Collective operations of the model.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
#: Largest threshold: "never compress" (what `break_even_bytes` returns when compression never pays).
NEVER = 2**62


def _check_pos(name: str, value, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and math.isfinite(value) and (
        value >= 0 if zero_ok else value > 0)
    if not ok:
        raise ValueError(f"{name}={value!r} must be a finite number {'>= 0' if zero_ok else '> 0'}")


@dataclasses.dataclass(frozen=True)
class Link:
    """One α–β link: a transfer of n bytes in one step costs alpha_s (s, latency per algorithm step) + n ·
    beta_s_per_byte (s/B, inverse of the achieved bandwidth per direction); `source`: where the numbers come from.
    Raises: ValueError naming a negative or non-finite value."""

    name: str
    alpha_s: float
    beta_s_per_byte: float
    source: str = ""

    def __post_init__(self):
        _check_pos("alpha_s", self.alpha_s, zero_ok=True)
        _check_pos("beta_s_per_byte", self.beta_s_per_byte, zero_ok=True)

    @classmethod
    def from_bandwidth(cls, name: str, alpha_s: float, bandwidth_Bps: float, source: str = "") -> Link:
        """A link from its latency (s) and achieved bandwidth per direction (bytes/s; inf = free)."""
        if bandwidth_Bps == math.inf:
            return cls(name, alpha_s, 0.0, source)
        _check_pos("bandwidth_Bps", bandwidth_Bps)
        return cls(name, alpha_s, 1.0 / bandwidth_Bps, source)

    @property
    def bandwidth_GBps(self) -> float:
        """Achieved bandwidth per direction, GB/s (1e9 bytes/s); inf for beta = 0."""
        return math.inf if self.beta_s_per_byte == 0 else 1e-9 / self.beta_s_per_byte


@dataclasses.dataclass(frozen=True)
class CodecSpeed:
    """Time of one codec call on n uncompressed bytes: overhead_s (s, kernel launch / dispatch) + n / (GBps · 1e9), with
    encode_GBps / decode_GBps the throughput in GB/s (1e9 B/s) of uncompressed input / output; `source`: where the
    numbers come from. Raises: ValueError naming a non-positive throughput or a negative overhead."""

    encode_GBps: float
    decode_GBps: float
    overhead_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        _check_pos("encode_GBps", self.encode_GBps)
        _check_pos("decode_GBps", self.decode_GBps)
        _check_pos("overhead_s", self.overhead_s, zero_ok=True)

    def encode_s(self, nbytes: float, calls: int = 1) -> float:
        """Seconds to encode `nbytes` uncompressed bytes in `calls` calls."""
        return calls * self.overhead_s + nbytes / (self.encode_GBps * 1e9)

    def decode_s(self, nbytes: float, calls: int = 1) -> float:
        """Seconds to decode to `nbytes` uncompressed bytes in `calls` calls."""
        return calls * self.overhead_s + nbytes / (self.decode_GBps * 1e9)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of GPU (or CPU device) and its links: `peak_flops` (dense matmul peak of one device in the training
    dtype, FLOP/s), `mfu` (model FLOPs utilisation, 0 < mfu <= 1), `gpus_per_node` (devices sharing the `intra` link;
    `inter`: between nodes), `codec` ({backend name: `CodecSpeed`}; a missing backend uses "default").
    Raises: ValueError naming a bad value."""

    name: str
    peak_flops: float
    mfu: float
    gpus_per_node: int
    intra: Link
    inter: Link
    codec: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        _check_pos("peak_flops", self.peak_flops)
        if not (isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1):
            raise ValueError(f"mfu={self.mfu!r} must be in (0, 1]")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r} must be an integer >= 1")

    def codec_speed(self, codec: CodecConfig) -> CodecSpeed:
        """The `CodecSpeed` of `codec`'s backend (or "default"). Raises ValueError if neither is declared."""
        speed = self.codec.get(codec.backend, self.codec.get("default"))
        if speed is None:
            raise ValueError(f"hardware {self.name!r} declares no codec speed for backend={codec.backend!r} "
                             f"(known: {sorted(self.codec)})")
        return speed


# Collectives
def _check_op(op: str, p: int, nbytes) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    if not (isinstance(p, (int, np.integer)) and p >= 1):
        raise ValueError(f"p={p!r} must be an integer >= 1 (ranks on the axis)")
    _check_pos("nbytes", nbytes, zero_ok=True)


def wire_ratio(codec: CodecConfig, itemsize: int = 4) -> float:
    """Wire bytes / uncompressed bytes of `codec` on a message of `itemsize`-byte elements (large-message
    limit; 1.0 for the identity). Raises ValueError for an itemsize other than 2 or 4."""
    if itemsize not in (2, 4):
        raise ValueError(f"itemsize={itemsize!r} must be 2 (bf16) or 4 (fp32)")
    return 1.0 if codec.kind == "none" else codec.wire_bytes_per_element() / itemsize


def codec_bytes(op: str, nbytes: float, p: int) -> tuple[float, float, int]:
    """(bytes encoded, bytes decoded, calls per direction) of compressed `op` on an `nbytes` message
    over `p` ranks (two-shot all-reduce: two encodes and two decodes)."""
    _check_op(op, p, nbytes)
    if op == "all_reduce":
        return nbytes * (1 + 1 / p), 2 * nbytes, 2
    if op == "all_gather":
        return nbytes / p, nbytes, 1
    return nbytes, nbytes, 1  # reduce_scatter, send


def comm_time(op: str, nbytes: float, p: int, link: Link, ratio: float = 1.0) -> float:
    """Seconds `op` moves `ratio`·`nbytes` bytes over `p` ranks on `link` (formulas: module docstring).
    p = 1 costs nothing. Raises ValueError naming a bad op, p or size."""
    _check_op(op, p, nbytes)
    if p == 1:
        return 0.0
    n = ratio * nbytes
    if op == "all_reduce":
        return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * n * link.beta_s_per_byte
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) * link.alpha_s + (p - 1) / p * n * link.beta_s_per_byte
    return link.alpha_s + n * link.beta_s_per_byte


def collective_time(op: str, nbytes: float, p: int, link: Link, codec: CodecConfig = NONE,
                    speed: CodecSpeed | None = None, *, itemsize: int = 4, chunks: int = 1) -> float:
    """Predicted seconds of one (compressed) collective `op` (one of `OPS`; all-reduce two-shot when compressed) of an
    `nbytes` message (module docstring) over `p` ranks (send: must be >= 1) on `link`. `codec` NONE: the exact
    collective; otherwise `speed` (of `codec`'s backend) is needed. `itemsize`: bytes per message element (4: FP32, 2:
    BF16). `chunks`: K pipelined chunks (codec work overlapping transfers; 1: sequential).
    Raises: ValueError naming a bad value."""
    if not (isinstance(chunks, int) and chunks >= 1):
        raise ValueError(f"chunks={chunks!r} must be an integer >= 1")
    if codec.kind == "none" or (p == 1 and op != "send"):
        return comm_time(op, nbytes, p, link)
    if speed is None:
        raise ValueError(f"codec {codec.name!r} needs a CodecSpeed (speed=None)")
    comm = comm_time(op, nbytes, p, link, wire_ratio(codec, itemsize))
    comm += (chunks - 1) * (comm_time(op, 0, p, link))  # each extra chunk pays its latency
    enc, dec, calls = codec_bytes(op, nbytes, p)
    work = speed.encode_s(enc, calls * chunks) + speed.decode_s(dec, calls * chunks)
    if chunks == 1:
        return comm + work
    return max(comm, work) + min(comm, work) / chunks


def break_even_bytes(op: str, p: int, link: Link, codec: CodecConfig, speed: CodecSpeed, *,
                     itemsize: int = 4) -> int:
    """Smallest message size (bytes) from which compressed `op` is predicted faster than exact.

    Both times are affine in n (sequential codec, `chunks=1`): t = a + b·n; the answer is
    ceil((a_c - a_e) / (b_e - b_c)) (0 when compression is never slower), or `NEVER` (2**62) when
    the compressed slope is not smaller (compression never pays: keep the site exact).
    Raises: ValueError naming a bad value."""
    if codec.kind == "none":
        return NEVER
    t = lambda n, c: collective_time(op, n, p, link, c, speed, itemsize=itemsize)  # noqa: E731
    a_e, a_c = t(0.0, NONE), t(0.0, codec)
    b_e, b_c = t(1e6, NONE) - a_e, t(1e6, codec) - a_c  # per MB
    if b_c >= b_e:
        return 0 if a_c < a_e and b_c == b_e else NEVER
    n = (a_c - a_e) / (b_e - b_c) * 1e6
    return max(0, math.ceil(n))


# Models: FLOPs, parameters, messages
def _model(cfg) -> CausalLMConfig:
    if not isinstance(cfg, CausalLMConfig):
        raise ValueError(f"cfg of type {type(cfg).__name__} is not a model config (taco_jax.models.CausalLMConfig)")
    return cfg


def param_count(cfg: CausalLMConfig) -> int:
    """Parameters of `cfg`'s model without vocabulary padding (`cfg.n_params()`, exact).
    Raises ValueError for an object that is not a model config."""
    return _model(cfg).n_params()


def flops(cfg, batch: int, seq_len: int, *, backward: bool = True) -> dict:
    """Matmul FLOPs of one step on `batch` sequences of `seq_len` tokens (2 FLOP per multiply-add).

    Per token and layer, forward: 2·(matmul weights) + attention 4·T·(H·hd) (QKᵀ and AV, full
    T×T as Megatron counts it, no causal halving); LM head 2·D·V per token. Backward = 2× forward
    (no recomputation). Returns {"layer": one layer's, "layers": all layers', "head": LM head's,
    "total": FLOP}. Raises ValueError for a non-positive batch or sequence length."""
    for name, v in (("batch", batch), ("seq_len", seq_len)):
        if not (isinstance(v, (int, np.integer)) and v >= 1):
            raise ValueError(f"{name}={v!r} must be a positive integer")
    m = _model(cfg)
    tokens = batch * seq_len
    mult = 3 if backward else 1
    layer = mult * tokens * (2 * m.layer_matmul_params + 4 * seq_len * m.attn_width)
    head = mult * tokens * 2 * m.d_model * m.vocab_size
    return {"layer": float(layer), "layers": float(layer * m.n_layers), "head": float(head),
            "total": float(layer * m.n_layers + head)}


# The training step
@dataclasses.dataclass(frozen=True)
class Layout:
    """A 3D-parallel run (Megatron order: tensor innermost, then data, then stage): `tp`, `dp`, `pp` sizes (GPUs =
    tp·dp·pp); `micro_batch` b sequences of `seq_len` T tokens; `n_micro` m microbatches per step per data rank (1F1B
    bubble (pp-1)/m); `sequence_parallel`: TP sites are all-gather + reduce-scatter (else all-reduce); `act_bytes` per
    activation element on the TP/PP wire and `grad_bytes` per gradient element of the DP all-reduce (2: BF16, 4: FP32);
    `dp_overlap`: fraction (0..1) of the DP all-reduce hidden behind backward compute.
    Raises: ValueError naming a bad value."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    n_micro: int = 1
    sequence_parallel: bool = False
    act_bytes: int = 2
    grad_bytes: int = 4
    dp_overlap: float = 0.0

    def __post_init__(self):
        for f in ("tp", "dp", "pp", "micro_batch", "seq_len", "n_micro"):
            v = getattr(self, f)
            if not (isinstance(v, (int, np.integer)) and v >= 1):
                raise ValueError(f"{f}={v!r} must be a positive integer")
        for f in ("act_bytes", "grad_bytes"):
            if getattr(self, f) not in (2, 4):
                raise ValueError(f"{f}={getattr(self, f)!r} must be 2 or 4")
        if not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"dp_overlap={self.dp_overlap!r} must be in [0, 1]")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp


def links(layout: Layout, hw: Hardware) -> dict:
    """{"tp", "dp", "pp"}: the link each axis crosses (intra-node while the axis's ranks fit in a node)."""
    g = hw.gpus_per_node
    return {"tp": hw.intra if layout.tp <= g else hw.inter,
            "dp": hw.intra if layout.tp * layout.dp <= g else hw.inter,
            "pp": hw.intra if layout.gpus <= g else hw.inter}


def site_messages(cfg, layout: Layout) -> dict:
    """{site: (op, nbytes, ranks, count per step per pipeline stage... )}: every communication site's
    collective, uncompressed message bytes, axis size and how many run per microbatch per stage
    ("per_micro") or per step ("per_step")."""
    m = _model(cfg)
    act = layout.micro_batch * layout.seq_len * m.d_model * layout.act_bytes  # one [b, T, D] tensor
    layers = m.n_layers / layout.pp
    out = {}
    if layout.sequence_parallel:  # fwd: 2 AG + 2 RS per layer; bwd: 2 RS (AG's transpose) + 2 AG
        out["all_gather"] = ("all_gather", act, layout.tp, 4 * layers, "per_micro")
        out["reduce_scatter"] = ("reduce_scatter", act, layout.tp, 4 * layers, "per_micro")
    else:  # fwd: 2 "g" all-reduces per layer; bwd: 2 "f" all-reduces
        out["ar_fwd"] = ("all_reduce", act, layout.tp, 2 * layers, "per_micro")
        out["ar_bwd"] = ("all_reduce", act, layout.tp, 2 * layers, "per_micro")
    if layout.pp > 1:  # activation forward + gradient backward per microbatch
        send = act / layout.tp if layout.sequence_parallel else act
        out["pp_send"] = ("send", send, 2, 2, "per_micro")
    grads = param_count(cfg) / (layout.tp * layout.pp) * layout.grad_bytes
    out["dp_grads"] = ("all_reduce", grads, layout.dp, 1, "per_step")
    return out


def _site_link(site: str, lk: dict) -> Link:
    return lk["tp"] if site in TENSOR_SITES else lk["dp"] if site == "dp_grads" else lk["pp"]


def site_codec(site: str, nbytes: float, policy: CommPolicy) -> CodecConfig:
    """The codec `policy` runs at `site` for a message of `nbytes` in the model: the site's own, or
    exact (NONE) below `min_bytes`. Raises ValueError for an unresolved min_bytes "auto"."""
    if policy.min_bytes == "auto":
        raise ValueError("policy.min_bytes='auto' is unresolved; use taco_jax.perf.resolve_min_bytes first")
    return NONE if nbytes < policy.min_bytes else getattr(policy, site)


def compressed_sites(cfg, layout: Layout, policy: CommPolicy) -> list[str]:
    """The sites `step_time` compresses under `policy` (`site_codec`): those that run in `layout`
    (an axis of size 1 moves nothing; a pipeline send runs with pp > 1) with a codec at their message
    size. Empty: the policy's step is the exact one. Raises ValueError as `site_codec`."""
    return [site for site, (op, nbytes, p, _, _) in site_messages(cfg, layout).items()
            if (p > 1 or op == "send") and site_codec(site, nbytes, policy).kind != "none"]


def _site_time(site, op, nbytes, p, link, policy, hw, layout, chunks=1) -> float:
    codec = site_codec(site, nbytes, policy)
    item = layout.grad_bytes if site == "dp_grads" else layout.act_bytes
    speed = None if codec.kind == "none" else hw.codec_speed(codec)
    return collective_time(op, nbytes, p, link, codec, speed, itemsize=item, chunks=chunks)


def step_time(cfg, layout: Layout, hw: Hardware, policy: CommPolicy | None = None, *, chunks: int = 1) -> dict:
    """Predicted time of one training step (seconds) and its parts.

    Per microbatch and pipeline stage: compute = FLOPs / (tp · pp) / (peak · mfu) (LM head spread
    over the stages), plus every TP collective of the stage's layers (`site_messages`) and, with
    pp > 1, two sends; the 1F1B pipeline runs (m + pp - 1) such slots; then the DP gradient
    all-reduce, (1 - dp_overlap) of it exposed. No overlap of TP communication with compute.

    Returns: {"compute_s", "tp_s", "pp_s" (per microbatch per stage), "dp_s", "step_s",
      "tokens_per_s", "comm_fraction"}.
    Raises: ValueError for a bad config, layout or policy (e.g. an unresolved min_bytes "auto")."""
    policy = policy or CommPolicy()
    f = flops(cfg, layout.micro_batch, layout.seq_len)
    compute = f["total"] / (layout.tp * layout.pp) / (hw.peak_flops * hw.mfu)
    lk = links(layout, hw)
    parts = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    for site, (op, nbytes, p, count, _) in site_messages(cfg, layout).items():
        t = count * _site_time(site, op, nbytes, p, _site_link(site, lk), policy, hw, layout, chunks)
        parts["tp" if site in TENSOR_SITES else "pp" if site == "pp_send" else "dp"] += t
    slot = compute + parts["tp"] + parts["pp"]
    step = (layout.n_micro + layout.pp - 1) * slot + (1 - layout.dp_overlap) * parts["dp"]
    tokens = layout.dp * layout.n_micro * layout.micro_batch * layout.seq_len
    comm = step - (layout.n_micro + layout.pp - 1) * compute
    return {"compute_s": compute, "tp_s": parts["tp"], "pp_s": parts["pp"], "dp_s": parts["dp"], "step_s": step,
            "tokens_per_s": tokens / step, "comm_fraction": comm / step}


def speedup(cfg, layout: Layout, hw: Hardware, policy: CommPolicy, *, chunks: int = 1) -> float:
    """Predicted step-time ratio exact / `policy` (> 1: the policy is faster)."""
    return step_time(cfg, layout, hw)["step_s"] / step_time(cfg, layout, hw, policy, chunks=chunks)["step_s"]


def auto_policy(cfg, layout: Layout, hw: Hardware, candidate: CommPolicy | None = None) -> CommPolicy:
    """`candidate` (default: TACO on the TP sites) with every site the model predicts no gain for
    set exact: a site keeps its codec only if its compressed collective, at this run's message size,
    is predicted faster than the exact one on its link. Sites that do not run in `layout` (e.g.
    pp_send with pp = 1) are set exact too. Raises ValueError from the model."""
    candidate = candidate or CommPolicy.taco()
    if candidate.min_bytes == "auto":
        candidate = dataclasses.replace(candidate, min_bytes=0)
    lk = links(layout, hw)
    msgs = site_messages(cfg, layout)
    new = {}
    for site in SITES:
        keep = False
        if site in msgs and getattr(candidate, site).kind != "none":
            op, nbytes, p, _, _ = msgs[site]
            exact = _site_time(site, op, nbytes, p, _site_link(site, lk), CommPolicy(), hw, layout)
            comp = _site_time(site, op, nbytes, p, _site_link(site, lk), candidate, hw, layout)
            keep = comp < exact
        new[site] = getattr(candidate, site) if keep else NONE
    return dataclasses.replace(candidate, **new)
