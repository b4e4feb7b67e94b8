"""The communication flags of `taco-jax train` (`CommFlags`) and their one mapping to the run's `CommPolicy`."""

from __future__ import annotations

import dataclasses
import warnings

from taco_jax.codec import NONE, CodecConfig, codec_kinds, get_kind
from taco_jax.codec.kinds import registered as registered_kinds
from taco_jax.collectives.policy import SITES, TENSOR_SITES, CommPolicy
from taco_jax.parallel.mesh import DATA, STAGE, TENSOR
from taco_jax.train.settings import FlagWarning, flag_error, int_or_auto, setting

#: The policy sites of the tensor-axis all-reduce: `--algorithm`, `--chunks`, `--reduce-domain` apply there
#: (`collectives.megatron`).
AR_SITES = ("ar_fwd", "ar_bwd")
#: Mesh axis -> the policy sites whose messages travel on it.
AXIS_SITES = {TENSOR: TENSOR_SITES, DATA: ("dp_grads",), STAGE: ("pp_send",)}


@dataclasses.dataclass(frozen=True)
class CommFlags:
    """The communication flags of `taco-jax train`, as typed (each field is a flag: underscores -> dashes).

    `policy()` is the one place they become the run's `CommPolicy`. Precedence, later wins:
      1. `--comm` (with `--codec-kind`, `--fmt`, `--group-size`, `--scale-layout`, `--group-axis`,
         `--nonfinite`, `--backend`) on every tensor-axis site; `--dp-comm` / `--pp-comm` on the data /
         stage axis (with the same `--fmt`, `--group-size`, `--nonfinite` and `--backend`);
      2. `--policy FILE`: the sites it names (sites left out keep step 1's codec; docs/training.md);
      3. `--site SITE:field=value,...` (repeatable): that site's codec with these `CodecConfig` fields.
    """

    comm: str = setting("taco", "tensor-axis codec (every TP site): none (exact) | {kinds}", order=500)
    dp_comm: str = setting("none", "data-axis gradient all-reduce codec: none | {kinds}", order=510)
    pp_comm: str = setting("none", "stage-axis send/recv codec: none | {kinds}", order=520)
    codec_kind: str = setting("taco", "kind of `--comm taco` (= `--comm KIND`; deprecated, write --comm KIND): "
                              "{kinds}", order=530)
    fmt: str = setting("e4m3", "FP8 format, every axis (also --dp-comm / --pp-comm): e4m3 | e5m2", order=540)
    group_size: int = setting(128, "G, every axis (also --dp-comm / --pp-comm): 32..512", order=550)
    scale_layout: str = setting("dual", "taco on the tensor axis: dual (two FP32 scales / group) | folded (one)",
                                order=560)
    group_axis: str = setting("hidden", "tensor axis: groups along hidden (channels) | token (one channel across "
                              "tokens)", order=570)
    nonfinite: str = setting("propagate", "NaN/Inf in a message, every axis: propagate | zero | error (raise naming "
                             "the site)", order=580)
    backend: str = setting("auto", "taco group math: auto (CPU: ffi if built; GPU kernels) | reference | pallas | "
                           "triton | ffi", order=590)
    algorithm: str = setting("two_shot", "compressed all-reduce: two_shot | one_shot", order=600)
    min_bytes: int | str = setting(0, "messages below this many bytes stay uncompressed; auto: the cost model's "
                                   "break-even size", order=610, parse=lambda: int_or_auto("min_bytes", 0),
                                   metavar="BYTES|auto")
    reduce_domain: str = setting("signal", "two-shot taco all-reduce: signal (decode, sum, encode) | hadamard "
                                 "(transformed sum)", order=620)
    chunks: int | str = setting(1, "two-shot all-reduce: independent chunks K >= 1 (pipelining) | auto (from the "
                                "message size)", order=630, parse=lambda: int_or_auto("chunks", 1), metavar="K|auto")
    policy_file: str = setting("", "JSON policy (docs/training.md; `taco-jax calibrate`); overrides the sites it names",
                               order=640, aliases=("--policy",), metavar="FILE")
    site: tuple[str, ...] = setting((), "per-site codec, repeatable: SITE:field=value,... e.g. "
                                    "ar_bwd:fmt=e5m2,group_size=64", order=650, append=True,
                                    metavar="SITE:FIELD=VALUE,...")

    def tensor_codec(self) -> CodecConfig:
        """The codec of every tensor-axis site (`--comm` and the codec flags)."""
        if self.comm not in codec_kinds():
            raise flag_error("comm", f"comm={self.comm!r} is not supported; choose 'none' or a codec kind "
                             f"{codec_kinds()[1:]}")
        if self.codec_kind not in codec_kinds():
            raise flag_error("codec_kind", f"codec_kind={self.codec_kind!r} is not supported; choose one of "
                             f"{codec_kinds()}")
        kind = self.codec_kind if self.comm == "taco" else self.comm
        if self.comm not in ("none", "taco") and self.codec_kind not in ("taco", self.comm):
            raise flag_error("comm", f"comm={self.comm!r} and codec_kind={self.codec_kind!r} disagree; give one of "
                             "them")
        if kind == "none":
            return NONE
        return CodecConfig(kind=kind, fmt=self.fmt, group_size=self.group_size, scale_layout=self.scale_layout,
                           backend=self.backend, group_axis=self.group_axis, nonfinite=self.nonfinite)

    def axis_codec(self, kind: str, flag: str) -> CodecConfig:
        """Codec of the data / stage axis (`--dp-comm`, `--pp-comm`): NONE, or `kind` with this run's
        group size, FP8 format, non-finite policy and backend, and Hadamard smoothing where the kind
        offers it. Raises ValueError naming `flag` for an unknown kind."""
        if kind == "none":
            return NONE
        if kind not in codec_kinds():
            raise flag_error(flag, f"{flag}={kind!r} is not supported; choose one of {codec_kinds()}")
        return CodecConfig(kind=kind, fmt=self.fmt, group_size=self.group_size, nonfinite=self.nonfinite,
                           backend=self.backend, hadamard=get_kind(kind).hadamard == "optional")

    def policy(self) -> CommPolicy:
        """The run's policy (see the class docstring). Raises ValueError naming the bad flag or value;
        a FlagWarning for the deprecated `codec_kind`."""
        tensor = self.tensor_codec()
        policy = CommPolicy(**dict.fromkeys(TENSOR_SITES, tensor), dp_grads=self.axis_codec(self.dp_comm, "dp_comm"),
                            pp_send=self.axis_codec(self.pp_comm, "pp_comm"),
                            all_reduce_algorithm=self.algorithm, min_bytes=self.min_bytes,
                            reduce_domain=self.reduce_domain, chunks=self.chunks)
        if self.policy_file:  # unknown site or field -> ValueError naming the file
            policy = CommPolicy.from_json(self.policy_file, base=policy)
        for spec in self.site:
            name, fields = parse_site(spec)
            policy = policy.with_sites({name: site_codec(getattr(policy, name), fields, spec, self)})
        self._check_effect(policy)
        if self.codec_kind != CommFlags.codec_kind:  # accepted, as before; named once the policy is built
            warnings.warn(f"codec_kind={self.codec_kind!r} (--codec-kind) is deprecated; write --comm "
                          f"{self.codec_kind} (kind={self.codec_kind} in a --site or --policy file)", FlagWarning,
                          stacklevel=3)
        return policy

    def _check_effect(self, policy: CommPolicy) -> None:
        """A codec flag set away from its default must reach a codec of `policy`, so that it is never
        silently ignored. Where the run compresses something, one that reaches none is an error
        (ValueError naming it: `--comm int8 --fmt e5m2`, int8 has no FP8 format); where the whole
        policy is exact (`--comm none`, the baseline of a configured run) a FlagWarning names it. A
        `--policy` file's own all-reduce settings that override a flag, and the two-shot settings with
        `--algorithm one_shot`, are errors too."""
        codecs = [(s, c) for s, c in ((s, getattr(policy, s)) for s in SITES) if c.kind != "none"]
        spec = {c.kind: get_kind(c.kind) for _, c in codecs}
        chunked = self.chunks != 1
        applies = {  # flag -> (whether some codec takes its value, what it needs)
            "codec_kind": (self.comm in ("taco", self.codec_kind), "--comm taco (it names the kind of that codec; "
                           "or write --comm KIND)"),
            "fmt": (any(spec[c.kind].fp8 and c.fmt == self.fmt for _, c in codecs), _need("fmt")),
            "group_size": (any((spec[c.kind].grouped or chunked) and c.group_size == self.group_size
                               for _, c in codecs), _need("group_size")),
            "scale_layout": (any(c.scale_layout == self.scale_layout for s, c in codecs if s in TENSOR_SITES),
                             "a taco codec on the tensor axis"),
            "group_axis": (any(c.group_axis == self.group_axis for s, c in codecs if s in TENSOR_SITES),
                           "a codec on the tensor axis"),
            "nonfinite": (any(c.nonfinite == self.nonfinite for _, c in codecs), "a codec"),
            "backend": (any(spec[c.kind].backends and c.backend == self.backend for _, c in codecs),
                        _need("backend")),
            "reduce_domain": (any(spec[c.kind].transform_reduce for s, c in codecs if s in AR_SITES),
                              "a tensor-axis all-reduce codec that sums in its transform domain (" +
                              ", ".join(k.name for k in registered_kinds() if k.transform_reduce) + ")"),
            **{f: (any(s in AR_SITES for s, _ in codecs), "a codec on the tensor-axis all-reduce (ar_fwd, ar_bwd)")
               for f in ("algorithm", "chunks")},
            "min_bytes": (bool(codecs), "a codec"),
        }
        default = CommFlags()
        for flag, field in (("algorithm", "all_reduce_algorithm"), ("min_bytes", "min_bytes"),
                            ("reduce_domain", "reduce_domain"), ("chunks", "chunks")):
            if self.policy_file and getattr(self, flag) != getattr(default, flag) and \
                    getattr(policy, field) != getattr(self, flag):
                raise flag_error(flag, f"{flag}={getattr(self, flag)!r} has no effect: the policy file "
                                 f"{self.policy_file!r} sets {field}={getattr(policy, field)!r}; drop the flag or "
                                 "change the file")
        if self.algorithm == "one_shot":  # the one-shot all-reduce sends whole messages: no chunks, no domain
            for flag in ("chunks", "reduce_domain"):
                if getattr(self, flag) != getattr(default, flag):
                    raise flag_error(flag, f"{flag}={getattr(self, flag)!r} has no effect with algorithm='one_shot' "
                                     "(it applies to the two-shot all-reduce); drop one of them")
        for flag, (reached, needs) in applies.items():
            if getattr(self, flag) == getattr(default, flag) or reached:
                continue
            used = ", ".join(f"{s}={getattr(self, s)!r}" for s in ("comm", "dp_comm", "pp_comm"))
            tail = (" with its --policy / --site (set the field there, e.g. --site ar_bwd:kind=taco,fmt=e5m2)"
                    if self.policy_file or self.site else "")
            msg = f"{flag}={getattr(self, flag)!r} has no effect: it needs {needs}, and this run has {used}{tail}"
            if not codecs:
                warnings.warn(f"{msg}; the run is exact, so it is ignored", FlagWarning, stacklevel=4)
                continue
            raise flag_error(flag, f"{msg}; drop the flag or choose a codec it applies to")


def _need(field: str) -> str:
    """What a codec field (a flag, or a `--site` field) set away from its default needs to take effect."""
    return {"fmt": "a codec with FP8 codes", "group_size": "a codec with per-group scales (or --chunks)",
            "backend": "a codec of a kind with group backends (" +
                       ", ".join(k.name for k in registered_kinds() if k.backends) + ")",
            "hadamard": "a kind whose Hadamard transform is optional"}[field]


def parse_site(spec: str) -> tuple[str, dict]:
    """"ar_bwd:fmt=e5m2,group_size=64" -> ("ar_bwd", {"fmt": "e5m2", "group_size": 64}) (values typed
    like `CodecConfig`'s fields). Raises ValueError naming `spec` for a malformed entry."""
    name, sep, rest = spec.partition(":")
    if not sep or name not in SITES:
        raise ValueError(f"site={spec!r}: write SITE:field=value,... with SITE one of {SITES}")
    types = {f.name: type(f.default) for f in dataclasses.fields(CodecConfig) if f.name != "site"}  # SITE names it
    fields = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in types:
            raise ValueError(f"site={spec!r}: {item!r} is not field=value with a field among {sorted(types)}")
        try:
            if types[key] is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                fields[key] = value.lower() == "true"
            else:
                fields[key] = types[key](value)
        except ValueError:
            article = "an" if types[key] is int else "a"
            raise ValueError(f"site={spec!r}: {key}={value!r} is not {article} {types[key].__name__}") from None
    if not fields:
        raise ValueError(f"site={spec!r} gives no field; write e.g. ar_bwd:fmt=e5m2,group_size=64")
    return name, fields


def site_codec(base: CodecConfig, fields: dict, spec: str, flags: CommFlags) -> CodecConfig:
    """`base` (the site's codec so far) with `fields` replaced. A new `kind` starts from `CodecConfig`'s
    defaults plus the run's `--backend` and `--nonfinite`. Raises ValueError naming `spec`."""
    if "kind" in fields and fields["kind"] != base.kind:
        start = {"kind": fields["kind"], "backend": flags.backend, "nonfinite": flags.nonfinite}
    elif base.kind == "none":
        raise ValueError(f"site={spec!r}: the site is exact (kind='none'); give kind=... to compress it")
    else:
        start = {f.name: getattr(base, f.name) for f in dataclasses.fields(CodecConfig) if f.name != "site"}
    codec = CodecConfig.from_dict({**start, **fields}, where=f"site={spec!r}")
    kind = get_kind(codec.kind)
    takes = {"fmt": kind.fp8, "group_size": kind.grouped or flags.chunks != 1, "backend": kind.backends,
             "hadamard": kind.hadamard == "optional" or fields.get("hadamard") == (kind.hadamard == "always")}
    for field, ok in takes.items():  # a field the site's codec ignores is refused, as the flag is
        if field in fields and not ok:
            raise ValueError(f"site={spec!r}: {field}={fields[field]!r} has no effect on kind={codec.kind!r}: it "
                             f"needs {_need(field)}")
    return codec


def policy_label(policy: CommPolicy, sites=TENSOR_SITES) -> str:
    """"none", the one codec's name (e.g. "taco-e4m3-G128-dual") or "per-site" for `sites` of `policy`."""
    names = {getattr(policy, s).name for s in sites}
    return names.pop() if len(names) == 1 else "per-site"
