"""The text lines and Markdown of a `train.plan` result (`taco-jax plan` / `predict`): `lines`, `overlap_lines`,
`markdown`, and `paper_lines` for `plan.paper_table()`. Walkthrough: docs/plan.md."""

from __future__ import annotations

from taco_jax.train import deviceless
from taco_jax.train.plan import nothing_to_bound
from taco_jax.util.console import format_bytes


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _bytes(n) -> str:
    return "never" if n is None else format_bytes(n)


def _ms(s) -> str:
    return f"{s * 1e3:,.1f} ms"


def _tokens_per_s(v) -> str:
    return f"{v / 1e3:,.1f}k tok/s" if v >= 1e4 else f"{v:,.0f} tok/s"


#: Columns of `paper_lines`: (header, width, format of a row's value).
_PAPER_COLUMNS = (("TP share", 8, lambda r: f"{r['tp_comm_fraction']:.2f}"),
                  ("TACO TP", 7, lambda r: f"{r['taco_tp']:.2f}x"),
                  ("range", 12, lambda r: f"{r['range'][0]:.2f}-{r['range'][1]:.2f}x"),
                  ("TACO TP+DP+PP", 13, lambda r: f"{r['taco_tp+dp+pp']:.2f}x"))


def paper_lines(rows: list[dict]) -> list[str]:
    """`paper_table()`'s rows as a text table: a header naming each column, then one aligned line per row (setting, TP
    link, TP share of the exact step, TACO TP speedup with its range, TACO TP+DP+PP speedup, the published figure)."""
    ws = max(len(r["setting"]) for r in rows), max(len(r["tp_link"]) for r in rows)
    head = [f"{'setting':{ws[0]}s}", f"{'TP link':{ws[1]}s}", *(f"{h:>{w}s}" for h, w, _ in _PAPER_COLUMNS),
            "published"]
    out = ["  ".join(head)]
    for r in rows:
        cells = [f"{r['setting']:{ws[0]}s}", f"{r['tp_link']:{ws[1]}s}",
                 *(f"{fmt(r):>{w}s}" for _, w, fmt in _PAPER_COLUMNS), str(r["published"])]
        out.append("  ".join(cells))
    return out


def _microbatches(n: int) -> str:
    return f"{n} microbatch" + ("es" if n != 1 else "")


def _codec_source_full(hw: dict) -> str:
    """The codec speed's status and its whole source, the status said once ("assumed: the H200 ...")."""
    status, source = hw["codec"]["status"], hw["sources"]["codec"]
    return source if source.startswith(status) else f"{status}: {source}"


def _codec_source(hw: dict) -> str:
    """The codec speed's status and where it comes from, short: the first clause of its source
    (e.g. "measured on an H200"); the whole source is in plan.md."""
    source = hw.get("sources", {}).get("codec", "")
    short = source.split(" (")[0].split(";")[0].strip()
    status = hw["codec"]["status"]
    return f"{status}: {short}" if short and not short.startswith(status) else (short or status)


def lines(result: dict) -> list[str]:
    """The plan as short text lines (the terminal table; plan.md holds the same in Markdown)."""
    p = result["predict"]
    hw, lay = p["hardware"], p["layout"]
    r = p["range"]
    n = p["n_params"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    L = [f"{p['model']} ({size} parameters, {p['n_layers']} layers) on {lay['gpus']} x "
         f"{hw['name']}: tensor={lay['tp']} data={lay['dp']} stage={lay['pp']}, microbatch {lay['micro_batch']} x "
         f"{lay['seq_len']} tokens, {lay['n_micro']} microbatch{'es' if lay['n_micro'] != 1 else ''}"]
    codec = hw["codec"]
    L.append(f"links: tensor {p['links']['tensor']} (TP over {lay['tp_span_nodes']} node(s)), data "
             f"{p['links']['data']}, stage {p['links']['stage']}; codec {codec['encode_GBps']:,.0f}/"
             f"{codec['decode_GBps']:,.0f} GB/s encode/decode ({_codec_source(hw)})")
    me = p.get("memory")
    if me and not result.get("compiled"):  # a compile prints its own, from the exact shapes
        lo, hi = me["ratio"]
        L.append(f"memory per device, estimate without compiling: {_mib(me['total'])} = FP32 parameters, gradients "
                 f"and Adam state {_mib(me['state'])} + saved activations {_mib(me['activations'])}; rough: XLA:GPU's "
                 f"peak was {lo:.1f}-{hi:.1f}x this on 12 compiled configurations (plan --compiler gpu gives the peak)")
    c = result.get("compiled")
    if c:
        m, est = c["memory"], c["memory"]["estimate"]
        xla = (f"peak {_mib(m.get('peak'))} = arguments {_mib(m.get('argument'))} + outputs {_mib(m.get('output'))} "
               f"- aliased {_mib(m.get('alias'))} + temporaries {_mib(m.get('temp'))}" if m["analysis"] else
               "not available (the backend gave no memory analysis)")
        gpu = (f"parameters + optimizer state + FP32 gradients {_mib(m['params'] * 2 + m['opt_state'])} + activations "
               f"{_mib(est['activations'])} ({est['layers']} layers x {_microbatches(est['in_flight'])} in flight x "
               f"{_mib(est['per_layer'])}, --remat {est['remat']}) = {_mib(est['total'])}")
        args = (f"parameters {_mib(m['params'])}, optimizer state {_mib(m['opt_state'])}, batch {_mib(m['batch'])}")
        if c["platform"] == "cpu":  # XLA:CPU's temporaries are not a GPU's activations (docs/plan.md)
            L.append(f"memory per device, GPU estimate: {gpu}; rough (what is kept between layers; XLA:GPU's peak "
                     "was up to 7.8x it, docs/plan.md; --compiler gpu gives it)")
            L.append(f"  arguments (exact shapes, any backend): {args}")
            L.append(f"  XLA:CPU's analysis of this compile, not a GPU's (its temporaries hold no GPU schedule): {xla}")
        else:
            L.append(f"memory per device ({c['platform']}, XLA memory analysis): {xla}")
            L.append(f"  arguments: {args}; activations and scratch: the temporaries")
            L.append(f"  estimate: {gpu}")
        if c.get("extrapolated"):
            x = c["extrapolated"]
            (l1, p1), (l2, p2) = sorted((int(k), v) for k, v in x["from"].items())
            L.append(f"  compiled at {l1} and {l2} layers (peaks {_mib(p1)}, {_mib(p2)}; the rest of this report is "
                     f"the {l2}-layer copy's): peak at {x['layers']} layers extrapolated to {_mib(x['peak'])}")
        if c.get("verdict"):
            L.extend(deviceless.verdict_lines(c["verdict"], hw["name"]))
        L.append(f"compile: {c['compile_s']:.1f} s on {c['devices']} {c['platform']} devices")
        L.append("wire bytes per step and device, by axis: " + ", ".join(
            f"{a} {_bytes(b)}" for a, b in sorted(c["wire"]["by_axis"].items())) + "; as issued (bf16 as bf16, "
            "what a GPU sends): " + ", ".join(f"{a} {_bytes(b)}" for a, b in sorted(c["wire_issued"].items())))
        L.append(f"{'axis':8s} {'site':15s} {'collectives':>11s} {'compressed':>10s} {'bytes/step':>12s}  "
                 f"{'wire dtypes':14s} codec kernels (scoped ops)")
        for s in c["by_site"]:
            k = c["codec"].get(s["site"], {})
            kern = ", ".join(f"{v} {n}" for n, v in sorted(k.get("kernel_calls", {}).items())) or "-"
            ops = sum(k.get("scoped_ops", {}).values())
            L.append(f"{s['axis']:8s} {s['site'] or '(model)':15s} {s['collectives']:11d} {s['compressed']:10d} "
                     f"{_bytes(s['bytes']):>12s}  {','.join(s['dtypes']):14s} {kern}" + (f" ({ops})" if ops else ""))
        if c.get("overlap"):
            L.extend(overlap_lines(c["overlap"]))
        if c["mismatches"]:
            for x in c["mismatches"]:
                L.append(f"WARNING: {x['count']} {x['op']} on {x['axis']} at {x['site']} move {x['dtype']}; declared "
                         f"{x['declared']}")
        else:
            L.append("wire dtypes: every site moves what its policy declares")
    e, t = p["exact"], p["policy"]
    L.append(f"cost model on {hw['name']}, per step:")
    L.append(f"  {'':26s} {'exact':>13s} {'policy':>13s}")
    for k, name in (("step_s", "step time"), ("compute_s", "compute"), ("tensor_s", "tensor axis"),
                    ("data_s", "data axis"), ("stage_s", "stage axis")):
        L.append(f"  {name:26s} {_ms(e[k]):>13s} {_ms(t[k]):>13s}")
    L.append(f"  {'throughput':26s} {_tokens_per_s(e['tokens_per_s']):>13s} {_tokens_per_s(t['tokens_per_s']):>13s}")
    if (x := (result.get("compiled") or {}).get("xla_schedule")):  # the compiled program is the policy's
        L.append(f"  {'XLA:GPU scheduler':26s} {'-':>13s} {_ms(x['step_s']):>13s}  (its own estimate of this compile: "
                 f"{_ms(x['waiting_s'])} of it waiting on collectives; no autotuning, docs/plan.md)")
    if nothing := nothing_to_bound(p):
        L.append(f"predicted speedup 1.00x: {nothing[0]}; {_steps(p)}")
        threshold = nothing[1]
    else:
        L.append(f"predicted speedup {p['speedup']:.2f}x, range {r['all'][0]:.2f}-{r['all'][1]:.2f}x (emulated "
                 f"cluster {r['emulated'][0]:.2f}-{r['emulated'][1]:.2f}x; COCCL on 32 H800 "
                 f"{r['coccl'][0]:.2f}-{r['coccl'][1]:.2f}x); {_steps(p)}")
        threshold = _bytes(p["auto_threshold_bytes"])
    if best := _best_exact(p):
        L.append(best)
    L.append(f"--min-bytes auto on this hardware: threshold {threshold}" + "".join("; " + x for x in (
        f"{s['site']} {_bytes(s['message_bytes'])} (break-even {_bytes(s['break_even_bytes'])}) -> {s['auto']}"
        for s in p["sites"])))
    return L


def overlap_lines(rows: list[dict]) -> list[str]:
    """`compiled_report`'s "overlap" (async collectives of a GPU schedule, per site) as plan's lines."""
    total = sum(r["bytes"] for r in rows if r["site"])
    over = sum(r["overlapped_bytes"] for r in rows if r["site"])
    L = [f"overlap in the GPU schedule (async collectives with work between start and done): "
         f"{over / total:.0%} of the sites' bytes" if total else "overlap in the GPU schedule:"]
    for r in rows:
        what = ", ".join(f"{k} {v}" for k, v in sorted(r["between"].items())) or "nothing"
        L.append(f"  {r['axis']:8s} {r['site'] or '(model)':15s} {r['overlapped']}/{r['collectives']} overlapped "
                 f"({r['sync']} synchronous), {r['overlapped_frac']:.0%} of {_bytes(r['bytes'])}; between: {what}")
    return L


def _steps(p: dict) -> str:
    """The step times a speedup divides: the exact step, and the policy's where it differs."""
    e, t = p["exact"]["step_s"], p["policy"]["step_s"]
    return f"exact step {_ms(e)}" + (f", with the policy {_ms(t)}" if p["compressed_sites"] else "")


def _best_exact(p: dict) -> str | None:
    """The line on `best_exact_layout`: the fastest exact layout of the same GPUs and how much faster
    than this layout's exact step (and policy step) it is; None without one."""
    b = p.get("best_exact")
    if not b:
        return None
    rule = (f"of these {p['layout']['gpus']} GPUs (tensor inside a node; tensor x stage >= {b['min_split']} as here, "
            "so no device holds more of the layers; memory not checked otherwise)")
    e, t = p["exact"]["step_s"], p["policy"]["step_s"]
    if b["step_s"] >= e * (1 - 1e-9):
        return f"layout: this layout's exact step is the cost model's fastest {rule}"
    policy = f", with the policy {t / b['step_s']:.2f}x" if p["compressed_sites"] else ""
    return (f"layout: the cost model's fastest exact layout {rule} is --mesh {b['mesh']} --microbatches "
            f"{b['microbatches']} at {_ms(b['step_s'])} a step; this layout's exact step is {e / b['step_s']:.2f}x "
            f"that{policy}")


def markdown(result: dict) -> str:
    """plan.md: the plan's tables with what each number means (docs/plan.md)."""
    p = result["predict"]
    hw = p["hardware"]
    L = ["# Plan: " + lines(result)[0], "", "Hardware: " + ", ".join([
        f"{hw['name']} ({hw['peak_tflops']:,.0f} TFLOP/s BF16, MFU {hw['mfu']})",
        f"{hw['gpus_per_node']} GPUs per node", f"intra {hw['intra']['name']} {hw['intra']['GBps']:,.0f} GB/s achieved",
        f"inter {hw['inter']['name']} {hw['inter']['GBps']:,.0f} GB/s achieved",
        f"codec {_codec_source_full(hw)}"]) + ".", ""]
    c = result.get("compiled")
    if c:
        m = c["memory"]
        cpu = c["platform"] == "cpu"
        L += ["## Memory per device (XLA memory analysis of the compiled step on "
              f"{c['devices']} {c['platform']} devices)", "",
              *(["XLA:CPU's buffer assignment, not a GPU's: its temporaries follow no GPU schedule and hardly move "
                 "with `--remat`; the arguments are exact on any backend. The GPU estimate follows the table.", ""]
                if cpu else []),
              "| part | bytes |", "|---|---|"]
        L += [f"| {k} | {_mib(m.get(v))} |" for k, v in (
            ("parameters", "params"), ("optimizer state", "opt_state"), ("batch", "batch"),
            ("arguments (all of the above)", "argument"), ("outputs", "output"), ("aliased (donated)", "alias"),
            ("temporaries (activations, scratch)", "temp"), ("peak = arguments + outputs - aliased + temporaries",
                                                           "peak"))]
        est = m["estimate"]
        L += ["", f"Estimate for a GPU (Korthikanti et al. 2022; docs/plan.md): activations {_mib(est['activations'])} "
              f"({est['layers']} layers × {_microbatches(est['in_flight'])} in flight × {_mib(est['per_layer'])}, "
              f"`--remat {est['remat']}`) + parameters, optimizer state, batch and FP32 gradients = "
              f"**{_mib(est['total'])}** per device."]
        L += ["", f"Compile: {c['compile_s']:.1f} s.", "", "## Communication per step and device (compiled HLO)", "",
              "| axis | site | collectives | compressed | bytes | wire dtypes | codec kernels | scoped codec ops |",
              "|---|---|---|---|---|---|---|---|"]
        for s in c["by_site"]:
            k = c["codec"].get(s["site"], {})
            kern = ", ".join(f"{v} {n}" for n, v in sorted(k.get("kernel_calls", {}).items())) or "-"
            ops = sum(k.get("scoped_ops", {}).values())
            L.append(f"| {s['axis']} | {s['site'] or '(model)'} | {s['collectives']} | {s['compressed']} | "
                     f"{_bytes(s['bytes'])} | {', '.join(s['dtypes'])} | {kern} | {ops} |")
        L += ["", "By axis: " + ", ".join(f"{a} {_bytes(b)}" for a, b in sorted(c["wire"]["by_axis"].items())) +
              "; as the program issues them (before XLA:CPU widens bf16 collectives to f32; what a GPU sends): " +
              ", ".join(f"{a} {_bytes(b)}" for a, b in sorted(c["wire_issued"].items())) + ".", ""]
        L += [f"**Wire dtype mismatch**: {x['count']} {x['op']} on {x['axis']} at site {x['site']} move {x['dtype']}; "
              f"declared {x['declared']}." for x in c["mismatches"]] or ["Every site moves the wire dtype its "
                                                                         "policy declares."]
        L.append("")
    e, t, r = p["exact"], p["policy"], p["range"]
    L += [f"## Cost model on {hw['name']}", "", "| per step | exact | policy |", "|---|---|---|"]
    L += [f"| {n} | {_ms(e[k])} | {_ms(t[k])} |" for k, n in (
        ("step_s", "step"), ("compute_s", "compute"), ("tensor_s", "tensor axis"), ("data_s", "data axis"),
        ("stage_s", "stage axis"))]
    L.append(f"| throughput | {_tokens_per_s(e['tokens_per_s'])} | {_tokens_per_s(t['tokens_per_s'])} |")
    if nothing := nothing_to_bound(p):
        L += ["", f"Predicted speedup **1.00×**: {nothing[0]}; {_steps(p)}.", "",
              f"`--min-bytes auto` here: threshold {nothing[1]}.", ""]
    else:
        L += ["", f"Predicted speedup **{p['speedup']:.2f}×**, range {r['all'][0]:.2f}–{r['all'][1]:.2f}× "
              f"(emulated cluster {r['emulated'][0]:.2f}–{r['emulated'][1]:.2f}×, {p['errors']['emulated']['points']} "
              f"points; COCCL's 32 H800 {r['coccl'][0]:.2f}–{r['coccl'][1]:.2f}×, {p['errors']['coccl']['points']} "
              f"settings); {_steps(p)}. With only the sites predicted to gain "
              f"({', '.join(p['auto_sites']) or 'none'}): {p['auto_speedup']:.2f}×.", "",
              f"`--min-bytes auto` here: threshold {_bytes(p['auto_threshold_bytes'])}.", ""]
    if best := _best_exact(p):
        L += [best[0].upper() + best[1:] + ".", ""]
    L += ["| site | axis | op | message | break-even | --min-bytes auto |", "|---|---|---|---|---|---|"]
    L += [f"| {s['site']} | {s['axis']} | {s['op']} | {_bytes(s['message_bytes'])} | {_bytes(s['break_even_bytes'])} "
          f"| {s['auto']} |" for s in p["sites"]]
    return "\n".join(L) + "\n"
