"""A guard against timing the emulated-cluster studies on a busy machine (experiments/e2e/bench_e2e.py, e2e_study.py).

Three measurements, each judged against a limit of `Limits`:

- **Other processes' CPU** (cores): over a window, all CPUs' busy time from /proc/stat (user, nice,
  system, steal; interrupt time, which the emulated links' packet processing fills, is left out) minus
  the CPU time of this process and of its child processes that ended in the window. Taken over the
  probe (between runs) and over every run (the study's processes are children: their CPU is
  subtracted exactly). Linux only; elsewhere not measured.
- **The compute probe**: a fixed loop of `PROBE_MATMULS` float64 matmuls of `PROBE_SIZE`² (numpy,
  BLAS threads on every core), its wall time against the time calibrated on
  this machine when it was quiet (`calibrate`, `--calibrate-probe`; stored in `PROBE_CALIBRATION` with
  the machine: node, CPU model, CPU count, numpy version). No calibration for this machine: not judged,
  and said so.
- **The 1-minute load average** (`os.getloadavg`), judged before the study only: later it holds the
  study's own processes of the last minute. Allowed: the cores the study leaves free
  (cores − its processes, at least 0) plus `Limits.load_tolerance`.

A check that exceeds a limit prints a warning naming the measurements on stderr at once; the study
marks its result `loaded` and does not write it as a result (bench_e2e.py) unless `--allow-loaded`.

With `--wait-quiet SECONDS` (`Guard.wait_s`) a busy machine is waited out instead: a busy check is
repeated every `WAIT_POLL_S` until one is quiet (for at most SECONDS each time), and a round during
which the machine was busy (over a run, or at the check after it) is discarded and run again once
the machine is quiet (`Guard.redo`; at most `MAX_REDOS` times per round). The checks waited through
and those of discarded rounds stay in the record (`waited`, `redone`) and do not make the result
loaded; one busy check that the wait does not end does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import sys
import time

import numpy as np

from experiments.common import host

#: The probe's fixed work: PROBE_MATMULS products of PROBE_SIZE × PROBE_SIZE float64 matrices.
PROBE_SIZE = 512
PROBE_MATMULS = 40
#: Probe runs of a calibration (their median is the calibrated time).
CALIBRATION_RUNS = 5
#: Where `calibrate` writes, and the studies read, the probe's calibrated time.
PROBE_CALIBRATION = pathlib.Path(__file__).resolve().with_name("load_probe.json")
#: Exit status of a study that refused to write a result (a subclass of SystemExit carries it).
LOADED_EXIT = 3
#: Seconds between the checks of a wait for a quiet machine (`Guard.wait_s` > 0).
WAIT_POLL_S = 5.0
#: Discarded attempts of one round (`Guard.redo`) before its busy checks count as loaded.
MAX_REDOS = 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a study allows. probe_slowdown: probe wall time / calibrated time; other_cpu_cores: CPU of
    other processes (cores) over a probe or a run; load_tolerance: 1-minute load average above the
    cores the study leaves free, before the study starts."""

    probe_slowdown: float = 1.25
    other_cpu_cores: float = 0.3
    load_tolerance: float = 0.5

    def __post_init__(self):
        for k, v in dataclasses.asdict(self).items():
            if not v > 0:
                raise ValueError(f"Limits.{k}={v!r} must be > 0")


class Loaded(SystemExit):
    """A study refused to write a result (or to start) on a busy machine; exit status LOADED_EXIT."""

    def __init__(self, message: str):
        super().__init__(LOADED_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(message: str):
    """Prints `message` on stderr and raises Loaded(message)."""
    print(message, file=sys.stderr, flush=True)
    raise Loaded(message)


def machine() -> dict:
    """The machine a probe time belongs to: node name, CPU model, CPU count, numpy version."""
    cpu = host()
    return {"node": platform.node(), "cpu": cpu["cpu"], "cpus": cpu["cores"], "numpy": np.__version__}


def _same_machine(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("cpu", "cpus", "numpy"))


def _busy_s() -> float | None:
    """Seconds all CPUs spent busy (user, nice, system, steal) since boot; None without /proc/stat."""
    try:
        fields = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    """CPU seconds of this process and of its waited-for child processes."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class _Window:
    """Other processes' CPU (cores) between construction and `other_cores()`."""

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), _busy_s(), _own_s()

    def other_cores(self) -> tuple[float | None, float]:
        """(other processes' cores, wall seconds) since construction."""
        wall = time.perf_counter() - self.t
        busy = _busy_s()
        if busy is None or self.busy is None or wall <= 0:
            return None, wall
        return max((busy - self.busy) - (_own_s() - self.own), 0.0) / wall, wall


def probe() -> float:
    """Wall seconds of the probe's fixed work (PROBE_MATMULS matmuls of PROBE_SIZE² float64)."""
    a, b = np.random.default_rng(0).standard_normal((2, PROBE_SIZE, PROBE_SIZE))
    c = np.empty_like(a)
    t = time.perf_counter()
    for _ in range(PROBE_MATMULS):
        np.matmul(a, b, out=c)
    return time.perf_counter() - t


def load_calibration(path: pathlib.Path = PROBE_CALIBRATION) -> tuple[float | None, str]:
    """(calibrated probe seconds, or None, and why not) for this machine from `path`."""
    path = pathlib.Path(path)
    if not path.exists():
        return None, f"no probe calibration ({path} missing)"
    cal = json.loads(path.read_text())
    if (cal.get("probe_size"), cal.get("probe_matmuls")) != (PROBE_SIZE, PROBE_MATMULS):
        return None, f"{path} calibrates another probe ({cal.get('probe_size')}², {cal.get('probe_matmuls')} matmuls)"
    if not _same_machine(cal["machine"], machine()):
        return None, f"{path} was measured on another machine ({cal['machine']})"
    return float(cal["probe_s"]), f"calibrated {cal['date']} on {cal['machine']['node']}"


def calibrate(path: pathlib.Path = PROBE_CALIBRATION, limits: Limits = Limits()) -> dict:
    """Runs the probe CALIBRATION_RUNS times and writes their median, with the machine, to `path`.
    Raises Loaded (printed; nothing written) when other processes used more than `limits.other_cpu_cores`
    during any run or the load average exceeds the machine's cores: a calibration needs a quiet machine."""
    load1 = os.getloadavg()[0]
    runs, others, worst = [], [], 0.0
    while len(runs) < CALIBRATION_RUNS and worst <= limits.other_cpu_cores and load1 <= (os.cpu_count() or 1):
        w = _Window()
        runs.append(probe())
        others.append(w.other_cores()[0])
        worst = max(worst, others[-1] or 0.0)
    if len(runs) < CALIBRATION_RUNS or worst > limits.other_cpu_cores:
        refuse(f"[load guard] not calibrated: the machine is not quiet (other processes used up to {worst:.2f} cores "
                     f"during the probe, limit {limits.other_cpu_cores:.2f}; load average {load1:.2f}); "
                     f"{path} left as it was")
    cal = {"probe_s": statistics.median(runs), "runs_s": runs, "probe_size": PROBE_SIZE,
           "probe_matmuls": PROBE_MATMULS, "machine": machine(), "load_average_1min": load1,
           "other_cpu_cores": others, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    pathlib.Path(path).write_text(json.dumps(cal, indent=1) + "\n")
    return cal


def counts(check: dict) -> bool:
    """Whether `check` makes its result loaded: busy, and neither waited through nor of a discarded round."""
    return check["busy"] and not check.get("waited") and not check.get("redone")


def _wait_seconds(text: str) -> float:
    """argparse type of --wait-quiet: a finite number of seconds >= 0."""
    import argparse  # noqa: PLC0415

    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not _seconds_ok(v):
        raise argparse.ArgumentTypeError(f"--wait-quiet {text!r} must be a finite number of seconds >= 0")
    return v


def _seconds_ok(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def add_arguments(p) -> None:
    """The guard's flags of a study's argument parser."""
    p.add_argument("--allow-loaded", action="store_true",
                   help="run and write results on a machine busier than the study allows (labelled loaded)")
    p.add_argument("--calibrate-probe", action="store_true",
                   help=f"time the load guard's compute probe on this (quiet) machine into {PROBE_CALIBRATION.name}, "
                        "then exit")
    p.add_argument("--wait-quiet", type=_wait_seconds, default=0.0, metavar="SECONDS",
                   help="on a busy machine, wait up to SECONDS (each time) for it to be quiet and run a round it "
                        "was busy during again, instead of refusing the result (default: 0, refuse)")


class Guard:
    """Measures the machine before and during a study and says, on stderr, when it is busier than
    `limits` allow.

    processes: the study's own processes per run (for the load average's allowance). wait_s: > 0 waits
    out a busy machine (module docstring; seconds per wait). `measure` (for tests) replaces the
    measurement: a function of `where` returning a dict with keys `other_cpu_cores`, `probe_s`,
    `load_average_1min` (each may be None). `sleep` (for tests) replaces time.sleep.
    Raises ValueError for a wait_s that is not a finite number >= 0."""

    def __init__(self, *, processes: int, allow_loaded: bool = False, limits: Limits = Limits(),
                 calibration: pathlib.Path = PROBE_CALIBRATION, tag: str = "[load guard]", measure=None,
                 wait_s: float = 0.0, sleep=time.sleep):
        if not _seconds_ok(wait_s):
            raise ValueError(f"wait_s={wait_s!r} (--wait-quiet) must be a finite number of seconds >= 0")
        self.processes, self.allow_loaded, self.limits, self.tag = processes, allow_loaded, limits, tag
        self.wait_s, self._sleep = wait_s, sleep
        self.calibrated_s, self.calibration_note = load_calibration(calibration)
        self._measure = measure
        self.checks: list[dict] = []
        self.started = False
        self._first = 0  # the checks of the result being measured: checks[_first:]
        self.runs_since_check = 0  # `watch` blocks since the last `check`
        self.redone: list[str] = []  # rounds of the result being measured that `redo` discarded

    @property
    def loaded(self) -> bool:
        """Whether a check of the result being measured (since the last `next_result`) found the
        machine busier than allowed."""
        return any(counts(c) for c in self.checks[self._first:])

    def next_result(self) -> None:
        """Starts the checks of the next result (a study's next configuration)."""
        self._first = len(self.checks)
        self.redone = []

    @property
    def label(self) -> str:
        """' [LOADED]' once the machine was found busy (for every printed result), else ''."""
        return " [LOADED]" if self.loaded else ""

    def will_redo(self, since: int, attempt: int) -> bool:
        """Whether `redo(since, ..., attempt)` would discard the round: wait_s > 0, a check since
        `since` is busy (not one waited through), attempt < MAX_REDOS, and the result is not already
        loaded by a wait that ran out (unless loaded results are allowed: then running again still helps)."""
        busy = any(c["busy"] and not c.get("waited") for c in self.checks[since:])
        lost = any(counts(c) for c in self.checks[self._first:since])
        return self.wait_s > 0 and busy and attempt < MAX_REDOS and not (lost and not self.allow_loaded)

    def run_label(self, since: int, attempt: int) -> str:
        """The label of a run's printed line: ' [busy: runs again]' when the round it belongs to (its
        checks from `since`) will be discarded (`will_redo`), else `label`."""
        return " [busy: runs again]" if self.will_redo(since, attempt) else self.label

    def _warn(self, text: str) -> None:
        print(f"{self.tag} {text}", file=sys.stderr, flush=True)

    def judge(self, where: str, m: dict, *, start: bool, quiet: bool = False) -> dict:
        """Adds the check `m` (keys other_cpu_cores, probe_s, load_average_1min; None = not measured)
        taken at `where`, with its reasons; warns on stderr when busy (not when `quiet`: a repeated
        check of a wait). Returns the check."""
        lim, reasons = self.limits, []
        cores = os.cpu_count() or 1
        other = m.get("other_cpu_cores")
        if other is not None and other > lim.other_cpu_cores:
            reasons.append(f"other processes used {other:.2f} cores (limit {lim.other_cpu_cores:.2f})")
        ratio = None
        if m.get("probe_s") is not None and self.calibrated_s:
            ratio = m["probe_s"] / self.calibrated_s
            if ratio > lim.probe_slowdown:
                reasons.append(f"compute probe {m['probe_s']:.3f} s = {ratio:.2f}x its calibrated "
                               f"{self.calibrated_s:.3f} s (limit {lim.probe_slowdown:.2f}x)")
        load = m.get("load_average_1min")
        allowed = max(cores - self.processes, 0) + lim.load_tolerance
        if start and load is not None and load > allowed:
            reasons.append(f"load average {load:.2f} (1 min; limit {allowed:.2f}: {cores} cores, "
                           f"{self.processes} processes of the study)")
        check = {"where": where, **m, "probe_ratio": ratio, "busy": bool(reasons), "reasons": reasons}
        self.checks.append(check)
        if reasons and not quiet:
            self._warn(f"WARNING: the machine is busier than the study allows ({where}): {'; '.join(reasons)}. "
                       "Timings now are not results.")
        return check

    def check(self, where: str, *, start: bool = False, wait: bool = True) -> dict:
        """Measures other processes' CPU over the compute probe, the probe, and the load average;
        judges them (`judge`). start: the first check of a study (also judges the load average, and
        says when the probe is not calibrated). With `wait_s` > 0 and `wait` a busy check is marked
        `waited` and repeated every WAIT_POLL_S until one is quiet or wait_s has passed (wait=False: the
        check after a round, which `redo` judges); returns the last check."""
        c = self._check(where, start=start)
        if not (c["busy"] and self.wait_s > 0 and wait):
            return c
        t0 = time.monotonic()
        self._warn(f"waiting up to {self.wait_s:.0f} s for a quiet machine ({where})")
        while c["busy"] and time.monotonic() - t0 < self.wait_s:
            c["waited"] = True
            self._sleep(min(WAIT_POLL_S, max(self.wait_s - (time.monotonic() - t0), 0.0)))
            c = self._check(where, start=start, quiet=True)
        waited = time.monotonic() - t0
        self._warn(f"quiet again ({where}) after {waited:.0f} s" if not c["busy"] else
                   f"still busy ({where}) after {waited:.0f} s: {'; '.join(c['reasons'])}; this check counts")
        return c

    def mark(self) -> int:
        """A position in the record, for `redo`: the checks from here on are the next round's."""
        return len(self.checks)

    def redo(self, since: int, what: str, attempt: int) -> bool:
        """When `will_redo(since, attempt)` (`since`: the round's first check, from `mark`; `attempt`: 0
        for the round's first run), marks the checks since `since` `redone`, says so on stderr, waits
        for a quiet machine and returns True: the caller discards the round and runs it again.
        Otherwise False (busy checks then make the result loaded)."""
        if not self.will_redo(since, attempt):
            return False
        busy = [c for c in self.checks[since:] if c["busy"] and not c.get("waited")]
        for c in self.checks[since:]:
            c["redone"] = True
        self.redone.append(what)
        self._warn(f"{what} discarded (the machine was busy: {busy[0]['where']}: {'; '.join(busy[0]['reasons'])}); "
                   f"it runs again when the machine is quiet (attempt {attempt + 2})")
        self.check(f"before {what}, attempt {attempt + 2}")
        return True

    def _check(self, where: str, *, start: bool, quiet: bool = False) -> dict:
        if self._measure is not None:
            m = self._measure(where)
        else:
            w = _Window()
            probe_s = probe()
            m = {"other_cpu_cores": w.other_cores()[0], "probe_s": probe_s,
                 "load_average_1min": os.getloadavg()[0]}
        self.runs_since_check = 0
        if start:
            self.started = True
            if self.calibrated_s is None and not quiet:
                self._warn(f"note: {self.calibration_note}: the compute probe is not judged; calibrate it on a "
                           "quiet machine with --calibrate-probe")
        return self.judge(where, m, start=start, quiet=quiet)

    @contextlib.contextmanager
    def watch(self, where: str):
        """Judges other processes' CPU over the block (a run: its processes are children, not counted)."""
        w = _Window()
        yield
        self.runs_since_check += 1
        other, wall = w.other_cores()
        if self._measure is not None:
            other = self._measure(where).get("other_cpu_cores")
        self.judge(where, {"other_cpu_cores": other, "probe_s": None, "load_average_1min": None, "wall_s": wall},
                   start=False)

    def refuse_start(self) -> None:
        """Raises Loaded (printed) when the first check found the machine busy and loaded runs are not allowed."""
        if self.loaded and not self.allow_loaded:
            waited = f" after waiting {self.wait_s:g} s (--wait-quiet)" if self.wait_s > 0 else ""
            refuse(f"{self.tag} not started{waited}: {'; '.join(self.checks[-1]['reasons'])}. Run on a quiet "
                         "machine (the 1-minute load average falls slowly after other work: wait longer with "
                         "--wait-quiet), or pass --allow-loaded to run anyway (results labelled loaded)")

    def summary(self) -> dict:
        """The guard's record of the result being measured, for its JSON."""
        return {"loaded": self.loaded, "allow_loaded": self.allow_loaded, "limits": dataclasses.asdict(self.limits),
                "calibrated_probe_s": self.calibrated_s, "calibration": self.calibration_note,
                "machine": machine(), "wait_s": self.wait_s,
                "waited_checks": sum(bool(c.get("waited")) for c in self.checks[self._first:]),
                "redone": list(self.redone),
                "checks": self.checks[self._first:]}


def main(argv=None) -> dict:
    """`python -m experiments.e2e.load_guard`: one check of the machine now (exit status 3 when busier
    than a 2-process study allows), or `--calibrate-probe`."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--processes", type=int, default=2, help="the study's processes per run (default: 2)")
    p.add_argument("--calibrate-probe", action="store_true", help=f"write {PROBE_CALIBRATION.name}, then exit")
    a = p.parse_args(argv)
    if a.calibrate_probe:
        cal = calibrate()
        print(f"compute probe: {cal['probe_s']:.3f} s (median of {len(cal['runs_s'])}) on {cal['machine']}, "
              f"written to {PROBE_CALIBRATION}")
        return cal
    guard = Guard(processes=a.processes)
    check = guard.check("now", start=True)
    print(json.dumps(check, indent=1))
    if check["busy"]:
        raise Loaded("busy")
    return check


if __name__ == "__main__":
    main()
