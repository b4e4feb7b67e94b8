"""Multi-process training on JAX's distributed runtime: start-up flags, the local launcher, process-local
batches, 2 processes × 4 devices vs 1 process × 8 devices, and the step watchdog.

The multi-process tests start real processes (`taco-jax launch`, `jax.distributed` on 127.0.0.1, gloo
collectives over TCP), each with a bounded timeout. Why the 1-process reference runs through the
launcher too (one process, gloo): with gloo, XLA:CPU runs every all-reduce of the step (in-process
groups included) as gloo's ring algorithm, which adds the partial sums in another order than the
in-process CPU all-reduce. Same collectives -> the same bits; the default in-process collectives
differ in the last bits (a few 1e-6 relative after a step; checked against a bound below).
"""

import json
import math
import re
import signal

import jax
import numpy as np
import pytest
from _procs import TINY, cli, losses, metrics, run, start, wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.data import batch_iterator
from taco_jax.launch import free_port, launch
from taco_jax.train import distributed
from taco_jax.train.distributed import DistConfig, TrainBatches


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


# -----------------------------------------------------------------------------
# in-process: flags, environment, batches


def test_dist_config_flags_env_and_errors(monkeypatch):
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    assert DistConfig.resolve() is None  # a single-process run
    assert DistConfig.resolve("10.0.0.1:1234", 4, 3) == DistConfig("10.0.0.1:1234", 4, 3)
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "host:99")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    assert DistConfig.resolve() == DistConfig("host:99", 2, 1)
    assert DistConfig.resolve(process_id=0) == DistConfig("host:99", 2, 0)  # the flag wins
    with pytest.raises(ValueError, match="coordinator='host' must be HOST:PORT"):
        DistConfig.resolve("host", 2, 0)
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        DistConfig.resolve("h:1", 2, 2)
    monkeypatch.delenv(distributed.ENV_PROCESS_ID)
    with pytest.raises(ValueError, match="needs --coordinator HOST:PORT, --num-processes N and --process-id I"):
        DistConfig.resolve()
    assert DistConfig.resolve(auto=True) == DistConfig("host:99", 2, -1)  # the rest auto-detected by JAX


def test_launch_refuses_bad_commands():
    with pytest.raises(ValueError, match="processes=0"):
        launch(0, ["train"])
    with pytest.raises(ValueError, match="no command"):
        launch(2, [])
    with pytest.raises(ValueError, match="--process-id is set by the launcher"):
        launch(2, ["train", "--process-id", "1"])
    assert 0 < free_port() < 65536


def test_train_batches_match_batch_iterator_and_resume(mesh):
    """The process-local stream draws the windows of `batch_iterator` (same seed), and its saved
    state continues it exactly."""
    tokens = np.arange(1000, dtype=np.int32) * 7 % 503
    sharding = NamedSharding(mesh, P("data"))
    ref = batch_iterator(tokens, 8, 16, seed=3)
    stream = TrainBatches(tokens, 8, 16, seed=3)
    for _ in range(2):
        x, y = stream.next(sharding)
        rx, ry = next(ref)
        np.testing.assert_array_equal(np.asarray(x), rx)
        np.testing.assert_array_equal(np.asarray(y), ry)
        assert x.sharding == sharding
    state = stream.state()
    assert state["position"] == 2
    again = TrainBatches(tokens, 8, 16, seed=99)
    again.restore(state)
    np.testing.assert_array_equal(np.asarray(again.next(sharding)[0]), next(ref)[0])
    with pytest.raises(ValueError, match="'MT19937'"):
        again.restore({"position": 1, "bit_generator": {"bit_generator": "MT19937"}})


def test_global_arrays_on_a_sharding(mesh):
    a = np.arange(64, dtype=np.int32).reshape(8, 8)
    (g,) = distributed.global_arrays(NamedSharding(mesh, P("data", "tensor")), a)
    np.testing.assert_array_equal(np.asarray(g), a)
    assert len(jax.devices()) == 8


# -----------------------------------------------------------------------------
# real processes


def _summaries(stdout: str) -> int:
    return len(re.findall(r"^\[\d+\] \{$", stdout, flags=re.M))


@pytest.mark.parametrize("mesh_spec, extra", [
    ("data=2,tensor=4", ["--comm", "taco"]),  # tensor axis inside each process, data axis across them
    pytest.param("tensor=4,data=2", ["--comm", "none"], marks=pytest.mark.slow),  # each tensor group spans both
    pytest.param("tensor=2,data=4", ["--model", "qwen3-tiny", "--comm", "taco"], marks=pytest.mark.slow),
    pytest.param("stage=2,tensor=4", ["--microbatches", "2", "--comm", "taco", "--pp-comm", "taco"],
                 marks=pytest.mark.slow),  # pipeline: stage 0 on process 0, stage 1 on process 1
], ids=["tensor-in-process-taco", "tensor-spans-processes-none", "qwen3-tensor-spans-taco", "stage-spans-taco"])
def test_two_processes_match_one(tmp_path, cache, mesh_spec, extra):
    """2 processes × 4 devices give the 1 process × 8 devices per-step losses and gradient norms bit
    for bit (both on gloo collectives); the files are written once (process 0)."""
    args = ["train", *TINY, "--steps", "3", "--mesh", mesh_spec, *extra, "--no-progress"]
    procs = {n: start(cli(*args, "--out", tmp_path / f"p{n}", processes=n), cache, tmp_path / f"p{n}.log")
             for n in (1, 2)}
    for n, p in procs.items():
        assert p.wait(timeout=420) == 0, (tmp_path / f"p{n}.log").read_text()[-3000:]
    one, two = losses(tmp_path / "p1"), losses(tmp_path / "p2")
    assert [r[0] for r in two] == [1, 2, 3]
    assert one == two  # bit-identical
    assert all(math.isfinite(v) and 4 < v < 9 for _, v, _ in two)  # ln(2048) = 7.6 at the start
    assert two[-1][1] < two[0][1]  # it learns
    log = (tmp_path / "p2.log").read_text()
    assert _summaries(log) == 1, log[-2000:]  # one summary, from process 0
    assert '"processes": 2' in log
    assert sorted(p.name for p in (tmp_path / "p2").iterdir()) == ["checkpoints", "config.json", "loss.png",
                                                                   "metrics.jsonl", "summary.json"]
    assert not list((tmp_path / "p2" / "checkpoints").iterdir())  # no --checkpoint-every, no SIGTERM


@pytest.mark.slow  # make test-slow (~40 s); the default suite keeps the gloo 2-vs-1 process test
def test_two_processes_vs_in_process_collectives(tmp_path, cache):
    """Known answer from another implementation: a plain one-process run (XLA's in-process CPU
    all-reduce, no gloo) gives per-step losses within 1e-5 relative: gloo's ring all-reduce adds the
    partial sums in another order, so they differ from step 1 in the last bits (~6e-8 relative).
    Exact communication (--comm none): with a codec the FP8 rounding of messages that differ in
    their last bits amplifies the difference (~2e-5 relative at step 3 with taco)."""
    args = ["train", *TINY, "--steps", "3", "--comm", "none", "--no-progress"]
    p2 = start(cli(*args, "--out", tmp_path / "p2", processes=2), cache, tmp_path / "p2.log")
    ref = run(cli(*args, "--out", tmp_path / "ref"), cache)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert p2.wait(timeout=420) == 0, (tmp_path / "p2.log").read_text()[-3000:]
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "p2")
    assert [r[0] for r in a] == [r[0] for r in b] == [1, 2, 3]
    for (_, la, ga), (_, lb, gb) in zip(a, b):
        assert abs(la - lb) <= 1e-5 * abs(la) and abs(ga - gb) <= 1e-4 * abs(ga), (a, b)


@pytest.mark.slow  # 36 s: a stalled process and a 10 s timeout (make test-slow)
def test_watchdog_names_the_late_process(tmp_path, cache):
    """Process 1 stalls before step 2: the run ends with an error naming step 2 and process 1 within
    --step-timeout + 10 s, and the launcher fails as a whole."""
    timeout = 10
    log = tmp_path / "log"
    args = ["train", *TINY, "--steps", "4", "--step-timeout", timeout, "--out", tmp_path / "run"]
    p = start(cli(*args, processes=2), cache, log, TACO_JAX_TEST_STALL="1:2:600")
    t_step1 = wait_for(lambda: "step 1/4" in log.read_text(), p, timeout=400, what="step 1", log=log)
    t_err = wait_for(lambda: "did not finish within --step-timeout" in log.read_text(), p,
                     timeout=timeout + 60, what="the watchdog's error", log=log)
    assert t_err - t_step1 <= timeout + 10, t_err - t_step1
    assert p.wait(timeout=60) == 1
    text = log.read_text()
    err = next(line for line in text.splitlines() if "did not finish" in line)
    assert "step 2 did not finish within --step-timeout 10 s" in err
    assert re.search(r"did not arrive at step 2: process 1 \(last started step 1\)", err), err
    assert "stopping the others" in text
    assert len(metrics(tmp_path / "run")) == 1  # step 1 logged, nothing after


@pytest.mark.slow  # make test-slow (~70 s); default: tests/test_checkpoint.py's SIGTERM and reshard tests
def test_sigterm_to_the_launcher_then_resume_on_another_mesh(tmp_path, cache):
    """SIGTERM to `launch` (a preemption) reaches both processes; JAX's preemption sync point makes
    them stop at the same step with one checkpoint (each process writing its shards) and exit 0.
    Resumed on data=4,tensor=2 (saved on data=2,tensor=4), Orbax reshards and the run continues."""
    out, log = tmp_path / "run", tmp_path / "log"
    args = ["train", *TINY, "--steps", "6", "--comm", "none", "--out", out]
    p = start(cli(*args, processes=2), cache, log)
    wait_for(lambda: "step 2/6" in log.read_text(), p, timeout=400, what="step 2", log=log)
    p.send_signal(signal.SIGTERM)  # the launcher forwards it
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    stopped = json.loads((out / "summary.json").read_text())["preempted_at_step"]
    assert 2 <= stopped < 6
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(stopped)]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (out / "checkpoints" / str(stopped) /
                                                                       "state").iterdir()}
    r = run(cli(*args, "--mesh", "data=4,tensor=2", "--resume", processes=2), cache)
    assert r.returncode == 0, r.stdout[-3000:]
    assert f"resumed from {out / 'checkpoints' / str(stopped)} (step {stopped}); mesh: checkpoint " \
           "'data=2,tensor=4', now 'data=4,tensor=2' (resharded)" in r.stdout
    recs = metrics(out)
    assert [x["step"] for x in recs] == list(range(1, 7))
    assert all(math.isfinite(x["loss"]) for x in recs) and recs[-1]["loss"] < recs[0]["loss"]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == stopped


@pytest.mark.slow  # make test-slow (two runs of 3 steps in 2 processes: 153 s wall, 70 s CPU, on 2 cores at load ~20)
def test_launch_compare_with_the_tensor_axis_spanning_two_processes(tmp_path, cache):
    """`launch --processes 2 -- compare` with tensor=2 over 2 processes × 1 device: both runs (exact,
    then TACO) on the distributed runtime; process 0 writes one summary.json naming both runs, with
    the tensor-axis wire bytes attributed to the tensor axis (replica groups are logical ids, not the
    processes' device ids)."""
    out = tmp_path / "cmp"
    r = run(cli("compare", *TINY, "--mesh", "data=1,tensor=2", "--steps", "3", "--eval-every", "3", "--no-progress",
                "--out", out, processes=2), cache)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["processes"] == 2 and s["mesh"] == "data=1,tensor=2"
    assert set(s["tokens_per_s"]) == {"none", "taco"} and all(v > 0 for v in s["tokens_per_s"].values())
    assert math.isfinite(s["val_loss_none"]) and math.isfinite(s["val_loss_taco"])
    assert s["compressed_axes"] == ["tensor"]
    wire = s["tensor_wire_bytes_per_step"]
    assert wire["none"] > 0 and 0 < wire["taco"] < wire["none"]
    assert "?" not in s["wire_bytes_per_step"]["none"]
    for run_ in ("none", "taco"):
        assert len(metrics(out / run_)) == 3
        assert json.loads((out / run_ / "summary.json").read_text())["processes"] == 2
    assert r.stdout.count('"val_loss_taco"') == 1  # one summary printed (process 0)
