"""The long paired-seed study's pieces on a tiny configuration: the corpus prepared reproducibly from
the interpreter's own stdlib (a subset), a real 2-seed × {exact, taco} study (real training, real
processes) and its report recomputed from the runs' metrics, `--analyze` training nothing, and a
study killed (SIGKILL) mid-run that continues where it stopped with bit-identical records."""

import json
import os
import signal
import sys

import numpy as np
import pytest
from _procs import run, start, wait_for

from experiments.fidelity import fidelity_long as fl
from experiments.fidelity import prepare_corpus as pc

STUDY = ["--models", "gpt2-tiny", "--steps", "6", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
         "--eval-batches", "1", "--monitor-every", "2", "--checkpoint-every", "2", "--log-every", "1",
         "--milestones", "2", "4", "--train-window", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    return out, pc.main(["--out", str(out), "--max-files", "20", "--vocab-size", "512", "--no-progress"])


def test_corpus_is_the_stdlib_in_order_reproducible_and_hashed(corpus, tmp_path):
    out, c = corpus
    everything = pc.corpus_files(pc.stdlib_root())
    assert [u["path"] for u in c["used"]] + [s["path"] for s in c["skipped"]] == sorted(
        f.relative_to(pc.stdlib_root()).as_posix() for f in everything[:20])
    assert not any("site-packages" in f.parts for f in everything)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] <= 512 and meta["sources"][0]["documents"] == c["files"]
    assert c["tokens"] == ((out / "train.bin").stat().st_size + (out / "val.bin").stat().st_size) // 2
    assert c["license_sha256"] == pc.sha256_file(pc.stdlib_root() / "LICENSE.txt")
    again = pc.prepare_corpus(tmp_path / "again", max_files=20, vocab_size=512, progress=False)
    assert (again["input_sha256"], again["output_sha256"]) == (c["input_sha256"], c["output_sha256"])
    assert c["input_sha256"] == pc.list_hash((u["path"], pc.sha256_file(pc.stdlib_root() / u["path"]))
                                             for u in c["used"])


def test_corpus_lists_undecodable_files_and_leaves_out_installed_packages(tmp_path):
    root = tmp_path / "lib"
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "site-packages" / "pkg" / "x.py").write_text("import this\n" * 50)
    (root / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    (root / "b.py").write_bytes("# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n".encode("latin-1"))
    c = pc.prepare_corpus(tmp_path / "out", root=root, vocab_size=300, progress=False)
    assert [u["path"] for u in c["used"]] == ["a.py"]
    assert [s["path"] for s in c["skipped"]] == ["b.py"] and "not UTF-8" in c["skipped"][0]["reason"]
    with pytest.raises(ValueError, match="max_files=-1"):
        pc.corpus_files(root, -1)


def _command(corpus, out, seeds: int) -> list[str]:
    return [sys.executable, "-m", "experiments.fidelity.fidelity_long", "--corpus", str(corpus[0]), "--out", str(out),
            "--seeds", str(seeds), *STUDY]


@pytest.fixture(scope="module")
def study(corpus, cache, tmp_path_factory):
    """A finished 2-seed study of gpt2-tiny (real training, one process)."""
    out = tmp_path_factory.mktemp("study") / "s"
    r = run(_command(corpus, out, 2), cache, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _records(path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in fl.TIMING_KEYS}
            for line in open(path / "metrics.jsonl")]


def test_report_is_recomputed_from_the_runs_and_analyze_trains_nothing(study):
    report = json.loads((study / "report.json").read_text())
    m = report["models"]["gpt2-tiny"]
    assert report["complete_pairs"] == 2 and m["seeds"] == [0, 1] and m["milestones"] == [2, 4, 6]
    runs = {(v, s): [json.loads(line) for line in open(fl.run_dir(study, "gpt2-tiny", v, s) / "metrics.jsonl")]
            for v in fl.VARIANTS for s in (0, 1)}
    for v, s in runs:
        assert not (fl.run_dir(study, "gpt2-tiny", v, s) / "checkpoints").exists()  # removed once complete
    val = lambda v, s, k: next(r["val_loss"] for r in runs[(v, s)] if r["step"] == k)  # noqa: E731
    for k in (2, 4, 6):
        d = [100 * (val("taco", s, k) - val("none", s, k)) / val("none", s, k) for s in (0, 1)]
        assert m["val"][str(k)]["mean"] == pytest.approx(np.mean(d), rel=1e-9, abs=1e-12)
        assert m["val"][str(k)]["n"] == 2
    loss = lambda v, s: [r["loss"] for r in runs[(v, s)] if r["step"] in (5, 6)]  # noqa: E731
    d = [100 * (np.mean(loss("taco", s)) - np.mean(loss("none", s))) / np.mean(loss("none", s)) for s in (0, 1)]
    assert m["train"]["6"]["mean"] == pytest.approx(np.mean(d), rel=1e-9, abs=1e-12)
    gn = lambda v, s: np.array([r["grad_norm"] for r in runs[(v, s)]])  # noqa: E731
    ratio = [100 * (np.mean(gn("taco", s) / gn("none", s)) - 1) for s in (0, 1)]
    assert m["grad_norm_ratio_run_mean_pct"]["mean"] == pytest.approx(np.mean(ratio), rel=1e-9, abs=1e-12)
    # SQNR: the sequence-parallel sites of the TACO runs, monitored at steps 2, 4, 6
    assert sorted(m["sqnr"]) == ["all_gather", "reduce_scatter"]
    for site, s in m["sqnr"].items():
        assert (s["first_step"], s["last_step"], s["steps"]) == (2, 6, [2, 4, 6])
        at = lambda k, site=site: np.mean([float(next(r["monitor"][site]["sqnr_db"]  # noqa: E731
                                                      for r in runs[("taco", sd)] if r["step"] == k)) for sd in (0, 1)])
        assert s["first_sqnr_db"] == pytest.approx(at(2)) and s["last_sqnr_db"] == pytest.approx(at(6))
        assert 10 < s["last_sqnr_db"] < 60 and np.isfinite(s["slope_db_per_1k_steps"])
        assert s["drifts_down"] == (s["drift_db"] < -fl.DRIFT_DB)
    assert not any("monitor" in r for v, sd in runs if v == "none" for r in runs[(v, sd)])
    assert m["tokens_per_run"] == 6 * 2 * 32 and m["tokens_total"] == 4 * 6 * 2 * 32
    for png in ("gap.png", "sqnr.png"):
        assert (study / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --analyze: the same tables from the saved runs; no run file touched
    before = {p: p.stat().st_mtime_ns for p in (study / "runs").rglob("*") if p.is_file()}
    md = (study / "report.md").read_text()
    fl.main(["--out", str(study), "--analyze", "--milestones", "2", "4", "--train-window", "2"])
    assert (study / "report.md").read_text() == md
    assert {p: p.stat().st_mtime_ns for p in (study / "runs").rglob("*") if p.is_file()} == before
    assert "| gpt2-tiny | val | 6 | 2 |" in md and "reduce_scatter" in md


def test_killed_study_continues_where_it_stopped_bit_identical(study, corpus, cache, tmp_path):
    """SIGKILL during the TACO run of seed 0 (after a checkpoint), then the same command: the finished
    exact run is skipped (its files untouched), the TACO run resumes from its checkpoint, and every
    step's loss, grad norm, val loss and monitor SQNR equal the uninterrupted study's."""
    out, log = tmp_path / "s", tmp_path / "log"
    cmd = _command(corpus, out, 1)
    taco = fl.run_dir(out, "gpt2-tiny", "taco", 0)

    def mid_run():
        ckpts = [int(p.name) for p in (taco / "checkpoints").glob("*") if p.name.isdigit()]
        try:
            last = json.loads(open(taco / "metrics.jsonl").read().splitlines()[-1])["step"]
        except (OSError, IndexError, ValueError):
            return False
        return bool(ckpts) and max(ckpts) < last < 6

    p = start(cmd, cache, log)
    wait_for(mid_run, p, timeout=600, what="a checkpoint and a later step of the TACO run", log=log)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    exact = fl.run_dir(out, "gpt2-tiny", "none", 0) / "metrics.jsonl"
    mtime = exact.stat().st_mtime_ns
    r = run(cmd, cache, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gpt2-tiny none seed 0: complete, skipped" in r.stderr and "resumed from checkpoints/" in r.stderr
    assert exact.stat().st_mtime_ns == mtime
    for v in fl.VARIANTS:
        assert _records(fl.run_dir(out, "gpt2-tiny", v, 0)) == _records(fl.run_dir(study, "gpt2-tiny", v, 0))


def test_another_setting_in_the_same_out_is_refused(study):
    s = json.loads((study / "study.json").read_text())
    with pytest.raises(ValueError, match=r"steps: 6 there, 7 now"):
        fl.check_study(study, {**s, "steps": 7})
    with pytest.raises(ValueError, match=r"milestones \[3\] are not multiples of eval_every=2"):
        fl.analyze(study, s, milestones=(3,))
