"""The trainer's tools beside the loop: `--profile-steps` (a jax.profiler trace holding the named scopes
of the compressed collectives), `--tensorboard` (events read back), `--config FILE` (TOML / a run's
config.json; the command line wins; errors name the key)."""

import glob
import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from taco_jax.cli import config_from_argv, main
from taco_jax.data.shakespeare import EOT
from taco_jax.models import load_hf
from taco_jax.train.config import flag_values
from taco_jax.train.profile import hlo_op_names
from taco_jax.train.sample import load_for_sampling
from taco_jax.util import jsonio

QWEN3 = pathlib.Path(__file__).parent / "fixtures" / "hf" / "qwen3"

TINY = ["--vocab-size", "512", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _cache(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("TACO_JAX_CACHE", str(tokenizer_dir))


def _executed_scopes(xplane_path) -> tuple[dict[str, set], list[int]]:
    """({HLO module: taco_* scopes in the op names of its ops that ran}, numbers of the traced steps)."""
    from jax.profiler import ProfileData

    names = hlo_op_names(open(xplane_path, "rb").read())
    scopes, steps = {}, []
    for plane in ProfileData.from_file(str(xplane_path)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_module" in stats and "hlo_op" in stats:
                    op_name = names.get(stats["hlo_module"], {}).get(stats["hlo_op"], "")
                    scopes.setdefault(stats["hlo_module"], set()).update(re.findall(r"taco_[a-z_]+", op_name))
                if event.name == "train_step" and "step_num" in stats:
                    steps.append(int(stats["step_num"]))
    return scopes, sorted(set(steps))


def test_toml_config_profile_tensorboard_and_export(tmp_path, capsys, monkeypatch):
    """One run set up by a TOML file (the command line's --out wins over the file's): the profile of
    steps 2:3 holds the train step's executed ops under the codec's named scopes; the TensorBoard
    events hold metrics.jsonl's loss, gradient norm and validation loss, the wire bytes and the
    monitor's SQNR; the run's config.json, passed back as --config, gives the same configuration
    and records the relative --export-hf absolute: `sample --from` the run, from another folder
    holding a decoy export of the same relative name, loads the run's export; the export's
    end-of-text id (the tokenizer's) is its eos / bos in config.json and generation_config.json,
    and `transformers` generate stops there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 3\neval-every = 2\nmonitor_every = 2\nprofile_steps = "2:3"\ntensorboard = true\n'
                    f'out = "{tmp_path / "not-this"}"\nsite = ["ar_bwd:fmt=e5m2"]\n')
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(toml), *TINY, "--out", str(out), "--export-hf", "hf"]) == 0
    assert not (tmp_path / "not-this").exists()
    recs = jsonio.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]

    (xplane,) = glob.glob(str(out / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    scopes, steps = _executed_scopes(xplane)
    assert steps == [2, 3]
    assert {"taco_encode", "taco_decode", "taco_psum"} <= scopes["jit_train_step"], scopes
    # experiments/codec/codec_time.py's reading of the same trace: the codec's share of each traced step
    from experiments.codec.codec_time import summarize
    from taco_jax.kernels import ffi_codec

    share = summarize(xplane, out / "metrics.jsonl", 0, jax.device_count())
    assert share["steps"] == 2 and min(share["codec"], share["collectives"], share["other"], share["step_ms"]) > 0
    assert share["codec"] < share["other"], share
    assert not ffi_codec.available() or any(k.endswith("taco_encode") for k in share["ffi_call_us"]), share

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    f32 = lambda v: float(np.float32(v))  # noqa: E731  (TensorBoard stores float32)
    assert scalars["train/loss"] == [(r["step"], f32(r["loss"])) for r in recs]
    assert scalars["train/grad_norm"] == [(r["step"], f32(r["grad_norm"])) for r in recs]
    assert scalars["val/loss"] == [(r["step"], f32(r["val_loss"])) for r in recs if "val_loss" in r] != []
    wire = json.loads((out / "summary.json").read_text())["wire_bytes_per_step"]
    assert scalars["wire_bytes_per_step/tensor"] == [(s, f32(wire["tensor"])) for s in (1, 2, 3)]
    assert [s for s, _ in scalars["monitor/ar_bwd/sqnr_db"]] == [2, 3]
    assert scalars["monitor/ar_bwd/min_sqnr_db"][-1] == (3, f32(recs[-1]["monitor"]["ar_bwd"]["min_sqnr_db"]))

    written = json.loads((out / "config.json").read_text())
    assert written["training"]["steps"] == 3 and written["checkpoint"]["out"] == str(out)
    assert written["logging"]["tensorboard"] is True
    assert written["communication"]["policy"]["sites"]["ar_bwd"]["fmt"] == "e5m2"
    again = config_from_argv(["train", "--config", str(out / "config.json")])
    assert jsonio.strict(again.to_dict()) == written  # the same run, policy included
    assert (written["checkpoint"]["export_hf"], written["data"]["path"], written["model"]["init_from"]) == \
        (str(tmp_path / "hf"), "", "")

    # sample --from the run, from another folder that has a model folder "hf" of its own
    export, params = load_hf(tmp_path / "hf")
    shutil.copytree(QWEN3, tmp_path / "elsewhere" / "hf")
    monkeypatch.chdir(tmp_path / "elsewhere")
    older = {**flag_values(written), "export_hf": "hf", "out": "run"}  # flat, relative: as older runs wrote it
    for conf in (written, older):
        (out / "config.json").write_text(json.dumps(conf))
        model, got, _ = load_for_sampling(out)
        assert model.config == export.config
        jax.tree.map(np.testing.assert_array_equal, got, params)

    # the export's end-of-text: the run's tokenizer's, as transformers reads it
    eot = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(EOT)
    hf_conf, gen = (json.loads((tmp_path / "hf" / f).read_text()) for f in ("config.json", "generation_config.json"))
    assert hf_conf["eos_token_id"] == hf_conf["bos_token_id"] == gen["eos_token_id"] == gen["bos_token_id"] == eot
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert tok.eos_token_id == tok.bos_token_id == lm.generation_config.eos_token_id == lm.config.eos_token_id == eot
    prompt = torch.tensor([tok.encode("ROMEO:")])
    with torch.no_grad():  # end-of-text made the likeliest next token: generation stops after it
        ids = lm.generate(prompt, max_new_tokens=8, do_sample=False, sequence_bias={(eot,): 100.0},
                          pad_token_id=eot)
    assert ids[0, prompt.shape[1]:].tolist() == [eot]


def test_a_run_of_another_run_s_config_json_exports_into_its_own_folder(tmp_path, capsys):
    """`train --out A --export-hf A/hf`, then `train --config A/config.json --out B` (another seed):
    B exports into B/hf (A's config.json records its export inside --out as {out}/hf) and A's export
    is left as it was; `sample --from A` reads it and says so with its step. An --export-hf into A's
    folder from another run is refused before anything is built, naming the folder and
    --overwrite-export. Each export is said with its step and records it (`EXPORT_RECORD`); its
    files, model.safetensors included, are written 0666 less the umask, as the run's own."""
    import os

    from taco_jax.models.hf import EXPORT_RECORD, read_record

    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["train", *TINY, "--eval-batches", "0", "--steps", "2", "--out", str(first), "--export-hf",
                 str(first / "hf")]) == 0
    assert f"[taco-jax] HF export of step 2 written to hf (hf/{EXPORT_RECORD} records the step)" in \
        capsys.readouterr().err
    assert json.loads((first / "config.json").read_text())["checkpoint"]["export_hf"] == "{out}/hf"
    assert read_record(first / "hf") == {"step": 2, "steps": 2, "preempted": False, "run": str(first.resolve())}
    before = {p.name: p.read_bytes() for p in (first / "hf").iterdir()}
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*(first / "hf").iterdir(), first / "config.json"]}
    assert set(modes.values()) == {0o666 & ~umask}, modes

    assert main(["train", "--config", str(first / "config.json"), "--seed", "1", "--out", str(second)]) == 0
    assert {p.name: p.read_bytes() for p in (first / "hf").iterdir()} == before
    assert read_record(second / "hf")["run"] == str(second.resolve())
    assert (second / "hf" / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert main(["train", "--config", str(first / "config.json"), "--out", str(third), "--export-hf",
                 str(first / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"export_hf='{first / 'hf'}' lies in '{first}', the folder of another run" in err
    assert "--overwrite-export to write there anyway" in err and not (third / "config.json").exists()

    _, params, _ = load_for_sampling(first)
    jax.tree.map(np.testing.assert_array_equal, params, load_hf(first / "hf")[1])
    assert f"[taco-jax] sample: the weights of {first / 'hf'} (the run's --export-hf, step 2)" in \
        capsys.readouterr().err


def test_command_line_wins_over_the_config_file(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text('steps = 7\nlr = 1e-3\nmodel = "qwen3-tiny"\nmin_bytes = "auto"\nmonitor_min_sqnr = -inf\n'
                    'sequence_parallel = true\n')
    cfg = config_from_argv(["train", "--config", str(toml), "--steps", "9", "--no-sequence-parallel"])
    assert (cfg.training.steps, cfg.training.lr, cfg.model.name, cfg.communication.policy.min_bytes,
            cfg.parallelism.sequence_parallel) == (9, 1e-3, "qwen3-tiny", "auto", False)
    assert cfg.logging.monitor_min_sqnr == float("-inf")
    # a run's config.json holds its policy; communication flags on the command line replace it
    run = tmp_path / "config.json"
    jsonio.write(run, config_from_argv(["train", "--comm", "int8", "--dp-comm", "taco"]).to_dict())
    assert config_from_argv(["train", "--config", str(run)]).communication.policy.dp_grads.kind == "taco"
    cfg = config_from_argv(["train", "--config", str(run), "--comm", "none"])
    assert cfg.communication.label == "none" and cfg.communication.policy.dp_grads.kind == "none"
    assert "its policy is replaced by the command line's communication flags (--comm)" in capsys.readouterr().err


@pytest.mark.parametrize("text, suffix, match", [
    ("stepz = 3\n", ".toml", r"unknown key 'stepz' \(not a flag of train; did you mean 'steps'\?\)"),
    ('steps = "ten"\n', ".toml", r": \[training\] steps='ten' must be an integer"),
    ('[training]\nlr = "x"\n', ".toml", r": \[training\] lr='x' must be a number"),
    ("lr = true\n", ".toml", r"lr=True must be a single"),
    ('model = "gpt5"\n', ".toml", r"\[model\] name='gpt5' is not one of"),
    ('min_bytes = "lots"\n', ".toml", r"min_bytes='lots'"),
    ("allow_nonfinite = 1\n", ".toml", r"allow_nonfinite=1 must be true or false"),
    ("steps = \n", ".toml", r"not valid TOML"),
    ('{"steps": 3,}', ".json", r"not valid JSON"),
    ("[1, 2]", ".json", r"must hold a table"),
    ('steps = 2\nprofile_steps = "3:4"\n', ".toml", r"profile_steps='3:4' must satisfy 1 <= A <= B <= steps=2"),
    ('profile_steps = "a:b"\n', ".toml", r"profile_steps='a:b' must be A:B"),
    ('comm = "int8"\n[policy]\nsites = {}\n', ".toml", r"gives a policy table and communication flags \(comm\)"),
    ('[policy]\nsites = {ar_fwd = {fmt = "e9m9"}}\n', ".toml", r"policy.*e9m9"),
])
def test_bad_config_file_exits_2_naming_the_key(tmp_path, capsys, text, suffix, match):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    assert main(["train", "--config", str(path), *TINY, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taco-jax: error: ") and re.search(match, err[0]), err
    assert not (tmp_path / "run" / "config.json").exists()  # refused before anything ran


def test_missing_config_file_is_named(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config '{tmp_path / 'nope.toml'}': cannot read it" in capsys.readouterr().err
