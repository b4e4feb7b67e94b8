"""experiments/gpu/gpu_check.sh --dry-run runs on CPU and writes a report in the format a lent GPU's run has."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.gpu import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
    env.update(OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "experiments" / "gpu" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu_check.log").exists()
    report = json.loads((out / "gpu_check.json").read_text())
    report["_out"] = out  # for the test of the speed table written beside it
    return report


def test_dry_run_report_is_valid_and_complete(dry_report):
    gpu_check.validate(dry_report)
    assert dry_report["dry_run"] is True and dry_report["errors"] == []
    env = dry_report["environment"]
    assert env["platform"] == "cpu" and env["n_devices"] == 8
    conf = dry_report["conformance"]
    assert {r["backend"] for r in conf} == set(env["backends"]) - {"reference", "auto"} and all(r["ok"] for r in conf)
    cases = {(r["backend"], r["dtype"], r["op"]) for r in dry_report["throughput"]}
    assert cases >= {("reference", d, op) for d in ("bfloat16", "float32") for op in ("encode", "decode", "decode_sum")}
    coll = dry_report["collectives"]
    assert {(r["op"], r["dtype"]) for r in coll["rows"]} == {
        (op, d) for op in ("all_reduce", "all_gather") for d in ("bfloat16", "float32")}
    assert all(0 < r["rel_err"] < 0.1 for r in coll["rows"])  # FP8 error, not garbage
    speeds = json.loads((dry_report["_out"] / "gpu_speeds.json").read_text())["backends"]
    assert speeds["reference"]["measured"] is True and speeds["reference"]["encode_GBps"] > 0
    train = dry_report["training"]
    assert train["steps"] == len(train["losses"]) and train["mesh"] == "data=1,tensor=2"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r.update(schema="other"), "schema"),
        (lambda r: r.pop("throughput"), "lacks 'throughput'"),
        (lambda r: r["throughput"][0].update(gbps="fast"), r"throughput\[0\]\.gbps"),
        (lambda r: r["conformance"][0].pop("ok"), r"conformance\[0\]\.ok"),
        (lambda r: r["collectives"].update(rows=[]), "no rows and no 'skipped'"),
        (lambda r: r["training"]["losses"].pop(), "training.losses"),
        (lambda r: r.update(training={"error": "boom"}), "training failed but is not listed"),
    ],
)
def test_validate_names_the_bad_field(dry_report, edit, match):
    bad = copy.deepcopy(dry_report)
    edit(bad)
    with pytest.raises(ValueError, match=match):
        gpu_check.validate(bad)


def test_a_section_left_out_is_skipped_not_an_error(dry_report):
    rep = copy.deepcopy(dry_report)
    rep["training"] = {"skipped": "not run (--sections)"}
    gpu_check.validate(rep)  # no error: --sections left it out
