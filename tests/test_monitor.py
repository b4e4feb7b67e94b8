"""`train --monitor-every N`: the per-site SQNR the monitor logs agrees with an independent numpy
computation on the captured messages; a bad codec under `--monitor-min-sqnr` stops the run naming
the site and step (exit 1); the train step's program is the same with and without the monitor."""

import json
import math

import jax
import numpy as np
import pytest

from taco_jax.cli import main
from taco_jax.codec import max_rel_error, roundtrip, sqnr_db
from taco_jax.data import TokenStream
from taco_jax.train.capture import make_capture_fn
from taco_jax.train.config import TrainConfig
from taco_jax.train.monitor import Monitor, MonitorError, make_monitor_fn, monitor_due, summarize
from taco_jax.train.step import make_trainer, shard_batch

pytestmark = pytest.mark.slow

SMALL = dict(model="gpt2-tiny", dtype="float32", vocab_size=512, batch_size=8, seq_len=32, warmup_steps=1,
             eval_every=50, eval_batches=1)


@pytest.fixture(scope="module")
def dataset(shakespeare512):
    return shakespeare512


def _monitor_and_capture(dataset, tmp_path, **flags):
    """(trainer, monitor loss, per-site monitor summary, capture loss, captured messages) of one
    batch at init parameters, for `--comm taco` with `flags`."""
    cfg = TrainConfig.from_flags(comm="taco", steps=2, out=str(tmp_path), **SMALL, **flags)
    trainer = make_trainer(cfg)
    params, _ = trainer.init()
    x, y = shard_batch(trainer, *next(TokenStream(dataset.train, cfg.data.batch_size, cfg.data.seq_len, seed=0)))
    loss_m, per_call = make_monitor_fn(trainer)(params, x, y)
    loss_c, msgs = make_capture_fn(trainer)(params, x, y)
    return trainer, loss_m, summarize({k: np.asarray(v) for k, v in per_call.items()}), loss_c, msgs


def test_monitor_matches_numpy_on_the_captured_messages(dataset, tmp_path):
    """One-shot all-reduce (decode every rank's message, sum in FP32 in rank order): the compressed
    result is rebuilt from the captured messages with the codec's own roundtrip, the exact one is
    the float64 numpy sum, and SQNR / relative errors come from `codec.metrics`."""
    trainer, loss_m, got, loss_c, msgs = _monitor_and_capture(dataset, tmp_path, algorithm="one_shot")
    assert float(loss_m) == loss_c  # the same twin
    n_d, n_t = 2, 4
    codec = trainer.policy.ar_fwd
    rt = jax.jit(lambda m: roundtrip(m, codec, batch_dims=1))
    assert set(got) == {"ar_fwd", "ar_bwd"}
    for site in ("ar_fwd", "ar_bwd"):
        keys = sorted(k for k in msgs if k.startswith(site + "__"))
        exact, comp = [], []
        for k in keys:  # [devices in mesh order (data-major), *message]
            parts = msgs[k].reshape(n_d, n_t, *msgs[k].shape[1:])
            dec = np.asarray(rt(msgs[k])).reshape(parts.shape)
            acc = dec[:, 0]
            for r in range(1, n_t):  # FP32, rank order
                acc = acc + dec[:, r]
            exact.append(parts.astype(np.float64).sum(1))
            comp.append(acc)
        per = {k.split("__")[1]: sqnr_db(e, c) for k, e, c in zip(keys, exact, comp)}
        want = {"sqnr_db": sqnr_db(exact, comp), "min_sqnr_db": min(per.values()),
                "worst_call": min(per, key=per.get), "max_rel_err": max_rel_error(exact, comp), "calls": len(keys)}
        want["rel_err"] = 10 ** (-want["sqnr_db"] / 20)
        assert got[site]["calls"] == want["calls"] == 9 and got[site]["worst_call"] == want["worst_call"]
        for key in ("sqnr_db", "min_sqnr_db"):
            assert got[site][key] == pytest.approx(want[key], abs=1e-3), (site, key)
        for key in ("rel_err", "max_rel_err"):
            assert got[site][key] == pytest.approx(want[key], rel=1e-4), (site, key)
        assert 20 < got[site]["min_sqnr_db"] <= got[site]["sqnr_db"] < 40  # E4M3: ~30 dB


def test_bad_codec_under_min_sqnr_stops_the_run_naming_site_and_step(tokenizer_dir, tmp_path, capsys, monkeypatch):
    """int4 with one scale per 512 values (~15 dB) on ar_fwd (the other sites exact: a smaller
    program) against --monitor-min-sqnr 25: exit 1 at step 1, after that step's record (with the
    monitor's numbers) is written."""
    monkeypatch.setenv("TACO_JAX_CACHE", str(tokenizer_dir))
    out = tmp_path / "run"
    argv = ["train", "--comm", "none", "--site", "ar_fwd:kind=int4,group_size=512", "--steps", "2",
            "--monitor-every", "1",
            "--monitor-min-sqnr", "25", "--vocab-size", "512", "--batch-size", "8", "--seq-len", "32",
            "--eval-batches", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "taco-jax: error: step 1: site ar_fwd: SQNR" in err and "--monitor-min-sqnr 25 dB" in err
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1] and not (out / "summary.json").exists()
    mon = recs[0]["monitor"]
    assert set(mon) == {"ar_fwd"} and mon["ar_fwd"]["min_sqnr_db"] < 25 and mon["ar_fwd"]["calls"] == 9
    assert f"SQNR {mon['ar_fwd']['min_sqnr_db']:.2f} dB (worst call {mon['ar_fwd']['worst_call']}" in err


def test_train_step_program_is_unchanged_by_the_monitor():
    base = dict(SMALL, comm="none", site=["ar_fwd:kind=int8"], steps=10)
    plain = make_trainer(TrainConfig.from_flags(**base))
    monitored = make_trainer(TrainConfig.from_flags(**base, monitor_every=1, monitor_min_sqnr=30.0))
    params, opt = plain.init()
    batch = jax.ShapeDtypeStruct((8, 32), np.int32)
    texts = [t.train_step.lower(params, opt, batch, batch).as_text() for t in (plain, monitored)]
    assert texts[0] == texts[1]


def test_monitor_steps_thresholds_and_config():
    assert [k for k in range(1, 11) if monitor_due(k, 4, 10)] == [4, 8, 10]
    assert not any(monitor_due(k, 0, 10) for k in range(1, 11))
    mon = Monitor.__new__(Monitor)
    mon.warn_db, mon.min_db, mon.roles = 20.0, 10.0, {"exit01": "h0.attn"}
    site = {"sqnr_db": 16.0, "min_sqnr_db": 15.0, "worst_call": "exit01"}
    mon.check(7, {"ar_fwd": site})  # below the warning only: no error
    with pytest.raises(MonitorError, match=r"step 7: site ar_bwd: SQNR nan dB \(worst call exit02\)"):
        mon.check(7, {"ar_bwd": {**site, "min_sqnr_db": math.nan, "worst_call": "exit02"}})  # NaN counts as below
    with pytest.raises(ValueError, match="monitor_every=-1"):
        TrainConfig.from_flags(monitor_every=-1)
    with pytest.raises(ValueError, match="monitor_every=2 needs the unpipelined layout"):
        TrainConfig.from_flags(monitor_every=2, mesh="data=2,stage=2,tensor=2", microbatches=2)
    with pytest.raises(ValueError, match="monitor_min_sqnr=nan"):
        TrainConfig.from_flags(monitor_min_sqnr=math.nan)


def test_monitor_warning_is_printed(capsys):
    mon = Monitor.__new__(Monitor)
    mon.warn_db, mon.min_db, mon.roles = 20.0, float("-inf"), {"exit01": "h0.attn"}
    mon.check(3, {"ar_fwd": {"sqnr_db": 16.0, "min_sqnr_db": 15.0, "worst_call": "exit01"},
                  "ar_bwd": {"sqnr_db": 31.0, "min_sqnr_db": 30.0, "worst_call": "enter00"}})
    err = capsys.readouterr().err
    assert "monitor: step 3: site ar_fwd: SQNR 15.00 dB (worst call exit01, h0.attn) is below 20 dB" in err
    assert "ar_bwd" not in err


def test_monitor_summary_and_plot(tmp_path):
    """summary.json's "monitor" and monitor.png from a run's records (non-finite values as strings)."""
    from taco_jax.train.hooks import monitor_summary
    from taco_jax.train.plots import plot_monitor
    from taco_jax.util import jsonio

    def site(db, worst):
        return {"sqnr_db": db, "min_sqnr_db": worst, "worst_call": "exit01", "rel_err": 10 ** (-db / 20),
                "max_rel_err": 0.05, "calls": 9}

    recs = [{"step": k, "loss": 6.0 - k / 10, "grad_norm": 1.0, "step_s": 0.1, "tokens_per_s": 1.0}
            for k in range(1, 5)]
    recs[1].update(monitor={"ar_fwd": site(29.0, 28.0), "ar_bwd": site(float("inf"), float("inf"))}, monitor_s=9.0)
    recs[3].update(monitor={"ar_fwd": site(31.0, 27.0), "ar_bwd": site(30.0, 29.5)}, monitor_s=0.3, val_loss=5.7)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(jsonio.dumps(r) + "\n" for r in recs))
    got = monitor_summary(recs)
    assert got["steps"] == [2, 4]
    assert got["sites"]["ar_fwd"] == {"mean_sqnr_db": 30.0, "min_sqnr_db": 27.0, "first_sqnr_db": 29.0,
                                      "last_sqnr_db": 31.0}
    assert got["sites"]["ar_bwd"]["min_sqnr_db"] == 29.5 and got["sites"]["ar_bwd"]["mean_sqnr_db"] == float("inf")
    assert got["monitor_s_mean"] == 0.3 and got["step_s_mean"] == pytest.approx(0.1)
    assert '"Infinity"' in metrics.read_text()
    assert plot_monitor(tmp_path / "monitor.png", metrics, title="t").stat().st_size > 1000


@pytest.mark.slow
def test_monitor_sequence_parallel_sites(dataset, tmp_path):
    """--sequence-parallel: all_gather's SQNR against numpy (every rank's shard decoded with the codec's
    roundtrip: the compressed all-gather's result); reduce_scatter measured over as many calls."""
    trainer, _, got, _, msgs = _monitor_and_capture(dataset, tmp_path, sequence_parallel=True)
    rt = jax.jit(lambda m: roundtrip(m, trainer.policy.all_gather, batch_dims=1))
    keys = sorted(k for k in msgs if k.startswith("all_gather__"))
    exact = [msgs[k] for k in keys]
    want = sqnr_db(exact, [np.asarray(rt(m)) for m in exact])
    assert set(got) == {"all_gather", "reduce_scatter"}
    assert got["all_gather"]["calls"] == got["reduce_scatter"]["calls"] == len(keys) == 18
    assert got["all_gather"]["sqnr_db"] == pytest.approx(want, abs=1e-3)
    assert 20 < got["reduce_scatter"]["min_sqnr_db"] <= got["reduce_scatter"]["sqnr_db"] < 40


def test_progress_lines_name_the_step_of_an_earlier_val_loss(capsys):
    """Off a terminal the progress line shows the latest val loss, with "(step K)" when it was
    evaluated at an earlier step K (also the one a resumed run found in its history)."""
    from taco_jax.train.hooks import Progress, RunState

    state = RunState(None, None, None, None, start=2, history=[{"step": 2, "loss": 7.0, "val_loss": 6.5}],
                     val_loss=6.5)
    progress = Progress("x", 2, 5, 1, True)
    for step in (3, 4, 5):
        rec = {"step": step, "loss": 6.0, "tokens_per_s": 10.0}
        if step == 4:
            state.val_loss = rec["val_loss"] = 6.25
        progress.on_step(state, step, rec)
    progress.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train x]")]
    assert [line.split(" val ")[1] for line in lines] == ["6.5000 (step 2) 10 tokens/s", "6.2500 10 tokens/s",
                                                         "6.2500 (step 4) 10 tokens/s"], lines
