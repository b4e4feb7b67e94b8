"""`taco-jax` as a user meets it: version, flags -> policy, strict JSON outputs, a diverging run, output edges."""

import json
import math
import re
import warnings

import pytest

from taco_jax import __version__
from taco_jax.cli import main
from taco_jax.codec import CodecConfig
from taco_jax.collectives.policy import SITES, TENSOR_SITES, CommPolicy
from taco_jax.train.config import TrainConfig
from taco_jax.util import jsonio
from taco_jax.util.console import format_bytes, summary_block

pytestmark = pytest.mark.slow

#: Smallest useful run of the CLI (gpt2-tiny; vocabulary 512 keeps the tokenizer quick).
TINY = ["--vocab-size", "512", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]


def _strict_loads(text: str):
    """json.loads that refuses the non-JSON tokens NaN / Infinity / -Infinity."""
    def refuse(token):
        raise ValueError(f"non-JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(autouse=True)
def _cache(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("TACO_JAX_CACHE", str(tokenizer_dir))


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"taco-jax {__version__}"


def test_strict_json_writes_nonfinite_as_strings():
    text = jsonio.dumps({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5})
    assert _strict_loads(text) == {"a": "NaN", "b": ["Infinity", "-Infinity"], "c": 1.5}
    assert [float(v) for v in _strict_loads(text)["b"]] == [float("inf"), -float("inf")]


def test_diverging_run_stops_naming_the_step_with_strict_json(tmp_path, capsys):
    """A diverging run: `taco-jax train --lr 1e6 --warmup-steps 0 --steps 4` (gpt2-tiny)."""
    out = tmp_path / "run"
    assert main(["train", "--lr", "1e6", "--warmup-steps", "0", "--steps", "4", "--out", str(out), *TINY]) == 1
    err = capsys.readouterr().err
    recs = [_strict_loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bad = recs[-1]["step"]
    assert f"step {bad}: " in err and "--allow-nonfinite" in err and "not finite" in err
    assert all(isinstance(r["loss"], float) for r in recs[:-1])  # the steps before were finite
    assert "NaN" in (recs[-1]["loss"], recs[-1]["grad_norm"]) or "Infinity" in (recs[-1]["loss"], recs[-1]["grad_norm"])
    assert bad < 4 and not (out / "summary.json").exists()
    _strict_loads((out / "config.json").read_text())


def test_run_asked_to_continue_writes_strict_json_resolved_policy_and_progress_lines(tmp_path, capsys):
    """--allow-nonfinite: all 4 steps, exit 0, non-finite numbers as strings in every JSON output; the
    policy printed at start and stored in summary.json with the backend resolved (not "auto");
    progress lines since pytest's stderr is not a terminal. (One run checks all three: compiles are slow.)"""
    from taco_jax import kernels

    out = tmp_path / "run"
    assert main(["train", "--lr", "1e6", "--warmup-steps", "0", "--steps", "4", "--allow-nonfinite",
                 "--log-every", "2", "--backend", "auto", "--comm", "int8", "--dp-comm", "taco",
                 "--site", "ar_bwd:kind=taco,fmt=e5m2,group_size=64", "--no-final-checkpoint", "--out", str(out),
                 *TINY[:-1]]) == 0
    captured = capsys.readouterr()
    err = captured.err
    summary = _strict_loads((out / "summary.json").read_text())
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert summary["final_val_loss"] in ("NaN", "Infinity")
    shown = dict(line.strip().split(": ", 1) for line in captured.out.splitlines()[1:])  # the summary block
    assert not math.isfinite(float(shown["val loss"]))  # as in summary.json
    assert shown["full summary"].strip() == str(out / "summary.json")
    assert (out / "loss.png").exists()  # `train` writes its loss plot
    assert not (out / "checkpoints").exists()  # --no-final-checkpoint: no (empty) checkpoints/ folder

    concrete = kernels.resolve("auto")
    assert summary["backend"] == concrete != "auto"
    assert summary["comm"] == "per-site" and summary["compressed_axes"] == ["data", "tensor"]
    pol = CommPolicy.from_dict(summary["policy"])
    # the other kinds run the jnp reference; wire codec and transport are resolved too (one process: xla)
    assert pol.ar_fwd == CodecConfig(kind="int8", backend="reference", wire="generic", transport="xla")
    wire = "ffi" if concrete == "ffi" else "generic"
    assert pol.ar_bwd == CodecConfig(fmt="e5m2", group_size=64, backend=concrete, wire=wire, transport="xla")
    assert pol.dp_grads.backend == concrete and pol.dp_grads.kind == "taco"
    assert f"ar_bwd=taco-e5m2-G64-dual[{concrete}]" in err and f"data: taco-e4m3-G128-dual[{concrete}]" in err
    assert "step 2/4" in err and "step 4/4" in err


def test_resume_without_evaluation_reports_no_final_val_loss(tmp_path, capsys):
    """A run that evaluated (step 2), resumed to step 3 with --eval-batches 0: the progress line shows
    step 2's val loss named as step 2's; summary.json's final_val_loss is null and the summary block
    shows none (the final weights were not evaluated); nothing of step 3 is a val loss."""
    out = str(tmp_path / "run")
    assert main(["train", "--steps", "2", "--warmup-steps", "0", "--out", out, *TINY]) == 0
    capsys.readouterr()
    assert main(["train", "--steps", "3", "--warmup-steps", "0", "--out", out, "--resume", "--log-every", "1",
                 *TINY[:-1], "--eval-batches", "0"]) == 0
    captured = capsys.readouterr()
    summary = _strict_loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_val_loss"] is None and summary["resumed_from_step"] == 2
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and "val_loss" in recs[1] and "val_loss" not in recs[2]
    line = rf"step 3/3 loss \d+\.\d{{4}} val {recs[1]['val_loss']:.4f} \(step 2\)"
    assert re.search(line, captured.err), captured.err
    assert "val loss" not in captured.out


def test_compare_summary_per_axis_ratio_and_plot_labels(tmp_path):
    from PIL import Image

    from taco_jax.train.compare import compare
    from taco_jax.train.step import lr_schedule

    cfg = TrainConfig.from_flags(steps=2, warmup_steps=0, vocab_size=512, batch_size=8, seq_len=32, eval_batches=1,
                                 dp_comm="int8", out=str(tmp_path))
    summary = compare(cfg, progress=False)
    ratio = summary["wire_ratio_taco_over_none"]
    assert set(ratio) == {"data", "tensor"} and ratio["data"] < 0.5 and ratio["tensor"] < 0.5
    assert summary["tensor_wire_ratio_taco_over_none"] == ratio["tensor"]
    # the printed ratios say what they are measured against: the compiled exact step (XLA:CPU widens
    # its bf16 all-reduces to f32), and its bf16 messages as issued (twice the ratio then)
    issued = summary["tensor_wire_ratio_vs_exact_issued"]
    assert issued == pytest.approx(2 * ratio["tensor"], rel=0.05)
    shown = {k.strip(): v.strip() for k, v in (line.split(": ", 1) for line in
                                               summary_block(summary, tmp_path).splitlines()[1:])}
    assert shown["wire ratio compiled"].startswith(f"data {ratio['data']:.3f}, tensor {ratio['tensor']:.3f} "
                                                   "(taco / exact bytes per step as compiled; XLA:CPU widens")
    assert shown["wire ratio issued"] == f"{issued:.3f} (tensor axis: taco / the exact step's bfloat16 messages " \
                                         "as issued)"
    # the absolute bytes beside the ratios, per run and mesh axis, and the run length
    wire = summary["wire_bytes_per_step"]
    assert shown["wire bytes/step"].startswith(
        f"none: data {format_bytes(wire['none']['data'])}, tensor {format_bytes(wire['none']['tensor'])}; "
        f"taco: data {format_bytes(wire['taco']['data'])}, tensor {format_bytes(wire['taco']['tensor'])} (sent per")
    assert shown["steps"] == "2"
    assert shown["taco run codecs"] == summary["codecs_taco"] == "data: int8-G128-had, tensor: taco-e4m3-G128-dual"
    # steady-state throughput: batch 8 × 32 tokens over the median step after the first (here step 2)
    from taco_jax.util.jsonio import read_metrics

    for run_ in ("none", "taco"):
        step2 = read_metrics(tmp_path / run_ / "metrics.jsonl")[1]
        assert summary["step_tokens_per_s"][run_] == pytest.approx(8 * 32 / step2["step_s"])
        assert step2["lr"] == pytest.approx(float(lr_schedule(cfg)(1)))  # the learning rate of step 2's update
    info = Image.open(tmp_path / "loss.png").info
    assert info["Title"].startswith("gpt2-tiny on Shakespeare")
    assert "compressed (data: int8-G128-had, tensor: taco-e4m3-G128-dual)" in info["Description"]


def test_compare_refuses_a_policy_that_compresses_nothing(tmp_path):
    """compare --comm none, or a codec only on an axis the mesh lacks, would train the exact run twice,
    and --eval-batches 0 would leave no validation loss to compare: refused before training, naming
    the way out."""
    from taco_jax.train.compare import compare

    with pytest.raises(ValueError, match=r"this policy compresses no site \(--comm none.*both runs would be exact"):
        compare(TrainConfig.from_flags(comm="none", out=str(tmp_path / "c")), progress=False)
    with pytest.raises(ValueError, match=r"compresses the tensor axis, which mesh='data=8' does not have .*both "
                                         r"runs would be exact"):
        compare(TrainConfig.from_flags(mesh="data=8", out=str(tmp_path / "c")), progress=False)
    with pytest.raises(ValueError, match=r"eval_batches=0 evaluates nothing, .*: give 1 or more; set by --eval-b"):
        compare(TrainConfig.from_flags(eval_batches=0, out=str(tmp_path / "c")), progress=False)
    assert not (tmp_path / "c").exists()


def test_ctrl_c_is_one_line_saying_what_is_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a run (KeyboardInterrupt out of `train`): exit 130 and one line, no traceback,
    naming the latest checkpoint and --resume when there is one, else how to stop with a checkpoint."""
    from taco_jax.train import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    argv = ["train", "--steps", "3", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 130
    assert capsys.readouterr().err.splitlines() == [
        "taco-jax: interrupted (Ctrl-C) before any checkpoint; SIGTERM (kill PID) instead checkpoints and stops, "
        "and --checkpoint-every N saves along the way"]
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    assert main([*argv, "--resume"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"taco-jax: interrupted (Ctrl-C); the latest checkpoint is {tmp_path / 'checkpoints' / '2'}: give --resume "
        "to continue from it")


def test_summary_block_gives_throughput_and_compile_time_with_units(tmp_path):
    """The printed summary names each speed and time with its unit (train: one run; compare: per run)."""
    train = {"comm": "taco", "steps": 3, "tokens_per_s": 123456.7, "compile_s": 12.345, "final_val_loss": 4.25,
             "step_tokens_per_s": 234567.8}
    shown = dict(line.strip().split(": ", 1) for line in summary_block(train, tmp_path).splitlines()[1:])
    assert shown["throughput"].strip().startswith("123,457 tokens/s (over the run's wall time after compiling")
    assert shown["step throughput"].strip() == "234,568 tokens/s (median training step after the first: no " \
                                               "evaluation, checkpoint or warmup)"
    assert shown["compile time"].strip() == "12.3 s"
    assert shown["val loss"].strip() == "4.25" and shown["steps"].strip() == "3"
    train["wire_bytes_per_step"] = {"data": 1196548, "tensor": 472620, "stage": 512}
    shown = dict(line.strip().split(": ", 1) for line in summary_block(train, tmp_path).splitlines()[1:])
    assert shown["wire bytes/step"].strip().startswith(
        "data 1.20 MB, tensor 472.62 KB, stage 512 B (sent per device, by mesh axis")
    both = {"val_loss_none": 4.0, "val_loss_taco": 4.1, "val_loss_rel_diff": 0.025,
            "tokens_per_s": {"none": 24.845, "taco": 23.5}}
    shown = dict(line.strip().split(": ", 1) for line in summary_block(both, tmp_path).splitlines()[1:])
    assert shown["throughput"].strip().startswith("none 24.8 tokens/s, taco 23.5 tokens/s (over the run's wall time")
    assert shown["relative diff"].strip() == "+2.500 % ((taco - none) / none)"


def test_flags_map_to_one_policy(tmp_path):
    cfg = TrainConfig.from_flags(comm="int8", dp_comm="taco", pp_comm="tah", backend="ffi", group_size=64)
    assert {getattr(cfg.communication.policy, s).kind for s in TENSOR_SITES} == {"int8"}
    # every site's codec gets the requested backend (--dp-comm / --pp-comm included)
    assert {getattr(cfg.communication.policy, s).backend for s in SITES} == {"ffi"}
    assert cfg.communication.policy.pp_send == CodecConfig(kind="tah", group_size=64, backend="ffi")
    # the policy file is read once, when the config is built
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"sites": {"ar_fwd": {"kind": "int4"}}}))
    cfg = TrainConfig.from_flags(policy_file=str(path), site=["ar_fwd:group_size=256", "ar_bwd:kind=int8"])
    path.unlink()
    assert cfg.communication.policy.ar_fwd == CodecConfig(kind="int4", group_size=256)  # file, then --site
    pol = cfg.communication.policy
    assert pol.ar_bwd == CodecConfig(kind="int8") and pol.all_gather == CodecConfig()
    sites = _strict_loads(jsonio.dumps(cfg.to_dict()))["communication"]["policy"]["sites"]
    assert sites["ar_fwd"] == {"kind": "int4", "group_size": 256}


def test_default_flags_give_the_default_policy():
    assert TrainConfig.from_flags() == TrainConfig()  # --comm taco: TACO on the tensor sites, other axes exact
    assert TrainConfig().communication.policy == CommPolicy.taco()
    with pytest.raises(TypeError, match="not both"):
        TrainConfig.from_flags(policy=CommPolicy.none(), comm="int8")


@pytest.mark.parametrize("flags,match", [
    (dict(site=["attn:fmt=e5m2"]), r"site='attn:fmt=e5m2': write SITE:field=value"),
    (dict(site=["ar_bwd:groupsize=64"]), r"'groupsize=64' is not field=value"),
    (dict(site=["ar_bwd:group_size=big"]), r"group_size='big' is not an int"),
    (dict(site=["ar_bwd:group_size=48"]), r"site='ar_bwd:group_size=48': group_size=48"),
    (dict(site=["ar_bwd:hadamard=maybe"]), r"hadamard='maybe' is not a bool"),
    (dict(comm="none", site=["ar_bwd:fmt=e5m2"]), r"exact \(kind='none'\); give kind="),
    (dict(site=["ar_fwd:site=ar_bwd"]), r"'site=ar_bwd' is not field=value"),  # SITE names the site
    (dict(site=["ar_fwd:kind=int8,fmt=e5m2"]), r"fmt='e5m2' has no effect on kind='int8': it needs a codec with FP8"),
    (dict(site=["ar_fwd:kind=fp8_tensor,group_size=64"]), r"group_size=64 has no effect on kind='fp8_tensor'"),
    (dict(comm="int8", codec_kind="tah"), r"comm='int8' and codec_kind='tah' disagree"),
    (dict(dp_comm="zip"), r"dp_comm='zip'"),
])
def test_bad_flags_name_the_value(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**flags)


@pytest.mark.parametrize("flags,match", [
    (dict(comm="int8", fmt="e5m2"), r"fmt='e5m2' has no effect: it needs a codec with FP8 codes, and this run has "
                                    r"comm='int8', dp_comm='none', pp_comm='none'; drop the flag.*"
                                    r"; set by --fmt or \[communication\] fmt$"),
    (dict(comm="fp8_tensor", group_size=64), r"group_size=64 has no effect: it needs a codec with per-group scales"),
    (dict(comm="int8", backend="ffi"), r"backend='ffi' has no effect: it needs a codec of a kind with group "
                                       r"backends \(taco"),
    (dict(comm="int8", reduce_domain="hadamard"), r"reduce_domain='hadamard' has no effect: .*transform domain"),
    (dict(comm="none", dp_comm="taco", scale_layout="folded"), r"scale_layout='folded' has no effect: it needs a "
                                                               r"taco codec on the tensor axis"),
    (dict(comm="none", dp_comm="int8", codec_kind="int8"), r"codec_kind='int8' has no effect: it needs --comm taco"),
    (dict(comm="none", dp_comm="int8", group_axis="token"), r"group_axis='token' has no effect"),
    (dict(comm="none", pp_comm="taco", chunks=4), r"chunks=4 has no effect: it needs a codec on the tensor-axis "
                                                  r"all-reduce \(ar_fwd, ar_bwd\)"),
    (dict(comm="taco", site=[f"{s}:fmt=e4m3" for s in TENSOR_SITES], fmt="e5m2"),
     r"fmt='e5m2' has no effect: .* with its --policy / --site \(set the field there"),
])
def test_a_codec_flag_that_reaches_no_codec_is_refused(flags, match):
    """A codec flag away from its default must change some codec of a compressed run."""
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**flags)


def test_a_policy_file_or_one_shot_that_overrides_a_flag_is_named(tmp_path):
    """A policy file's own all-reduce settings win over the flags: a flag it overrides is refused, as
    are the two-shot settings with the one-shot all-reduce."""
    pol = tmp_path / "pol.json"
    pol.write_text(json.dumps({"sites": {"ar_bwd": {"kind": "int8"}}, "reduce_domain": "signal", "chunks": 1,
                               "all_reduce_algorithm": "two_shot", "min_bytes": 0}))
    for flag, value, field in (("chunks", 4, "chunks"), ("algorithm", "one_shot", "all_reduce_algorithm"),
                               ("min_bytes", 4096, "min_bytes")):
        with pytest.raises(ValueError, match=rf"{flag}={value!r} has no effect: the policy file '{pol}' sets "
                                             rf"{field}="):
            TrainConfig.from_flags(policy_file=str(pol), **{flag: value})
    for flag, value in (("chunks", 2), ("reduce_domain", "hadamard")):
        with pytest.raises(ValueError, match=rf"{flag}={value!r} has no effect with algorithm='one_shot'"):
            TrainConfig.from_flags(algorithm="one_shot", **{flag: value})
    # --codec-kind none with --comm taco makes the tensor axis exact: it has an effect
    assert TrainConfig.from_flags(comm="taco", codec_kind="none", dp_comm="int8").communication.policy.ar_fwd.kind == \
        "none"


def test_the_command_line_prints_a_flag_warning_on_one_line(capsys):
    assert main(["predict", "--model", "gpt2-tiny", "--mesh", "data=2,tensor=4", "--hardware", "h200",
                 "--comm", "none", "--fmt", "e5m2"]) == 0
    err = capsys.readouterr().err
    assert "[taco-jax] warning: fmt='e5m2' has no effect" in err and "UserWarning" not in err


@pytest.mark.parametrize("flags,match", [
    (dict(comm="none", fmt="e5m2"), r"fmt='e5m2' has no effect: .*comm='none'.*; the run is exact, so it is ignored"),
    (dict(comm="none", backend="pallas"), r"backend='pallas' has no effect"),
    (dict(comm="none", chunks=4, nonfinite="zero"), r"nonfinite='zero' has no effect"),
])
def test_a_codec_flag_of_an_exact_run_is_named_in_a_warning(flags, match):
    """The exact baseline of a configured run (its codec flags and --comm none) runs, with a warning."""
    with pytest.warns(UserWarning, match=match):
        cfg = TrainConfig.from_flags(**flags)
    assert all(getattr(cfg.communication.policy, s).kind == "none" for s in SITES)


@pytest.mark.parametrize("flags", [
    dict(comm="none", dp_comm="int8", backend="auto", fmt="e4m3"),  # defaults are never refused
    dict(comm="int8", dp_comm="taco", backend="ffi"),  # the data axis's taco takes the backend
    dict(comm="none", pp_comm="taco", fmt="e5m2", nonfinite="zero", group_size=64),
    dict(comm="none", site=["ar_bwd:kind=taco"], backend="reference"),  # a site's new kind takes --backend
    dict(comm="fp8_tensor", chunks=4, group_size=64),  # chunk boundaries are multiples of G
    dict(comm="int8", codec_kind="int8"),
])
def test_a_codec_flag_that_reaches_some_axis_is_accepted(flags):
    assert TrainConfig.from_flags(**flags).communication.policy != CommPolicy.none()


def test_out_that_cannot_be_a_folder_is_one_clear_error(tmp_path, capsys):
    afile = tmp_path / "taken"
    afile.write_text("x")
    for out, match in ((afile, "is an existing file"), (afile / "sub", "is not a writable folder")):
        assert main(["train", "--steps", "1", "--out", str(out), *TINY]) == 2
        err = capsys.readouterr().err
        assert err.startswith("taco-jax: error: ") and match in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["plan", "predict"])
def test_plan_help_lists_the_flags_it_uses_and_accepts_train_s_others(command, tmp_path, capsys):
    """`plan` / `predict --help` list the run's shape, communication and hardware flags, not train's
    steps / optimization / checkpoint flags; those are still accepted (a train config works as it is)."""
    from taco_jax.cli import PLAN_UNUSED

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--mesh", "--batch-size", "--comm", "--site", "--hardware"))
    listed = {f.replace("-", "_") for f in re.findall(r"^\s+--([\w-]+)", text, flags=re.M)}
    assert listed.isdisjoint(PLAN_UNUSED) and "lr" not in listed and "checkpoint_every" not in listed
    assert ("out" in listed) == (command == "plan")
    own = ["--no-compile", "--out", str(tmp_path)] if command == "plan" else []
    assert main([command, "--steps", "7", "--lr", "0.1", "--checkpoint-every", "2", "--json", *own]) == 0
    assert json.loads(capsys.readouterr().out)["predict"]["speedup"] > 0


def test_help_lists_presets_and_axis_flags(capsys):
    from taco_jax.models import PRESETS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in PRESETS)
    assert "also --dp-comm / --pp-comm" in text  # --fmt / --group-size apply to every axis
    assert "--site SITE:FIELD=VALUE" in text and "data × tensor meshes only" in text


@pytest.mark.parametrize("command", ["train", "compare", "plan", "predict", "launch", "sample", "prepare-data"])
def test_help_gives_each_flag_one_default(command, capsys):
    """No flag's help says its default twice (its own text and argparse's "(default: ...)")."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    flags = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    doubled = [f.split()[0] for f in flags if "(default: " in f and len(re.findall(r"\bdefault\b", f)) > 1]
    assert not doubled, doubled


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "abc"], "taco-jax train: error: argument --steps: invalid int value: 'abc' "
                                  "(all flags: taco-jax train --help)"),
    (["launch", "--processes", "x", "--", "train"], "taco-jax launch: error: argument --processes: invalid int "
                                                    "value: 'x' (all flags: taco-jax launch --help)"),
    (["trian"], "taco-jax: error: argument command: invalid choice: 'trian'"),
    (["train", "--stpes", "5"], "taco-jax train: error: unrecognized arguments: --stpes 5 (did you mean --steps?) "
                                "(all flags: taco-jax train --help)"),
    (["launch", "--pin", "--", "train"], "taco-jax launch: error: unrecognized arguments: --pin (did you mean "
                                         "--pin-cpus?)"),  # the flag it begins, not difflib's --link
])
def test_a_usage_error_is_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_a_schedule_without_a_pipeline_is_a_warning():
    """`--schedule 1f1b` on a run with stage = 1 and one microbatch orders nothing: a warning, not silence;
    with a pipeline (microbatches > 1) none."""
    from taco_jax.train.settings import FlagWarning

    with pytest.warns(FlagWarning, match=r"schedule='1f1b' has no effect: this run has no pipeline"):
        TrainConfig.from_flags(schedule="1f1b")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlagWarning)
        TrainConfig.from_flags(schedule="1f1b", mesh="data=2,stage=2,tensor=2", microbatches=2)
        TrainConfig.from_flags()  # the defaults warn of nothing


def test_the_command_line_prints_each_flag_warning_once(capsys):
    """A config checked again where a command derives one from it (compare, plan) warns again; the command
    line prints each warning once."""
    from taco_jax.cli.common import show_warning
    from taco_jax.train.settings import FlagWarning

    text = "test-only flag warning printed once"
    for _ in range(3):
        show_warning(text, FlagWarning, "x.py", 1)
    assert capsys.readouterr().err.count(text) == 1


@pytest.mark.parametrize("command,flag", [(["train", "--pin-cpus"], "--pin-cpus"),
                                          (["compare", "--steps", "3", "--link=1gbit"], "--link"),
                                          (["--pin-cpus", "train"], "--pin-cpus")])
def test_a_launch_flag_after_the_double_dash_is_named_before_any_process_starts(command, flag, capsys):
    """No command takes the launcher's own flags: one given after `--` is refused once, naming where it
    goes (before, `train` refused it in every process, or in none of them when it came first)."""
    assert main(["launch", "--processes", "2", "--", *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"launch: {flag} is a flag of `taco-jax launch`, not of the command after " \
        f"`--`; put it before `--`" in err, err
