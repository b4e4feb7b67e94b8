"""`TrainConfig` in sections: TOML tables mirror them (`--config`), each section checks its own
fields naming the bad value, flat keys (config files and config.json written before sections) map
to their section, and `--transport` reaches the codec resolution of the train step."""

import dataclasses
import json
import re

import jax
import pytest

from taco_jax.cli import config_from_argv, main
from taco_jax.train.config import (
    FLAGS,
    SECTIONS,
    CheckpointSection,
    CommunicationSection,
    DataSection,
    LoggingSection,
    ModelSection,
    ParallelismSection,
    TrainConfig,
    TrainingSection,
    flag_values,
)
from taco_jax.util import jsonio

pytestmark = pytest.mark.fast

#: One key per section, and communication flags beside the section's own fields.
TABLES = """\
[model]
name = "qwen3-tiny"
vocab-size = 512
[data]
batch_size = 8
seq_len = 32
[training]
steps = 7
lr = 1e-3
[parallelism]
mesh = "data=2,tensor=2"
sequence_parallel = true
[communication]
comm = "int8"
dp_comm = "taco"
transport = "xla"
[checkpoint]
keep_checkpoints = 2
[logging]
eval_batches = 1
monitor_min_sqnr = -inf
"""


def test_every_flag_is_one_field_of_one_section():
    fields = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(FLAGS.values()) | {("communication", "policy")} == fields
    assert len(set(FLAGS.values())) == len(FLAGS)


def test_toml_with_tables_round_trips(tmp_path):
    """TOML tables -> the config -> its config.json (sectioned) -> `--config config.json` -> the same
    config; each table's values land in their section."""
    (tmp_path / "run.toml").write_text(TABLES)
    cfg = config_from_argv(["train", "--config", str(tmp_path / "run.toml")])
    assert (cfg.model.name, cfg.model.vocab_size, cfg.data.batch_size, cfg.training.steps, cfg.training.lr) == \
        ("qwen3-tiny", 512, 8, 7, 1e-3)
    assert cfg.parallelism.axes == {"data": 2, "tensor": 2} and cfg.parallelism.sequence_parallel
    assert cfg.communication.policy.ar_fwd.kind == "int8" and cfg.communication.policy.dp_grads.kind == "taco"
    assert (cfg.communication.transport, cfg.checkpoint.keep_checkpoints) == ("xla", 2)
    assert cfg.logging.monitor_min_sqnr == float("-inf")
    written = tmp_path / "config.json"
    jsonio.write(written, cfg.to_dict())
    recorded = json.loads(written.read_text())
    assert list(recorded) == list(SECTIONS) and recorded["data"] == {"batch_size": 8, "seq_len": 32, "path": ""}
    assert config_from_argv(["train", "--config", str(written)]) == cfg
    assert TrainConfig.from_dict(recorded) == cfg.replace(policy=cfg.communication.policy)


def test_an_export_inside_the_run_folder_is_recorded_relative_to_it(tmp_path, monkeypatch):
    """config.json records an --export-hf inside --out as "{out}/REL": a run started from that
    config.json with another --out exports into its own folder, not into the first run's (a path
    outside --out stays absolute, as the other folders); `{out}/hf` may be given as the flag too."""
    monkeypatch.chdir(tmp_path)
    first = TrainConfig.from_flags(out="runs/a", export_hf="runs/a/hf/final")
    recorded = first.to_dict()["checkpoint"]
    assert recorded["export_hf"] == "{out}/hf/final" and first.checkpoint.export_dir == "runs/a/hf/final"
    jsonio.write(tmp_path / "runs.json", first.to_dict())
    again = config_from_argv(["train", "--config", str(tmp_path / "runs.json"), "--out", "runs/b"])
    assert again.checkpoint.export_dir == "runs/b/hf/final"
    outside = TrainConfig.from_flags(out="runs/a", export_hf="exports/a")
    assert outside.to_dict()["checkpoint"]["export_hf"] == str(tmp_path / "exports" / "a")
    for export in ("runs/a", "runs/ab/hf"):  # --out itself (refused by the run), a sibling with a common prefix
        assert TrainConfig.from_flags(out="runs/a", export_hf=export).to_dict()["checkpoint"]["export_hf"] == \
            str(tmp_path / export)
    given = config_from_argv(["train", "--out", "runs/d", "--export-hf", "{out}/hf"])
    assert given.checkpoint.export_dir == "runs/d/hf" and given.to_dict()["checkpoint"]["export_hf"] == "{out}/hf"
    assert given.replace(out="runs/e").checkpoint.export_dir == "runs/e/hf"


@pytest.mark.parametrize("section, values, match", [
    (ModelSection, dict(vocab_size=-1), r"vocab_size=-1 must be >= 0 .*; set by --vocab-size or \[model\] vocab_size"),
    (ModelSection, dict(dtype="fp16"), r"fp16"),
    (DataSection, dict(batch_size=0), r"batch_size=0 must be positive; set by --batch-size or \[data\] batch_size$"),
    (TrainingSection, dict(steps=3, warmup_steps=5),
     r"warmup_steps=5 must be -1 .* steps=3\); set by --warmup-steps or \[training\] warm"),
    (TrainingSection, dict(lr=-1.0), r"lr=-1.0 must be positive and finite; set by --lr or \[training\] lr$"),
    (TrainingSection, dict(lr=float("inf")), r"lr=inf must be positive and finite"),
    (TrainingSection, dict(grad_clip=-1.0),
     r"grad_clip=-1.0 must be a positive, finite global norm; set by --grad-clip"),
    (TrainingSection, dict(grad_clip=0.0), r"grad_clip=0.0 must be a positive"),
    (TrainingSection, dict(steps=2**32), r"steps=4294967296 must be <= 2\*\*31 - 1 = 2147483647 .*; set by --steps"),
    (TrainingSection, dict(min_lr_ratio=-0.1), r"min_lr_ratio=-0.1 must be in \[0, 1\]"),
    (TrainingSection, dict(min_lr_ratio=2.0), r"min_lr_ratio=2.0 must be in \[0, 1\]"),
    (TrainingSection, dict(weight_decay=-1.0), r"weight_decay=-1.0 must be >= 0 and finite; set by --weight-decay"),
    (ParallelismSection, dict(mesh="data=2,depth=2"), r"'depth' in mesh='data=2,depth=2'"),
    (CommunicationSection, dict(transport="ring"), r"transport='ring' must be one of"),
    (CommunicationSection, dict(step_timeout=-1.0), r"step_timeout=-1.0 must be >= 0"),
    (CheckpointSection, dict(keep_checkpoints=0), r"keep_checkpoints=0 must be >= 1"),
    (CheckpointSection, dict(out=""),
     r"out='' must name a folder; an empty one would write .*; set by --out or \[checkpoint\] out$"),
    (CheckpointSection, dict(export_hf="hf/{out}"),
     r"export_hf='hf/\{out\}' may hold \{out\} only as its first folder, e\.g\. \{out\}/hf .*; set by --export-hf"),
    (LoggingSection, dict(profile_dir="p"), r"profile_dir='p' is given without profile_steps"),
    (LoggingSection, dict(eval_batches=-1), r"eval_batches=-1 must be >= 0 \(0: off\); set by --eval-batches"),
    (LoggingSection, dict(eval_every=0), r"eval_every=0 must be positive; set by --eval-every"),
])
def test_a_section_rejects_its_bad_value_naming_it(section, values, match):
    with pytest.raises(ValueError, match=match):
        section(**values)
    with pytest.raises(ValueError, match=match):  # the same check through the flags
        TrainConfig.from_flags(**values)


@pytest.mark.parametrize("text, match", [
    ("[data]\nbatch_size = 0\n", r"batch_size=0 must be positive; set by --batch-size or \[data\] batch_size"),
    ("[data]\nlr = 0.1\n", r"\[data\] has no key 'lr'; it is 'lr' in \[training\]"),
    ("[model]\nmodel = \"qwen3-tiny\"\n", r"\[model\] has no key 'model'; it is 'name' in \[model\]"),
    ("[trainig]\nsteps = 3\n", r"\[trainig\] is not a table of the config; did you mean \[training\]\?"),
    ("[xyzzy]\nsteps = 3\n", r"\[xyzzy\] is not a table of the config; the tables are \['model', 'data'"),
    ("steps = 3\n[training]\nsteps = 4\n", r"\[training\] steps gives 'steps' a second time"),
    ("training = 3\n", r"training must be a table \(\[training\]\), not 3"),
    ("[training]\nlr = \"0.001\"\n", r"\[training\] lr='0.001' must be a number \(not text\)"),
    ("[communication]\nmin_bytes = -3\n", r"\[communication\] min_bytes=-3 must be an integer >= 0 or 'auto'$"),
    ("[communication]\npolicy = \"no-such.json\"\n", r"policy file 'no-such.json': cannot read it"),
])
def test_bad_table_exits_2_naming_the_key(tmp_path, capsys, text, match):
    (tmp_path / "c.toml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run")]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_flat_keys_map_to_their_section(tmp_path):
    """A flat config (flag names at the top level: TOML files and config.json written before
    sections, a top-level "policy" table) is read as its sections; flat and sectioned forms of one
    run give the same flags (checkpoint metas compare them so)."""
    cfg = TrainConfig.from_flags(model="qwen3-tiny", data="", steps=7, mesh="data=2,tensor=2", comm="int8",
                                 transport="xla", vocab_size=512)
    flat = flag_values(cfg.to_dict())
    assert flat["model"] == "qwen3-tiny" and flat["steps"] == 7 and flat["transport"] == "xla"
    assert set(flat) == set(FLAGS) | {"policy"}
    assert flag_values(flat) == flat
    old = tmp_path / "config.json"  # as a run wrote it before sections
    old.write_text(json.dumps({**{k: v for k, v in flat.items()}, "policy": cfg.communication.policy.to_dict()}))
    assert config_from_argv(["train", "--config", str(old)]) == cfg
    assert TrainConfig.from_dict(json.loads(old.read_text())) == cfg
    (tmp_path / "flat.toml").write_text('steps = 7\nmodel = "qwen3-tiny"\n[data]\nseq_len = 32\n')
    mixed = config_from_argv(["train", "--config", str(tmp_path / "flat.toml")])
    assert (mixed.training.steps, mixed.model.name, mixed.data.seq_len) == (7, "qwen3-tiny", 32)


def test_transport_reaches_dispatch(tmp_path, monkeypatch, capsys):
    """`--transport` is recorded in config.json and decides the exact transport of the train step's
    codecs: "auto" follows the process's collectives (gloo where `gloo_collectives` says so), a
    concrete value is taken wherever the step runs (a policy site that names its transport keeps
    it); a bad value exits 2 naming it."""
    from taco_jax.codec import dispatch
    from taco_jax.collectives.policy import SITES
    from taco_jax.train.step import make_trainer

    argv = ["train", "--comm", "none", "--mesh", "data=1,tensor=2", "--vocab-size", "512", "--batch-size", "2",
            "--seq-len", "16"]
    xla_cfg = config_from_argv([*argv, "--transport", "xla"])
    gloo_cfg = config_from_argv([*argv, "--transport", "gloo"])
    assert xla_cfg.to_dict()["communication"]["transport"] == "xla"
    assert config_from_argv(argv).communication.transport == "auto"
    policy = gloo_cfg.communication.policy
    pinned = gloo_cfg.replace(policy=policy.with_sites({"ar_fwd": dataclasses.replace(policy.ar_fwd, transport="xla")}))

    def transports(cfg):
        policy = make_trainer(cfg, jax.devices()[:2]).policy
        return {s: getattr(policy, s).transport for s in SITES}

    assert set(transports(gloo_cfg).values()) == {"gloo"}  # one process: gloo only when asked for
    assert set(transports(config_from_argv(argv)).values()) == {"xla"}
    assert transports(pinned)["ar_fwd"] == "xla" and transports(pinned)["ar_bwd"] == "gloo"
    monkeypatch.setattr(dispatch, "gloo_collectives", lambda: True)
    assert set(transports(xla_cfg).values()) == {"xla"}  # under gloo: XLA's own collectives
    assert set(transports(config_from_argv(argv)).values()) == {"gloo"}
    with pytest.raises(SystemExit) as e:
        config_from_argv([*argv, "--transport", "nccl"])
    assert e.value.code == 2 and "nccl" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (dict(mesh="data=3,tensor=2", batch_size=16),
     r"batch_size=16 is not divisible by data=3 \(--mesh data=3,tensor=2\)"),
    (dict(mesh="data=2,tensor=3"), r"n_head=4 is not divisible by the tensor axis size 3 \(--mesh data=2,tensor=3, "
                                   r"model gpt2-tiny\)"),
    (dict(mesh="data=2,stage=2,tensor=2", batch_size=8, microbatches=3),
     r"data × microbatches = 2 × 3 \(--mesh data=2,stage=2,tensor=2, --microbatches 3\)"),
    (dict(mesh="data=2,stage=2,tensor=2", microbatches=1),
     r"microbatches=1 must be >= stage=2, else .* \(--mesh data=2,stage=2,tensor=2, --microbatches 1, model gpt2"),
    (dict(seq_len=4096), r"seq_len=4096 exceeds the model's block_size=256 \(model gpt2-tiny\); set by --seq-len or "
                         r"\[data\] seq_len$"),
    (dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*63\) .*; set by --seed or \[training\] seed$"),
    (dict(profile_steps="5:3"), r"profile_steps='5:3' must satisfy 1 <= A <= B; set by --profile-steps"),
    (dict(mesh="foo=2"), r"mesh axis 'foo' .*; set by --mesh or \[parallelism\] mesh$"),
    (dict(dtype="fp16"), r"dtype='fp16' is not supported; .*; set by --dtype or \[model\] dtype$"),
    (dict(schedule="zb"), r"schedule='zb' is not supported; .*; set by --schedule or \[parallelism\] schedule$"),
    (dict(fmt="e3m4"), r"fmt='e3m4' is not supported; .*; set by --fmt or \[communication\] fmt$"),
    (dict(algorithm="x"), r"all_reduce_algorithm='x' .*; set by --algorithm or \[communication\] algorithm$"),
    (dict(site=("ar_bwd:fmt=e9",)), r"site='ar_bwd:fmt=e9': fmt='e9' .*; set by --site or \[communication\] site$"),
    (dict(init_from="/nonexistent"), r"init_from='/nonexistent': .*; set by --init-from or \[model\] init_from$"),
])
def test_a_conflict_between_flags_names_them(flags, match):
    """A mesh the batch or the model does not divide, a pipeline with fewer microbatches than stages, a
    sequence longer than the model's context, a value another module checks: the error names the
    flags (--mesh, ...) beside the values, and the flag and table of the value it starts with."""
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**flags)


def test_a_vocabulary_too_small_for_the_shakespeare_bpe_is_refused_by_the_command_line():
    """--vocab-size 10 without --data: the command line refuses it naming the flag (a library caller
    may still train a 10-entry vocabulary on its own token arrays)."""
    with pytest.raises(ValueError, match=r"vocab_size=10 is too small for the Shakespeare BPE: give >= 257 .*; "
                                         r"set by --vocab-size or \[model\] vocab_size$"):
        config_from_argv(["train", "--vocab-size", "10"])
    assert TrainConfig.from_flags(vocab_size=10).model.vocab_size == 10


def test_overwrite_export_is_not_handed_on_by_config_json_and_a_bom_is_read(tmp_path):
    """`--overwrite-export` is one run's permission: its config.json records false, so a rerun of that
    file asks again (issue 52 item 1). A config file saved with a UTF-8 byte-order mark reads as without."""
    import json

    from taco_jax.util.jsonio import read_table

    cfg = TrainConfig.from_flags(out=str(tmp_path / "a"), export_hf=str(tmp_path / "x"), overwrite_export=True)
    assert cfg.checkpoint.overwrite_export and cfg.to_dict()["checkpoint"]["overwrite_export"] is False
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 7\n")
    assert read_table(bom, "--config") == {"training": {"steps": 7}}
    assert json.loads(json.dumps(cfg.to_dict()))["checkpoint"]["export_hf"] == str(tmp_path / "x")


def test_errors_are_structured_naming_field_and_flag():
    """A bad setting raises `ConfigError(field, flag, message)` (a ValueError): a section's own check,
    a rule joining sections, and a lower layer's check (the codec's, the model's) alike."""
    from taco_jax.train.settings import ConfigError

    for flags, field, flag, table in ((dict(lr=-1.0), "lr", "lr", "[training] lr"),
                                      (dict(batch_size=3), "batch_size", "batch_size", "[data] batch_size"),
                                      (dict(fmt="e3m4"), "fmt", "fmt", "[communication] fmt"),
                                      (dict(dtype="float8"), "dtype", "dtype", "[model] dtype"),
                                      (dict(comm="int3"), "comm", "comm", "[communication] comm")):
        with pytest.raises(ConfigError) as e:
            TrainConfig.from_flags(**flags)
        assert (e.value.field, e.value.flag) == (field, flag), flags
        assert str(e.value).endswith(f"; set by --{flag.replace('_', '-')} or {table}"), str(e.value)


def test_construction_reads_no_file_and_resolve_does(tmp_path):
    """`TrainConfig(...)` is pure: a `data` folder is not read until `resolve` (which `from_flags`
    calls), and its error names the flag."""
    from taco_jax.train.config import resolve
    from taco_jax.train.settings import ConfigError

    cfg = TrainConfig(data=DataSection(path=str(tmp_path / "none")))
    assert cfg.reads and cfg.model.vocab_size == 0
    for build in (lambda: resolve(cfg), lambda: TrainConfig.from_flags(data=str(tmp_path / "none"))):
        with pytest.raises(ConfigError, match=r"no meta.json.*; set by --data or \[data\] path$") as e:
            build()
        assert (e.value.field, e.value.flag) == ("path", "data")
    plain = TrainConfig()  # nothing to read: resolved on construction
    assert not plain.reads and resolve(plain) is plain and (plain.model.name, plain.model.vocab_size) == \
        ("gpt2-tiny", 2048)


def test_flag_help_lists_the_registries():
    """--comm, --dp-comm, --pp-comm and --codec-kind list the codec kinds' registry; plan's --hardware
    the hardware table; --model the presets."""
    from taco_jax.cli import _parser
    from taco_jax.codec import codec_kinds
    from taco_jax.models import PRESETS
    from taco_jax.perf.hardware import load_hardware
    from taco_jax.train.config import flags

    texts = {fl.name: fl.text for fl in flags()}
    for name in ("comm", "dp_comm", "pp_comm", "codec_kind"):
        assert texts[name].endswith(" | ".join(codec_kinds()[1:])), texts[name]
    assert texts["model"].endswith(", ".join(sorted(PRESETS)))
    hardware = next(a for a in _parser().flag_parsers["plan"]._actions if "--hardware" in a.option_strings)
    assert f"hardware.toml: {', '.join(load_hardware())};" in hardware.help


def test_codec_config_docstring_lists_every_built_in_kind():
    """The `CodecConfig` docstring describes each kind of the registry (built in: registered by
    taco_jax itself), in the registry's order."""
    from taco_jax.codec import CodecConfig
    from taco_jax.codec.kinds import registered

    kinds = [k.name for k in registered() if k.encode.__module__.startswith("taco_jax.")]
    block = CodecConfig.__doc__.split("\n      kind:", 1)[1].split("\n      fmt:", 1)[0]  # the `kind` entry
    listed = [k for k in re.findall(r'^ {8}"(\w+)" ', block, flags=re.M) if k != "none"]
    assert listed == kinds, listed
