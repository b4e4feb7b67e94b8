"""Typed training configuration: `TrainConfig` (one run; its `policy` holds every codec setting) and
`CommFlags` (the command line's communication flags, mapped to that policy in one place)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from taco_jax.codec import NONE, CodecConfig, codec_kinds, get_kind
from taco_jax.collectives.policy import SITES, TENSOR_SITES, CommPolicy
from taco_jax.models import GPTConfig, get_config
from taco_jax.parallel.context import check_tp_overlap
from taco_jax.parallel.layers import check_compute
from taco_jax.parallel.mesh import DATA, STAGE, TENSOR, parse_mesh
from taco_jax.parallel.pipeline import check_pipeline

#: The model of a run without `--model` and `--init-from`.
DEFAULT_MODEL = "gpt2-tiny"
#: Entries of the Shakespeare BPE (and the vocabulary of a CPU-sized preset on it) without `--vocab-size`.
DEFAULT_VOCAB = 2048
#: Fields naming folders, recorded absolute (against the current folder) by `TrainConfig.to_dict`: a
#: run's config.json names the same folders wherever it is read from (`taco-jax sample --from`, `--config`).
PATH_FIELDS = ("init_from", "data", "export_hf")
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

    comm: str = "taco"  # tensor-axis codec (every TP site): none (exact) | taco | a codec kind (int8, ...)
    dp_comm: str = "none"  # data-axis gradient all-reduce codec: none | a codec kind (taco, int8, int4, ...)
    pp_comm: str = "none"  # stage-axis send/recv codec: none | a codec kind (taco, tah, int4, ...)
    codec_kind: str = "taco"  # kind of `--comm taco` (= `--comm KIND`): taco | fp8_tensor | fp8_group | int8 | ...
    fmt: str = "e4m3"  # FP8 format, every axis (also --dp-comm / --pp-comm): e4m3 | e5m2
    group_size: int = 128  # G, every axis (also --dp-comm / --pp-comm): 32..512
    scale_layout: str = "dual"  # taco on the tensor axis: dual (two FP32 scales / group) | folded (one)
    group_axis: str = "hidden"  # tensor axis: groups along hidden (channels) | token (one channel across tokens)
    nonfinite: str = "propagate"  # NaN/Inf in a message, every axis: propagate | zero | error (raise naming the site)
    backend: str = "auto"  # taco group math: auto (CPU: ffi if built; GPU kernels) | reference | pallas | triton | ffi
    algorithm: str = "two_shot"  # compressed all-reduce: two_shot | one_shot
    min_bytes: int | str = 0  # messages below this many bytes stay uncompressed; auto: the cost model's break-even size
    reduce_domain: str = "signal"  # two-shot taco all-reduce: signal (decode, sum, encode) | hadamard (transformed sum)
    chunks: int | str = 1  # two-shot all-reduce: independent chunks K >= 1 (pipelining) | auto (from the message size)
    policy_file: str = ""  # JSON policy (docs/training.md; `taco-jax calibrate`); overrides the sites it names
    site: tuple[str, ...] = ()  # per-site codec, repeatable: SITE:field=value,... e.g. ar_bwd:fmt=e5m2,group_size=64

    def tensor_codec(self) -> CodecConfig:
        """The codec of every tensor-axis site (`--comm` and the codec flags)."""
        if self.comm not in codec_kinds():
            raise ValueError(f"comm={self.comm!r} is not supported; choose 'none' or a codec kind {codec_kinds()[1:]}")
        kind = self.codec_kind if self.comm == "taco" else self.comm
        if self.comm not in ("none", "taco") and self.codec_kind not in ("taco", self.comm):
            raise ValueError(f"comm={self.comm!r} and codec_kind={self.codec_kind!r} disagree; give one of them")
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
            raise ValueError(f"{flag}={kind!r} is not supported; choose one of {codec_kinds()}")
        return CodecConfig(kind=kind, fmt=self.fmt, group_size=self.group_size, nonfinite=self.nonfinite,
                           backend=self.backend, hadamard=get_kind(kind).hadamard == "optional")

    def policy(self) -> CommPolicy:
        """The run's policy (see the class docstring). Raises ValueError naming the bad flag or value."""
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
        return policy


def parse_site(spec: str) -> tuple[str, dict]:
    """"ar_bwd:fmt=e5m2,group_size=64" -> ("ar_bwd", {"fmt": "e5m2", "group_size": 64}) (values typed
    like `CodecConfig`'s fields). Raises ValueError naming `spec` for a malformed entry."""
    name, sep, rest = spec.partition(":")
    if not sep or name not in SITES:
        raise ValueError(f"site={spec!r}: write SITE:field=value,... with SITE one of {SITES}")
    types = {f.name: type(f.default) for f in dataclasses.fields(CodecConfig)}
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
            raise ValueError(f"site={spec!r}: {key}={value!r} is not a {types[key].__name__}") from None
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
    return CodecConfig.from_dict({**start, **fields}, where=f"site={spec!r}")


def policy_label(policy: CommPolicy, sites=TENSOR_SITES) -> str:
    """"none", the one codec's name (e.g. "taco-e4m3-G128-dual") or "per-site" for `sites` of `policy`."""
    names = {getattr(policy, s).name for s in sites}
    return names.pop() if len(names) == 1 else "per-site"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Every field but `policy` is a CLI flag of `taco-jax train` (underscores -> dashes);
    the communication flags are `CommFlags`'s, mapped into `policy` once (`TrainConfig.from_flags`)."""

    model: str = ""  # preset name (taco_jax.models.PRESETS); default gpt2-tiny, with --init-from the checkpoint's
    mesh: str = "data=2,tensor=4"  # mesh axes and sizes; product = device count
    sequence_parallel: bool = False  # Megatron sequence parallelism on the tensor axis
    tp_overlap: str = "none"  # with --sequence-parallel: none | collective-matmul (SP collectives as matmul rings)
    microbatches: int = 1  # pipeline microbatches per data shard (>= stages; > 1 without stages: accumulation)
    schedule: str = "gpipe"  # pipeline schedule: gpipe | 1f1b (parallel/pipeline.py)
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # global batch (sequences); divided over the data axis
    seq_len: int = 128  # tokens per sequence
    vocab_size: int = 0  # model vocabulary (and Shakespeare's BPE); 0: --data's, a published preset's own, else 2048
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = -1  # linear warmup steps; -1 = 10% of --steps
    weight_decay: float = 0.1  # on matrices only (not biases / LayerNorm)
    grad_clip: float = 1.0  # global-norm clipping
    seed: int = 0  # init and data order (same for every --comm)
    eval_every: int = 50  # steps between validation evaluations (and at the last step)
    eval_batches: int = 8  # validation batches per evaluation (fixed windows of held-out plays)
    init_from: str = ""  # Hugging Face checkpoint dir (config.json + *.safetensors) to start from; sets the model
    data: str = ""  # token folder of `taco-jax prepare-data` (train.bin, val.bin, meta.json); default: Shakespeare
    export_hf: str = ""  # after training, write the parameters as a Hugging Face checkpoint dir (transformers loads it)
    dtype: str = "bfloat16"  # compute dtype: bfloat16 (bf16 TP messages; FP32 weights, Adam, norms, loss) | float32
    remat: str = "none"  # rematerialise each decoder layer: none | block (keep matmul outputs) | full (keep input)
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary to a multiple of this × tensor size (Megatron)
    allow_nonfinite: bool = False  # keep training when loss or grad norm is NaN/Inf (else: stop, naming the step)
    log_every: int = 10  # with stderr not a terminal (e.g. `2> log`): a progress line every N steps (0: none)
    capture: int = 0  # record the TP messages of N steps to <out>/captures; data × tensor meshes only
    monitor_every: int = 0  # log per-site SQNR of compressed vs exact TP collectives on steps k % N == 0 and the last
    monitor_warn_sqnr: float = 15.0  # monitor: warn on stderr when a site's worst call is below this SQNR (dB)
    monitor_min_sqnr: float = float("-inf")  # monitor: stop the run (exit 1) when a site's worst call is below this dB
    out: str = "runs/default"  # output folder (created; must not be a file)
    checkpoint_every: int = 0  # Orbax checkpoint to <out>/checkpoints every N steps (0: the final one, SIGTERM's)
    final_checkpoint: bool = True  # checkpoint at the end of a run that ends normally (--no-final-checkpoint: none)
    keep_checkpoints: int = 3  # newest complete checkpoints kept (older ones deleted once a newer one is complete)
    resume: bool = False  # continue from the latest complete checkpoint in <out>/checkpoints (any mesh)
    resume_fallback: bool = True  # --resume: newest checkpoint corrupt -> the newest intact one (warned); off: refuse
    step_timeout: float | str = 0.0  # end the run when a step takes over S s, naming late processes (0: off; auto)
    emulated_link: str = ""  # the emulated links as JSON, set by `taco-jax launch --link` ("": none)
    profile_steps: str = ""  # trace steps A:B (first:last, e.g. 3:5) with jax.profiler into --profile-dir
    profile_dir: str = ""  # folder of the --profile-steps trace (default <out>/profile)
    tensorboard: bool = False  # also write the metrics as TensorBoard event files to <out>/tensorboard
    policy: CommPolicy = CommPolicy.taco()  # codec of every communication site (built from CommFlags)

    def __post_init__(self):
        object.__setattr__(self, "model", self._resolve_model())  # what the run records as its model
        object.__setattr__(self, "vocab_size", self._resolve_vocab())  # and as its vocabulary
        if not isinstance(self.policy, CommPolicy):
            raise ValueError(f"policy={self.policy!r} must be a CommPolicy (use TrainConfig.from_flags for flags)")
        if self.capture < 0:
            raise ValueError(f"capture={self.capture} must be >= 0 (number of steps to record)")
        timeout_ok = self.step_timeout == "auto" or (type(self.step_timeout) in (int, float)
                                                     and 0 <= self.step_timeout < math.inf)
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or not timeout_ok:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be >= 0, keep_checkpoints="
                             f"{self.keep_checkpoints} >= 1 and step_timeout={self.step_timeout!r} >= 0 or 'auto'")
        if self.emulated_link:
            try:
                ok = isinstance(json.loads(self.emulated_link), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"emulated_link={self.emulated_link[:80]!r} must be a JSON object (the link "
                                 "description `taco-jax launch --link` passes), or empty")
        if self.log_every < 0:
            raise ValueError(f"log_every={self.log_every} must be >= 0 (0: no progress lines)")
        if self.monitor_every < 0:
            raise ValueError(f"monitor_every={self.monitor_every} must be >= 0 (0: no monitor)")
        for f in ("monitor_warn_sqnr", "monitor_min_sqnr"):
            if math.isnan(getattr(self, f)):
                raise ValueError(f"{f}={getattr(self, f)} must be a number of dB (-inf: never)")
        for f in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        check_compute(self.dtype, self.remat)
        check_tp_overlap(self.tp_overlap, self.sequence_parallel)
        if self.profile_steps:
            self.profile_range  # noqa: B018  (ValueError naming a malformed A:B)
        elif self.profile_dir:
            raise ValueError(f"profile_dir={self.profile_dir!r} is given without profile_steps (e.g. 3:5)")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not (self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps):
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be -1 (10% of steps) or in [0, steps={self.steps})"
            )
        axes = self.mesh_axes
        data = axes.get(DATA, 1)
        if self.batch_size % data:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by data={data}")
        check_pipeline(self.model_config.n_layers, axes.get(STAGE, 1), self.microbatches, self.schedule)
        if self.capture and (axes.get(STAGE, 1) > 1 or self.microbatches > 1):
            raise ValueError(f"capture={self.capture} needs the unpipelined layout (stage=1, microbatches=1); "
                             "capture on pipelined meshes is not supported")
        if self.monitor_every and (axes.get(STAGE, 1) > 1 or self.microbatches > 1):
            raise ValueError(f"monitor_every={self.monitor_every} needs the unpipelined layout (stage=1, "
                             "microbatches=1); the monitor on pipelined meshes is not supported")
        if self.batch_size % (data * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by data × microbatches = "
                             f"{data} × {self.microbatches}")
        if self.seq_len > self.model_config.block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's block_size={self.model_config.block_size}")
        self.model_config.check_tensor_parallel(axes.get(TENSOR, 1), sequence_parallel=self.sequence_parallel,
                                                seq_len=self.seq_len)

    def _resolve_model(self) -> str:
        """`model` as recorded: the preset (default gpt2-tiny); with `init_from` the checkpoint's
        architecture (`models.hf.architecture_label`). A preset given with `init_from` must describe
        the checkpoint's architecture (vocabulary aside). Raises ValueError naming both otherwise."""
        if not self.init_from:
            return self.model or DEFAULT_MODEL
        from taco_jax.models import PRESETS
        from taco_jax.models.hf import architecture_label

        ckpt = self.model_config
        label = architecture_label(ckpt)
        if self.model in ("", label):
            return label
        if self.model in PRESETS:
            same = {f: getattr(ckpt, f) for f in ("vocab_size", "vocab_multiple", "dtype", "remat", "init_std")}
            if get_config(self.model, **same) == ckpt:
                return label
        raise ValueError(f"model={self.model!r} disagrees with init_from={self.init_from!r}, a {label}; "
                         "leave --model out (the checkpoint sets the model)")

    def _resolve_vocab(self) -> int:
        """`vocab_size` as recorded: the given one; else with `init_from` 2048 (the Shakespeare BPE's:
        the model's vocabulary is the checkpoint's), with a published preset (`models.PUBLISHED`)
        its own, with `data` the prepared folder's (meta.json: its tokenizer's largest id + 1),
        else 2048. Raises ValueError for a negative value, a `data` folder without meta.json, or a
        published preset's own vocabulary smaller than `data`'s (naming both)."""
        from taco_jax.models import PRESETS, PUBLISHED

        if self.vocab_size < 0:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 0 (0: from the data or the preset)")
        if self.vocab_size:
            return self.vocab_size
        if self.init_from:
            return DEFAULT_VOCAB
        from taco_jax.data.prepared import read_meta

        if self.model in PUBLISHED:
            own = PRESETS[self.model].vocab_size
            theirs = int(read_meta(self.data)["vocab_size"]) if self.data else 0
            if theirs > own:
                raise ValueError(f"data={self.data!r} has a vocabulary of {theirs:,} ids (meta.json) and {self.model} "
                                 f"(a published model) has {own:,}; prepare the data with the model's tokenizer, "
                                 f"or give --vocab-size {theirs} (then the model is not the published one)")
            return own
        if self.data:
            return int(read_meta(self.data)["vocab_size"])
        return DEFAULT_VOCAB

    @property
    def own_vocab(self) -> bool:
        """Whether the model runs with a published preset's own vocabulary (`models.PUBLISHED`)."""
        from taco_jax.models import PRESETS, PUBLISHED

        return not self.init_from and self.model in PUBLISHED and self.vocab_size == PRESETS[self.model].vocab_size

    @property
    def bpe_vocab_size(self) -> int:
        """Entries of the Shakespeare BPE of a run without `data`: `vocab_size`, or 2048 when that is a
        published preset's own vocabulary (no BPE of that size can be trained on the plays; the
        model keeps its vocabulary, of which the BPE's ids are the first 2048)."""
        return DEFAULT_VOCAB if self.own_vocab else self.vocab_size

    def vocab_note(self) -> str:
        """The line a run prints about its vocabulary when the tokenizer does not plainly set it (a
        published preset's own; `data`'s); "" otherwise (Shakespeare on a CPU-sized preset, `init_from`)."""
        if self.init_from or not (self.own_vocab or self.data):
            return ""
        from taco_jax.data.prepared import read_meta

        cfg = self.model_config
        rows = f" ({cfg.padded_vocab_size:,} rows)" if cfg.padded_vocab_size != cfg.vocab_size else ""
        if self.data:
            theirs = int(read_meta(self.data)["vocab_size"])
            tokens = f"the tokenizer of data={self.data!r} ({theirs:,} ids)"
        else:
            theirs, tokens = self.bpe_vocab_size, f"the Shakespeare BPE ({self.bpe_vocab_size:,} ids)"
        if self.own_vocab:
            return (f"vocabulary {cfg.vocab_size:,}{rows} and context {cfg.block_size:,}: {self.model}'s own "
                    f"(a published model); {tokens} uses a part of it; `sample` draws only the tokenizer's ids")
        if cfg.vocab_size == theirs:
            return f"vocabulary {cfg.vocab_size:,}{rows}: {tokens}"
        return f"vocabulary {cfg.vocab_size:,}{rows} (--vocab-size); {tokens} uses a part of it"

    @classmethod
    def from_flags(cls, **kwargs) -> TrainConfig:
        """A config from flag values: `TrainConfig`'s fields plus `CommFlags`'s (mapped to `policy` by
        `CommFlags.policy()`), e.g. `TrainConfig.from_flags(comm="int8", dp_comm="taco", steps=20)`.

        Raises: ValueError naming a bad value; TypeError for a name that is no flag, or for `policy`
        given together with communication flags.
        """
        comm_names = {f.name for f in dataclasses.fields(CommFlags)}
        comm = {k: kwargs.pop(k) for k in list(kwargs) if k in comm_names}
        if comm and "policy" in kwargs:
            raise TypeError(f"give policy= or the communication flags {sorted(comm)}, not both")
        if "site" in comm:
            comm["site"] = tuple(comm["site"] or ())
        if "policy" not in kwargs:
            kwargs["policy"] = CommFlags(**comm).policy()
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """JSON-ready fields, `policy` as `CommPolicy.to_dict()` (the `config.json` of a run); the
        folders of `PATH_FIELDS` absolute (resolved against the current folder; "" stays "")."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "policy"}
        out.update({f: os.path.abspath(out[f]) for f in PATH_FIELDS if out[f]})
        return {**out, "policy": self.policy.to_dict()}

    @property
    def comm(self) -> str:
        """Label of the tensor-axis codec: "none", its name (e.g. "taco-e4m3-G128-dual") or "per-site"."""
        return policy_label(self.policy)

    @property
    def warmup(self) -> int:
        """Warmup steps actually used (`warmup_steps`, or 10% of `steps` when it is -1)."""
        return self.steps // 10 if self.warmup_steps == -1 else self.warmup_steps

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """`profile_steps` "A:B" as (A, B), 1 <= A <= B <= steps ("A": one step); None when not set.
        Raises ValueError naming a malformed value."""
        if not self.profile_steps:
            return None
        a, sep, b = self.profile_steps.partition(":")
        try:
            first, last = int(a), int(b if sep else a)
        except ValueError:
            raise ValueError(f"profile_steps={self.profile_steps!r} must be A:B (first and last step traced, "
                             "e.g. 3:5)") from None
        if not 1 <= first <= last <= self.steps:
            raise ValueError(f"profile_steps={self.profile_steps!r} must satisfy 1 <= A <= B <= steps={self.steps}")
        return first, last

    @property
    def mesh_axes(self) -> dict[str, int]:
        return parse_mesh(self.mesh)

    @functools.cached_property  # built once: with --init-from it reads config.json
    def model_config(self) -> GPTConfig:
        """The model: `--init-from`'s config.json, else the preset with our tokenizer's vocabulary; its
        vocabulary padded to a multiple of make_vocab_size_divisible_by × tensor size (Megatron); with
        this run's compute `dtype` and `remat`."""
        multiple = self.make_vocab_size_divisible_by * self.mesh_axes.get(TENSOR, 1)
        if self.init_from:
            from taco_jax.models.hf import config_from_hf

            cfg = config_from_hf(self.init_from, vocab_multiple=multiple)
            return dataclasses.replace(cfg, dtype=self.dtype, remat=self.remat)
        return get_config(self.model, vocab_size=self.vocab_size, vocab_multiple=multiple, dtype=self.dtype,
                          remat=self.remat)


def read_config_file(path) -> dict:
    """The flag values of a `--config FILE`: a TOML file (as torchtitan's), or a JSON object (".json",
    e.g. the `config.json` a run wrote). Top-level keys are flag names (underscores or dashes); the
    only table allowed is "policy" (a `CommPolicy.to_dict()`, as config.json holds it).

    Raises ValueError naming the file when it cannot be read or parsed, or is not a table / object.
    """
    import json
    import pathlib
    import tomllib

    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--config {str(path)!r}: cannot read it ({e.strerror or e})") from None
    try:
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if path.suffix == ".json" else "TOML (.json files are read as JSON)"
        raise ValueError(f"--config {str(path)!r}: not valid {kind}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {str(path)!r}: must hold a table of flag = value, not {type(values).__name__}")
    return {k.replace("-", "_"): v for k, v in values.items()}
