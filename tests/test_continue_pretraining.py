"""Continued pre-training end to end on the fixtures (no network): a tiny Qwen3 checkpoint with its own
tokenizer -> `prepare-data` on a text file -> `train --init-from --data --comm taco` on 2 processes
whose tensor groups each span both processes (and on 1, the reference) with `--export-hf` -> per-step
losses and gradient norms bit-identical, the exports byte-identical, `transformers` loads
them with logits equal to taco_jax's, the validation loss falls, the recorded model is the
checkpoint's, a resume without `--init-from` names it, and `sample` continues a prompt."""

import json
import pathlib
import re

import numpy as np
import pytest
from _procs import ROOT, cli, losses, metrics, run, start

from taco_jax.data.shakespeare import play_text
from taco_jax.models import hf, load_hf
from taco_jax.train.checkpoint import Checkpoints

pytestmark = pytest.mark.extras

QWEN3 = pathlib.Path(__file__).parent / "fixtures" / "hf" / "qwen3"


def _files(d: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_continue_pretraining_qwen3_on_two_processes(tmp_path, cache):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    (tmp_path / "corpus.txt").write_text(play_text("macbeth")[:40000])
    r = run(cli("prepare-data", tmp_path / "corpus.txt", "--init-from", QWEN3, "--out", tmp_path / "data",
                "--no-progress"), cache, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"] <= 99

    args = ["train", "--init-from", QWEN3, "--data", tmp_path / "data", "--comm", "taco", "--mesh", "tensor=2,data=2",
            "--batch-size", "8", "--seq-len", "32", "--steps", "9", "--warmup-steps", "0", "--eval-every", "3",
            "--eval-batches", "4", "--lr", "3e-3", "--checkpoint-every", "9", "--log-every", "3", "--no-progress"]
    procs = {n: start(cli(*args, "--out", tmp_path / f"p{n}", "--export-hf", tmp_path / f"hf{n}", processes=n),
                      cache, tmp_path / f"p{n}.log") for n in (1, 2)}
    for n, p in procs.items():
        assert p.wait(timeout=420) == 0, (tmp_path / f"p{n}.log").read_text()[-3000:]

    # 2 processes (each holding its shards) export what 1 process exports, byte for byte, with the
    # checkpoint's tokenizer files and generation config; each export records its step and run
    one, two = _files(tmp_path / "hf1"), _files(tmp_path / "hf2")
    assert sorted(two) == ["config.json", "generation_config.json", "model.safetensors", hf.EXPORT_RECORD,
                           "tokenizer.json", "tokenizer_config.json"]
    assert [json.loads(files.pop(hf.EXPORT_RECORD)) for files in (one, two)] == \
        [{"step": 9, "steps": 9, "preempted": False, "run": str((tmp_path / f"p{n}").resolve())} for n in (1, 2)]
    assert one == two
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert two[name] == (QWEN3 / name).read_bytes()

    # transformers loads the export; its logits equal taco_jax's
    ids = np.asarray(np.load(QWEN3 / "golden.npz")["ids"])
    model, params = load_hf(tmp_path / "hf2")
    mine = np.asarray(model.logits(params, ids))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager")
    with torch.no_grad():
        want = theirs.float().eval()(torch.from_numpy(ids).long()).logits.numpy()
    assert np.abs(mine - want).max() <= 1e-5, np.abs(mine - want).max()
    assert not np.allclose(mine, np.load(QWEN3 / "golden.npz")["logits"], atol=1e-3)  # it trained

    # the validation loss on the prepared data falls; 1 and 2 processes ran the same steps
    recs = metrics(tmp_path / "p2")
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0], val
    assert losses(tmp_path / "p2") == losses(tmp_path / "p1")  # per-step losses and gradient norms, bit for bit

    # the recorded model: the checkpoint's architecture and folder
    label = hf.architecture_label(hf.config_from_hf(QWEN3))
    assert label.startswith("qwen3(layers=2, hidden=32")
    log = (tmp_path / "p2.log").read_text()
    assert f"[taco-jax] {label} from {QWEN3} on mesh tensor=2,data=2" in log
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    config = json.loads((tmp_path / "p2" / "config.json").read_text())
    assert summary["model"] == config["model"]["name"] == label
    assert config["model"]["init_from"] == summary["init_from"] == str(QWEN3)
    ckpt = Checkpoints(tmp_path / "p2" / "checkpoints", keep=3)
    try:
        assert ckpt.read_meta(9)["config"]["model"]["name"] == label
    finally:
        ckpt.close()
    assert (tmp_path / "p2" / "tokenizer.json").read_bytes() == (QWEN3 / "tokenizer.json").read_bytes()

    # resuming without --init-from is refused, naming the checkpoint the run started from
    r = run(cli("train", "--data", tmp_path / "data", "--vocab-size", "512", "--mesh", "data=2,tensor=2",
                "--steps", "12", "--resume", "--out", tmp_path / "p2", "--no-progress"), cache, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert re.search(rf"is of model='{re.escape(label)}', this run has model='gpt2-tiny' \(the run started from "
                     rf"init_from='{re.escape(str(QWEN3))}'; give --init-from", r.stderr), r.stderr[-3000:]

    # sample continues a prompt with the run's tokenizer
    r = run(cli("sample", "--from", tmp_path / "p2", "--prompt", "MACBETH:", "--max-new-tokens", "8"), cache,
            timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("MACBETH:") and len(r.stdout.strip()) > len("MACBETH:")
    # ... and from the run's latest checkpoint when it has no export, named by a relative path
    import os
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tmp_path / "p2" / "checkpoints", ck / "checkpoints")
    shutil.copy(tmp_path / "p2" / "tokenizer.json", ck)
    (ck / "config.json").write_text(json.dumps({**config, "checkpoint": {**config["checkpoint"], "export_hf": ""}}))
    r = run(cli("sample", "--from", os.path.relpath(ck, ROOT), "--prompt", "MACBETH:", "--max-new-tokens", "8"),
            cache, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Metadata file does not exist" not in r.stderr  # no absl warning about orbax's step metadata
    assert r.stdout.startswith("MACBETH:") and len(r.stdout.strip()) > len("MACBETH:")
