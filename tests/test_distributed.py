"""Multi-process training on JAX's distributed runtime: start-up flags, the local launcher, process-local
batches, 2 processes × 4 devices vs 1 process × 8 devices, and the step watchdog.

The multi-process tests start real processes (`taco-jax launch`, `jax.distributed` on 127.0.0.1, gloo
collectives over TCP), each with a bounded timeout. Why the 1-process reference runs through the
launcher too (one process, gloo): with gloo, XLA:CPU runs every all-reduce of the step (in-process
groups included) as gloo's ring algorithm, which adds the partial sums in another order than the
in-process CPU all-reduce. Same collectives -> the same bits; the default in-process collectives
differ in the last bits (a few 1e-6 relative after a step; checked against a bound below).
"""

import dataclasses
import json
import math
import re
import signal
import sys
import time

import jax
import numpy as np
import pytest
from _procs import TEST_XLA_FLAGS, TINY, cli, losses, metrics, run, start, wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.cli import config_from_argv
from taco_jax.data import TokenStream
from taco_jax.launch import MALLOC_KEEP, free_port, launch, malloc_env, run_local
from taco_jax.train import distributed
from taco_jax.train.distributed import DistConfig

pytestmark = pytest.mark.fast

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
        launch(0, ["train"], config_of=config_from_argv)
    with pytest.raises(ValueError, match="no command"):
        launch(2, [], config_of=config_from_argv)
    with pytest.raises(ValueError, match="--process-id is set by the launcher"):
        launch(2, ["train", "--process-id", "1"], config_of=config_from_argv)
    with pytest.raises(ValueError, match="--emulated-link is set by the launcher"):  # --link measures it
        launch(2, ["train", "--emulated-link", "{}"], config_of=config_from_argv, link="1gbit")
    assert 0 < free_port() < 65536


def test_launch_malloc_setting():
    """`malloc="keep"` gives the processes MALLOC_KEEP unless GLIBC_TUNABLES is set; "default" adds nothing."""
    assert malloc_env({"A": "1"})["GLIBC_TUNABLES"] == MALLOC_KEEP
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"})["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"
    assert "GLIBC_TUNABLES" not in malloc_env({"A": "1"}, "default")
    with pytest.raises(ValueError, match="malloc='tcmalloc'"):
        malloc_env({}, "tcmalloc")
    with pytest.raises(ValueError, match="malloc='x'"):
        launch(2, ["train"], config_of=config_from_argv, malloc="x")


@pytest.mark.procs
def test_run_local_waits_names_the_failure_and_bounds_the_time():
    """Real processes: all succeed -> returns; one fails -> RuntimeError naming it, the sleeping one
    is stopped (not left behind); the timeout stops every process."""
    import os

    ok = [sys.executable, "-c", "pass"]
    run_local([ok, ok], env=dict(os.environ), timeout_s=60)
    t = time.monotonic()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match="process 1 exited with status 3"):
        run_local([sleeper, [sys.executable, "-c", "raise SystemExit(3)"]], env=dict(os.environ), timeout_s=60)
    with pytest.raises(RuntimeError, match="timed out after 1 s"):
        run_local([sleeper], env=dict(os.environ), timeout_s=1)
    assert time.monotonic() - t < 30  # neither waited for the 60 s sleeper


_MMAPPED = """
import ctypes, sys
import numpy as np
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
x = np.ones(64 << 20, np.uint8)  # 64 MiB
print(libc.mallinfo2().hblkhd)   # bytes in mmapped chunks
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables: Linux only")
@pytest.mark.procs
def test_malloc_keep_takes_effect_in_glibc():
    """A real process: with MALLOC_KEEP glibc serves a 64 MiB buffer from the heap (no mmapped chunk);
    with glibc's defaults it maps it (the behaviour that page-faults fresh buffers in on every step)."""
    import os
    import subprocess

    def mapped(env):
        out = subprocess.run([sys.executable, "-c", _MMAPPED], env=env, capture_output=True, text=True, check=True,
                             timeout=120)
        return int(out.stdout.split()[-1])

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert mapped(base) >= 64 << 20
    assert mapped(malloc_env(base)) == 0


def test_run_transport_is_resolved_per_codec():
    """A run's transport (its --transport) is what an "auto" codec transport becomes when the codec is
    resolved (policy resolution, or a library call's unresolved codec at trace time); a codec that
    names its transport keeps it; a bad value is named."""
    from taco_jax.codec import NONE, resolve_codec
    from taco_jax.codec.dispatch import resolve_transport
    from taco_jax.collectives import CommPolicy

    with pytest.raises(ValueError, match="run transport='bogus' must be one of"):
        resolve_transport(run="bogus")
    with pytest.raises(ValueError, match="site ar_fwd: run transport='bogus'"):
        CommPolicy.none().resolve_backends(transport="bogus")
    assert resolve_transport() == "xla"  # one process, jax.distributed not initialized: no gloo
    assert resolve_transport(run="gloo") == "gloo" and resolve_transport("xla", run="gloo") == "xla"
    assert resolve_transport("gloo") == "gloo"
    assert resolve_codec(dataclasses.replace(NONE, transport="gloo")).transport == "gloo"
    assert resolve_codec(NONE, transport="gloo_widened").transport == "gloo_widened"


_GLOO_RS = """
import sys
import jax
from taco_jax.launch import free_port
from taco_jax.train import distributed
distributed.initialize(distributed.DistConfig(f"127.0.0.1:{free_port()}", 1, 0))
import numpy as np
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from taco_jax.codec import NONE
from taco_jax.collectives import compressed as cc
from taco_jax.codec import resolve_codec
WORKAROUND = sys.argv[1] == "1"
NONE = resolve_codec(NONE, transport="auto" if WORKAROUND else "xla")  # after jax.distributed
assert NONE.transport == ("gloo" if WORKAROUND else "xla"), NONE
mesh = jax.make_mesh((4,), ("t",), devices=jax.devices())
x = np.random.default_rng(0).standard_normal((4, 3, 8, 5)).astype(np.float32)  # rank r: x[r] [3, 8, 5]
def loss(v):
    y = cc.psum_scatter(v[0], "t", codec=NONE, scatter_dimension=1)            # [3, 2, 5]
    g = cc.all_gather(y, "t", codec=NONE, axis=1, tiled=True)                  # [3, 8, 5]
    return y[None], jnp.sum(g * g)
f = jax.jit(jax.shard_map(lambda v: (loss(v)[0], jax.grad(lambda w: loss(w)[1])(v)), mesh=mesh,
                          in_specs=P("t"), out_specs=(P("t"), P("t"))))
xd = jax.device_put(x, NamedSharding(mesh, P("t")))
hlo = f.lower(xd).compile().as_text()
y, g = (np.asarray(a) for a in f(xd))
def fwd_mode(v):  # jvp of both exact collectives (linear: tangent = the collective of the tangent)
    rs = lambda a: cc.psum_scatter(a, "t", codec=NONE, scatter_dimension=1)
    ag = lambda a: cc.all_gather(a, "t", codec=NONE, axis=0, tiled=True)
    (_, t1), (_, t2) = jax.jvp(rs, (v[0],), (2 * v[0],)), jax.jvp(ag, (v[0],), (2 * v[0],))
    return (t1 - 2 * rs(v[0]))[None], (t2 - 2 * ag(v[0]))[None]
d1, d2 = (np.asarray(a) for a in jax.jit(jax.shard_map(fwd_mode, mesh=mesh, in_specs=P("t"),
                                                       out_specs=(P("t"), P("t"))))(xd))
def zero_size(v):  # grad and jvp of the exact all-gather of an empty block (shape [0, 3] per rank)
    ag = lambda a: cc.all_gather(a, "t", codec=NONE, axis=1, tiled=True)
    e = v[0, 0, :0, :3]
    g0 = jax.grad(lambda a: jnp.sum(ag(a)))(e)
    _, t0 = jax.jvp(ag, (e,), (e,))
    return g0[None], t0[None]
g0, t0 = jax.jit(jax.shard_map(zero_size, mesh=mesh, in_specs=P("t"), out_specs=(P("t"), P("t"))))(xd)
jvp_ok = bool(np.abs(d1).max() < 1e-5 and np.abs(d2).max() < 1e-5 and g0.shape == (4, 0, 3)
              and t0.shape == (4, 0, 12))
s = x[0] + x[1] + x[2] + x[3]
want = np.stack([s[:, 2 * r:2 * r + 2] for r in range(4)])
print("reduce-scatter" in hlo, "all-to-all" in hlo,
      np.array_equal(y, want) if WORKAROUND else np.allclose(y, want, rtol=1e-6, atol=1e-6),
      np.allclose(g, np.broadcast_to(8 * s, x.shape), rtol=1e-5, atol=1e-5), jvp_ok)
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("workaround", [True, False], ids=["workaround", "xla"])
@pytest.mark.procs
def test_exact_reduce_scatter_avoids_gloo_reduce_scatter(workaround, tmp_path):
    """Under gloo (jax.distributed initialized, 1 process x 4 CPU devices) the exact reduce-scatter and
    the exact all-gather's transpose compile to an all-to-all plus a local sum, not XLA:CPU's gloo
    reduce-scatter (jax-ml/jax#40830), and give psum_scatter's values (bit for bit the sum in rank
    order; gloo's own reduce-scatter sums in another order) and gradient (8 s: 4 ranks, each with
    loss sum(s^2)), and forward mode (jax.jvp) works, also for a zero-size block; with
    the run's transport "xla" (`--transport xla`), the compiled step has the reduce-scatter again."""
    import os
    import subprocess

    e = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                           "JAX_PROCESS_ID")}
    e.update(XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _GLOO_RS, "1" if workaround else "0"], env=e, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    has_rs, has_a2a, values_ok, grad_ok, jvp_ok = out.stdout.split()[-5:]
    assert (has_rs, has_a2a) == (("False", "True") if workaround else ("True", "False"))
    assert values_ok == "True" and grad_ok == "True" and jvp_ok == "True"


def test_token_stream_sharded_rows_match_host_windows_and_resume(mesh):
    """The one training stream (`data.TokenStream`) gives the same windows built as global arrays on a
    sharding (each process reads its own rows) as iterated on the host (same seed),
    and its saved state continues it exactly."""
    tokens = np.arange(1000, dtype=np.int32) * 7 % 503
    sharding = NamedSharding(mesh, P("data"))
    ref = TokenStream(tokens, 8, 16, seed=3)
    stream = TokenStream(tokens, 8, 16, seed=3)
    for _ in range(2):
        x, y = stream.next(sharding)
        rx, ry = next(ref)
        np.testing.assert_array_equal(np.asarray(x), rx)
        np.testing.assert_array_equal(np.asarray(y), ry)
        assert x.sharding == sharding
    state = stream.state()
    assert state["position"] == 2
    again = TokenStream(tokens, 8, 16, seed=99)
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
    return len(re.findall(r"^\[\d+\] summary$", stdout, flags=re.M))


def _check_quiet(log: str, steps: int, model: str) -> None:
    """The output of `launch --processes 2 -- train` of `model` (every line prefixed "[I] " by the
    launcher): process 0 prints the start line, one progress line per step and the summary block,
    each line whole; process 1 prints no progress, information or summary (warnings and errors only).
    Gloo's "[Gloo] Rank I is connected to ..." lines are left out (every peer connected)."""
    lines = [line for line in log.splitlines() if line.strip()]
    assert all(re.match(r"\[[01]\] ", line) for line in lines), lines
    assert not [line for line in lines if "[Gloo]" in line], lines
    first = [line[4:] for line in lines if line.startswith("[0] ")]
    others = [line[4:] for line in lines if line.startswith("[1] ")]
    progress = [line for line in first if line.startswith("[train ")]
    line_re = r"\[train [\w-]+\] step (\d+)/3 loss \d+\.\d{4} val (-|\d+\.\d{4}( \(step \d+\))?) \d+ tokens/s"
    assert [re.fullmatch(line_re, line)[1] for line in progress] == [str(k) for k in range(1, steps + 1)], first
    assert sum(line.startswith(f"[taco-jax] {model} on mesh") for line in first) == 1, first
    block = first[first.index("summary") + 1:]
    assert block and all(re.fullmatch(r"  [a-z/ ]+: +\S.*", line) for line in block), block
    assert not [line for line in others if re.search(r"step \d|summary|\[taco-jax\]|tokens/s", line)], others


@pytest.mark.parametrize("mesh_spec, extra", [
    ("data=2,tensor=4", ["--comm", "taco"]),  # tensor axis inside each process, data axis across them
    ("stage=2,tensor=4", ["--microbatches", "2", "--comm", "taco", "--pp-comm", "taco"]),  # stage s on process s
    # tensor groups spanning both processes: Qwen3 with TACO in tests/test_continue_pretraining.py, exact
    # communication ± sequence parallelism in tests/test_exact_transport.py
], ids=["tensor-in-process-taco", "stage-spans-taco"])
def test_two_processes_match_one(tmp_path, cache, mesh_spec, extra, capsys):
    """2 processes × 4 devices give the 1 process × 8 devices per-step losses and gradient norms bit
    for bit (both on gloo collectives); the files are written once (process 0). The finished run keeps
    its weights: a final checkpoint (each process its shards) that `sample --from` reads."""
    args = ["train", *TINY, "--steps", "3", "--final-checkpoint", "--mesh", mesh_spec, *extra]  # progress: a file
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
    _check_quiet(log, steps=3, model=dict(zip(args, args[1:]))["--model"])  # the last --model given
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert summary["processes"] == 2
    # TINY's --eval-batches 0: no evaluation, none logged or summarized
    assert summary["final_val_loss"] is None and not any("val_loss" in r for r in metrics(tmp_path / "p2"))
    assert sorted(p.name for p in (tmp_path / "p2").iterdir()) == ["checkpoints", "config.json", "loss.png",
                                                                   "metrics.jsonl", "summary.json", "tokenizer.json"]
    # no --checkpoint-every: the final checkpoint only, written by both processes
    assert [p.name for p in (tmp_path / "p2" / "checkpoints").iterdir()] == ["3"]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (tmp_path / "p2" / "checkpoints" / "3" /
                                                                       "state").iterdir()}
    from taco_jax.cli import main

    capsys.readouterr()
    assert main(["sample", "--from", str(tmp_path / "p2"), "--prompt", "ROMEO:", "--max-new-tokens", "4",
                 "--temperature", "1.0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.strip()) > len("ROMEO:"), text


#: The preempted 2-process run and its plain one-process reference (`preempted`): exact communication.
PREEMPTED = ["train", *TINY, "--steps", "8", "--comm", "none"]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, cache):
    """One 2-process run read by two tests: `PREEMPTED` through `launch --processes 2`, SIGTERM to the
    launcher once step 3 is logged (a preemption); alongside it, the plain one-process run of the same
    flags (XLA's in-process all-reduce, no gloo) to its end. Returns (folder of the 2-process run,
    its exit status, its log, its per-step records when it stopped, the reference's records)."""
    d = tmp_path_factory.mktemp("preempted")
    out, log = d / "run", d / "log"
    p = start(cli(*PREEMPTED, "--out", out, processes=2), cache, log)
    ref = start(cli(*PREEMPTED, "--no-progress", "--out", d / "ref"), cache, d / "ref.log")
    wait_for(lambda: "step 3/8" in log.read_text(), p, timeout=400, what="step 3", log=log)
    p.send_signal(signal.SIGTERM)  # the launcher forwards it
    status = p.wait(timeout=120)
    assert ref.wait(timeout=420) == 0, (d / "ref.log").read_text()[-3000:]
    return out, status, log.read_text(), losses(out), losses(d / "ref")


def test_two_processes_vs_in_process_collectives(preempted):
    """Known answer from another implementation: a plain one-process run (XLA's in-process CPU
    all-reduce, no gloo) gives per-step losses within 1e-5 relative of the 2-process run's (steps 1-3,
    before its preemption): gloo's ring all-reduce adds the partial sums in another order, so they
    differ from step 1 in the last bits (~6e-8 relative). Exact communication (--comm none): with a
    codec the FP8 rounding of messages that differ in their last bits amplifies the difference (~2e-5
    relative at step 3 with taco)."""
    _, _, _, two, ref = preempted
    a, b = ref[:3], two[:3]
    assert [r[0] for r in a] == [r[0] for r in b] == [1, 2, 3]
    for (_, la, ga), (_, lb, gb) in zip(a, b):
        assert abs(la - lb) <= 1e-5 * abs(la) and abs(ga - gb) <= 1e-4 * abs(ga), (a, b)


def test_watchdog_names_the_late_process(tmp_path, cache):
    """Process 1 stalls before step 2: the run ends with an error naming step 2 and process 1 within
    --step-timeout + 10 s, and the launcher fails as a whole."""
    timeout = 5
    log = tmp_path / "log"
    # the flags of test_two_processes_match_one[tensor-in-process-taco]: its compiled programs, from the cache
    args = ["train", *TINY, "--steps", "3", "--final-checkpoint", "--mesh", "data=2,tensor=4", "--comm", "taco",
            "--step-timeout", timeout, "--out", tmp_path / "run"]
    p = start(cli(*args, processes=2), cache, log, TACO_JAX_TEST_STALL="1:2:600")
    t_step1 = wait_for(lambda: "step 1/3" in log.read_text(), p, timeout=400, what="step 1", log=log)
    t_err = wait_for(lambda: "did not finish within --step-timeout" in log.read_text(), p,
                     timeout=timeout + 60, what="the watchdog's error", log=log)
    assert t_err - t_step1 <= timeout + 10, t_err - t_step1
    assert p.wait(timeout=60) == 1
    text = log.read_text()
    err = next(line for line in text.splitlines() if "did not finish" in line)
    assert f"step 2 did not finish within --step-timeout {timeout} s" in err
    assert re.search(r"did not arrive at step 2: process 1 \(last started step 1\)", err), err
    assert "stopping the others" in text
    assert len(metrics(tmp_path / "run")) == 1  # step 1 logged, nothing after


def test_sigterm_to_the_launcher_then_resume_on_another_mesh(preempted, cache):
    """SIGTERM to `launch` (a preemption) reaches both processes; JAX's preemption sync point makes
    them stop at the same step with one checkpoint (each process writing its shards) and exit 0.
    Resumed on data=4,tensor=2 (saved on data=2,tensor=4), Orbax reshards and the run continues."""
    out, status, log, _, _ = preempted
    assert status == 0, log[-3000:]
    stopped = json.loads((out / "summary.json").read_text())["preempted_at_step"]
    assert 3 <= stopped < 8
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(stopped)]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (out / "checkpoints" / str(stopped) /
                                                                       "state").iterdir()}
    r = run(cli(*PREEMPTED, "--out", out, "--mesh", "data=4,tensor=2", "--resume", processes=2), cache)
    assert r.returncode == 0, r.stdout[-3000:]
    assert f"resumed from checkpoints/{stopped} (step {stopped}); mesh: checkpoint " \
           "'data=2,tensor=4', now 'data=4,tensor=2' (resharded)" in r.stdout
    recs = metrics(out)
    assert [x["step"] for x in recs] == list(range(1, 9))
    assert all(math.isfinite(x["loss"]) for x in recs) and recs[-1]["loss"] < recs[0]["loss"]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == stopped
