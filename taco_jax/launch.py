"""`taco-jax launch --processes N -- train ...`: N local processes of one multi-process run (development
and tests, in the manner of `torchrun --standalone`).

Each process runs `python -P -m taco_jax.cli <command> ... --coordinator 127.0.0.1:PORT --num-processes N
--process-id I` on a free port, with `--xla_force_host_platform_device_count` = mesh devices / N on CPU (another
count in XLA_FLAGS is replaced, said in one line). `<command>` is train or compare (`LAUNCHED`); the command's mesh
is resolved before any process starts, and one not divisible by N is refused. `-P` and PYTHONPATH: the processes
import the launcher's own taco_jax whatever the working directory holds. A port taken between choosing and
binding it: the processes start again on another (`PORT_ATTEMPTS`). Output lines are prefixed
"[I] " (gloo's connection lines left out unless `verbose`). When one process fails the others are
stopped and the launcher returns its status. SIGTERM / SIGINT to the launcher is forwarded to every
process (they checkpoint and exit); those still running `stop_grace_s` later are killed.

Allocator (`malloc="keep"`, the default, `malloc_env`): glibc keeps freed memory for reuse instead of mapping each
buffer of >= 32 MB anew and page-faulting it in on every step (resident memory stays at its peak; docs/results.md).
Emulated cluster (`--link`, taco_jax/emulate.py): the measured link description reaches every process as
`--emulated-link JSON`, so summary.json records it and `--min-bytes auto` / `--step-timeout auto` use the measured rate.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from taco_jax import emulate
from taco_jax.util.links import EmulatedLink
from taco_jax.util.procs import child_env, cli_command


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGKILL when the launcher dies, even by SIGKILL, so a killed
    launcher never leaves training processes behind (prctl PR_SET_PDEATHSIG). Elsewhere: no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "CPUs 0-2,5", {3} -> "CPU 3" (the kernel's list format)."""
    runs, start = [], None
    ordered = sorted(cpus)
    for a, b in zip(ordered, [*ordered[1:], None]):
        start = a if start is None else start
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = None
    return ("CPUs " if len(cpus) > 1 else "CPU ") + ",".join(runs)


def _child_setup(cpus: set[int] | None):
    """A `preexec_fn`: `_die_with_parent`, then the CPU affinity `cpus` (None: unchanged)."""
    def setup():
        _die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return setup


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The commands `launch` runs: those that join a multi-process run (`--coordinator`, `--num-processes`,
#: `--process-id`). A command line starting with a flag (`--version`, `--help`) is passed on as it is.
LAUNCHED = ("train", "compare")


def run_config(argv: list[str], config_of):
    """The `TrainConfig` that `taco-jax ARGV` runs (`config_of(argv)`, e.g. `cli.config_from_argv`), or
    None when ARGV is not a `train` / `compare` command. Raises ValueError naming a bad value;
    SystemExit for a malformed command line."""
    if not argv or argv[0] not in LAUNCHED:
        return None
    return config_of(argv)


def check_mesh_fits(mesh: dict[str, int], processes: int) -> None:
    """Raises ValueError when the `mesh` size does not divide over `processes` (each process holds
    mesh size / processes of its devices)."""
    n = math.prod(mesh.values())
    if n % processes:
        spec = ",".join(f"{k}={v}" for k, v in mesh.items())
        raise ValueError(f"mesh {spec} has {n} devices, not divisible by --processes {processes}: each process "
                         f"holds an equal share of the mesh; give a process count that divides {n}, or another "
                         "--mesh")


#: glibc tunables of `malloc="keep"`: no mmap below 4 GiB, no trimming of the heap below 4 GiB free.
MALLOC_KEEP = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
MALLOC_MODES = ("keep", "default")


def malloc_env(env: dict, malloc: str = "keep") -> dict:
    """A copy of `env` with the allocator setting of `malloc` ("keep": `GLIBC_TUNABLES=MALLOC_KEEP` unless `env`
    already has a GLIBC_TUNABLES; "default": unchanged). Raises ValueError for another `malloc`."""
    if malloc not in MALLOC_MODES:
        raise ValueError(f"malloc={malloc!r} must be one of {MALLOC_MODES}")
    env = dict(env)
    if malloc == "keep":
        env.setdefault("GLIBC_TUNABLES", MALLOC_KEEP)
    return env


def cpu_shares(processes: int, cpus: list[int] | None = None) -> list[set[int]]:
    """Each process's CPUs under `launch(..., pin_cpus=True)`: the launcher's CPUs (`cpus`, default
    `os.sched_getaffinity(0)`, sorted) in `processes` contiguous shares, the first len(cpus) mod
    processes one CPU larger; with more processes than CPUs, process i gets CPU i mod len(cpus).
    Raises ValueError for processes < 1 or no CPUs."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if processes < 1 or not cpus:
        raise ValueError(f"cpu_shares needs processes >= 1 and CPUs (got {processes}, {cpus})")
    if processes >= len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(processes)]
    q, r = divmod(len(cpus), processes)
    shares, start = [], 0
    for i in range(processes):
        n = q + (i < r)
        shares.append(set(cpus[start:start + n]))
        start += n
    return shares


def launch(processes: int, argv: list[str], *, config_of, grace_s: float = 10.0, env=None, out=None,
           malloc: str = "keep", link: str | None = None, nodes: int = 0, verbose: bool = False,
           pin_cpus: bool = False, stop_grace_s: float | None = None) -> int:
    """Runs `taco_jax.cli argv` as `processes` cooperating processes; returns the exit status (0, or the first
    failure's). `out`: stream for the prefixed lines (default stdout). `malloc`: "keep" or "default" (module docstring).
    `link`, `nodes`: an emulated cluster (None: plain local processes; "" is refused). `verbose`: gloo's connection
    lines too. `pin_cpus`: process i runs on its own share of the launcher's CPUs (`cpu_shares`, printed to `out`).
    `config_of`: argv -> the `TrainConfig` the command runs (`cli.config_from_argv`, passed in: this module sits below
    the CLI). `stop_grace_s`: after a SIGTERM or SIGINT, the processes still running this long are killed and the
    launcher returns 128 + the signal (before any process started: at once). Raises ValueError for processes < 1, an
    empty command, a command other than train / compare, flags the launcher sets itself, a configuration `train` would
    refuse, a mesh size not divisible by `processes`, an unknown `malloc`, a malformed `link` / `nodes` or a tensor
    axis spanning nodes; emulate.EmulationUnavailable (a ValueError) naming what is missing to make namespaces."""
    if malloc not in MALLOC_MODES:
        raise ValueError(f"malloc={malloc!r} must be one of {MALLOC_MODES}")
    if processes < 1:
        raise ValueError(f"processes={processes} must be >= 1")
    if not argv:
        raise ValueError("no command after `--`; e.g. taco-jax launch --processes 2 -- train --steps 20")
    if not argv[0].startswith("-") and argv[0] not in LAUNCHED:  # it would die on the --coordinator given to it
        raise ValueError(f"launch runs {' and '.join(LAUNCHED)} (the commands that join a multi-process run), not "
                         f"{argv[0]}: run `taco-jax {argv[0]} ...` without launch (one process)")
    own = ("--coordinator", "--num-processes", "--process-id", *(("--emulated-link",) if link is not None else ()))
    for flag in own:
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ValueError(f"{flag} is set by the launcher; remove it from the command")
    out = out or sys.stdout
    cfg = run_config(argv, config_of)  # the mesh of the command as `train` resolves it (--mesh, --config, default)
    axes = cfg.parallelism.axes if cfg is not None else None
    if axes:
        check_mesh_fits(axes, processes)
    spec = emulate.LinkSpec.parse(link, nodes) if link is not None else None
    if nodes and link is None:
        raise ValueError(f"--nodes {nodes} needs --link intra=RATE,inter=RATE")
    if spec is not None:
        node_of = spec.node_of(processes)
        if axes and spec.intra is not None:  # two tiers: tensor parallelism inside a node
            emulate.check_tensor_in_node(axes, processes, node_of)
        emulate.check_available()
    base = child_env(malloc_env(os.environ if env is None else env, malloc))
    if axes:  # each process's share of the mesh; another count exported in XLA_FLAGS gives way, said
        from taco_jax.train.distributed import DEVICE_COUNT_FLAG, with_device_count

        share = math.prod(axes.values()) // processes
        base["XLA_FLAGS"], old = with_device_count(base.get("XLA_FLAGS", ""), share)
        if old is not None:
            print(f"[launch] warning: $XLA_FLAGS sets {DEVICE_COUNT_FLAG}={old}; each process gets {share} instead, as "
                  f"--mesh {cfg.parallelism.mesh} over --processes {processes} asks (the other XLA_FLAGS entries are "
                  "kept)", file=sys.stderr, flush=True)
    base["PYTHONUNBUFFERED"] = "1"
    stop_grace_s = STOP_GRACE_S if stop_grace_s is None else stop_grace_s
    if not 0 < stop_grace_s < math.inf:
        raise ValueError(f"--stop-grace {stop_grace_s:g} must be seconds > 0")
    shares = cpu_shares(processes) if pin_cpus else None
    if shares is not None:
        shared = sum(map(len, shares)) > len(set().union(*shares))  # a CPU in two shares
        print("[launch] CPUs: " + ", ".join(f"process {i} on {_cpu_list(c)}" for i, c in enumerate(shares))
              + (f" ({processes} processes on {_cpu_list(set().union(*shares))}: they share)" if shared else ""),
              file=out, flush=True)
    early = _StopBeforeProcesses()
    with early:  # a SIGTERM / SIGINT before the processes run: stopped here (namespaces removed), one line

        def start(coordinator_host: str, wrap) -> int:
            early.where = "starting the processes"
            status = _retry_ports(lambda port, busy: _run(processes, argv, base, f"{coordinator_host}:{port}", wrap,
                                                          grace_s, out, busy, verbose, shares,
                                                          stop_grace_s=stop_grace_s, kept=lambda: _kept(argv, cfg)),
                                  out)
            early.where = None  # the run is over: a signal now waits for the namespaces' removal
            return status

        if spec is None:
            return start("127.0.0.1", lambda i: [])
        if processes < 2:
            print(f"[launch] warning: --link {spec.text} with {processes} process shapes no link (nothing to connect)",
                  file=sys.stderr, flush=True)
        early.where = "making the namespaces"
        with emulate.Cluster(processes, spec) as cluster:
            early.where = "measuring the links"
            print(f"[launch] emulated cluster: namespaces {cluster.names[0]} .. {cluster.names[-1]}; measuring "
                  f"the links ...", file=out, flush=True)
            link = EmulatedLink.from_dict(cluster.measure_links())
            for tier, t in link.tiers.items():
                name = "link" if tier == "link" else f"{tier} link"
                print(f"[launch] {name}: requested {t['requested_bit_per_s'] / 1e6:g} Mbit/s, measured "
                      f"{t['measured_bit_per_s'] / 1e6:.1f} Mbit/s (TCP payload, median of "
                      f"{sum(x['tier'] == tier for x in link.record['links'])} links)", file=out, flush=True)
            argv = [*argv, "--emulated-link", link.to_json()]  # a config field: in config.json
            return start(cluster.addrs[0], cluster.exec_prefix)
    print(f"[launch] stopped by {early.signal} while {early.stopped_while}: no process ran"
          + ("; the namespaces are removed" if spec is not None else ""), file=out, flush=True)
    return 128 + early.signum


#: Seconds the processes get after a SIGTERM (or SIGINT) forwarded by the launcher before it kills the ones still
#: running (SIGKILL to each process group; `--stop-grace S`): a preempted step boundary and its checkpoint fit in it.
STOP_GRACE_S = 30.0


class _Stopped(BaseException):
    """A signal to the launcher before its processes run (`_StopBeforeProcesses`)."""


class _StopBeforeProcesses:
    """SIGTERM / SIGINT handlers (main thread only) that stop `launch` at once while no process runs
    (`where`: what the launcher does then; None: the run is over, the signal is ignored while the
    namespaces are removed). `_run` installs its own while its processes run (forwarding)."""

    def __init__(self):
        self.where, self.old, self.signum, self.stopped_while = "starting", {}, None, None

    @property
    def signal(self) -> str:
        return signal.Signals(self.signum).name

    def _on_signal(self, signum, _frame):
        if self.where is not None:
            self.signum, self.stopped_while = signum, self.where
            raise _Stopped

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, kind, *_):
        for s, h in self.old.items():
            signal.signal(s, h)
        return kind is not None and issubclass(kind, _Stopped)


def _kept(argv: list[str], cfg) -> str:
    """What the run of `argv` (its `TrainConfig` `cfg`; None: not a train / compare command) keeps, in
    words (`train.hooks.kept`: its latest checkpoint or none; compare's two runs each)."""
    if cfg is None:
        return ""
    from taco_jax.train.hooks import kept

    out = cfg.checkpoint.out
    return "; ".join(kept(o) for o in ([out] if argv[0] == "train" else [f"{out}/none", f"{out}/taco"]))


#: Tries of `launch` with a fresh port when another program took the chosen one first.
PORT_ATTEMPTS = 3


def _retry_ports(run_on, out) -> int:
    """`run_on(port, busy)` on a free port; again on another (up to `PORT_ATTEMPTS` tries) when it
    returned 2 with `busy` set: process 0 found the port in use (`distributed.check_coordinator_port`)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port, busy = free_port(), threading.Event()
        status = run_on(port, busy)
        if not (status == 2 and busy.is_set()) or attempt == PORT_ATTEMPTS:
            return status
        print(f"[launch] port {port} was taken before the coordinator started; retrying with another "
              f"(attempt {attempt + 1} of {PORT_ATTEMPTS})", file=out, flush=True)
    return status


#: Seconds the others get between SIGTERM and SIGKILL once a process failed: the run cannot go on (its
#: collectives lack a member), and a process blocked in one runs no Python signal handler.
FAILED_GRACE_S = 2.0


#: Gloo's TCP transport's message once its connections are made (stdout; no setting silences it).
#: Its threads write it unsynchronised, so a line may hold pieces of several messages.
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of "
                            r"connected peer ranks is : (\d+)")
GLOO_PIECES = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :")


def _gloo_connected_only(text: str) -> bool:
    """Whether `text` holds nothing but gloo's connection messages or pieces of them (numbers between),
    and is not one whole message with fewer peers connected than expected. A line of interleaved
    pieces is dropped whatever its numbers: they cannot be told apart there (a missing peer still
    ends the run with gloo's error, or the step watchdog's)."""
    if not GLOO_PIECES.search(text) or re.sub(r"[\d\s]", "", GLOO_PIECES.sub("", text)):
        return False
    whole = GLOO_CONNECTED.fullmatch(text.strip())
    return not (whole and whole[1] != whole[2])


def _run(processes: int, argv: list[str], base: dict, coordinator: str, wrap, grace_s: float, out,
         busy: threading.Event | None = None, verbose: bool = False, shares: list[set[int]] | None = None, *,
         stop_grace_s: float = STOP_GRACE_S, kept=lambda: "") -> int:
    """Starts the processes (`wrap(i) + python -P -m taco_jax.cli ...`) and waits (see `launch`). `busy` is set when
    process 0 reports `coordinator` in use. `shares`: process i's CPUs (set before its exec, so `ip netns exec` and
    python inherit them), or None. Signals: as `launch`, with `kept()` saying what the run keeps."""
    from taco_jax.train.distributed import PORT_IN_USE

    busy_line = f"coordinator {coordinator} {PORT_IN_USE}"
    procs, pumps, stop = [], [], {}  # stop: the launcher's first SIGTERM / SIGINT ("signum") and its time ("at")
    lock = threading.Lock()

    def pump(i, p):
        for line in iter(p.stdout.readline, b""):
            text = line.decode(errors="replace")
            if i == 0 and busy is not None and busy_line in text:
                busy.set()
            if not verbose and _gloo_connected_only(text):
                continue
            with lock:
                out.write(f"[{i}] {text}")
                out.flush()

    def forward(signum, _frame):
        stop.setdefault("signum", signum)
        stop.setdefault("at", time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # installed before the first process starts: a signal while they start reaches every one of them
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    status = 0
    try:
        for i in range(processes):
            cmd = [*wrap(i), *cli_command(*argv, "--coordinator", coordinator, "--num-processes", str(processes),
                                          "--process-id", str(i))]
            procs.append(subprocess.Popen(cmd, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=_child_setup(None if shares is None
                                                                                           else shares[i])))
            if stop:  # started after the signal came
                procs[i].send_signal(stop["signum"])
            pumps.append(threading.Thread(target=pump, args=(i, procs[i]), daemon=True))
            pumps[i].start()
        pending = set(range(processes))
        while pending:
            for i in sorted(pending):
                rc = procs[i].poll()
                if rc is None:
                    continue
                pending.discard(i)
                if rc != 0 and status == 0:
                    status = rc if rc > 0 else 128 - rc  # killed by a signal: 128 + signal number
                    after = f" after {signal.Signals(stop['signum']).name}" if stop else ""
                    what = kept() if stop else ""
                    with lock:
                        print(f"[launch] process {i} exited with status {rc}{after}; stopping the others"
                              + (f"; {what}" if what else ""), file=out, flush=True)
                    _stop([procs[j] for j in pending], min(grace_s, FAILED_GRACE_S))
            if stop and pending and time.monotonic() - stop["at"] > stop_grace_s:
                left, name, what = sorted(pending), signal.Signals(stop["signum"]).name, kept()
                for i in left:  # all of them first: a survivor would report its peer's death
                    _kill_group(procs[i])
                for i in left:
                    procs[i].wait()
                pending.clear()
                status = status or 128 + stop["signum"]
                with lock:
                    print(f"[launch] {name}: process{'es' if len(left) > 1 else ''} {', '.join(map(str, left))} still "
                          f"running {stop_grace_s:g} s after it (--stop-grace): killed (SIGKILL)"
                          + (f"; {what}" if what else ""), file=out, flush=True)
            time.sleep(0.05)
    finally:
        _stop(procs, grace_s)
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)
    return status


def run_local(cmds: list[list[str]], *, env: dict, timeout_s: float, quiet_after_first: bool = False,
              grace_s: float = 5.0) -> None:
    """Runs `cmds` as processes of one local run (each in its own session, killed if this process
    dies) and waits for all of them. `quiet_after_first`: only the first process's stdout is shown.
    Raises RuntimeError naming the first process that exited with a non-zero status, or the timeout
    (`timeout_s` seconds); the others are stopped then (SIGTERM, SIGKILL after `grace_s`)."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if quiet_after_first and i else None,
                              start_new_session=True, preexec_fn=_die_with_parent)
             for i, cmd in enumerate(cmds)]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                raise RuntimeError(f"process {bad[0]} exited with status {procs[bad[0]].returncode}")
            if all(p.poll() == 0 for p in procs):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g} s")
            time.sleep(0.1)
    finally:
        _stop(procs, grace_s)


def _stop(procs, grace_s: float) -> None:
    """SIGTERM each running process, then SIGKILL (its whole session) after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p)
            p.wait()


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL to the process group of `p` (started in its own session: it and what it started)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
