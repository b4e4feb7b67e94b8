"""Multi-process runs on JAX's multi-controller runtime (`jax.distributed`): start-up, process-local
data, outputs written once, and the step watchdog.

Collectives between processes run over NCCL on GPU and gloo (TCP) on CPU. Launch on a cluster:
docs/distributed.md; locally: `taco-jax launch --processes N -- train ...`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

import numpy as np

from taco_jax.testing import faults
from taco_jax.util.console import write_line
from taco_jax.util.links import EmulatedLink

#: Environment variables read when the flags are not given (JAX reads JAX_COORDINATOR_ADDRESS itself).
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
_STEP_KEY = "taco_jax/step/"  # coordinator key-value store: the last step each process started
_BEAT_KEY = "taco_jax/alive/"  # ... and a counter each process advances every HEARTBEAT_S (watchdog on)
HEARTBEAT_S = 0.5
#: `--step-timeout auto`: a step may take AUTO_FACTOR × the slowest step so far (the first step's time
#: until a second one finished), at least AUTO_FLOOR_S; the first step (gloo connections, caches):
#: AUTO_FIRST_S, or AUTO_FACTOR × its wire bytes at the measured link rate where that is longer.
AUTO_FACTOR, AUTO_FLOOR_S, AUTO_FIRST_S = 10.0, 10.0, 300.0
#: Work beside the steps that writes files (checkpoint, export) gets the step limit plus its bytes at this
#: rate (bytes/s): a slow disk is not a hang.
IO_FLOOR_BYTES_PER_S = 50e6


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """How this process joins a multi-process run (`--coordinator`, `--num-processes`, `--process-id`).

    coordinator: "HOST:PORT" of the coordinator service (process 0 starts it, all connect);
      "" = auto-detect (SLURM, Open MPI, ... as `jax.distributed.initialize` does).
    num_processes, process_id: 0 / -1 = from the environment or auto-detected."""

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1

    @classmethod
    def resolve(cls, coordinator: str = "", num_processes: int = 0, process_id: int = -1,
                auto: bool = False) -> DistConfig | None:
        """The flags, else `$JAX_COORDINATOR_ADDRESS`, `$JAX_NUM_PROCESSES`, `$JAX_PROCESS_ID`.

        Returns None for a single-process run (nothing given and `auto` False); with `auto`
        (`--distributed`) unset values are left to JAX's cluster auto-detection.
        Raises ValueError naming a malformed value (HOST:PORT, a count < 1, an id outside [0, N))."""
        env = os.environ
        coordinator = coordinator or env.get(ENV_COORDINATOR, "")
        try:
            num_processes = num_processes or int(env.get(ENV_NUM_PROCESSES, 0))
            process_id = process_id if process_id >= 0 else int(env.get(ENV_PROCESS_ID, -1))
        except ValueError as e:
            raise ValueError(f"${ENV_NUM_PROCESSES} / ${ENV_PROCESS_ID} must be integers: {e}") from None
        if not (coordinator or num_processes or process_id >= 0 or auto):
            return None
        if coordinator:
            host, sep, port = coordinator.rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"coordinator={coordinator!r} must be HOST:PORT (e.g. 10.0.0.1:1234)")
        if num_processes < 0:
            raise ValueError(f"num_processes={num_processes} must be >= 1")
        if process_id >= 0 and num_processes and process_id >= num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
        if not auto and not (coordinator and num_processes and process_id >= 0):
            raise ValueError(f"a multi-process run needs --coordinator HOST:PORT, --num-processes N and --process-id I "
                             f"(or ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}; or --distributed "
                             f"to auto-detect); got coordinator={coordinator!r}, num_processes={num_processes}, "
                             f"process_id={process_id}")
        return cls(coordinator, num_processes, process_id)


#: Start of the error of a coordinator address in use (`taco-jax launch` retries another port on it).
PORT_IN_USE = "is in use"
#: XLA's flag (in $XLA_FLAGS) for the number of simulated CPU devices of a process.
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(flags: str, n: int) -> tuple[str, str | None]:
    """`flags` (an XLA_FLAGS value) asking for `n` CPU devices (`DEVICE_COUNT_FLAG`; other flags kept in
    order, a repeated count dropped), and the other count it asked for before (None: none, or `n`)."""
    words, old, placed = [], None, False
    for word in flags.split():
        if not word.startswith(DEVICE_COUNT_FLAG + "="):
            words.append(word)
            continue
        old = word.split("=", 1)[1]
        if not placed:
            words.append(f"{DEVICE_COUNT_FLAG}={n}")
            placed = True
    if not placed:
        words.append(f"{DEVICE_COUNT_FLAG}={n}")
    return " ".join(words), (old if old is not None and old != str(n) else None)


def check_coordinator_port(address: str) -> str | None:
    """Probes the coordinator's address "HOST:PORT" (IPv6 as "[::1]:PORT") as its gRPC service will bind it
    (SO_REUSEADDR). Returns the address to bind: `address`, or "[::]:PORT" when HOST is not an address of this machine
    (NAT, container). Raises ValueError naming `address` when something listens there or HOST does not resolve."""
    import errno
    import socket

    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"coordinator {address}: host {host!r} does not resolve ({e.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"coordinator {address} {PORT_IN_USE} (another process listens on it); "
                                 "stop it or give --coordinator another port") from None
            if e.errno == errno.EADDRNOTAVAIL:  # not an address of this host: every interface
                return check_coordinator_port(f"[::]:{port}")
            raise ValueError(f"coordinator {address} cannot be bound: {e.strerror}") from None
    return address


def initialize(dist: DistConfig, *, heartbeat_timeout_s: int = 100) -> None:
    """Joins the run: gloo for CPU collectives (before the first device query), then
    `jax.distributed.initialize`, blocking until every process connected (up to 300 s). Process 0
    first checks its address (`check_coordinator_port`). Raises ValueError naming the coordinator
    address when it is in use; RuntimeError from JAX when the coordinator cannot be reached."""
    import jax

    bind = None
    if dist.coordinator and dist.process_id == 0:
        bind = check_coordinator_port(dist.coordinator)  # before gRPC starts (it would crash or hang)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist.coordinator or None, dist.num_processes or None,
                               dist.process_id if dist.process_id >= 0 else None,
                               heartbeat_timeout_seconds=heartbeat_timeout_s, coordinator_bind_address=bind)


def is_writer() -> bool:
    """True in the process that writes the run's files (process 0)."""
    import jax

    return jax.process_index() == 0


def _client():
    from jax._src import distributed

    return distributed.global_state.client


# --- data: each process builds only its own rows of the global batch


def global_arrays(sharding, *arrays):
    """Host arrays identical on every process -> global arrays on `sharding` (each process places only
    its own devices' slices)."""
    import jax

    return tuple(jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: np.asarray(a[idx]))
                 for a in arrays)


# --- hangs: the step watchdog


class StepWatchdog:
    """Ends the run when a step, or work between steps, does not finish within its time limit.

    `start(step)` before the step's work, `done()` after its result arrived; `with guard(...)` around
    work beside the steps (evaluation batch, checkpoint save, export). When the time passes, a thread
    prints an error naming the step (multi-process: also which processes had not started it and which
    stopped answering, from the coordinator's key-value store) and ends the process with
    `os._exit(exit_status)`: a hung collective cannot be interrupted from Python.
    timeout_s: seconds per step (<= 0: disabled); a process's first step gets `first_factor` ×
    timeout_s (it opens the collectives' connections). "auto": from the steps measured so far
    (`AUTO_FACTOR`, `AUTO_FLOOR_S`, `AUTO_FIRST_S`), the first step's limit lengthened by
    `wire_bytes` at the rate of `link` (the run's emulated links, None on real links)."""

    def __init__(self, timeout_s: float | str, *, exit_status: int = 1, first_factor: float = 10.0,
                 wire_bytes: float = 0.0, link: EmulatedLink | None = None):
        import jax

        self.auto = timeout_s == "auto"
        if self.auto:
            rate = tensor_link_bytes_per_s(link)
            self._first_limit = max(AUTO_FIRST_S, AUTO_FACTOR * wire_bytes / rate if rate else 0.0)
            timeout_s = self._first_limit
        else:
            self._first_limit = timeout_s * first_factor
        self.timeout_s, self.exit_status = float(timeout_s), exit_status
        self._first, self._done_steps, self._first_dt, self._slowest = True, 0, 0.0, 0.0
        self.process, self.processes = jax.process_index(), jax.process_count()
        self._step, self._since, self._closed, self._what, self._kinds = None, 0.0, False, "", set()
        self._cond = threading.Condition()
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, name="taco-jax-step-watchdog", daemon=True).start()
            if self.processes > 1:
                threading.Thread(target=self._heartbeat, name="taco-jax-heartbeat", daemon=True).start()

    def start(self, step: int) -> None:
        if self.timeout_s > 0:
            with self._cond:
                self._step, self._since, self._what = step, time.monotonic(), f"step {step}"
                self._limit = self._first_limit if self._first else self.timeout_s
                self._first = False
                self._cond.notify()
        faults.stall(str(step), self.process, f"before step {step}")
        if self.timeout_s > 0 and self.processes > 1:
            _client().key_value_set(f"{_STEP_KEY}{self.process}", str(step), allow_overwrite=True)

    @contextlib.contextmanager
    def guard(self, what: str, step: int, *, kind: str, nbytes: float = 0.0, stall: str = ""):
        """Arms the watchdog around `what` (e.g. "evaluation after step 5 (batch 2 of 8)") after step
        `step`: the step limit plus `nbytes` at `IO_FLOOR_BYTES_PER_S` (the first work of its `kind`:
        the first step's limit). `stall`: its `testing.faults.stall` point (e.g. "eval@5")."""
        if self.timeout_s > 0:
            with self._cond:
                first = self._first or kind not in self._kinds
                self._kinds.add(kind)
                self._step, self._since, self._what = step, time.monotonic(), what
                self._limit = (self._first_limit if first else self.timeout_s) + nbytes / IO_FLOOR_BYTES_PER_S
                self._cond.notify()
        if stall:
            faults.stall(stall, self.process, f"at the {what}")
        try:
            yield
        finally:
            if self.timeout_s > 0:
                with self._cond:
                    self._step = None
                    self._cond.notify()

    def done(self) -> None:
        if self.timeout_s > 0:
            with self._cond:
                if self.auto and self._step is not None:
                    self._adapt(time.monotonic() - self._since)
                self._step = None
                self._cond.notify()

    def _adapt(self, dt: float) -> None:
        """--step-timeout auto: the limit from the steps measured so far (the first only until a second finished)."""
        self._done_steps += 1
        if self._done_steps == 1:
            self._first_dt = dt
        self._slowest = max(self._slowest, dt) if self._done_steps > 1 else 0.0
        slowest = self._slowest if self._done_steps > 1 else self._first_dt
        self.timeout_s = max(AUTO_FLOOR_S, AUTO_FACTOR * slowest)
        if self._done_steps == 2 and self.process == 0:
            write_line(f"[taco-jax] --step-timeout auto: {self.describe()}")

    def describe(self) -> str:
        """The limit and where it comes from, e.g. "10 s (max(10 s, 10 × slowest step 0.2 s))"."""
        if not self.auto:
            return f"{self.timeout_s:g} s"
        if not self._done_steps:
            return f"{self._first_limit:.3g} s (first step)"
        which = "slowest step" if self._done_steps > 1 else "first step"
        return (f"{self.timeout_s:.3g} s (max({AUTO_FLOOR_S:g} s, {AUTO_FACTOR:g} × {which} "
                f"{self._slowest if self._done_steps > 1 else self._first_dt:.3g} s))")

    def close(self) -> None:
        """Disarms the watchdog for good and ends its thread (the run is over, however it ended)."""
        if self.timeout_s > 0:
            with self._cond:
                self._step, self._closed = None, True
                self._cond.notify()

    def _heartbeat(self):
        beat = 0
        while not self._closed:
            beat += 1
            try:
                _client().key_value_set(f"{_BEAT_KEY}{self.process}", str(beat), allow_overwrite=True)
            except Exception:  # the run is ending (coordinator gone); the watchdog reports
                return
            time.sleep(HEARTBEAT_S)

    def _watch(self):
        with self._cond:
            while True:
                if self._closed:
                    return
                if self._step is None:
                    self._cond.wait()
                    continue
                left = self._since + self._limit - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                step, what, limit_s = self._step, self._what, self._limit
                break
        limit = f"auto ({limit_s:.3g} s)" if self.auto else f"{limit_s:g} s"
        msg = f"{what} did not finish within --step-timeout {limit}"
        if self.processes > 1:
            msg += f" (process {self.process} of {self.processes}; {self.missing(step)})"
        write_line(f"taco-jax: error: {msg}; the run stopped")
        os._exit(self.exit_status)

    def missing(self, step: int, *, wait_s: float = 8.0) -> str:
        """Which processes had not started `step`, and which stopped answering (no heartbeat in
        4 × HEARTBEAT_S), read from the coordinator's key-value store; "coordinator unreachable"
        when it does not answer within `wait_s` seconds (process 0 dead, or this process cut off)."""
        found = []
        th = threading.Thread(target=lambda: found.append(self._missing(step)), daemon=True)
        th.start()
        th.join(wait_s)
        return found[0] if found else f"coordinator unreachable: no answer within {wait_s:g} s"

    def _missing(self, step: int) -> str:
        def read(key, p):
            try:
                return int(client.key_value_try_get(f"{key}{p}"))
            except Exception:  # not set: the process never started a step
                return 0

        try:
            client = _client()
            before = [read(_BEAT_KEY, p) for p in range(self.processes)]
            late = {p: read(_STEP_KEY, p) for p in range(self.processes)}
            time.sleep(4 * HEARTBEAT_S)
            silent = [p for p in range(self.processes) if p != self.process and read(_BEAT_KEY, p) == before[p]]
        except Exception as e:  # coordinator gone (process 0 died)
            return f"coordinator unreachable: {e}"
        why = f"no heartbeat for {4 * HEARTBEAT_S:g} s: link down, stopped or dead"
        late = [f"process {p} (last started step {last}{'; ' + why if p in silent else ''})"
                for p, last in late.items() if last < step]
        if late:
            return f"did not arrive at step {step}: " + ", ".join(late)
        if silent:
            return (f"every process started step {step}; stopped answering: "
                    + ", ".join(f"process {p}" for p in silent) + f" ({why})")
        return f"every process started step {step}; a collective of the step hung"


# --- emulated links (`taco-jax launch --link`, taco_jax/emulate.py)


def emulated_link(text: str) -> EmulatedLink | None:
    """The link description in `text`, a run's `TrainConfig.emulated_link` (JSON set by `taco-jax launch
    --link`; it goes into summary.json as "emulated_link"), None for "": `EmulatedLink.parse` (parsed
    once per text). Raises ValueError naming the field for malformed JSON."""
    return EmulatedLink.parse(text)


def tensor_link_bytes_per_s(link: EmulatedLink | None) -> float | None:
    """Measured payload bytes/s of the emulated link the tensor axis runs over (`tensor_tier`), or None."""
    return link.tensor_bytes_per_s if link else None
