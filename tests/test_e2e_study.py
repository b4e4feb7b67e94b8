"""The emulated-link study's bookkeeping (experiments/e2e/bench_e2e.py, experiments/e2e/e2e_study.py): argument
parsing, the α fit and the step-time model of docs/emulated.md, the GPU predictions table, and the load
guard (experiments/e2e/load_guard.py) that keeps a busy machine's timings out of the results. The
runs themselves need network namespaces and a quiet machine (`make bench-e2e`); the emulated cluster
is tested in tests/test_emulated_links.py."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from experiments.e2e import bench_e2e, e2e_study, load_guard


def test_links_split_rates_but_keep_a_two_tier_link_whole():
    assert bench_e2e._links(["250mbit,1gbit", "none"]) == ["250mbit", "1gbit", "none"]
    assert bench_e2e._links(["intra=1gbit,inter=100mbit"]) == ["intra=1gbit,inter=100mbit"]


@pytest.mark.parametrize("specs", [["taco=--comm taco"], ["exact", "taco=--comm taco"],
                                   ["a=--comm none", "a=--comm taco"], ["1x=--comm none", "b=--comm taco"]])
def test_bad_variants_are_refused_naming_them(specs, capsys):
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(["--links", "none", *[a for s in specs for a in ("--variant", s)]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "variant" in err


def _row(link_bits, local, msgs, tensor_bytes, alpha, variant="exact", data_bytes=0, kappa=1.0, kappa1=0.0):
    row = {"config": "c", "link": "x", "variant": variant, "local_s_per_step": local, "loopback_s_per_step": local,
           "measured_bit_per_s": None if link_bits is None else {"link": link_bits},
           "tensor_messages_per_step": msgs, "wire_bytes_per_step": {"tensor": tensor_bytes}}
    if data_bytes:
        row["wire_bytes_per_step"]["data"] = data_bytes
    nbytes = sum(row["wire_bytes_per_step"].values())
    row["s_per_step"] = local + msgs * alpha + (kappa + kappa1 * nbytes / msgs / 1e6) * nbytes * 8 / (link_bits or 8e9)
    return row


LOOPBACK = (1.5e-4, 1e-9)  # (α s, β s/B) of the gloo calibration


@pytest.mark.parametrize("kappa,kappa1", [(1.0, 0.0), (1.5, 0.0), (1.3, 0.5)])
def test_link_fit_recovers_latency_and_efficiency_and_the_model_reproduces_the_steps(kappa, kappa1):
    alpha = 3e-4
    rows = [_row(bits, 0.3, n, b, alpha, kappa=kappa, kappa1=kappa1) for bits in (50e6, 250e6, 1e9, 4e9)
            for n in (100, 200) for b in (9.5e6, 19e6)]
    got = e2e_study._fit_link(rows)
    assert got == pytest.approx((alpha, kappa, kappa1), rel=1e-6, abs=1e-9)
    for r in rows:  # the one-process model's anchor: the same fit against the one-process step
        r["loopback_s_per_step"] += 0.05
    assert e2e_study._fit_link(rows, "local_s_per_step") == pytest.approx(got, rel=1e-6, abs=1e-9)
    for r in rows:
        assert e2e_study._predict(r, r["local_s_per_step"], got, LOOPBACK) == pytest.approx(r["s_per_step"], rel=1e-9)


def test_loopback_rows_use_the_calibration_not_the_fit():
    row = _row(None, 0.3, 200, 9.5e6, 0.0)
    assert e2e_study._predict(row, 0.3, (1.0, 5.0, 1.0), LOOPBACK) == pytest.approx(0.3 + 200 * 1.5e-4 + 9.5e6 * 1e-9)


def test_a_negative_latency_fit_is_refitted_with_zero_latency():
    rows = [_row(bits, 0.3, n, 9.5e6, 0.0, kappa=1.2) for bits, n in ((50e6, 100), (1e9, 200))]
    rows[1]["s_per_step"] -= 0.01  # more messages, less time: α would come out negative
    alpha, kappa, kappa1 = e2e_study._fit_link(rows)  # one message size per row count: κ1 fitted too
    assert alpha == 0.0 and kappa1 >= 0.0 and 1.0 < kappa + kappa1 * 9.5e6 / 150 / 1e6 < 1.4


def test_two_tier_rows_send_data_axis_bytes_at_the_inter_node_rate():
    row = {"measured_bit_per_s": {"intra": 8e8, "inter": 8e7}, "tensor_messages_per_step": 0,
           "wire_bytes_per_step": {"tensor": 1e6, "data": 1e6}}
    assert e2e_study._predict(row, 0.5, (1.0, 1.0, 0.0), LOOPBACK) == pytest.approx(0.5 + 1e6 / 1e8 + 1e6 / 1e7)


def test_emulated_rate_of_a_transfer_fraction_inverts_the_model():
    ref = _row(250e6, 0.3, 200, 9.5e6, 0.0)
    link = (1e-4, 1.3, 0.4)
    for f in (0.05, 0.5, 0.9):
        bits = e2e_study._emulated_rate_for(f, ref, link)
        row = dict(ref, measured_bit_per_s={"link": bits})
        t = e2e_study._predict(row, 0.3, link, LOOPBACK)
        assert e2e_study._comm_s(row, link, LOOPBACK)[1] / t == pytest.approx(f)


def test_analyze_writes_tables_plot_and_gpu_predictions(tmp_path, monkeypatch, capsys):
    """A study folder with one configuration (rows built from the model with a known α) gives study.json,
    study.md (every row, the model's error, both models on the rows they were not fitted on, the GPU
    table with error ranges) and the plot; a configuration run on a loaded machine is labelled so in
    both and on the terminal."""
    monkeypatch.setattr(e2e_study, "CONFIGS", {"gpt2_tp2_sp_bf16": []})
    alpha, rows = 2e-4, []
    for bits, n in ((50e6, 200), (1e9, 100), (250e6, 150), (500e6, 120), (None, 150)):
        ex = _row(bits, 0.30, n, 9.5e6 * (1 + (n == 120)), alpha, kappa=1.4, kappa1=0.3)
        tc = _row(bits, 0.34, n + 20, 5.1e6, alpha, variant="taco", kappa=1.4, kappa1=0.3)
        for r in (ex, tc):
            if bits is None:  # loopback: the multi-process step without a link (here: the one-process step)
                r["s_per_step"] = r["local_s_per_step"]
            r.update(link=f"{bits:.0f}" if bits else "none", speedup_median=ex["s_per_step"] / r["s_per_step"],
                     tokens_per_s=1.0, comm_fraction=0.5, byte_ratio=0.536, byte_bound=1.3)
            r["speedup_min"] = r["speedup_max"] = r["speedup_median"]
            for k in ("config", "loopback_s_per_step"):
                r.pop(k)
        rows += [ex, tc]
    d = tmp_path / "gpt2_tp2_sp_bf16"
    d.mkdir()
    (d / "bench_e2e.json").write_text(json.dumps({"command": "python -m experiments.e2e.bench_e2e ...", "rows": rows,
                                                  "loaded": True}))  # written under --allow-loaded
    res = e2e_study.analyze(tmp_path)
    assert res["loaded"] == ["gpt2_tp2_sp_bf16"] and "LOADED: gpt2_tp2_sp_bf16" in capsys.readouterr().err
    assert (res["alpha_s"], res["kappa0"], res["kappa1_per_mb"]) == pytest.approx((alpha, 1.4, 0.3), rel=1e-6)
    lm = res["loopback_model"]
    assert (lm["alpha_s"], lm["kappa0"], lm["kappa1_per_mb"]) == pytest.approx((alpha, 1.4, 0.3), rel=1e-6)
    shaped = [r for r in res["rows"] if r["link"] != "none"]
    assert all(abs(r["model_error"]) < 1e-6 and abs(r["loop_model_error"]) < 1e-6 for r in shaped)
    assert [r["model_fitted"] for r in shaped] == [True, False] * 4 and res["model_error"]["held_out_rows"] == 4
    assert res["fit_configs"] == ["gpt2_tp2_sp_bf16"] and res["machine"].startswith("not recorded by the runs")
    taco = [r for r in shaped if r["variant"] == "taco"]
    assert all(r["model_speedup"] == pytest.approx(r["speedup_median"]) for r in taco)
    assert all(r["codec_s_per_step"] == pytest.approx(0.04) for r in taco)
    assert all(1.0 < r["bandwidth_bound"] < 1 / 0.536 for r in taco)
    gpu = res["gpu_predictions"]
    assert len({g["tp_link"] for g in gpu}) == 4 and all(g["taco_tp"] > 0.5 for g in gpu)
    # the model's error here is 0, so each range is the point; COCCL's settings on H800 NVLink get an error
    assert all(g["range_taco_tp"] == pytest.approx([g["taco_tp"]] * 2) for g in gpu)
    coccl = [g for g in gpu if "published_error" in g]
    assert len(coccl) == 4 and all(g["tp_link"].startswith("H800") and g["published"].startswith("COCCL")
                                   for g in coccl)
    md = (tmp_path / "study.md").read_text()
    assert md.count("| taco |") == 5 + 4 and "Predicted on GPU clusters" in md  # the config table + held out
    assert "### The models on the shaped rows they were not fitted on" in md and md.count("| gpt2_tp2_sp_bf16 | ") == 4
    assert md.startswith("**LOADED machine") and "### gpt2_tp2_sp_bf16 (LOADED machine: not a result)" in md
    assert (tmp_path / "speedup_vs_link.png").stat().st_size > 10_000


def test_the_loopback_model_keeps_the_processes_sharing_of_the_cores_out_of_alpha():
    """When the processes' sharing of the cores costs a time per collective that loopback shows too, the
    one-process model folds it into α and the loopback model leaves it in its anchor (the loopback step)."""
    alpha, share = 3e-4, 3e-3
    rows = [_row(bits, 0.3, n, b, alpha, kappa=1.3) for bits in (50e6, 250e6, 1e9, 4e9) for n in (40, 80)
            for b in (9.5e6, 19e6)]
    for r in rows:
        r["loopback_s_per_step"] = r["local_s_per_step"] + r["tensor_messages_per_step"] * share
        r["s_per_step"] += r["tensor_messages_per_step"] * share
    assert e2e_study._fit_link(rows) == pytest.approx((alpha, 1.3, 0.0), rel=1e-6, abs=1e-9)
    assert e2e_study._fit_link(rows, "local_s_per_step") == pytest.approx((alpha + share, 1.3, 0.0), rel=1e-6,
                                                                         abs=1e-9)


def test_a_two_tier_loopback_run_drops_the_nodes_flag():
    assert bench_e2e._launch_args("--nodes 2", "intra=1gbit,inter=100mbit") == [
        "--nodes", "2", "--link", "intra=1gbit,inter=100mbit"]
    assert bench_e2e._launch_args("--nodes 2 --verbose", "none") == ["--verbose"]
    assert bench_e2e._launch_args("--nodes=2", "none") == [] and bench_e2e._launch_args("", "1gbit") == [
        "--link", "1gbit"]


def test_pinned_configurations_add_the_flag_to_their_launch_args():
    assert e2e_study.pinned(["--links", "none"]) == ["--links", "none", "--launch-args=--pin-cpus"]
    two_tier = e2e_study.pinned(e2e_study.CONFIGS["gpt2_dp2_tp2_two_tier"])
    assert "--launch-args=--nodes 2 --pin-cpus" in two_tier and len(two_tier) == len(
        e2e_study.CONFIGS["gpt2_dp2_tp2_two_tier"])
    assert e2e_study.pinned(two_tier) == two_tier
    assert bench_e2e._launch_args("--nodes 2 --pin-cpus", "none") == ["--pin-cpus"]
    # a flag list as the next word, which argparse alone refuses ("expected one argument")
    assert bench_e2e._joined(["--launch-args", "--pin-cpus", "--train-args", "--vocab-size 512", "--rounds", "2"]) == [
        "--launch-args=--pin-cpus", "--train-args=--vocab-size 512", "--rounds", "2"]
    assert bench_e2e._joined(["--links", "none", "--launch-args"]) == ["--links", "none", "--launch-args"]


@pytest.mark.parametrize("args,message", [
    (["--links", "fast"], "link rate 'fast'"), (["--links", "intra=1gbit"], "must be RATE or intra=RATE,inter=RATE"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"), (["--steps", "2", "--warmup", "2"], "--steps 2 must be >"),
    (["--processes", "1"], "--processes 1 must be >= 2"), (["--dtype", "foo"], "invalid choice: 'foo'"),
    (["--launch-args", "--pin-cpus", "--rounds", "0"], "--rounds 0 must be >= 1")])  # the flag list is taken
def test_bad_arguments_fail_before_any_run(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_e2e.main([*args, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [(["--rounds", "0"], "--rounds 0 must be >= 1"),
                                          (["--analyze"], "no results under")])
def test_study_refuses_bad_rounds_and_an_empty_results_folder(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        e2e_study.main([*args, "--out", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


# The load guard (experiments/e2e/load_guard.py): its decision with injected measurements, the studies'
# handling of a loaded run with injected runs, and one real CPU burner.

def _calibration(path, probe_s, **machine):
    path.write_text(json.dumps({"probe_s": probe_s, "probe_size": load_guard.PROBE_SIZE, "date": "today",
                                "probe_matmuls": load_guard.PROBE_MATMULS,
                                "machine": {**load_guard.machine(), **machine}}))
    return path


def _measured(other=0.0, probe=None, load=0.0):
    """Injected measurements of a quiet machine unless told otherwise; the probe by default at its
    calibrated time (experiments/e2e/load_probe.json where it belongs to this machine), else 0.3 s."""
    if probe is None:
        probe = load_guard.load_calibration()[0] or 0.3
    return {"other_cpu_cores": other, "probe_s": probe, "load_average_1min": load}


def test_load_guard_judges_each_limit_and_warns_on_the_terminal(tmp_path, capsys):
    cores = os.cpu_count()
    guard = load_guard.Guard(processes=cores, calibration=_calibration(tmp_path / "cal.json", 0.3), tag="[t]")
    lim = guard.limits
    assert not guard.judge("quiet", _measured(lim.other_cpu_cores, 0.3 * lim.probe_slowdown, lim.load_tolerance),
                           start=True)["busy"]
    assert capsys.readouterr().err == "" and not guard.loaded and guard.label == ""
    c = guard.judge("busy core", _measured(other=1.0), start=False)
    assert c["busy"] and "other processes used 1.00 cores" in capsys.readouterr().err
    c = guard.judge("slow probe", _measured(probe=0.45), start=False)
    assert c["probe_ratio"] == pytest.approx(1.5)
    err = capsys.readouterr().err
    assert err.startswith("[t] WARNING: the machine is busier than the study allows (slow probe)") and "1.50x" in err
    # the load average counts before the study only (later it holds the study's own runs)
    assert not guard.judge("during", _measured(load=cores + 5), start=False)["busy"]
    c = guard.judge("start", _measured(load=lim.load_tolerance + 0.1), start=True)
    assert c["busy"] and "load average" in capsys.readouterr().err
    assert guard.loaded and guard.label == " [LOADED]"
    assert [c["where"] for c in guard.summary()["checks"] if c["busy"]] == ["busy core", "slow probe", "start"]
    guard.next_result()
    assert not guard.loaded and guard.summary()["checks"] == []
    with pytest.raises(ValueError, match="probe_slowdown=0"):
        load_guard.Limits(probe_slowdown=0)


def test_the_probe_calibration_belongs_to_its_machine_and_needs_a_quiet_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cal.json"
    assert load_guard.load_calibration(path) == (None, f"no probe calibration ({path} missing)")
    assert load_guard.load_calibration(_calibration(path, 0.3, cpu="another CPU"))[0] is None
    assert "another machine" in load_guard.load_calibration(path)[1]
    path.write_text(path.read_text().replace(f'"probe_size": {load_guard.PROBE_SIZE}', '"probe_size": 7'))
    assert "another probe" in load_guard.load_calibration(path)[1]
    guard = load_guard.Guard(processes=2, calibration=path, measure=lambda where: _measured(probe=10.0))
    assert not guard.check("start", start=True)["busy"]  # an uncalibrated probe is not judged, and said so
    assert "the compute probe is not judged" in capsys.readouterr().err
    # calibrating: refused on a busy machine (file untouched), written on a quiet one
    monkeypatch.setattr(load_guard, "probe", lambda: 0.25)
    monkeypatch.setattr(load_guard.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(load_guard._Window, "other_cores", lambda self: (1.2, 0.25))
    before = path.read_text()
    with pytest.raises(load_guard.Loaded) as e:
        load_guard.calibrate(path)
    assert e.value.code == load_guard.LOADED_EXIT and "not quiet" in capsys.readouterr().err
    assert path.read_text() == before
    monkeypatch.setattr(load_guard._Window, "other_cores", lambda self: (0.0, 0.25))
    assert load_guard.calibrate(path)["machine"] == load_guard.machine()
    assert load_guard.load_calibration(path)[0] == 0.25


def _fake_run(cmd, out, timeout, warmup, env):
    """bench_e2e._run without processes: a step time per variant, the byte counts of a tiny step."""
    taco = "taco" in cmd
    return {"step_s": 0.3 if taco else 0.4, "steps_s": [0.5, 0.4, 0.4], "wall_s": 1.0,
            "wire_bytes_per_step": {"tensor": 500 if taco else 1000}, "tensor_messages_per_step": 10,
            "wire_detail": [{"axis": "tensor", "op": "all-reduce", "dtype": "u8" if taco else "bf16", "count": 10,
                             "bytes": 500 if taco else 1000}], "emulated_link": None, "final_train_loss": 7.0}


def test_a_run_on_a_loaded_machine_is_written_as_not_a_result(tmp_path, monkeypatch, capsys):
    """The machine turns busy during a run: bench_e2e warns at once, writes bench_e2e.loaded.json, no
    bench_e2e.json, and exits with status 3; with --allow-loaded the result is written labelled."""
    monkeypatch.setattr(bench_e2e, "_run", _fake_run)

    def measure(where):
        return _measured(other=1.5 if where == "none round 1 taco" else 0.0)

    args = ["--links", "none", "--rounds", "2", "--out", str(tmp_path / "a")]
    with pytest.raises(load_guard.Loaded) as e:
        bench_e2e.main(args, guard=load_guard.Guard(processes=2, measure=measure, tag="[bench_e2e]"))
    assert e.value.code == 3
    out = capsys.readouterr()
    assert "[bench_e2e] WARNING: the machine is busier than the study allows (none round 1 taco): other " \
           "processes used 1.50 cores" in out.err and "NOT A RESULT" in out.err
    assert "round 0 taco: 0.3000 s/step\n" in out.out and "round 1 taco: 0.3000 s/step [LOADED]" in out.out
    assert not (tmp_path / "a" / "bench_e2e.json").exists()
    res = json.loads((tmp_path / "a" / "bench_e2e.loaded.json").read_text())
    assert res["loaded"] and [c["where"] for c in res["load_guard"]["checks"] if c["busy"]] == ["none round 1 taco"]
    assert (tmp_path / "a" / "bench_e2e.loaded.md").read_text().startswith("**LOADED machine: not a result.**")

    args[-1] = str(tmp_path / "b")
    res = bench_e2e.main(args, guard=load_guard.Guard(processes=2, allow_loaded=True, measure=measure))
    assert res["loaded"] and json.loads((tmp_path / "b" / "bench_e2e.json").read_text())["loaded"]
    assert res["command"] == res["run"]["command"] == "python -m experiments.e2e.bench_e2e " + " ".join(args)
    assert capsys.readouterr().out.count("LOADED") == 3  # one run line, the last round's other run, the table


def test_the_study_stops_at_a_loaded_configuration_and_keeps_the_finished_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_e2e, "_run", _fake_run)
    cfg = ["--processes", "2", "--links", "none", "--rounds", "1"]
    monkeypatch.setattr(e2e_study, "CONFIGS", {"one": cfg, "two": cfg, "three": cfg})

    def measure(where):  # busy once the first configuration is written
        return _measured(other=1.0 if (tmp_path / "one" / "bench_e2e.json").exists() else 0.0)

    guard = load_guard.Guard
    monkeypatch.setattr(load_guard, "Guard", lambda **k: guard(**k, measure=measure))
    with pytest.raises(load_guard.Loaded) as e:
        e2e_study.main(["--out", str(tmp_path)])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "WARNING" in err and "[e2e_study] stopped: two ran on a busy machine and was not added" in err
    assert (tmp_path / "one" / "bench_e2e.json").exists() and (tmp_path / "two" / "bench_e2e.loaded.json").exists()
    assert not (tmp_path / "two" / "bench_e2e.json").exists() and not (tmp_path / "three").exists()
    assert not (tmp_path / "study.json").exists()
    with pytest.raises(load_guard.Loaded):  # busy before the start: nothing runs
        e2e_study.main(["--out", str(tmp_path), "--only", "three"])
    assert "[e2e_study] not started: other processes used 1.00 cores" in capsys.readouterr().err
    assert not (tmp_path / "three").exists()


def test_wait_quiet_waits_out_a_busy_machine_and_runs_a_busy_round_again(tmp_path, monkeypatch, capsys):
    """--wait-quiet: a busy check before the study is repeated until quiet; a round during which the
    machine was busy (over a run, or at the check after it) is discarded and run again; the result is
    written, not loaded, and says what was waited through and run again. A machine that stays busy
    past the wait still makes the result loaded."""
    calls = []

    def _counting_run(cmd, out, timeout, warmup, env):
        calls.append(out.name)
        return _fake_run(cmd, out, timeout, warmup, env)

    monkeypatch.setattr(bench_e2e, "_run", _counting_run)
    seen = {}

    def measure(where):  # busy: the first check, the first attempt of round 1's taco run, after one process taco
        seen[where] = seen.get(where, 0) + 1
        busy = (where in ("before the study", "none round 1 taco", "after one process taco") and seen[where] == 1)
        return _measured(other=1.5 if busy else 0.0)

    guard = load_guard.Guard(processes=2, measure=measure, tag="[bench_e2e]", wait_s=60, sleep=lambda s: None)
    res = bench_e2e.main(["--links", "none", "--rounds", "2", "--out", str(tmp_path / "a")], guard=guard)
    assert not res["loaded"] and (tmp_path / "a" / "bench_e2e.json").exists()
    err = capsys.readouterr().err
    assert "waiting up to 60 s for a quiet machine (before the study)" in err
    assert "quiet again (before the study)" in err
    assert "none round 1 discarded (the machine was busy: none round 1 taco: other processes used 1.50" in err
    assert res["load_guard"]["redone"] == ["one process taco", "none round 1"]
    assert res["load_guard"]["waited_checks"] == 1
    # each discarded run ran twice, every other once; the kept rows hold one run per round
    assert calls == ["local_exact", "local_taco", "local_taco", "none_exact_r0", "none_taco_r0",
                     "none_taco_r1", "none_taco_r1", "none_exact_r1"]  # a busy run ends its round's attempt
    assert all(len(r["runs"]) == 2 for r in res["rows"])
    assert (tmp_path / "a" / "bench_e2e.md").read_text().startswith(
        "Waited out a busy machine (`--wait-quiet 60`): 1 busy check waited through; 2 runs or rounds discarded")

    def always_busy(where):
        return _measured(other=1.5)

    guard = load_guard.Guard(processes=2, measure=always_busy, tag="[bench_e2e]", wait_s=0.01, sleep=lambda s: None)
    with pytest.raises(load_guard.Loaded):
        bench_e2e.main(["--links", "none", "--out", str(tmp_path / "b")], guard=guard)
    assert "still busy (before the study) after 0 s" in capsys.readouterr().err
    with pytest.raises(ValueError, match="wait_s=-1"):
        load_guard.Guard(processes=2, wait_s=-1)
    for bad in ("inf", "-3", "soon"):
        with pytest.raises(SystemExit) as e:
            bench_e2e.main(["--links", "none", "--wait-quiet", bad])
        assert e.value.code == 2 and f"--wait-quiet {bad!r} must be a finite number" in capsys.readouterr().err


def test_wait_quiet_gives_up_on_a_round_that_stays_busy(tmp_path, monkeypatch, capsys):
    """A round busy at every attempt runs MAX_REDOS + 1 times, then its busy checks make the result loaded."""
    monkeypatch.setattr(bench_e2e, "_run", _fake_run)
    monkeypatch.setattr(load_guard, "MAX_REDOS", 2)

    def measure(where):  # quiet at every check, busy over every run of round 0 on loopback
        return _measured(other=1.5 if where.startswith("none round 0 ") else 0.0)

    guard = load_guard.Guard(processes=2, measure=measure, wait_s=60, sleep=lambda s: None, allow_loaded=True)
    res = bench_e2e.main(["--links", "none", "--rounds", "1", "--no-local", "--out", str(tmp_path)], guard=guard)
    assert res["loaded"] and res["load_guard"]["redone"] == ["none round 0", "none round 0"]
    out = capsys.readouterr().out
    assert out.count("[busy: runs again]") == 2 and "none round 0 exact: 0.4000 s/step [LOADED]" in out
    assert res["config"]["wait_quiet"] == 60 and res["config"]["allow_loaded"]


def test_a_cpu_burner_makes_the_study_warn_and_not_start(tmp_path, capsys):
    """A real busy machine: 3 busy-loop processes on this machine's cores; the one-rate command warns on
    the terminal naming the measurement and writes nothing."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        time.sleep(0.5)
        with pytest.raises(load_guard.Loaded) as e:
            bench_e2e.main(["--links", "none", "--out", str(tmp_path / "out")])
    finally:
        for b in burners:
            b.kill()
            b.wait()
    err = capsys.readouterr().err
    assert e.value.code == 3 and "[bench_e2e] WARNING: the machine is busier than the study allows" in err
    assert "[bench_e2e] not started: other processes used" in err
    assert not (tmp_path / "out").exists()


def test_one_process_step_runs_the_transport_the_processes_resolve_to(tmp_path, monkeypatch):
    """The one-process (transport-free) step gets `--transport gloo`, what "auto" is in a multi-process
    CPU run, unless the variant names its own; bench_e2e.json records it per variant and per row."""
    assert bench_e2e.local_transport(["--comm", "none"]) == "gloo"
    assert bench_e2e.local_transport(["--transport", "xla", "--comm", "none"]) == "xla"
    assert bench_e2e.local_transport(["--transport", "xla", "--transport=auto"]) == "gloo"
    commands = []

    def run(cmd, out, timeout, warmup, env):  # the bookkeeping only: no processes
        commands.append(cmd)
        return {"step_s": 0.5 if "launch" in cmd else 0.3, "wire_bytes_per_step": {"tensor": 1e6},
                "tensor_messages_per_step": 10, "wire_detail": detail, "emulated_link": None,
                "final_train_loss": 1.0}

    detail = [{"axis": "tensor", "op": "all-reduce", "dtype": "bf16", "count": 10, "bytes": 1000000}]

    monkeypatch.setattr(bench_e2e, "_run", run)
    res = bench_e2e.main(["--links", "none", "--rounds", "1", "--out", str(tmp_path),
                          "--variant", "exact=--comm none", "--variant", "x=--comm none --transport xla"],
                         guard=load_guard.Guard(processes=2, measure=lambda where: _measured()))
    local = [c for c in commands if "launch" not in c]
    assert [c[-4:-2] for c in local] == [["--transport", "gloo"], ["--transport", "xla"]]
    recorded = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert {v: r["transport"] for v, r in recorded["local"].items()} == {"exact": "gloo", "x": "xla"}
    assert [r["local_transport"] for r in res["rows"]] == ["gloo", "xla"]
    assert all(r["wire_detail"] == detail and "wire_detail" not in r["runs"][0] for r in res["rows"])
    launched = [c for c in commands if "launch" in c]
    assert ["--transport" in c for c in launched] == [False, True]  # the processes resolve "auto" themselves


def test_a_run_folder_left_by_an_interrupted_run_is_replaced(tmp_path, monkeypatch):
    """Rerunning a configuration (after a loaded or interrupted run) reuses its run folders: the old
    folder, checkpoints included, is removed before the run, so `train` does not refuse it."""
    out = tmp_path / "local_exact"
    (out / "checkpoints" / "8").mkdir(parents=True)

    def train(cmd, **kw):  # what `taco-jax train --out DIR` leaves (no process: the bookkeeping only)
        o = pathlib.Path(cmd[-1])
        o.mkdir()  # fails if the old folder is still there
        (o / "metrics.jsonl").write_text("".join(json.dumps({"step_s": s}) + "\n" for s in (9, 1, 2, 3)))
        (o / "summary.json").write_text(json.dumps({"wire_bytes_per_step": {"tensor": 8}, "final_train_loss": 1,
                                                    "wire_detail": [{"axis": "tensor", "count": 3}]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_e2e.subprocess, "run", train)
    got = bench_e2e._run(["taco-jax", "train", "--out", str(out)], out, 60, 1, {})
    assert got["step_s"] == 2 and got["tensor_messages_per_step"] == 3 and not (out / "checkpoints").exists()


def test_a_broken_result_file_is_named(tmp_path, capsys):
    """A truncated or foreign bench_e2e.json fails the analysis naming the file, not with a bare parse error."""
    d = tmp_path / "gpt2_tp2_sp_bf16"
    d.mkdir()
    (d / "bench_e2e.json").write_text('{"rows": [{"link": "50')
    with pytest.raises(SystemExit) as e:
        e2e_study.main(["--out", str(tmp_path), "--analyze"])
    assert e.value.code == 2 and f"{d / 'bench_e2e.json'} is not a bench_e2e result" in capsys.readouterr().err


def test_rate_label_gives_the_frame_rate_where_recorded():
    """study.md's link column: payload Mbit/s per tier, the rate in Ethernet frames beside it where the run
    recorded it (runs before the link test read the MSS have none), 'loopback' without a link."""
    row = {"measured_bit_per_s": {"intra": 9.4e8, "inter": 9.5e7}}
    assert e2e_study._rate_label(row) == "intra 940, inter 95"
    row["measured_wire_bit_per_s"] = {"intra": 9.83e8}
    assert e2e_study._rate_label(row) == "intra 940; 983 in frames, inter 95"
    assert e2e_study._rate_label({"measured_bit_per_s": None}) == "loopback"
