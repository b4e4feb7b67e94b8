"""An emulated cluster on one Linux machine: each process of a `taco-jax launch --link ...` run in its
own network namespace, joined by links shaped with `tbf` (docs/distributed.md, "Emulated links").

Topology (names `<prefix><run id>-...`, prefix `taco-` or `$TACO_JAX_NETNS_PREFIX`; run id = the
launcher's pid and start time, so a leftover of a dead launcher is recognised as stale):
  - one namespace per process, `...-p<i>`, address 198.18.a.b/32 (RFC 2544 benchmarking range)
    on its inter-node interface `x0`; its own hosts file `/etc/netns/<ns>/hosts` maps this
    machine's hostname to that address (gloo binds the address its hostname resolves to);
  - one "switch" namespace `...-sw` holding a bridge `bx` that joins every process's `x0` and,
    in the two-tier form, one bridge `bn<k>` per node joining the `i0` (intra-node) interfaces of
    that node's processes. No interface is made in the caller's namespace.
  - Routes are per peer (/32): a peer on the same node via `i0`, any other via `x0`. The links carry
    IPv4 only (`IPV6_DEFAULT`): no traffic of their own.
  - Every interface is shaped on egress on both sides (a process neither sends nor receives faster
    than its link) by `tbf` (`_burst`, `_queue_bytes`, `_receive_burst`; docs/emulated.md, "The bucket"): a small
    send bucket so that a step's messages are shaped too, a larger receive one so that a late timer on busy cores
    does not cost the link its rate.
Two tiers (`--link intra=8gbit,inter=1gbit --nodes K`): processes 0..N/K-1 are node 0, the next
N/K node 1, ... . Devices of process i are global devices i·d .. (i+1)·d-1 and a mesh spec
takes devices in that order, the last axis fastest: `data=2,tensor=2` over 2 nodes of 2
one-device processes puts each tensor pair inside a node (`check_tensor_in_node`).

Each link is measured before the run by a bulk TCP transfer (`measure`). Cleanup: `Cluster.close()`, a reaper
process when the launcher dies by any signal, and `cleanup_stale()` at the next start or `taco-jax launch --cleanup`."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

from taco_jax.util.procs import child_env

ENV_PREFIX = "TACO_JAX_NETNS_PREFIX"
DEFAULT_PREFIX = "taco-"
NETNS_DIR = pathlib.Path("/var/run/netns")
ETC_NETNS = pathlib.Path("/etc/netns")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_CLONE_NEWNET = 0x40000000


class EmulationUnavailable(ValueError):
    """Network namespaces cannot be made here; the message names what is missing."""


def prefix() -> str:
    """Name prefix of this machine's emulated-cluster namespaces (`$TACO_JAX_NETNS_PREFIX`, default `taco-`)."""
    p = os.environ.get(ENV_PREFIX, DEFAULT_PREFIX)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*-", p):
        raise ValueError(f"${ENV_PREFIX}={p!r} must be letters, digits or _ ending in '-' (e.g. 'taco-')")
    return p


def parse_rate(text: str) -> float:
    """"100mbit" -> 1e8 bits/s (decimal units as tc: bit, kbit, mbit, gbit, tbit; case-insensitive).
    Raises ValueError naming `text` for another form or a rate <= 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m[2] not in _UNITS or not float(m[1]) > 0:
        raise ValueError(f"link rate {text!r} must be a positive number with a unit of {sorted(_UNITS)}, "
                         "e.g. 100mbit or 1gbit")
    return float(m[1]) * _UNITS[m[2]]


def _check_min(rate_bps: float, text: str) -> float:
    """`rate_bps`; raises ValueError naming `text` and `MIN_RATE_BPS` when it is slower."""
    if rate_bps < MIN_RATE_BPS:
        raise ValueError(f"link rate {text!r} is below the slowest accepted, {MIN_RATE_BPS / 1e3:g}kbit (a "
                         "tensor-parallel step of even the tiny model, ~0.6 MB, would take over a minute)")
    return rate_bps


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """`--link RATE` (one tier: every process on one switch) or `--link intra=RATE,inter=RATE` with
    `--nodes K` (two tiers). Rates in bits/s (at least `MIN_RATE_BPS`); `intra` is None for one tier."""

    inter: float
    intra: float | None = None
    nodes: int = 0  # 0: one tier (every process its own node)
    text: str = ""

    @classmethod
    def parse(cls, text: str, nodes: int = 0) -> LinkSpec:
        """Raises ValueError naming a malformed `text`, a rate below `MIN_RATE_BPS`, a two-tier form
        without `nodes` >= 1, or `nodes` with the one-tier form."""
        if "=" not in text:
            if nodes:
                raise ValueError(f"--nodes {nodes} needs the two-tier form --link intra=RATE,inter=RATE "
                                 f"(got --link {text!r})")
            return cls(_check_min(parse_rate(text), text), None, 0, text)
        parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
        if sorted(parts) != ["inter", "intra"] or text.count("=") != 2:
            raise ValueError(f"--link {text!r} must be RATE or intra=RATE,inter=RATE (e.g. intra=8gbit,inter=1gbit)")
        if nodes < 1:
            raise ValueError(f"--link {text!r} (two tiers) needs --nodes K >= 1")
        return cls(_check_min(parse_rate(parts["inter"]), parts["inter"]),
                   _check_min(parse_rate(parts["intra"]), parts["intra"]), nodes, text)

    def node_of(self, processes: int) -> list[int]:
        """Node index of each process (contiguous blocks of processes / nodes). Raises ValueError when
        the node count does not divide the process count."""
        if not self.nodes:
            return list(range(processes))
        if processes % self.nodes:
            raise ValueError(f"--nodes {self.nodes} must divide --processes {processes}")
        per = processes // self.nodes
        return [i // per for i in range(processes)]


def check_tensor_in_node(mesh: dict[str, int], processes: int, node_of: list[int]) -> None:
    """Raises ValueError when a tensor-axis group of `mesh` (axes in spec order, the last fastest; device
    d on process d // (devices / processes)) spans two nodes."""
    import numpy as np

    n = math.prod(mesh.values())
    if "tensor" not in mesh or n % processes:
        return
    ids = np.arange(n).reshape(tuple(mesh.values()))
    groups = np.moveaxis(ids, list(mesh).index("tensor"), -1).reshape(-1, mesh["tensor"])
    nodes = np.asarray(node_of)[groups // (n // processes)]
    if (nodes != nodes[:, :1]).any():
        raise ValueError(f"mesh {','.join(f'{k}={v}' for k, v in mesh.items())} puts a tensor group on processes "
                         f"of different nodes ({sorted(set(map(int, nodes[(nodes != nodes[:, :1]).any(1)][0])))}); "
                         "write the tensor axis last and give each node a multiple of tensor devices")


def check_available() -> None:
    """Raises EmulationUnavailable naming what is missing: Linux, root / CAP_NET_ADMIN and
    CAP_SYS_ADMIN (namespaces, mounts of the hosts file), the `ip` and `tc` commands."""
    missing = []
    if not sys.platform.startswith("linux"):
        raise EmulationUnavailable(f"--link needs Linux network namespaces; this is {sys.platform}")
    caps = _effective_caps()
    for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")):
        if not caps >> bit & 1:
            missing.append(f"{name} (run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (iproute2)")
    if missing:
        raise EmulationUnavailable("--link cannot make network namespaces here: missing " + ", ".join(missing))


def _effective_caps() -> int:
    """This process's effective capability bits (/proc/self/status CapEff), 0 where unreadable."""
    try:
        return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        return 0


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise EmulationUnavailable(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` (clock ticks since boot), None if it does not exist."""
    try:
        return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def list_namespaces(pre: str | None = None) -> list[str]:
    """Names of the network namespaces starting with `pre` (default: `prefix()`)."""
    pre = prefix() if pre is None else pre
    names = {p.name for p in NETNS_DIR.glob(pre + "*")} if NETNS_DIR.exists() else set()
    return sorted(names | {p.name for p in ETC_NETNS.glob(pre + "*")} if ETC_NETNS.exists() else names)


def remove(names) -> None:
    """Deletes the namespaces `names` (one `ip -batch`) and their /etc/netns folders. Every interface of
    a run lives in its namespaces, both veth ends included, so the kernel deletes them with those."""
    names = list(names)
    live = [ns for ns in names if (NETNS_DIR / ns).exists()]
    if live:
        subprocess.run(["ip", "-force", "-batch", "-"], input="".join(f"netns del {ns}\n" for ns in live),
                       capture_output=True, text=True, timeout=60)
    for ns in names:
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def cleanup_stale(pre: str | None = None) -> list[str]:
    """Removes the namespaces (and hosts files) of emulated clusters whose launcher is gone (a run id
    `<pid>-<start ticks>` that no live process has); returns their names. Live runs are left alone."""
    pre = prefix() if pre is None else pre
    stale = []
    for ns in list_namespaces(pre):
        m = re.fullmatch(re.escape(pre) + r"(\d+)-(\d+)-(?:p\d+|sw)", ns)
        if m and _start_ticks(int(m[1])) != int(m[2]):
            stale.append(ns)
    remove(stale)
    return stale


def _addr(i: int) -> str:
    return f"198.18.{i // 250}.{i % 250 + 1}"


#: Smallest send-side tbf bucket (bytes): two full Ethernet frames (1,514 bytes each) and a little more.
SEND_BURST_MIN_BYTES = 4096


def _burst(rate_bps: float) -> int:
    """Bytes of the send side's tbf bucket at `rate_bps`: max(`SEND_BURST_MIN_BYTES`, 250 µs of the rate)."""
    return max(SEND_BURST_MIN_BYTES, int(rate_bps / 8 * 250e-6))


#: Fewest bytes a tbf queue holds beyond its bucket: TCP's initial window (10 segments) and more, so a
#: slow link does not drop the first packets of a transfer (at 400 kbit/s, 100 ms of the rate is 5 KB).
QUEUE_MIN_BYTES = 64 * 1024


def _queue_bytes(rate_bps: float, burst: int) -> int:
    """tbf's `limit` at `rate_bps` with bucket `burst`: the bucket and max(100 ms of the rate,
    `QUEUE_MIN_BYTES`) of queue (`latency 100ms` at rates above ~5 Mbit/s)."""
    return burst + max(int(rate_bps / 8 * 0.1), QUEUE_MIN_BYTES)


def _receive_burst(rate_bps: float) -> int:
    """Bytes of the receive side's (switch port's) tbf bucket at `rate_bps`: max(32 KB, 1 ms of the rate)."""
    return max(32 * 1024, int(rate_bps / 8 * 1e-3))


_libc = ctypes.CDLL(None, use_errno=True)


def _in_netns(ns: str, fn):
    """`fn()` with this thread in network namespace `ns` (sockets made there stay there)."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if _libc.setns(there, _CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        return fn()
    finally:
        _libc.setns(here, _CLONE_NEWNET)
        os.close(there)
        os.close(here)


#: The namespace's default IPv6 setting of new interfaces. `Cluster` sets it to 1 in its namespaces
#: before making their links, so that no IPv6 chatter takes turns on a shaped link.
IPV6_DEFAULT = pathlib.Path("/proc/sys/net/ipv6/conf/default/disable_ipv6")

#: Fewest payload bytes a link test times after the bucket's burst: 16 full TCP segments, so the
#: rate of a slow link is read over more than a few packets (±1 segment: ~6 %).
MIN_PROBE_BYTES = 16 * 1448
#: Slowest `--link` rate accepted (bits/s): below it even the tiny model's tensor-parallel step
#: (~0.6 MB per step) takes over a minute, and the link test alone takes seconds per link.
MIN_RATE_BPS = 100e3


#: A link test reading above this multiple of a shaped link's rate means the link is not shaped as the test
#: assumes (a bucket bigger than the burst it skips): `measure` refuses it instead of returning it.
UNSHAPED_ABOVE = 1.5

#: `Cluster.measure_links` measures a link again when it reads below this fraction of its rate
#: (docs/distributed.md, "Measured before the run").
RETEST_BELOW = 0.9


def probe_bytes(rate_bps: float, seconds: float = 0.5, max_bytes: int = 256 << 20) -> tuple[int, int]:
    """(burst, timed) bytes of the link test at `rate_bps`: the tbf bucket's burst (`_burst`; it passes at
    once, so it is sent but not timed), then min(max(rate × `seconds`, `MIN_PROBE_BYTES`), `max_bytes`)."""
    return _burst(rate_bps), int(min(max(rate_bps / 8 * seconds, MIN_PROBE_BYTES), max_bytes))


#: SO_TIMESTAMPNS (Linux, asm-generic/socket.h; not in Python's socket module): a read's ancillary data
#: carries the kernel's arrival time of the last data it returned.
_SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")


def _recv_stamped(conn: socket.socket, size: int) -> tuple[bytes, float]:
    """One read of up to `size` bytes and the arrival time (CLOCK_REALTIME, s) of its last byte, stamped
    by the kernel (`_SO_TIMESTAMPNS`): a reader that runs late on a busy machine reads the times the
    bytes arrived, not its own. Without a stamp (an empty read), the reader's clock."""
    data, anc, _, _ = conn.recvmsg(size, socket.CMSG_SPACE(_TIMESPEC.size))
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(raw) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(raw[:_TIMESPEC.size])
            return data, sec + nsec * 1e-9
    return data, time.time()


#: The links' MTU (the veth default, which the emulator keeps) and the Ethernet header tbf counts with each
#: packet: a full TCP segment of `mss` payload bytes is a frame of MTU_BYTES + ETHERNET_HEADER_BYTES bytes.
MTU_BYTES = 1500
ETHERNET_HEADER_BYTES = 14


def wire_bit_per_s(payload_bit_per_s: float, mss: int) -> float:
    """The frame rate (bits/s of Ethernet frames, what tbf's rate counts) of a bulk TCP transfer that moved
    `payload_bit_per_s` in full segments of `mss` payload bytes: × (MTU_BYTES + 14) / mss (1514 / 1448 =
    1.0456 with TCP timestamps). Raises ValueError for an `mss` outside (0, MTU_BYTES)."""
    if not 0 < mss < MTU_BYTES:
        raise ValueError(f"mss {mss!r} is not a TCP payload size below the MTU {MTU_BYTES}")
    return payload_bit_per_s * (MTU_BYTES + ETHERNET_HEADER_BYTES) / mss


def measure(src_ns: str, dst_ns: str, dst_addr: str, rate_bps: float, *, seconds: float = 0.5,
            max_bytes: int = 256 << 20, info: dict | None = None, burst: int | None = None) -> float:
    """Payload bits/s of one TCP bulk transfer from namespace `src_ns` to `dst_addr` in `dst_ns`, timed by the
    receiver's kernel (`_recv_stamped`) from the end of the burst to the last byte; bounded by 4 × the timed bytes' time
    at `rate_bps` + 5 s. `burst`: bytes the link's bucket passes at once (default `_burst(rate_bps)`). `info`, if given,
    receives the connection's "mss". Raises EmulationUnavailable naming what arrived (or the socket error) when too
    little did, or when the link passed more than `burst` bytes unshaped (or read above `UNSHAPED_ABOVE` × its rate)."""
    default_burst, timed = probe_bytes(rate_bps, seconds, max_bytes)
    burst = default_burst if burst is None else int(burst)
    limit = 4 * timed * 8 / rate_bps + 5
    srv = _in_netns(dst_ns, lambda: socket.create_server((dst_addr, 0)))
    got = {"n": 0}

    def receive():
        srv.settimeout(limit)
        srv.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)  # before accept: the connection's first bytes stamped too
        try:
            conn, _ = srv.accept()
        except OSError as e:
            got["error"] = e
            return
        try:
            conn.settimeout(limit)
            n, t0, n0, t1 = 0, None, 0, None
            while True:
                # all that is queued, never part of a coalesced segment: the rest of that segment arrived
                # at its stamp, and timing it as later bytes overstates the rate
                b, t = _recv_stamped(conn, 1 << 20)
                if not b:
                    break
                n, t1 = n + len(b), t  # every byte read so far arrived by t (the kernel's stamp)
                if t0 is None and n >= burst:  # the bucket's burst passed at once: time what follows
                    t0, n0 = t1, n
                got["n"] = n
            got.update(timed=n - n0 if t0 is not None else 0, dt=(t1 - t0) if t0 is not None else 0.0)
        except OSError as e:
            got["error"] = e
        finally:
            conn.close()

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    deadline = time.monotonic() + limit
    total = burst + timed
    try:
        with _in_netns(src_ns, socket.socket) as c:
            c.settimeout(limit)
            c.connect((dst_addr, srv.getsockname()[1]))
            if info is not None:
                info["mss"] = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
            buf, sent = b"\0" * (1 << 16), 0
            while sent < total and time.monotonic() < deadline:
                sent += c.send(buf[:total - sent])
    except OSError as e:
        got.setdefault("error", e)
    finally:
        th.join(timeout=max(0.1, deadline - time.monotonic() + 1))
        srv.close()
    unshaped = f"the link passed more than its {burst}-byte burst unshaped (a bigger tbf bucket than this test skips?)"
    if not got.get("dt") or not got.get("timed"):
        if "error" in got:
            why = f"{type(got['error']).__name__}: {got['error']}"
        elif got["n"] >= total:
            why = f"all {total} bytes arrived at once, so none could be timed: {unshaped}"
        else:
            why = (f"{got['n']} of {total} bytes arrived within {limit:.3g} s (a {burst}-byte burst, then {timed} "
                   f"timed bytes at {rate_bps / 1e6:g} Mbit/s)")
        raise EmulationUnavailable(f"link test {src_ns} -> {dst_ns} ({dst_addr}) moved too little data to time: "
                                   f"{why}")
    rate = got["timed"] * 8 / got["dt"]
    if burst > 0 and rate > UNSHAPED_ABOVE * rate_bps:
        raise EmulationUnavailable(f"link test {src_ns} -> {dst_ns} ({dst_addr}) read {rate / 1e6:.4g} Mbit/s on a "
                                   f"link shaped to {rate_bps / 1e6:g} Mbit/s: {unshaped}")
    return rate


class Cluster:
    """The namespaces and shaped links of one run (see the module docstring). `Cluster(processes, spec)`
    makes them (raises EmulationUnavailable naming a failed command; what was made is removed
    again); `measure_links()` -> the run's link description; `exec_prefix(i)` -> the command prefix
    that runs a program in process i's namespace; `close()` removes everything (idempotent)."""

    def __init__(self, processes: int, spec: LinkSpec, *, reaper: bool = True):
        check_available()
        self.processes, self.spec = processes, spec
        self.node_of = spec.node_of(processes)
        self.run = f"{prefix()}{os.getpid()}-{_start_ticks(os.getpid())}-"
        self.names = [f"{self.run}p{i}" for i in range(processes)] + [f"{self.run}sw"]
        self.addrs = [_addr(i) for i in range(processes)]
        self._reaper = None
        self._closed = False
        try:
            cleanup_stale()
            if reaper:  # removes the namespaces when this process dies, however it dies
                self._reaper = subprocess.Popen(  # -P: this taco_jax, whatever the working directory holds
                    [sys.executable, "-P", "-c", "import sys; from taco_jax.emulate import _reap; _reap(sys.argv[1:])",
                     *self.names], stdin=subprocess.PIPE, start_new_session=True,
                    env=child_env({**os.environ, ENV_PREFIX: prefix()}))
            self._build()
        except BaseException:
            self.close()
            raise

    def _tiers(self, i: int) -> list[tuple[str, str, float]]:
        """(interface in the process namespace, bridge in the switch, rate) of process i."""
        tiers = [("x0", "bx", self.spec.inter)]
        if self.spec.intra is not None and self.node_of.count(self.node_of[i]) > 1:
            tiers.append(("i0", f"bn{self.node_of[i]}", self.spec.intra))
        return tiers

    def _build(self) -> None:
        sw = self.names[-1]
        hostname = socket.gethostname()
        for ns in self.names:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            try:  # before the links are made: they get no IPv6 (no stray packets on them)
                _in_netns(ns, lambda: IPV6_DEFAULT.write_text("1\n"))
            except OSError:  # a kernel without IPv6 sends none; elsewhere the links work, with its few packets
                pass
        bridges = {b for i in range(self.processes) for _, b, _ in self._tiers(i)}
        for b in sorted(bridges):
            _sh("ip", "-n", sw, "link", "add", b, "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", b, "up")
        for i, ns in enumerate(self.names[:-1]):
            for dev, bridge, rate in self._tiers(i):
                port = f"p{i}{dev[0]}"
                _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
                _sh("ip", "-n", sw, "link", "set", port, "master", bridge)
                for where, d, burst in ((sw, port, _receive_burst(rate)), (ns, dev, _burst(rate))):
                    _sh("ip", "-n", where, "link", "set", d, "up")
                    _sh("tc", "-n", where, "qdisc", "add", "dev", d, "root", "tbf", "rate", f"{int(rate)}bit",
                        "burst", str(burst), "limit", str(_queue_bytes(rate, burst)))
            _sh("ip", "-n", ns, "addr", "add", f"{self.addrs[i]}/32", "dev", "x0")
            for j in range(self.processes):
                if j != i:
                    dev = "i0" if self.spec.intra is not None and self.node_of[j] == self.node_of[i] else "x0"
                    _sh("ip", "-n", ns, "route", "add", f"{self.addrs[j]}/32", "dev", dev, "src", self.addrs[i])
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{self.addrs[i]} {hostname}\n")

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def peers(self) -> list[tuple[str, int, int]]:
        """(tier, from, to) of each measured link: per process, one peer per tier (the next process of its node on
        "intra"; on "inter"/"link" the first process of the next node, or the next process with one tier)."""
        out = []
        n, nodes = self.processes, self.node_of
        for i in range(n):
            if self.spec.intra is None:
                if n > 1:
                    out.append(("link", i, (i + 1) % n))
                continue
            same = [j for j in range(n) if nodes[j] == nodes[i]]
            if len(same) > 1:
                out.append(("intra", i, same[(same.index(i) + 1) % len(same)]))
            other = [j for j in range(n) if nodes[j] == (nodes[i] + 1) % (max(nodes) + 1) and nodes[j] != nodes[i]]
            if other:
                out.append(("inter", i, other[0]))
        return out

    def measure_links(self, seconds: float = 0.5) -> dict:
        """Measures every link of `peers()`; returns the run's link description (`TrainConfig.emulated_link`): per tier
        the requested and measured (median over its links) payload bits/s and each link's rate.

        A link that reads below `RETEST_BELOW` × its rate is measured once more, keeping the faster
        reading (tbf passes no more than the rate; "tries" records 2)."""
        rates = {"link": self.spec.inter, "inter": self.spec.inter, "intra": self.spec.intra}
        links = []
        for tier, i, j in self.peers():
            info = {}
            got, tries = measure(self.names[i], self.names[j], self.addrs[j], rates[tier], seconds=seconds,
                                 info=info), 1
            if got < RETEST_BELOW * rates[tier]:
                got = max(got, measure(self.names[i], self.names[j], self.addrs[j], rates[tier], seconds=seconds))
                tries = 2
            links.append({"tier": tier, "from": i, "to": j, "measured_bit_per_s": got, "tries": tries,
                          "mss": info["mss"], "measured_wire_bit_per_s": wire_bit_per_s(got, info["mss"])})
        tiers = {}
        for tier in dict.fromkeys(x["tier"] for x in links):
            got = sorted(x["measured_bit_per_s"] for x in links if x["tier"] == tier)
            mss = min(x["mss"] for x in links if x["tier"] == tier)
            tiers[tier] = {"requested_bit_per_s": rates[tier], "measured_bit_per_s": got[len(got) // 2],
                           "measured_wire_bit_per_s": wire_bit_per_s(got[len(got) // 2], mss), "mss": mss,
                           "measured_min_bit_per_s": got[0], "burst_bytes": _burst(rates[tier]),
                           "receive_burst_bytes": _receive_burst(rates[tier])}
        tensor_tier = "intra" if "intra" in tiers else next(iter(tiers), None)
        return {"link": self.spec.text, "processes": self.processes, "nodes": self.spec.nodes or self.processes,
                "node_of_process": self.node_of, "addresses": self.addrs, "tiers": tiers, "links": links,
                "tensor_tier": tensor_tier,
                "method": "tbf on each interface's egress, both sides (send bucket burst_bytes, receive bucket "
                          "receive_burst_bytes); TCP bulk transfer per link, payload bits/s "
                          "(measured_wire_bit_per_s: the same as Ethernet frames, as tbf counts them)"}

    def close(self) -> None:
        """Removes every namespace, interface and hosts file of the run; ends the reaper."""
        if self._closed:
            return
        self._closed = True
        remove(self.names)
        if self._reaper is not None:
            self._reaper.stdin.close()  # the reaper finds nothing left and exits
            try:
                self._reaper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._reaper.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _reap(names: list[str]) -> None:
    """The reaper: waits until its stdin ends (the launcher closed it or died), then removes `names`."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal's group is the launcher's
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    finally:
        remove(names)
