"""`taco-jax plan` / `predict` (taco_jax/train/plan.py), the hardware table (perf/hardware.py) and the error
bars (perf/uncertainty.py): the plan's compiled figures against a real run's in the same process, the
cost model against docs/emulated.md, the wire-dtype check on a program built to fail it, and the
errors a bad `--hardware-file` gets."""

import json
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.cli import main
from taco_jax.codec import TACO
from taco_jax.collectives import compressed
from taco_jax.collectives.hlo import site_scope
from taco_jax.collectives.policy import CommPolicy
from taco_jax.perf import uncertainty
from taco_jax.perf.hardware import CODEC_STATUS, get_hardware, load_hardware
from taco_jax.train import loop
from taco_jax.train import plan as planner
from taco_jax.train import plan_report as report
from taco_jax.train.config import TrainConfig

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _per_device_bytes(tree) -> dict:
    """Bytes each device holds of the jax arrays in `tree` (their addressable shards), by device."""
    out = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


@pytest.mark.parametrize("model", ["gpt2-tiny", "qwen3-tiny"])
@pytest.mark.slow
def test_plan_matches_a_real_run_in_the_same_process(model, tmp_path):
    """The plan compiles from shapes alone: its wire bytes by axis are those a real run's summary
    reports (`wire_bytes_per_step`, the run's own compiled step), and its per-device argument memory
    (parameters + optimizer state + batch) is within 10 % of what the busiest device holds of the
    arrays the run's first step returns and takes (counted on those arrays, not on `jax.live_arrays`,
    which other tests' leftovers in the same worker process change)."""
    cfg = TrainConfig.from_flags(model=model, mesh="data=2,tensor=4", steps=2, batch_size=8, seq_len=64,
                                 out=str(tmp_path / "run"))
    result = planner.plan(cfg, get_hardware("h100"))
    compiled = result["compiled"]
    assert compiled["devices"] == 8 and compiled["compile_s"] > 0
    mem = compiled["memory"]
    assert mem["analysis"] and mem["argument"] > 0 and mem["temp"] > 0
    assert mem["params"] + mem["opt_state"] + mem["batch"] == pytest.approx(mem["argument"], rel=0.01)
    # on the CPU mesh the terminal leads with the GPU estimate and labels XLA:CPU's own analysis
    text = report.lines(result)
    at = next(i for i, line in enumerate(text) if line.startswith("memory per device"))
    assert text[at].startswith("memory per device, GPU estimate: parameters + optimizer state + FP32 gradients")
    assert text[at + 2].startswith("  XLA:CPU's analysis of this compile, not a GPU's") and " peak " in text[at + 2]

    run = loop.prepare(cfg)
    state = loop.initial_state(run)
    acct = loop.compile_step(run, state)
    loop.resume(run, acct, state)
    state.params, state.opt_state, metrics = acct.train_step(state.params, state.opt_state, state.inputs,
                                                             state.targets)
    jax.block_until_ready(metrics)
    held = max(_per_device_bytes((state.params, state.opt_state, state.inputs, state.targets)).values())
    assert compiled["wire"]["by_axis"] == acct.wire["by_axis"]  # summary.json's wire_bytes_per_step
    assert compiled["wire"]["by_axis"]["tensor"] > 0 and compiled["wire"]["by_axis"]["data"] > 0
    assert abs(mem["argument"] - held) <= 0.10 * held, (mem, held)
    # every compressed tensor collective sits at a site, with the codec's kernels counted there
    sites = {(s["axis"], s["site"]): s for s in compiled["by_site"]}
    for site in ("ar_fwd", "ar_bwd"):
        assert sites[("tensor", site)]["compressed"] == sites[("tensor", site)]["collectives"] > 0
        assert sum(compiled["codec"][site]["kernel_calls"].values()) + \
            sum(compiled["codec"][site]["scoped_ops"].values()) > 0
    assert sites[("data", "dp_grads")]["compressed"] == 0
    assert compiled["mismatches"] == []


def _emulated_gpu_table() -> list[list[str]]:
    text = (ROOT / "docs" / "emulated.md").read_text()
    body = text[text.index("| setting | TP link |"):].split("\n\n")[0].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body]


def test_predict_reproduces_the_emulated_gpu_table():
    """`predict --paper` gives docs/emulated.md's GPU table: per setting and TP link the TP share of
    the exact step and both speedups, to the table's two decimals, each with the emulated error range
    of `perf.uncertainty` (the table's brackets); every row carries a range that holds the point."""
    table = _emulated_gpu_table()
    rows = planner.paper_table()
    errors = uncertainty.summary()
    assert len(rows) == len(table) >= 16
    for row, cells in zip(rows, table, strict=True):
        assert (row["setting"], row["tp_link"]) == (cells[0], cells[1])
        assert f"{row['tp_comm_fraction']:.2f}" == cells[2]
        for k, cell in (("taco_tp", cells[3]), ("taco_tp+dp+pp", cells[4])):
            lo, hi = uncertainty.speedup_range(row[k], errors)["emulated"]
            assert f"{row[k]:.2f}× [{lo:.2f}, {hi:.2f}]" == cell
        assert row["published"].replace("x", "×") == cells[6].split(" (")[0]
        assert row["range"][0] <= row["taco_tp"] <= row["range"][1]
    head, *body = report.paper_lines(rows)  # what `predict --paper` prints: a header over aligned columns
    assert head.split()[:2] == ["setting", "TP"] and "TP share" in head and head.endswith("published")
    assert len(body) == len(rows)
    for line, row in zip(body, rows, strict=True):
        assert line.index(row["published"]) == head.index("published")
        assert line.index(f"{row['taco_tp']:.2f}x") + 5 == head.index("TACO TP ") + len("TACO TP")


def test_predict_places_tp_over_infiniband_across_two_nodes(capsys):
    """`--tp-span-nodes 2` puts the tensor axis on the inter-node link (no code edit): slower exact TP
    than inside a node, a larger TACO speedup, and a range from both error sources around it."""
    base = ["predict", "--model", "qwen3-8b", "--mesh", "stage=2,tensor=8", "--microbatches", "8",
            "--batch-size", "8", "--seq-len", "2048", "--hardware", "h800", "--json"]
    out = {}
    for span in ("1", "2"):
        assert main(base + ["--tp-span-nodes", span]) == 0
        out[span] = json.loads(capsys.readouterr().out)["predict"]
    hw = get_hardware("h800").hardware
    assert out["1"]["links"]["tensor"] == hw.intra.name and out["2"]["links"]["tensor"] == hw.inter.name
    assert out["2"]["exact"]["tensor_s"] > 2 * out["1"]["exact"]["tensor_s"]
    assert out["2"]["speedup"] > out["1"]["speedup"]
    r = out["2"]["range"]
    assert set(r) == {"emulated", "coccl", "all"} and r["all"][0] < out["2"]["speedup"] < r["all"][1]
    assert main(base + ["--tp-span-nodes", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_plan_flags_collectives_moving_another_wire_dtype_than_declared():
    """A program whose all-gather site is declared TACO but gathers the float message (as if the
    gather were hoisted above the encode) is flagged; the compressed all-gather at the same site
    is not; an exact site that moves codes is flagged too."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("tensor",))
    policy = CommPolicy.taco(TACO)
    x = jnp.ones((4, 64, 256), jnp.float32)

    def compiled(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
        return planner.compiled_report(f.lower(x).compile().as_text(), mesh, policy)

    def hoisted(v):
        with site_scope("all_gather"):
            return lax.all_gather(v, "tensor", axis=1, tiled=True)[:, :64]

    def encoded(v):
        with site_scope("all_gather"):
            return compressed.all_gather(v, "tensor", codec=TACO, axis=1, tiled=True)[:, :64]

    bad = compiled(hoisted)["mismatches"]
    assert [(m["site"], m["axis"], m["op"], m["dtype"]) for m in bad] == [("all_gather", "tensor", "all-gather", "f32")]
    assert "u8" in bad[0]["declared"]
    good = compiled(encoded)
    assert good["mismatches"] == []
    assert [s["compressed"] for s in good["by_site"] if s["site"] == "all_gather"] == [1]
    exact = planner.compiled_report(jax.jit(jax.shard_map(encoded, mesh=mesh, in_specs=P("tensor"),
                                                          out_specs=P("tensor"), check_vma=False)).lower(x)
                                    .compile().as_text(), mesh, CommPolicy())
    assert [m["declared"] for m in exact["mismatches"]] == ["exact: float messages"]


_OWN = """
[mycluster]
name = "my GPUs"
peak_tflops = 500
mfu = 0.35
gpus_per_node = 4
source = "ours"
[mycluster.intra]
name = "PCIe Gen5"
bandwidth_GBps = 64
efficiency = 0.7
alpha_us = 5
source = "spec"
[mycluster.inter]
name = "RoCE 100G"
bandwidth_GBps = 12.5
efficiency = 0.8
alpha_us = 12
source = "spec"
[mycluster.codec]
encode_GBps = 500
decode_GBps = 700
overhead_us = 10
status = "measured"
source = "our bench"
"""


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("peak_tflops = 500\n", ""), "missing key 'peak_tflops'"),
    (lambda t: t.replace("mfu = 0.35", "mfu = 1.5"), "mfu=1.5 must be in (0, 1]"),
    (lambda t: t.replace("bandwidth_GBps = 64", "bandwidth_GBps = -64"), "intra.bandwidth_GBps=-64 must be"),
    (lambda t: t.replace("gpus_per_node = 4", "gpus_per_node = 2.5"), "gpus_per_node=2.5 must be an integer"),
    (lambda t: t.replace('status = "measured"', 'status = "guessed"'), "codec.status='guessed' must be one of"),
    (lambda t: t.replace("alpha_us = 12", "alpha_us = 12\nlatency = 3"), "unknown key 'latency'"),
    (lambda t: t.split("[mycluster.codec]")[0], "missing table [mycluster.codec]"),
    (lambda t: t.replace("[mycluster]", "[mycluster"), "not valid TOML"),
])
def test_hardware_file_errors_name_the_file_entry_and_key(tmp_path, capsys, edit, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(_OWN))
    assert main(["predict", "--hardware-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err, err


def test_hardware_entries_differing_only_in_case_are_refused_naming_both(tmp_path, capsys):
    """Names are case-insensitive (`--hardware MyCluster`): [mycluster] and [MyCluster] in one file are
    refused naming both, not merged (the later winning); so is a key given twice in a JSON file."""
    both = tmp_path / "both.toml"
    both.write_text(_OWN + _OWN.replace("[mycluster", "[MyCluster").replace("peak_tflops = 500", "peak_tflops = 900"))
    assert main(["predict", "--hardware-file", str(both), "--hardware", "mycluster"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"taco-jax: error: --hardware-file {str(both)!r}: [mycluster] and [MyCluster] name one hardware (names "
        "are case-insensitive); rename or remove one")
    twice = tmp_path / "twice.json"  # json.loads would keep the last one silently; TOML refuses it itself
    twice.write_text('{"mycluster": {}, "mycluster": {}}')
    assert main(["predict", "--hardware-file", str(twice)]) == 2
    assert f"--hardware-file {str(twice)!r}: key 'mycluster' is given twice in one object" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named_with_its_flag(tmp_path, capsys):
    """A --config or --hardware-file that is not UTF-8 (here Latin-1 "café") is refused naming the flag,
    the file, the byte and its line, not with the codec's bare message."""
    for flag, text in (("--config", 'steps = 3\n# caf\xe9\n'), ("--hardware-file", _OWN.replace("ours", "caf\xe9"))):
        for suffix in (".toml", ".json"):
            f = tmp_path / f"latin1{suffix}"
            f.write_bytes(text.encode("latin-1"))
            at = text.index("\xe9")  # one byte a character in Latin-1
            assert main(["predict", flag, str(f)]) == 2
            assert capsys.readouterr().err.strip() == (
                f"taco-jax: error: {flag} {str(f)!r}: not UTF-8 text (byte 0xe9 at offset {at}, "
                f"line {text[:at].count(chr(10)) + 1}); save it as UTF-8")


def test_own_hardware_file_and_the_shipped_table(tmp_path, capsys):
    """A valid file is used as given (its one entry without --hardware); an unknown name lists the
    known ones; the shipped table declares the six GPUs, the H200 codec speed measured, the others
    assumed, each with its source."""
    own = tmp_path / "own.toml"
    own.write_text(_OWN)
    assert main(["predict", "--hardware-file", str(own), "--mesh", "data=2,tensor=4", "--json"]) == 0
    hw = json.loads(capsys.readouterr().out)["predict"]["hardware"]
    assert (hw["name"], hw["gpus_per_node"], hw["codec"]["status"]) == ("my GPUs", 4, "measured")
    assert hw["intra"]["GBps"] == pytest.approx(0.7 * 64)
    assert main(["predict", "--hardware", "tpu9"]) == 2
    assert "hardware='tpu9' is not declared" in capsys.readouterr().err
    # nodes of 3 GPUs: a tensor axis of 4 would span them unevenly (3 + 1); 2 fits one; nodes of 2: 4 spans two
    for gpus, mesh, span, ok, why in (
            (3, "tensor=4", [], False, "does not fit nodes of 3 GPUs"), (3, "tensor=2", [], True, ""),
            (2, "tensor=4", [], True, ""),
            # 6 GPUs on nodes of 3: the tensor pair of ranks 2 and 3 would cross nodes (TP said to sit in one node too)
            (3, "data=3,tensor=2", [], False, "(2 ranks) does not divide nodes of 3 GPUs"),
            (3, "data=3,tensor=2", ["--tp-span-nodes", "1"], False, "(2 ranks) does not divide nodes of 3 GPUs"),
            (4, "data=3,tensor=2", [], True, ""),
            # 2 ranks of each group in a node of 3: the next group would cross a node boundary
            (3, "data=3,tensor=4", ["--tp-span-nodes", "2"], False, "puts 2 tensor ranks in each node of 3 GPUs"),
            (4, "data=3,tensor=4", ["--tp-span-nodes", "2"], True, "")):
        f = tmp_path / f"n{gpus}.toml"
        f.write_text(_OWN.replace("gpus_per_node = 4", f"gpus_per_node = {gpus}"))
        assert main(["predict", "--hardware-file", str(f), "--mesh", mesh, "--batch-size", "12", *span,
                     "--json"]) == (0 if ok else 2)
        err = capsys.readouterr().err
        assert ok or why in err, err
    # predict --paper takes no flag of its own run; --comm none predicts nothing to bound
    assert main(["predict", "--paper", "--hardware-file", "/nonexistent"]) == 2
    assert "takes no other flag (got --hardware-file)" in capsys.readouterr().err
    paper_only, paper_and_mesh = tmp_path / "paper.toml", tmp_path / "paper_mesh.toml"
    paper_only.write_text("paper = true\n")
    paper_and_mesh.write_text('paper = true\nmesh = "tensor=2"\n')
    assert main(["predict", "--config", str(paper_only)]) == 0  # the file says --paper and nothing else
    assert "GPT-6.7B" in capsys.readouterr().out
    assert main(["predict", "--config", str(paper_and_mesh)]) == 2
    assert f"(got --config '{paper_and_mesh}' setting --mesh)" in capsys.readouterr().err
    assert main(["predict", "--config", str(paper_only), "--mesh", "tensor=2"]) == 2  # --paper from the file
    assert capsys.readouterr().err.startswith(f"taco-jax: error: --config '{paper_only}' sets paper = true: ")
    assert main(["predict", "--mesh", "tensor=2", "--comm", "none"]) == 0
    out = capsys.readouterr().out
    assert "this policy compresses no site" in out and "range" not in out and "threshold none" in out, out
    assert main(["predict", "--mesh", "tensor=2", "--comm", "none", "--json"]) == 0  # no range in the JSON either
    p = json.loads(capsys.readouterr().out)["predict"]
    assert p["range"] is None and p["auto_threshold_bytes"] is None and p["speedup"] == 1.0
    assert main(["predict", "--mesh", "tensor=1", "--comm", "taco"]) == 0  # one device: nothing crosses a link
    out = capsys.readouterr().out
    assert "no communication site on this mesh" in out and out.rstrip().endswith("threshold none (no site)"), out
    shipped = load_hardware()
    assert set(shipped) == {"h100", "h200", "h800", "a100", "b200", "l40s"}
    assert {k: s.codec_status for k, s in shipped.items() if s.codec_status == "measured"} == {"h200": "measured"}
    assert all(s.codec_status in CODEC_STATUS and all(s.sources.values()) for s in shipped.values())
    assert "PCIe" in shipped["l40s"].hardware.intra.name


def test_predict_gives_no_range_when_min_bytes_keeps_every_site_exact(capsys):
    """A policy with codecs whose --min-bytes (given, or "auto" resolved on the hardware) is above every
    message compresses nothing: the speedup is exact against exact, 1.00x with no range (text and JSON),
    and the line says that nothing is compressed and why; --min-bytes auto's threshold is still given.
    One byte lower than gpt2-tiny's 262,144-byte tensor messages, they are compressed and the range is back
    (issue 52 item 9: "1.00x, range 0.87-1.23x" before)."""
    mesh = ["predict", "--mesh", "data=2,tensor=4", "--hardware", "h200"]
    for flags, why in ((["--min-bytes", "1000000000"], "(each message of a site with a codec is below --min-bytes "
                        "1,000,000,000 bytes); exact step "),
                       (["--min-bytes", "262145"], "below --min-bytes 262,145 bytes)"),
                       (["--min-bytes", "auto"], "(--min-bytes auto keeps every site exact on this hardware: "
                        "threshold 1.00 GB, above each message); exact step ")):
        assert main([*mesh, *flags]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("predicted speedup"))
        assert line.startswith("predicted speedup 1.00x: nothing is compressed (") and why in line, line
        assert "range" not in line and "with the policy" not in line, line
        assert "--min-bytes auto on this hardware: threshold 1.00 GB;" in out, out
        assert main([*mesh, *flags, "--json"]) == 0
        p = json.loads(capsys.readouterr().out)["predict"]
        assert p["range"] is None and p["compressed_sites"] == [] and p["speedup"] == 1.0, p["range"]
        assert p["auto_threshold_bytes"] is not None
    assert main([*mesh, "--min-bytes", "262144", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["predict"]
    assert p["compressed_sites"] == ["ar_fwd", "ar_bwd"] and p["range"]["all"][0] < p["speedup"] < p["range"]["all"][1]
    # where compression never pays (docs/plan.md's worked example, NVLink), auto says so
    assert main(["predict", "--model", "qwen3-8b", "--mesh", "data=2,stage=4,tensor=4", "--microbatches", "8",
                 "--seq-len", "4096", "--hardware", "h100", "--min-bytes", "auto"]) == 0
    assert "predicted speedup 1.00x: nothing is compressed (--min-bytes auto keeps every site exact on this " \
        "hardware: compression never pays here); exact step " in capsys.readouterr().out


def test_predict_sets_the_speedup_beside_the_exact_step_and_the_fastest_exact_layout(capsys):
    """Beside the speedup, `predict` prints the exact step (and the policy's), and the cost model's fastest
    exact layout of the same GPUs with tensor inside a node and at least this layout's tensor x stage:
    Qwen3-8B on 32 H100 as data=2,tensor=16 (TP over InfiniBand) gains 1.52x from TACO, but its exact step
    is 4.72x that of data=2,stage=4,tensor=4 with 8 microbatches (issue 52 item 15). That layout, predicted
    in turn, is its own fastest, with the same exact step; one GPU has no layout line."""
    run = ["predict", "--model", "qwen3-8b", "--seq-len", "4096", "--hardware", "h100"]
    assert main([*run, "--mesh", "data=2,tensor=16", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["predict"]
    best = p["best_exact"]
    assert best["mesh"] == "data=2,stage=4,tensor=4" and best["microbatches"] == 8 and best["min_split"] == 16, best
    assert best["step_s"] < p["exact"]["step_s"] / 4
    assert main([*run, "--mesh", "data=2,tensor=16"]) == 0
    text = capsys.readouterr().out.splitlines()
    line = next(x for x in text if x.startswith("predicted speedup"))
    assert line.startswith(f"predicted speedup {p['speedup']:.2f}x, range ")
    assert line.endswith(f"; exact step {p['exact']['step_s'] * 1e3:,.1f} ms, with the policy "
                         f"{p['policy']['step_s'] * 1e3:,.1f} ms"), line
    layout = text[text.index(line) + 1]
    assert layout.startswith("layout: the cost model's fastest exact layout of these 32 GPUs (tensor inside a node; "
                             "tensor x stage >= 16 as here"), layout
    assert " is --mesh data=2,stage=4,tensor=4 --microbatches 8 at " \
        f"{best['step_s'] * 1e3:,.1f} ms a step; this layout's exact step is " \
        f"{p['exact']['step_s'] / best['step_s']:.2f}x that, with the policy " \
        f"{p['policy']['step_s'] / best['step_s']:.2f}x" in layout, layout
    assert main([*run, "--mesh", "data=2,stage=4,tensor=4", "--microbatches", "8", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)["predict"]
    assert q["exact"]["step_s"] == pytest.approx(best["step_s"], rel=1e-12) and q["best_exact"] == best
    assert main([*run, "--mesh", "data=2,stage=4,tensor=4", "--microbatches", "8"]) == 0
    assert "layout: this layout's exact step is the cost model's fastest of these 32 GPUs" in capsys.readouterr().out
    assert main(["predict", "--mesh", "tensor=1"]) == 0
    assert "layout:" not in capsys.readouterr().out


def test_plan_says_what_it_compiles_and_how_long_it_took(tmp_path, capsys):
    """`plan` prints (stderr) a start line naming what it compiles (model, depth, size, mesh, devices) and
    what to expect, and its wall time when done; stdout keeps the table. While it compiles,
    `progress_lines` prints a line every few minutes and one just after XLA's 2-minute slow-compile alarm
    saying what that alarm is, none after the compile (issue 52 item 14)."""
    assert main(["plan", "--mesh", "data=2", "--layers", "1", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    said = [x for x in err.splitlines() if x.startswith("plan: ")]
    assert said[0].startswith("plan: compiling the train step of gpt2-tiny (1 layer, ") and \
        " parameters) for --mesh data=2, --microbatches 1, on 2 simulated CPU devices: seconds for a tiny model, " \
        "minutes for a large one" in said[0], said
    assert re.fullmatch(r"plan: compiled in [\d.]+ s wall \(tracing, lowering and XLA's compile of the step [\d.]+ s; "
                        r"building the trainer and its abstract state the rest\)", said[-1]), said
    assert out.splitlines()[0].startswith("gpt2-tiny") and "compile: " in out
    assert planner.XLA_ALARM_S == 120  # XLA's alarm: xla/service/slow_operation_alarm.cc, 2 minutes
    said = []
    with planner.progress_lines(said.append, planner.XLA_ALARM_NOTE, 0.01):  # once
        with planner.progress_lines(said.append, "plan: still compiling ({minutes:.1f} min so far)", 0.01, 0.01):
            deadline = time.monotonic() + 30
            while len(said) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
    after = len(said)
    time.sleep(0.1)
    assert after >= 3 and len(said) == after, said  # none after the block
    alarm = [x for x in said if not x.startswith("plan: still compiling")]
    assert len(alarm) == 1 and alarm[0].startswith(
        "plan: XLA's compile of the step has run 0.0 min; if XLA's own compile of the module passes 2 minutes, XLA "
        "prints \"Very slow compile? If you want to file a bug")
    assert alarm[0].endswith("its generic alarm for any long compile, harmless here, nothing to file"), alarm
    assert all(re.fullmatch(r"plan: still compiling \([\d.]+ min so far\)", x) for x in said if x not in alarm), said


def test_shipped_model_errors_are_the_study_s():
    """model_errors.json is `errors_from_study` of the committed e2e study, and the emulated error
    span covers the per-configuration errors docs/emulated.md reports (up to +21 % and down to −35 % step time)."""
    shipped = json.loads(uncertainty.ERRORS_FILE.read_text())
    study = json.loads((ROOT / shipped["study"]).read_text())  # the repository's copy; the package reads none
    assert shipped == uncertainty.errors_from_study(study, shipped["study"])
    s = uncertainty.summary()
    assert s["emulated"]["step_error"][1] == pytest.approx(max(
        r["taco_step_error"] for r in uncertainty.emulated_errors()))
    assert s["coccl"]["points"] == 4 and s["emulated"]["points"] == len(uncertainty.emulated_errors())


def test_plan_cli_writes_json_and_markdown_without_compiling(tmp_path, capsys):
    """`plan --no-compile` (the cost model only) writes plan.json and plan.md and prints the table;
    --layers overrides the depth the model sees."""
    out = tmp_path / "plan"
    assert main(["plan", "--model", "qwen3-8b", "--mesh", "data=2,stage=4,tensor=4", "--microbatches", "8",
                 "--seq-len", "4096", "--layers", "8", "--hardware", "h100", "--no-compile", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"predicted speedup [\d.]+x, range [\d.]+-[\d.]+x", text)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("cost model on "))
    assert lines[at].endswith(", per step:")
    head, rows = lines[at + 1], lines[at + 2:at + 8]
    assert [r.split()[0] for r in rows] == ["step", "compute", "tensor", "data", "stage", "throughput"]
    for r in rows:  # each value right-aligned under its column's header, with its unit
        assert r.endswith(" ms") or r.endswith(" tok/s")
        assert len(r) == len(head) and r[head.index("exact") + 4] != " " and r[:head.index("exact") - 3].strip()
    data = json.loads((out / "plan.json").read_text())
    assert data["predict"]["n_layers"] == 8 and "compiled" not in data
    assert "--min-bytes auto" in (out / "plan.md").read_text()
    # the codec speed says where it comes from (h100: the H200's measurement scaled by HBM bandwidth)
    assert "967/1,369 GB/s encode/decode (assumed: the H200 measurement x 3.35/4.8)" in text
    # a second plan into the same folder says that it replaces the first
    assert main(["plan", "--model", "gpt2-tiny", "--mesh", "data=2,tensor=4", "--hardware", "h200", "--no-compile",
                 "--out", str(out)]) == 0
    text, err = capsys.readouterr()
    assert f"plan: replacing the previous plan in {out}" in err
    assert "GB/s encode/decode (measured on an H200)" in text
    assert main(["plan", "--mesh", "data=2,tensor=4", "--devices", "4", "--out", str(out)]) == 2
    assert "devices=4 differs" in capsys.readouterr().err
    assert main(["predict", "--mesh", "data=2,tensor=4", "--devices", "4"]) == 2  # as plan --no-compile
    assert "devices=4 differs" in capsys.readouterr().err
    assert main(["predict", "--mesh", "data=2,tensor=4", "--devices", "8", "--json"]) == 0
    capsys.readouterr()
    # a train config file's run folder is not plan's output folder: plan writes to its own --out
    conf = tmp_path / "run.toml"
    conf.write_text(f'[model]\nname = "gpt2-tiny"\n[checkpoint]\nout = "{tmp_path / "trainrun"}"\n')
    assert main(["plan", "--config", str(conf), "--no-compile", "--out", str(tmp_path / "p2")]) == 0
    assert (tmp_path / "p2" / "plan.json").exists() and not (tmp_path / "trainrun").exists()


def test_package_code_reads_no_docs_path():
    """Data the package needs ships inside it (`perf/model_errors.json`, `perf/hardware.toml`, ...):
    no string in taco_jax/ code, docstrings aside, names a docs/ path or the docs folder."""
    import ast

    bad = []
    for path in sorted((ROOT / "taco_jax").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        bad += [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                and (n.value.strip("/") == "docs" or "docs/bench" in n.value)]
    assert not bad, bad


def test_a_run_and_its_plan_resolve_min_bytes_auto_through_one_function_on_the_same_hardware():
    """`--min-bytes auto` on a GPU: the run (`perf.resolve_min_bytes`, as `make_trainer` calls it) and
    `plan` / `predict` (`plan.resolve_policy`, the threshold of its site table) choose the same threshold
    for the same hardware; a run names no hardware and gets the shipped default (the H200), whose
    threshold is the one it chose before the resolvers were one (pinned)."""
    import dataclasses

    from taco_jax import perf
    from taco_jax.perf import hardware, model

    policy = dataclasses.replace(CommPolicy.taco().resolve_backends(n_devices=2), min_bytes="auto")
    for key, spec in hardware.shipped().items():
        for tp in (2, 4, 8, 16):
            for sp in (False, True):
                for item in (2, 4):
                    run = perf.resolve_min_bytes(policy, "cuda", tensor_size=tp, itemsize=item, sequence_parallel=sp,
                                                 hardware=spec.hardware).min_bytes
                    lay = model.Layout(tp=tp, sequence_parallel=sp, act_bytes=item)
                    assert planner.resolve_policy(policy, lay, spec.hardware).min_bytes == run, (key, tp, sp, item)
    cfg = TrainConfig.from_flags(model="qwen3-8b", mesh="data=2,stage=4,tensor=4", comm="taco", min_bytes="auto",
                                 microbatches=8, batch_size=16)
    got = planner.predict(cfg, get_hardware("h100"))
    lay = planner.layout_of(cfg)
    run = perf.resolve_min_bytes(policy, "cuda", tensor_size=lay.tp, itemsize=lay.act_bytes,
                                 sequence_parallel=lay.sequence_parallel, hardware=get_hardware("h100").hardware)
    assert got["policy_min_bytes"] == run.min_bytes
    default = perf.resolve_min_bytes(policy, "cuda", tensor_size=4, itemsize=2, sequence_parallel=False).min_bytes
    assert default == 1003729285 == perf.resolve_min_bytes(
        policy, "cuda", tensor_size=4, itemsize=2, sequence_parallel=False,
        hardware=hardware.shipped()[hardware.DEFAULT_GPU].hardware).min_bytes


def test_gpu_codec_speeds_live_in_the_hardware_table_only(tmp_path):
    """The speeds codec backend `auto` ranks GPU backends by are the shipped h200 entry's (`[h200.codec]`,
    backend ffi, and `[h200.codec.backends.*]`), the cost model's H200 codec is the same row, and
    `update_codec_speeds` (`experiments.gpu_check --update-speeds`) rewrites them in place, nothing else."""
    from taco_jax import kernels
    from taco_jax.perf import hardware

    spec = hardware.shipped()["h200"]
    table = kernels.gpu_speed_table()
    assert {k: (r["encode_GBps"], r["decode_GBps"], r["measured"]) for k, r in table.items()} == {
        k: (r["encode_GBps"], r["decode_GBps"], r["status"] == "measured") for k, r in spec.codec_backends.items()}
    assert sorted(table, key=kernels.gpu_rank) == ["ffi", "triton", "reference", "pallas"]
    ffi, codec = spec.codec_backends["ffi"], hardware.H200_CODEC
    assert (codec.encode_GBps, codec.decode_GBps) == (ffi["encode_GBps"], ffi["decode_GBps"])
    path = tmp_path / "hardware.toml"
    path.write_text(hardware.HARDWARE_FILE.read_text())
    row = {"encode_GBps": 1500.5, "decode_GBps": 2100.25, "measured": True, "source": "a GPU run"}
    hardware.update_codec_speeds({"backends": {"ffi": row, "triton": {**row, "measured": False}}}, path=path)
    got, before = hardware.load_hardware(path), hardware.shipped()
    speed = got["h200"].hardware.codec["default"]
    assert (speed.encode_GBps, speed.decode_GBps, speed.overhead_s) == (1500.5, 2100.25, 8e-6)
    assert got["h200"].codec_backends["triton"]["status"] == "bound"
    assert got["h200"].codec_backends["reference"] == spec.codec_backends["reference"]
    assert all(got[k].describe() | {"file": ""} == before[k].describe() | {"file": ""} for k in before if k != "h200")
