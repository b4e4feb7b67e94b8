"""Typed training configuration: `TrainConfig` (one run, in sections: model, data, training, parallelism,
communication, checkpoint, logging), the tables derived from its settings, and `read_config_file`
(`--config FILE`: TOML tables mirror the sections). `resolve(cfg)` is the one step that reads files."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import pathlib
import warnings

from taco_jax.codec.config import TRANSPORTS
from taco_jax.collectives.policy import CommPolicy
from taco_jax.models import PRESETS, GPTConfig, get_config
from taco_jax.parallel.context import check_tp_overlap
from taco_jax.parallel.layers import check_compute
from taco_jax.parallel.mesh import DATA, STAGE, TENSOR, parse_mesh
from taco_jax.parallel.pipeline import check_pipeline, pipelined_layout
from taco_jax.train.comm_flags import CommFlags, policy_label
from taco_jax.train.settings import (
    HOMES,
    ConfigError,
    Flag,
    FlagWarning,
    declared,
    flag_error,
    seconds_or_auto,
    setting,
)
from taco_jax.util.links import EmulatedLink

#: The model of a run without `--model` and `--init-from`.
DEFAULT_MODEL = "gpt2-tiny"
#: Entries of the Shakespeare BPE (and the vocabulary of a CPU-sized preset on it) without `--vocab-size`.
DEFAULT_VOCAB = 2048


def flags() -> list[Flag]:
    """Every flag of `train` / `compare` in `--help` order: the sections', then `CommFlags`'."""
    if not _FLAGS:
        stored = sorted((fl for s, cls in SECTIONS.items() for fl in declared(cls, s)), key=lambda fl: fl.order)
        _FLAGS.extend(stored + sorted(declared(CommFlags, "communication", stored=False),
                                       key=lambda fl: fl.order))
    return list(_FLAGS)


_FLAGS: list[Flag] = []


def _invalid(section: str, field: str, value, rule: str) -> ConfigError:
    """The error of a bad field value: names the value, its flag and its `--config` table, e.g.
    "lr=-1.0 must be positive and finite; set by --lr or [training] lr"."""
    return flag_error(FIELD_FLAGS[section, field], f"{field}={value!r} {rule}")


def _blame(err: ValueError, flag: str = "") -> ValueError:
    """`err` as the `ConfigError` of `flag`, by default the one a lower layer's message starts with
    (they start "FIELD=VALUE ..."); `err` itself when it already is one or names no flag."""
    if isinstance(err, ConfigError) or "; set by --" in str(err):
        return err
    if not flag:
        head = str(err).partition("=")[0]
        flag = {"all_reduce_algorithm": "algorithm"}.get(head, head)
    if flag not in FLAGS and flag not in COMM_FLAGS:
        return err
    return flag_error(flag, str(err))


def _positive(section: str, obj, names) -> None:
    """Raises ValueError naming the first field of `names` of `obj` that is not > 0."""
    for f in names:
        if getattr(obj, f) <= 0:
            raise _invalid(section, f, getattr(obj, f), "must be positive")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """`[model]`: the architecture and its numerics. `name` is the `--model` flag."""

    name: str = setting("", "preset name (taco_jax.models.PRESETS); default gpt2-tiny, with --init-from the "
                        "checkpoint's: {presets}", flag="model", order=0, choices=lambda: sorted(PRESETS),
                        metavar="PRESET")
    init_from: str = setting("", "Hugging Face checkpoint dir (config.json + *.safetensors) to start from; sets the "
                             "model", order=200, path=True)
    vocab_size: int = setting(0, "model vocabulary (and Shakespeare's BPE); 0: --data's, a published preset's own, "
                              "else 2048", order=90)
    make_vocab_size_divisible_by: int = setting(128, "pad the vocabulary to a multiple of this × tensor size "
                                                "(Megatron)", order=260)
    dtype: str = setting("bfloat16", "compute dtype: bfloat16 (bf16 TP messages; FP32 weights, Adam, norms, loss) | "
                         "float32", order=240)
    remat: str = setting("none", "rematerialise each decoder layer: none | block (keep matmul outputs) | full (keep "
                         "input)", order=250)

    def __post_init__(self):
        if self.vocab_size < 0:
            raise _invalid("model", "vocab_size", self.vocab_size, "must be >= 0 (0: from the data or the preset)")
        if self.make_vocab_size_divisible_by < 1:
            raise _invalid("model", "make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, "must be >= 1")
        check_compute(self.dtype, self.remat)


@dataclasses.dataclass(frozen=True)
class DataSection:
    """`[data]`: what a step reads. `path` is the `--data` flag."""

    path: str = setting("", "token folder of `taco-jax prepare-data` (train.bin, val.bin, meta.json); default: "
                        "Shakespeare", flag="data", order=210, path=True)
    batch_size: int = setting(16, "global batch (sequences); divided over the data axis", order=70)
    seq_len: int = setting(128, "tokens per sequence", order=80)

    def __post_init__(self):
        _positive("data", self, ("batch_size", "seq_len"))


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    """`[training]`: the optimization (AdamW, cosine schedule) and its length."""

    steps: int = setting(300, "optimizer steps", order=60, applies="train")
    lr: float = setting(3e-3, "peak learning rate (AdamW)", order=100, applies="train")
    min_lr_ratio: float = setting(0.1, "cosine decays to lr * min_lr_ratio", order=110, applies="train")
    warmup_steps: int = setting(-1, "linear warmup steps; -1 = 10% of --steps", order=120, applies="train")
    weight_decay: float = setting(0.1, "on matrices only (not biases / LayerNorm)", order=130, applies="train")
    grad_clip: float = setting(1.0, "global-norm clipping", order=140, applies="train")
    adam_b1: float = setting(0.9, "AdamW beta1 (first-moment decay)", order=150, applies="train")
    adam_b2: float = setting(0.95, "AdamW beta2 (second-moment decay; nanoGPT's and Megatron's GPT recipe)",
                             order=160, applies="train")
    seed: int = setting(0, "init and data order (same for every --comm)", order=170, applies="train")
    allow_nonfinite: bool = setting(False, "keep training when loss or grad norm is NaN/Inf (else: stop, naming the "
                                    "step)", order=270, applies="train")

    def __post_init__(self):
        _positive("training", self, ("steps",))
        if self.steps > 2**31 - 1:
            raise _invalid("training", "steps", self.steps,
                           "must be <= 2**31 - 1 = 2147483647 (the schedule and optimizer count steps in int32)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise _invalid("training", "lr", self.lr, "must be positive and finite")
        if not (self.grad_clip > 0 and math.isfinite(self.grad_clip)):
            raise _invalid("training", "grad_clip", self.grad_clip, "must be a positive, finite global norm")
        if not 0 <= self.min_lr_ratio <= 1:
            raise _invalid("training", "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1] (a fraction of lr)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise _invalid("training", "weight_decay", self.weight_decay, "must be >= 0 and finite")
        for f in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, f) < 1:
                raise _invalid("training", f, getattr(self, f), "must be in [0, 1)")
        if not 0 <= self.seed < 2**63:
            raise _invalid("training", "seed", self.seed, "must be in [0, 2**63) (numpy's and JAX's seeds)")
        if not (self.warmup_steps == -1 or 0 <= self.warmup_steps < self.steps):
            raise _invalid("training", "warmup_steps", self.warmup_steps,
                           f"must be -1 (10% of steps) or in [0, steps={self.steps})")

    @property
    def warmup(self) -> int:
        """Warmup steps actually used (`warmup_steps`, or 10% of `steps` when it is -1)."""
        return self.steps // 10 if self.warmup_steps == -1 else self.warmup_steps


@dataclasses.dataclass(frozen=True)
class ParallelismSection:
    """`[parallelism]`: the device mesh and how the model is split over it."""

    mesh: str = setting("data=2,tensor=4", "mesh axes and sizes; product = device count", order=10)
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism on the tensor axis", order=20)
    tp_overlap: str = setting("none", "with --sequence-parallel: none | collective-matmul (SP collectives as matmul "
                              "rings)", order=30)
    microbatches: int = setting(1, "pipeline microbatches per data shard (>= stages; > 1 without stages: "
                                "accumulation)", order=40)
    schedule: str = setting("gpipe", "pipeline schedule: gpipe | 1f1b (parallel/pipeline.py)", order=50)

    def __post_init__(self):
        try:
            self.axes  # noqa: B018  (ValueError naming a malformed mesh)
        except ValueError as e:
            raise _blame(e, "mesh") from None
        check_tp_overlap(self.tp_overlap, self.sequence_parallel)

    @property
    def axes(self) -> dict[str, int]:
        """`mesh` as {axis: size}, e.g. {"data": 2, "tensor": 4}."""
        return parse_mesh(self.mesh)

    @property
    def pipelined(self) -> bool:
        """Whether steps run the pipeline layout (stage > 1 or microbatches > 1; `pipelined_layout`)."""
        return pipelined_layout(self.axes.get(STAGE, 1), self.microbatches)


@dataclasses.dataclass(frozen=True)
class CommunicationSection:
    """`[communication]`: the codec of every communication site (`policy`, built from `CommFlags`:
    the same table takes those flags) and how the processes' collectives run."""

    step_timeout: float | str = setting(0.0, "end the run when a step takes over S s, naming late processes (0: "
                                        "off; auto)", order=390, applies="train", parse=lambda: seconds_or_auto,
                                        metavar="S|auto")
    emulated_link: str = setting("", 'the emulated links as JSON, set by `taco-jax launch --link` ("": none)',
                                 order=400, applies="train")
    # transport: how the exact collectives of every site whose codec says "auto" move data (CodecConfig.transport).
    # xla: XLA's own (under gloo its reduce-scatter; XLA:CPU widens bf16 to f32); gloo: reduce-scatter as
    # all-to-all + FP32 sum, narrow floats as their own bytes (in one process: the multi-process CPU program).
    transport: str = setting("auto", "exact collectives: auto (multi-process CPU: gloo, else xla) | xla | gloo | "
                             "gloo_widened", order=410, choices=lambda: TRANSPORTS)
    policy: CommPolicy = CommPolicy.taco()  # codec of every communication site (built from CommFlags; no flag)

    def __post_init__(self):
        if not isinstance(self.policy, CommPolicy):
            raise ValueError(f"policy={self.policy!r} must be a CommPolicy (use TrainConfig.from_flags for flags)")
        timeout_ok = self.step_timeout == "auto" or (type(self.step_timeout) in (int, float)
                                                     and 0 <= self.step_timeout < math.inf)
        if not timeout_ok:
            raise _invalid("communication", "step_timeout", self.step_timeout, "must be >= 0 or 'auto'")
        if self.emulated_link:
            try:
                EmulatedLink.parse(self.emulated_link)
            except ValueError:
                raise flag_error("emulated_link", f"emulated_link={self.emulated_link[:80]!r} must be a JSON object "
                                 "(the link description `taco-jax launch --link` passes), or empty") from None
        if self.transport not in TRANSPORTS:
            raise _invalid("communication", "transport", self.transport, f"must be one of {TRANSPORTS}")

    @property
    def label(self) -> str:
        """Label of the tensor-axis codec: "none", its name (e.g. "taco-e4m3-G128-dual") or "per-site"."""
        return policy_label(self.policy)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """`[checkpoint]`: the output folder, Orbax checkpoints, resuming and the Hugging Face export."""

    out: str = setting("runs/default", "output folder (created; must not be a file)", order=330,
                       applies="train,plan")
    checkpoint_every: int = setting(0, "Orbax checkpoint to <out>/checkpoints every N steps (0: the final one, "
                                    "SIGTERM's)", order=340, applies="train")
    final_checkpoint: bool = setting(True, "checkpoint at the end of a run that ends normally (--no-final-checkpoint: "
                                     "none)", order=350, applies="train")
    keep_checkpoints: int = setting(3, "newest complete checkpoints kept (older ones deleted once a newer one is "
                                    "complete)", order=360, applies="train")
    resume: bool = setting(False, "continue from the latest complete checkpoint in <out>/checkpoints (any mesh)",
                           order=370, applies="train")
    resume_fallback: bool = setting(True, "--resume: newest checkpoint corrupt -> the newest intact one (warned); "
                                    "off: refuse", order=380, applies="train")
    export_hf: str = setting("", "after training (and on SIGTERM) write the weights as an HF checkpoint ({out}/hf: in "
                             "--out)", order=220, applies="train", path=True)
    overwrite_export: bool = setting(False, "let --export-hf replace another run's export or write into another "
                                     "run's folder", order=230, applies="train")

    def __post_init__(self):
        if OUT_DIR in self.export_hf and not self.export_hf.startswith(OUT_DIR + "/"):
            raise _invalid("checkpoint", "export_hf", self.export_hf, f"may hold {OUT_DIR} only as its first folder, "
                           f"e.g. {OUT_DIR}/hf (the run's --out folder; not --out itself)")
        if not str(self.out).strip():
            raise _invalid("checkpoint", "out", self.out, "must name a folder; an empty one would write the run's "
                           "files into the current folder")
        if self.checkpoint_every < 0:
            raise _invalid("checkpoint", "checkpoint_every", self.checkpoint_every,
                           "must be >= 0 (0: the final checkpoint only)")
        if self.keep_checkpoints < 1:
            raise _invalid("checkpoint", "keep_checkpoints", self.keep_checkpoints, "must be >= 1")

    @property
    def export_dir(self) -> str:
        """The folder of the HF export: `export_hf` with a leading `{out}/` read as the run's `out`
        folder (as config.json records an export inside it: `recorded_export`); "" for none."""
        if self.export_hf.startswith(OUT_DIR + "/"):
            return str(pathlib.Path(self.out) / self.export_hf.removeprefix(OUT_DIR + "/"))
        return self.export_hf


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """`[logging]`: what a run measures and writes besides checkpoints: evaluations, progress lines,
    captures, the SQNR monitor, profiles and TensorBoard."""

    eval_every: int = setting(50, "steps between validation evaluations (and at the last step)", order=180,
                              applies="train")
    eval_batches: int = setting(8, "validation batches per evaluation (fixed windows of held-out plays; 0: no "
                                "evaluation)", order=190, applies="train")
    log_every: int = setting(10, "with stderr not a terminal (e.g. `2> log`): a progress line every N steps (0: "
                             "none)", order=280, applies="train")
    capture: int = setting(0, "record the TP messages of N steps to <out>/captures; data × tensor meshes only",
                           order=290, applies="train")
    monitor_every: int = setting(0, "log per-site SQNR of compressed vs exact TP collectives on steps k % N == 0 and "
                                 "the last", order=300, applies="train")
    monitor_warn_sqnr: float = setting(15.0, "monitor: warn on stderr when a site's worst call is below this SQNR "
                                       "(dB)", order=310, applies="train")
    monitor_min_sqnr: float = setting(float("-inf"), "monitor: stop the run (exit 1) when a site's worst call is "
                                      "below this dB", order=320, applies="train")
    profile_steps: str = setting("", "trace steps A:B (first:last, e.g. 3:5) with jax.profiler into --profile-dir",
                                 order=420, applies="train")
    profile_dir: str = setting("", "folder of the --profile-steps trace (default <out>/profile)", order=430,
                               applies="train")
    tensorboard: bool = setting(False, "also write the metrics as TensorBoard event files to <out>/tensorboard",
                                order=440, applies="train")

    def __post_init__(self):
        _positive("logging", self, ("eval_every",))
        for f in ("eval_batches", "capture", "log_every", "monitor_every"):
            if getattr(self, f) < 0:
                raise _invalid("logging", f, getattr(self, f), "must be >= 0 (0: off)")
        for f in ("monitor_warn_sqnr", "monitor_min_sqnr"):
            if math.isnan(getattr(self, f)):
                raise _invalid("logging", f, getattr(self, f), "must be a number of dB (-inf: never)")
        if self.profile_steps:
            self.profile_range(math.inf)  # ValueError naming a malformed A:B
        elif self.profile_dir:
            raise _invalid("logging", "profile_dir", self.profile_dir, "is given without profile_steps (e.g. 3:5)")

    def profile_range(self, steps) -> tuple[int, int] | None:
        """`profile_steps` "A:B" as (A, B), 1 <= A <= B <= steps ("A": one step); None when not set.
        Raises ValueError naming a malformed value."""
        if not self.profile_steps:
            return None
        a, sep, b = self.profile_steps.partition(":")
        try:
            first, last = int(a), int(b if sep else a)
        except ValueError:
            raise _invalid("logging", "profile_steps", self.profile_steps,
                           "must be A:B (first and last step traced, e.g. 3:5)") from None
        if not 1 <= first <= last <= steps:
            bound = f" <= steps={steps}" if steps < math.inf else ""
            raise _invalid("logging", "profile_steps", self.profile_steps, f"must satisfy 1 <= A <= B{bound}")
        return first, last


#: Section of `TrainConfig` (its attribute and `--config` TOML table) -> its class.
SECTIONS = {"model": ModelSection, "data": DataSection, "training": TrainingSection,
            "parallelism": ParallelismSection, "communication": CommunicationSection,
            "checkpoint": CheckpointSection, "logging": LoggingSection}

#: Every flag stored in `TrainConfig` -> (section, field), in `--help` order.
FLAGS = {fl.name: (fl.section, fl.field.name) for fl in flags() if fl.stored}
HOMES.update(FLAGS)
#: The flags of `CommFlags` (`[communication]`): they build `communication.policy`.
COMM_FLAGS = tuple(fl.name for fl in flags() if not fl.stored)
#: (section, field) -> its flag; `policy` is `communication.policy`.
FIELD_FLAGS = {**{v: k for k, v in FLAGS.items()}, ("communication", "policy"): "policy"}
#: `train` flags that `plan` / `predict` accept (a train --config works as it is) but do not list.
PLAN_UNUSED = frozenset(fl.name for fl in flags() if "plan" not in fl.applies)
#: Flags naming folders, recorded absolute (against the current folder) by `TrainConfig.to_dict`: a
#: run's config.json names the same folders wherever it is read from (`taco-jax sample --from`, `--config`).
#: An `export_hf` inside the run's `out` is recorded relative to it (`recorded_export`).
PATH_FLAGS = tuple(fl.name for fl in flags() if fl.path)
#: The run's `out` folder at the start of `export_hf` ("{out}/hf"): `CheckpointSection.export_dir`.
OUT_DIR = "{out}"


def recorded_export(export: str, out: str) -> str:
    """How a run's config.json records `export_hf` (`TrainConfig.to_dict`): "{out}/REL" when the folder
    lies inside the run's `out` folder (so a run started from that config.json with another --out
    exports into its own folder, never into the first run's), else absolute; "" stays "". E.g.
    ("runs/qc/hf", "runs/qc") -> "{out}/hf"; ("exports/qc", "runs/qc") -> "/abs/exports/qc"."""
    if not export or export.startswith(OUT_DIR + "/"):
        return export
    path, root = pathlib.Path(os.path.abspath(export)), pathlib.Path(os.path.abspath(out))
    if path != root and path.is_relative_to(root):
        return f"{OUT_DIR}/{path.relative_to(root).as_posix()}"
    return str(path)


def _grouped(flags: dict, what: str) -> dict[str, dict]:
    """{flag: value} (flags of `FLAGS` and "policy") -> {section: {field: value}}. Raises TypeError
    naming a name that is no such flag (`what`: the caller, for the message)."""
    out = {}
    for name, value in flags.items():
        where = ("communication", "policy") if name == "policy" else FLAGS.get(name)
        if where is None:
            close = difflib.get_close_matches(name, [*FLAGS, "policy"], n=1)
            raise TypeError(f"{what}: {name!r} is not a flag of TrainConfig" + (f" (did you mean {close[0]!r}?)"
                                                                               if close else ""))
        out.setdefault(where[0], {})[where[1]] = value
    return out


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run, in sections (`SECTIONS`; each validates its own fields on construction,
    this class the rules that join sections). Every field but `communication.policy` is a CLI flag
    of `taco-jax train` (`FLAGS`); the communication flags are `CommFlags`'s, mapped into the
    policy once. Build one from flag values with `TrainConfig.from_flags(steps=20, comm="int8")`,
    change flags with `cfg.replace(out=...)`, read `cfg.training.steps`, `cfg.model.name`, ...
    Construction reads no file: `resolve` completes a config with `data` or `init_from`.

    Raises: ValueError naming the bad value (and its flag) of any section, or of a rule joining
    sections (batch vs data axis, pipeline layout, seq_len vs the model's block_size, ...).
    """

    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    training: TrainingSection = TrainingSection()
    parallelism: ParallelismSection = ParallelismSection()
    communication: CommunicationSection = CommunicationSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig.{name} must be a {cls.__name__}, not {getattr(self, name)!r} "
                                "(flag values: TrainConfig.from_flags)")
        self._settle(full=not self.reads, warn=True)

    @property
    def reads(self) -> bool:
        """Whether `resolve` reads a file for this config (`data`'s meta.json, `init_from`'s config.json)."""
        return bool(self.data.path or self.model.init_from)

    def _settle(self, full: bool, warn: bool) -> None:
        """The rules joining sections; `full`: also the model's name and vocabulary and the rules that
        need the model (reading what `reads` names). `warn`: the schedule's FlagWarning."""
        if full:
            model = dataclasses.replace(self.model, name=self._resolve_model())  # what the run records as its model
            object.__setattr__(self, "model", dataclasses.replace(model, vocab_size=self._resolve_vocab(model.name)))
        steps = self.training.steps
        self.logging.profile_range(steps)  # ValueError naming A:B beyond the run's steps
        axes, microbatches = self.parallelism.axes, self.parallelism.microbatches
        data, batch = axes.get(DATA, 1), self.data.batch_size
        mesh = f"--mesh {self.parallelism.mesh}"
        if batch % data:
            raise flag_error("batch_size", f"batch_size={batch} is not divisible by data={data} ({mesh}); change "
                             "either")
        if full:
            try:
                check_pipeline(self.model_config.n_layers, axes.get(STAGE, 1), microbatches,
                               self.parallelism.schedule)
            except ValueError as e:
                raise _blame(ValueError(f"{e} ({mesh}, --microbatches {microbatches}, model {self.model.name})")) \
                    from None
        if warn and self.parallelism.schedule != ParallelismSection.schedule and not self.parallelism.pipelined:
            warnings.warn(f"schedule={self.parallelism.schedule!r} has no effect: this run has no pipeline ({mesh}, "
                          f"--microbatches {microbatches}; a schedule orders stage > 1 or microbatches > 1), so it "
                          "is ignored", FlagWarning, stacklevel=4)
        if self.logging.capture and self.parallelism.pipelined:
            raise flag_error("capture", f"capture={self.logging.capture} needs the unpipelined layout (stage=1, "
                             "microbatches=1); capture on pipelined meshes is not supported")
        if self.logging.monitor_every and self.parallelism.pipelined:
            raise flag_error("monitor_every", f"monitor_every={self.logging.monitor_every} needs the unpipelined "
                             "layout (stage=1, microbatches=1); the monitor on pipelined meshes is not supported")
        if batch % (data * microbatches):
            raise flag_error("batch_size", f"batch_size={batch} is not divisible by data × microbatches = {data} × "
                             f"{microbatches} ({mesh}, --microbatches {microbatches})")
        if not full:
            return
        if self.data.seq_len > self.model_config.block_size:
            raise flag_error("seq_len", f"seq_len={self.data.seq_len} exceeds the model's block_size="
                             f"{self.model_config.block_size} (model {self.model.name})")
        try:
            self.model_config.check_tensor_parallel(axes.get(TENSOR, 1), seq_len=self.data.seq_len,
                                                    sequence_parallel=self.parallelism.sequence_parallel)
        except ValueError as e:
            raise _blame(ValueError(f"{e} ({mesh}, model {self.model.name}): choose a tensor size that divides it")) \
                from None

    def _resolve_model(self) -> str:
        """`model.name` as recorded: the preset (default gpt2-tiny); with `init_from` the checkpoint's
        architecture (`models.hf.architecture_label`). A preset given with `init_from` must describe
        the checkpoint's architecture (vocabulary aside). Raises ValueError naming both otherwise."""
        name, init_from = self.model.name, self.model.init_from
        if not init_from:
            return name or DEFAULT_MODEL
        from taco_jax.models import PRESETS
        from taco_jax.models.hf import architecture_label

        try:
            ckpt = self.model_config
        except ValueError as e:
            raise flag_error("init_from", f"init_from={init_from!r}: {e}") from None
        label = architecture_label(ckpt)
        if name in ("", label):
            return label
        if name in PRESETS:
            same = {f: getattr(ckpt, f) for f in ("vocab_size", "vocab_multiple", "dtype", "remat", "init_std")}
            if get_config(name, **same) == ckpt:
                return label
        raise flag_error("model", f"model={name!r} disagrees with init_from={init_from!r}, a {label}; "
                         "leave --model out (the checkpoint sets the model)")

    def _resolve_vocab(self, name: str) -> int:
        """`model.vocab_size` as recorded (`name`: the resolved model): the given one; else with
        `init_from` 2048 (the Shakespeare BPE's: the model's vocabulary is the checkpoint's), with a
        published preset (`models.PUBLISHED`) its own, with `data` the prepared folder's (meta.json:
        its tokenizer's largest id + 1), else 2048. Raises ValueError for a `data` folder without
        meta.json, or a published preset's own vocabulary smaller than `data`'s (naming both)."""
        from taco_jax.data.prepared import read_meta
        from taco_jax.models import PRESETS, PUBLISHED

        data, given = self.data.path, self.model.vocab_size
        if given and data and not self.model.init_from:
            theirs = int(read_meta(data)["vocab_size"])
            if given < theirs:
                raise _invalid("model", "vocab_size", given, f"is smaller than the {theirs:,} ids of data={data!r} "
                               "(meta.json); give at least that, or 0 for the data's own")
        if given:
            return given
        if self.model.init_from:
            return DEFAULT_VOCAB
        if name in PUBLISHED:
            own = PRESETS[name].vocab_size
            theirs = int(read_meta(data)["vocab_size"]) if data else 0
            if theirs > own:
                raise flag_error("data", f"data={data!r} has a vocabulary of {theirs:,} ids (meta.json) and {name} "
                                 f"(a published model) has {own:,}; prepare the data with the model's tokenizer, "
                                 f"or give --vocab-size {theirs} (then the model is not the published one)")
            return own
        if data:
            return int(read_meta(data)["vocab_size"])
        return DEFAULT_VOCAB

    def check_shakespeare_vocab(self) -> None:
        """Raises ValueError (naming --vocab-size) when this run trains on the Shakespeare BPE (no
        `data`, no `init_from`) and its vocabulary is too small for one (a byte-level BPE needs 257:
        256 byte tokens + <|endoftext|>). The command line checks it before a run starts; a library
        caller may train a small vocabulary on its own `dataset`."""
        m = self.model
        if not (self.data.path or m.init_from) and self.bpe_vocab_size < 257:
            raise _invalid("model", "vocab_size", m.vocab_size, "is too small for the Shakespeare BPE: give "
                           ">= 257 (256 byte tokens + <|endoftext|>), or 0 for 2048")

    @property
    def own_vocab(self) -> bool:
        """Whether the model runs with a published preset's own vocabulary (`models.PUBLISHED`)."""
        from taco_jax.models import PRESETS, PUBLISHED

        m = self.model
        return not m.init_from and m.name in PUBLISHED and m.vocab_size == PRESETS[m.name].vocab_size

    @property
    def bpe_vocab_size(self) -> int:
        """Entries of the Shakespeare BPE of a run without `data`: `vocab_size`, or 2048 when that is a
        published preset's own vocabulary (no BPE of that size can be trained on the plays; the
        model keeps its vocabulary, of which the BPE's ids are the first 2048)."""
        return DEFAULT_VOCAB if self.own_vocab else self.model.vocab_size

    def vocab_note(self) -> str:
        """The line a run prints about its vocabulary when the tokenizer does not plainly set it (a
        published preset's own; `data`'s); "" otherwise (Shakespeare on a CPU-sized preset, `init_from`)."""
        data = self.data.path
        if self.model.init_from or not (self.own_vocab or data):
            return ""
        from taco_jax.data.prepared import read_meta

        cfg = self.model_config
        rows = f" ({cfg.padded_vocab_size:,} rows)" if cfg.padded_vocab_size != cfg.vocab_size else ""
        if data:
            theirs = int(read_meta(data)["vocab_size"])
            tokens = f"the tokenizer of data={data!r} ({theirs:,} ids)"
        else:
            theirs, tokens = self.bpe_vocab_size, f"the Shakespeare BPE ({self.bpe_vocab_size:,} ids)"
        if self.own_vocab:
            return (f"vocabulary {cfg.vocab_size:,}{rows} and context {cfg.block_size:,}: {self.model.name}'s own "
                    f"(a published model); {tokens} uses a part of it; `sample` draws only the tokenizer's ids")
        if cfg.vocab_size == theirs:
            return f"vocabulary {cfg.vocab_size:,}{rows}: {tokens}"
        return f"vocabulary {cfg.vocab_size:,}{rows} (--vocab-size); {tokens} uses a part of it"

    @classmethod
    def from_flags(cls, **flags) -> TrainConfig:
        """A config from flag values (`FLAGS`' names plus `CommFlags`'s, mapped to the policy by
        `CommFlags.policy()`, or `policy=` a `CommPolicy`), e.g.
        `TrainConfig.from_flags(comm="int8", dp_comm="taco", steps=20)`.

        Raises: ValueError naming a bad value; TypeError for a name that is no flag, or for `policy`
        given together with communication flags.
        """
        comm_names = set(COMM_FLAGS)
        comm = {k: flags.pop(k) for k in list(flags) if k in comm_names}
        if comm and "policy" in flags:
            raise TypeError(f"give policy= or the communication flags {sorted(comm)}, not both")
        if "site" in comm:
            comm["site"] = tuple(comm["site"] or ())
        try:
            if "policy" not in flags:
                flags["policy"] = CommFlags(**comm).policy()
            groups = _grouped(flags, "TrainConfig.from_flags")
            return resolve(cls(**{name: sec(**groups.get(name, {})) for name, sec in SECTIONS.items()}))
        except ValueError as e:
            raise _blame(e) from None

    @classmethod
    def from_dict(cls, values: dict, where: str = "config") -> TrainConfig:
        """The config a `to_dict()` (a run's config.json, sectioned or flat: `flag_values`) describes;
        floats recorded as strings ("-Infinity", strict JSON) are read back as floats. Raises
        ValueError naming `where` and a bad key or value."""
        flags = flag_values(values, where)
        floats = {k for k, (s, f) in FLAGS.items()
                  if isinstance(SECTIONS[s].__dataclass_fields__[f].default, float)} - {"step_timeout"}
        flags = {k: float(v) if k in floats else v for k, v in flags.items() if k in FLAGS or k == "policy"}
        if isinstance(flags.get("policy"), dict):
            flags["policy"] = CommPolicy.from_dict(flags["policy"], where=f"{where}: policy")
        return cls.from_flags(**flags)

    def replace(self, **flags) -> TrainConfig:
        """A copy with these flags (`FLAGS`' names, or `policy=` a `CommPolicy`) changed, checked
        again. Raises TypeError for a name that is no such flag; ValueError as the constructor."""
        groups = _grouped(flags, "TrainConfig.replace")
        try:
            return resolve(dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **kw)
                                                        for s, kw in groups.items()}))
        except ValueError as e:
            raise _blame(e) from None

    def to_dict(self) -> dict:
        """JSON-ready sections {section: {field: value}} (`communication.policy` as
        `CommPolicy.to_dict()`): the `config.json` of a run, and a `--config` file. The folders of
        `PATH_FLAGS` absolute (resolved against the current folder; "" stays ""), but an `export_hf`
        inside `out` as "{out}/REL" (`recorded_export`); `overwrite_export` always false (a permission
        for the run that was given it, not for a rerun of its config.json)."""
        out = {}
        for name in SECTIONS:
            section = out[name] = {}
            for f in dataclasses.fields(getattr(self, name)):
                value, flag = getattr(getattr(self, name), f.name), FIELD_FLAGS[name, f.name]
                if flag == "policy":
                    value = value.to_dict()
                elif flag == "export_hf":
                    value = recorded_export(value, self.checkpoint.out)
                elif flag == "overwrite_export":  # one run's permission: a rerun of its config.json asks again
                    value = False
                elif flag in PATH_FLAGS and value:
                    value = os.path.abspath(value)
                section[f.name] = value
        return out

    def profile_range(self) -> tuple[int, int] | None:
        """`logging.profile_steps` "A:B" as (A, B), 1 <= A <= B <= steps; None when not set."""
        return self.logging.profile_range(self.training.steps)

    @functools.cached_property  # built once: with --init-from it reads config.json
    def model_config(self) -> GPTConfig:
        """The model: `--init-from`'s config.json, else the preset with our tokenizer's vocabulary; its
        vocabulary padded to a multiple of make_vocab_size_divisible_by × tensor size (Megatron); with
        this run's compute `dtype` and `remat`."""
        m = self.model
        multiple = m.make_vocab_size_divisible_by * self.parallelism.axes.get(TENSOR, 1)
        if m.init_from:
            from taco_jax.models.hf import config_from_hf

            cfg = config_from_hf(m.init_from, vocab_multiple=multiple)
            return dataclasses.replace(cfg, dtype=m.dtype, remat=m.remat)
        return get_config(m.name, vocab_size=m.vocab_size, vocab_multiple=multiple, dtype=m.dtype, remat=m.remat)


def resolve(cfg: TrainConfig) -> TrainConfig:
    """`cfg` ready to run, reading `data`'s meta.json (the vocabulary) and `init_from`'s config.json
    (the model), then checking what needs the model (pipeline depth, block size, tensor split); a
    config that `reads` nothing comes back as it is. `from_flags`, `from_dict` and `replace` call it.
    Raises ConfigError naming the bad value or unreadable file."""
    if not cfg.reads or getattr(cfg, "_resolved", False):
        return cfg
    out = copy.copy(cfg)  # no second construction: its checks passed, its warning was given
    out.__dict__.pop("model_config", None)  # cached before the vocabulary was known
    try:
        out._settle(full=True, warn=False)
    except ValueError as e:
        raise _blame(e) from None
    object.__setattr__(out, "_resolved", True)
    return out


def flag_values(values: dict, where: str = "config", flat: list | None = None) -> dict:
    """{flag: value} of a config mapping: sectioned (`TrainConfig.to_dict()`, a TOML file with
    tables `[model]`, `[data]`, ...: each table's keys are its section's fields, plus `CommFlags`'
    names in `[communication]`) or flat (flag names at the top level, as config files and run
    folders' config.json were written before sections; each is mapped to its section). A flat
    "policy" table is `communication.policy`. Keys may use dashes. Top-level keys that are neither
    a section nor a flag come back unchanged (the caller names them).

    `flat`: receives the flat keys that are settings.

    Raises ValueError naming `where` and the key: a table that is no section (with the closest
    section's name), a key that is not in its table (naming the table it belongs to), a flag given
    both flat and in its table.
    """
    comm = set(COMM_FLAGS)
    out, flat = {}, [] if flat is None else flat

    def put(flag, value, key):
        if flag in out:
            raise ValueError(f"{where}: {key} gives {flag!r} a second time (flat and in its table); give it once")
        out[flag] = value

    for key, value in values.items():
        key = key.replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            for k, v in value.items():
                k = k.replace("-", "_")
                flag = FIELD_FLAGS.get((key, k)) or (k if key == "communication" and k in comm else None)
                if flag is None:
                    home = FLAGS.get(k) or (("communication", k) if k in comm else None)
                    hint = (f"; it is {home[1]!r} in [{home[0]}]" if home else
                            f"; [{key}] takes {sorted(f for s, f in FIELD_FLAGS if s == key)}")
                    raise ValueError(f"{where}: [{key}] has no key {k!r}{hint}")
                put(flag, v, f"[{key}] {k}")
        elif key in SECTIONS and key not in FLAGS:
            raise ValueError(f"{where}: {key} must be a table ([{key}]), not {value!r}")
        elif isinstance(value, dict) and key != "policy":
            close = difflib.get_close_matches(key, SECTIONS, n=1)
            raise ValueError(f"{where}: [{key}] is not a table of the config" +
                             (f"; did you mean [{close[0]}]?" if close else f"; the tables are {list(SECTIONS)}"))
        else:
            put(key, value, key)
            if key in FLAGS or key in comm or key == "policy":
                flat.append(key)
    return out


def flat_note(flat: list[str], where: str) -> str:
    """The deprecation line of `flat` keys in the `--config` file `where`; "" for none."""
    if not flat:
        return ""
    home = {**FLAGS, "policy": ("communication", "policy"), **{k: ("communication", k) for k in COMM_FLAGS}}
    tables = ", ".join(f"{k} as [{home[k][0]}] {home[k][1]}" for k in flat[:3])
    more = f" and {len(flat) - 3} more" if len(flat) > 3 else ""
    return f"{where}: flat keys at the top level are deprecated; write each in its table ({tables}{more})"


def read_config_file(path, flat: list | None = None) -> dict:
    """The flag values {flag: value} of a `--config FILE`: a TOML file (as torchtitan's), or a JSON
    object (".json", e.g. the `config.json` a run wrote). Tables mirror `TrainConfig`'s sections
    (`[model]`, `[data]`, `[training]`, `[parallelism]`, `[communication]`, `[checkpoint]`,
    `[logging]`; keys are the fields, dashes allowed); flat flag names at the top level are read
    too and mapped to their section (`flag_values`). "policy" (`[communication.policy]`, or a flat
    "policy" table) is a `CommPolicy.to_dict()`, as config.json holds it.

    Flat keys are deprecated: listed in `flat` when given, else a FlagWarning (`flat_note`).

    Raises ValueError naming the file when it cannot be read or parsed, is not a table / object,
    or has a key outside its table (`flag_values`).
    """
    from taco_jax.util.jsonio import read_table

    where, keys = f"--config {str(path)!r}", [] if flat is None else flat
    values = flag_values(read_table(path, "--config"), where, keys)
    if flat is None and keys:
        warnings.warn(flat_note(keys, where), FlagWarning, stacklevel=2)
    return values
