"""The per-message cost of an emulated link: one TCP message exchange between two namespaces of
`taco_jax.emulate.Cluster`, timed under each shaping variant (JSON + a markdown table).

Run as root from the repository root (a 2-process cluster is made and always removed again):

    python -m experiments.e2e.link_latency --rate 1gbit --out runs/link_latency
    python -m experiments.e2e.link_latency --rate 1gbit --variants base,ackbypass --sizes 256K \\
        --gaps 0,0.001,0.02,0.2 --modes bidir --out runs/link_latency_gap

What is timed: one persistent TCP connection (TCP_NODELAY, as gloo's pairs) between process 0 and
process 1, one thread per side in its namespace. A rep: both threads start at a barrier;
  oneway  process 0 sends SIZE bytes, process 1 answers 1 byte once all arrived;
  bidir   both send SIZE bytes at once and each receives the other's (the exchange of a 2-rank
          all-reduce step); the rep ends when the last side has received everything.
Time = the rep's wall time (µs clock of the thread that ends last, from the barrier). `--gap`
seconds of idle precede each rep (a training step's compute phase). Ideal = SIZE / bulk rate (the
payload rate `taco_jax.emulate.measure` reads over the same links, measured in every round of every
variant): no propagation delay is emulated, so the ideal has none. Per variant and mode the script
fits t = α + SIZE / R_eff over the sizes' medians (least squares): α is the per-message cost.

Variants (`--variants`; every egress of the link: x0 of both processes, both switch ports):
  base       what `taco_jax.emulate` installs: tbf with bucket max(4 KB, R·250 µs) on the processes'
             x0 (send side), bucket max(32 KB, R·1 ms) on the switch ports (receive side)
  base32k    base with the send bucket of `tbf` (the emulator's until 2026-12-03): its first 32 KB
             pass at once after a gap
  tbf        tbf rate R burst max(32 KB, R·250 µs) latency 100ms on all four (the same bucket on
             both sides)
  tbf5ms     the same with latency 5ms (a short queue)
  tbfburst   burst max(256 KB, R·2 ms) (a bigger bucket: short messages pass unshaped)
  nogso      tbf as `tbf`, and gso_max_size 1500 on the veths: no 64 KB super-packets
  ackbypass  htb root: packets of IP length < 128 B (pure ACKs, gloo's small control messages) go
             to htb's direct queue (unshaped, served first); everything else to a tbf leaf as `tbf`
  rxburst    `tbf` on the processes' x0 (sender egress); the switch ports (receive side) with the
             bucket of `tbfburst`: it caps the sustained receive rate and absorbs the sender's jitter
  rx1ms      as rxburst with a switch-side bucket of max(64 KB, R·1 ms)
  sendonly   `tbf` on the processes' x0 only (sender egress), switch ports unshaped
  none       no shaping (veth at memory speed)
Socket variants (`--sockopts`): nodelay (default), quickack (TCP_QUICKACK set after every recv),
bufs4m (SO_SNDBUF = SO_RCVBUF = 4 MB), delay (Nagle on).

The timing threads run SCHED_FIFO (`--rt-prio`, default 50; 0: off) so the other load of a shared
machine does not delay them; the kernel's packet work (softirq, tbf timers) still runs where the
kernel puts it. Rounds interleave the variants (order rotated per round).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import selectors
import socket
import statistics
import subprocess
import threading
import time

from experiments.common import run_record
from taco_jax import emulate

VARIANTS = ("base", "base32k", "tbf", "tbf5ms", "tbfburst", "rxburst", "rx1ms", "nogso", "ackbypass", "sendonly",
            "none")
SOCKOPTS = ("nodelay", "quickack", "bufs4m", "delay")


def _size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    return int(float(t.rstrip("KM")) * mult)


def _sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(args)}` failed: {r.stderr.strip()}")


def _egresses(cl: emulate.Cluster) -> list[tuple[str, str, bool]]:
    """(namespace, device, is_process_side) of every egress of the 2-process link."""
    sw = cl.names[-1]
    return [(cl.names[0], "x0", True), (cl.names[1], "x0", True), (sw, "p0x", False), (sw, "p1x", False)]


def _tbf(rate: float, burst: int, latency: str = "100ms") -> list[str]:
    return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "latency", latency]


def apply_variant(cl: emulate.Cluster, variant: str, rate: float) -> int:
    """Replaces the root qdisc of every egress of the link by `variant`'s (module docstring); returns the
    bytes its processes' (send-side) bucket passes at once, for the link test (`emulate.measure`'s burst;
    0 for an unshaped link)."""
    b = max(32 * 1024, int(rate / 8 * 250e-6))
    send_bucket = {"none": 0, "base": emulate._burst(rate), "tbfburst": max(256 * 1024, int(rate / 8 * 2e-3))}
    for ns, dev, proc_side in _egresses(cl):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        _sh("ip", "-n", ns, "link", "set", dev, "gso_max_size", "65536")
        if variant == "none" or (variant == "sendonly" and not proc_side):
            continue
        if variant in ("base", "base32k"):  # the emulator's queue limit (= latency 100ms above ~5 Mbit/s)
            send = emulate._burst(rate) if variant == "base" else b  # base32k: the send bucket of `tbf`
            burst = send if proc_side else emulate._receive_burst(rate)
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit", "burst",
                str(burst), "limit", str(emulate._queue_bytes(rate, burst)))
            continue
        if variant in ("tbf", "sendonly"):
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(rate, b))
        elif variant == "rxburst":
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                *_tbf(rate, b if proc_side else max(256 * 1024, int(rate / 8 * 2e-3))))
        elif variant == "rx1ms":
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                *_tbf(rate, b if proc_side else max(64 * 1024, int(rate / 8 * 1e-3))))
        elif variant == "tbf5ms":
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(rate, b, "5ms"))
        elif variant == "tbfburst":
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(rate, max(256 * 1024, int(rate / 8 * 2e-3))))
        elif variant == "nogso":
            _sh("ip", "-n", ns, "link", "set", dev, "gso_max_size", "1500")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(rate, b))
        elif variant == "ackbypass":
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
            _sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
                "rate", "100gbit", "burst", "1mb")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", *_tbf(rate, b))
            # IPv4 total length < 128 bytes -> flowid 1:0 = htb's direct queue (unshaped, dequeued first)
            _sh("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:0")
        else:
            raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return send_bucket.get(variant, b)


def _connect(cl: emulate.Cluster, sockopt: str) -> tuple[socket.socket, socket.socket]:
    srv = emulate._in_netns(cl.names[1], lambda: socket.create_server((cl.addrs[1], 0)))
    a = emulate._in_netns(cl.names[0], socket.socket)
    for s in (a, srv):
        if sockopt == "bufs4m":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    a.connect((cl.addrs[1], srv.getsockname()[1]))
    b, _ = srv.accept()
    srv.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0 if sockopt == "delay" else 1)
        s.setblocking(False)
    return a, b


def _side(sock, send_n, recv_n, payload, buf, quickack):
    """Sends `send_n` bytes and receives `recv_n` bytes at once (non-blocking, one selector)."""
    sent = got = 0
    view = memoryview(payload)
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while sent < send_n or got < recv_n:
            ev = (selectors.EVENT_READ if got < recv_n else 0) | (selectors.EVENT_WRITE if sent < send_n else 0)
            sel.modify(sock, ev)
            for _, mask in sel.select(timeout=5.0) or [(None, 0)]:
                if mask & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(view[sent:send_n])
                    except BlockingIOError:
                        pass
                if mask & selectors.EVENT_READ:
                    try:
                        n = sock.recv_into(buf, min(len(buf), recv_n - got))
                    except BlockingIOError:
                        n = -1
                    if n == 0:
                        raise ConnectionError("peer closed")
                    got += max(n, 0)
                    if quickack:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            if not sel.get_map():
                break
    return time.perf_counter()


def exchange(a, b, size: int, mode: str, reps: int, gap: float, quickack: bool) -> list[float]:
    """`reps` timed exchanges (seconds) of `size` bytes, `mode` oneway / bidir, `gap` s idle before each."""
    payload = b"\x5a" * size
    bufs = [bytearray(1 << 20), bytearray(1 << 20)]
    out = []
    for _ in range(reps):
        time.sleep(gap)
        ends = [0.0, 0.0]
        bar = threading.Barrier(3)

        def run(i, bar=bar, ends=ends):
            bar.wait()
            if mode == "bidir":
                ends[i] = _side((a, b)[i], size, size, payload, bufs[i], quickack)
            elif i == 0:  # oneway: 0 sends SIZE, waits for 1 byte
                ends[i] = _side(a, size, 1, payload, bufs[i], quickack)
            else:
                _side(b, 0, size, payload, bufs[i], quickack)
                ends[i] = _side(b, 1, 0, payload, bufs[i], quickack)

        ts = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in ts:
            t.start()
        bar.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        out.append(max(ends) - t0)
    return out


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _fit(points):
    """Least squares t = alpha + size / r over (size bytes, median s) points -> (alpha s, r bytes/s)."""
    n = len(points)
    if n < 2:
        return float("nan"), float("nan")
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my - slope * mx, 1 / slope


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--variants", default="tbf,ackbypass,nogso,sendonly,tbf5ms,tbfburst,none")
    p.add_argument("--sockopts", default="nodelay")
    p.add_argument("--sizes", default="4K,64K,256K,1M,4M")
    p.add_argument("--modes", default="oneway,bidir")
    p.add_argument("--gaps", default="0.005", help="idle seconds before each exchange, comma-separated")
    p.add_argument("--reps", type=int, default=15, help="timed exchanges per case per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rt-prio", type=int, default=50)
    p.add_argument("--out", default="runs/link_latency")
    args = p.parse_args(argv)
    rate = emulate.parse_rate(args.rate)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; choose from {VARIANTS}")
    sockopts = args.sockopts.split(",")
    sizes = [_size(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    gaps = [float(g) for g in args.gaps.split(",")]
    if args.rt_prio:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_prio))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples: dict = {}
    rates: dict = {}
    run = run_record(__spec__.name, argv)
    env = {"uname": " ".join(os.uname()), "cpus": os.cpu_count(), "load_before": os.getloadavg(),
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": argv or __import__("sys").argv[1:]}
    with emulate.Cluster(2, emulate.LinkSpec.parse(args.rate)) as cl:
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for v in order:
                bucket = apply_variant(cl, v, rate)
                r = emulate.measure(cl.names[0], cl.names[1], cl.addrs[1], rate, seconds=0.3, burst=bucket)
                rates.setdefault(v, []).append(r)
                for so in sockopts:
                    a, b = _connect(cl, so)
                    try:
                        exchange(a, b, 64 << 10, "bidir", 3, 0.0, so == "quickack")  # warm the connection
                        for mode in modes:
                            for gap in gaps:
                                for size in sizes:
                                    ts = exchange(a, b, size, mode, args.reps, gap, so == "quickack")
                                    samples.setdefault((v, so, mode, gap, size), []).extend(ts)
                    finally:
                        a.close()
                        b.close()
                print(f"round {rnd} {v}: bulk {r / 1e6:.0f} Mbit/s, load {os.getloadavg()[0]:.1f}", flush=True)
    env["load_after"] = os.getloadavg()
    rows = []
    for (v, so, mode, gap, size), ts in samples.items():
        bulk = statistics.median(rates[v])
        ideal = size * 8 / bulk
        med = statistics.median(ts)
        rows.append({"variant": v, "sockopt": so, "mode": mode, "gap_s": gap, "size": size, "n": len(ts),
                     "median_ms": med * 1e3, "p10_ms": _pct(ts, 0.1) * 1e3, "p90_ms": _pct(ts, 0.9) * 1e3,
                     "ideal_ms": ideal * 1e3, "excess_ms": (med - ideal) * 1e3,
                     "bulk_mbit": bulk / 1e6, "bulk_vs_requested": bulk / rate})
    fits = []
    for key in sorted({(r["variant"], r["sockopt"], r["mode"], r["gap_s"]) for r in rows}):
        pts = [(r["size"], r["median_ms"] / 1e3) for r in rows
               if (r["variant"], r["sockopt"], r["mode"], r["gap_s"]) == key]
        alpha, reff = _fit(pts)
        fits.append({"variant": key[0], "sockopt": key[1], "mode": key[2], "gap_s": key[3],
                     "alpha_ms": alpha * 1e3, "r_eff_mbit": reff * 8 / 1e6})
    doc = {"schema": "taco_jax.link_latency/1", "run": run, "env": env, "rate_bit_per_s": rate,
           "bulk_bit_per_s": rates, "rows": rows, "fits": fits}
    (out / "link_latency.json").write_text(json.dumps(doc, indent=1))
    md = [f"rate {args.rate}; load {env['load_before'][0]:.1f} -> {env['load_after'][0]:.1f} (1-min avg); "
          f"{env['uname']}; {env['utc']}", "",
          "| variant | sockopt | mode | gap ms | size | n | median ms | p10 | p90 | ideal ms | excess ms "
          "| bulk Mbit/s (÷ req) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mode"], r["gap_s"], r["size"], variants.index(r["variant"]), r["sockopt"])):
        md.append(f"| {r['variant']} | {r['sockopt']} | {r['mode']} | {r['gap_s'] * 1e3:g} | {r['size'] >> 10} KB | "
                  f"{r['n']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | {r['ideal_ms']:.2f} | "
                  f"{r['excess_ms']:+.2f} | {r['bulk_mbit']:.0f} ({r['bulk_vs_requested']:.3f}) |")
    md += ["", "| variant | sockopt | mode | gap ms | fitted α ms | fitted R_eff Mbit/s |", "|---|---|---|---|---|---|"]
    for f in fits:
        md.append(f"| {f['variant']} | {f['sockopt']} | {f['mode']} | {f['gap_s'] * 1e3:g} | {f['alpha_ms']:.2f} | "
                  f"{f['r_eff_mbit']:.0f} |")
    (out / "link_latency.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
