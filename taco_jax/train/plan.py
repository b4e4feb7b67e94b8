"""`taco-jax plan` and `taco-jax predict`: what a training run will need and gain, before any GPU is booked.

`plan(cfg, spec)` builds the run's trainer, takes the parameter and optimizer-state shapes from `jax.eval_shape` of
its init (nothing is allocated), lowers and compiles the real train step on abstract inputs (`jax.ShapeDtypeStruct`s
carrying the mesh shardings), and reads off the compiled program:
- per-device memory (XLA's `memory_analysis()`: arguments, outputs, temporaries; the arguments split
  into parameters, optimizer state and batch from their shapes and shardings);
- wire bytes per step by mesh axis (`collectives.hlo.collective_bytes`, as a run's summary.json)
  and by communication site (`collectives.hlo.collectives`: the `site_scope` in each op_name);
- the codec kernels and compressed collectives per site, and every collective whose wire dtype is not the one the
  policy declares (a compressing site must move 1-byte codes; an exact one its float messages);
- compile time. `predict(cfg, spec)` is the cost model alone (`perf.model.step_time`, < 1 s): step time exact vs the
policy per mesh axis on the named hardware, the speedup with its error bars (`perf.uncertainty`), and the per-site
choice of `--min-bytes auto` there. `plan` includes it. `paper_table()` is the model's GPU table of
docs/emulated.md. The text and Markdown of a result: `train.plan_report`. Walkthrough: docs/plan.md."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import tempfile
import time

from taco_jax.collectives.policy import SITES, CommPolicy
from taco_jax.perf import hardware as hwt
from taco_jax.perf import model, uncertainty
from taco_jax.perf.hardware import HardwareSpec, with_tp_span
from taco_jax.train import deviceless
from taco_jax.train.comm_flags import AXIS_SITES
from taco_jax.train.config import TrainConfig
from taco_jax.util.console import format_bytes

#: Element types of compressed wire buffers in compiled HLO (codes and scales travel as bytes).
CODE_DTYPES = ("u8", "s8")
#: Element types of uncompressed messages (u16: a bf16 / f16 message bit-cast for the wire).
FLOAT_DTYPES = ("f16", "bf16", "f32", "f64", "u16")
_AXIS_OF_SITE = {s: a for a, sites in AXIS_SITES.items() for s in sites}
_OP = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "send": "send"}
PLAN_FORMAT = "taco_jax.plan/1"


def with_layers(cfg: TrainConfig, layers: int | None) -> TrainConfig:
    """`cfg` whose model has `layers` decoder layers (None: unchanged); the pipeline layout is
    checked again. Raises ValueError naming a bad depth."""
    if layers is None:
        return cfg
    if not (isinstance(layers, int) and layers >= 1):
        raise ValueError(f"layers={layers!r} must be an integer >= 1")
    from taco_jax.parallel.mesh import STAGE
    from taco_jax.parallel.pipeline import check_pipeline

    mc = cfg.model_config
    new = dataclasses.replace(mc, **{mc.DEPTH_FIELD: layers})
    check_pipeline(layers, cfg.parallelism.axes.get(STAGE, 1), cfg.parallelism.microbatches, cfg.parallelism.schedule)
    cfg.__dict__["model_config"] = new  # the cached model of this config (a frozen dataclass)
    return cfg


def layout_of(cfg: TrainConfig, axes: dict | None = None, microbatches: int | None = None) -> model.Layout:
    """The cost model's `Layout` of a run: tensor / data / stage sizes of its mesh (or of `axes`), microbatch size
    batch / (data · microbatches) (the run's count, or `microbatches`), its sequence length, microbatch count,
    sequence parallelism, and the compute dtype's bytes on the TP / PP wire (FP32 gradients on the DP wire)."""
    import numpy as np

    axes = cfg.parallelism.axes if axes is None else axes
    dp, micro = axes.get("data", 1), microbatches or cfg.parallelism.microbatches
    return model.Layout(tp=axes.get("tensor", 1), dp=dp, pp=axes.get("stage", 1),
                        micro_batch=cfg.data.batch_size // (dp * micro), seq_len=cfg.data.seq_len, n_micro=micro,
                        sequence_parallel=cfg.parallelism.sequence_parallel,
                        act_bytes=np.dtype(cfg.model_config.dtype).itemsize, grad_bytes=4)


def _site_rows(cfg, layout: model.Layout, hw: model.Hardware, policy: CommPolicy) -> tuple[list[dict], int | None]:
    """Per running site: its collective, message (as `CommPolicy.codec_for` measures it), link, break-even size on
    that link (for the site's codec; TACO where the site is declared exact) and what `--min-bytes auto` does there:
    one threshold, the largest break-even of the running compressed tensor sites (`perf.calibration.auto_threshold`,
    as a run resolves it), applied to every site. Returns (rows, threshold bytes; None: compression never pays)."""
    from taco_jax.codec import TACO
    from taco_jax.perf.calibration import auto_threshold

    lk = model.links(layout, hw)
    link_of = {"data": lk["dp"], "stage": lk["pp"], "tensor": lk["tp"]}
    msgs = model.site_messages(cfg, layout)
    threshold = auto_threshold(policy, hw, layout.tp, itemsize=layout.act_bytes,
                               sequence_parallel=layout.sequence_parallel)
    rows = []
    for site in SITES:
        if site not in msgs:
            continue
        op, nbytes, p, count, per = msgs[site]
        if p == 1 and op != "send":  # an axis of size 1: the site moves nothing
            continue
        codec = getattr(policy, site)
        candidate = codec if codec.kind != "none" else TACO
        item = layout.grad_bytes if site == "dp_grads" else layout.act_bytes
        link = link_of[_AXIS_OF_SITE[site]]
        be = model.break_even_bytes(op, p, link, candidate, hw.codec_speed(candidate), itemsize=item)
        shard = p if site == "all_gather" else 1  # the all-gather's message is the local shard
        if codec.kind == "none":
            auto = "exact (declared)"
        elif threshold >= model.NEVER:
            auto = "exact (never pays)"
        else:
            auto = "compress" if nbytes / shard >= threshold else "exact (below threshold)"
        rows.append({"site": site, "axis": _AXIS_OF_SITE[site], "op": _OP[op], "ranks": p,
                     "message_bytes": int(nbytes / shard), "count": count, "per": per, "link": link.name,
                     "declared": codec.name, "break_even_bytes": None if be >= model.NEVER else int(be / shard),
                     "site_gains": be < model.NEVER and nbytes >= be, "auto": auto})
    return rows, None if threshold >= model.NEVER else int(threshold)


def activation_estimate(cfg: TrainConfig) -> dict:
    """Bytes of activations one device keeps for the backward pass, estimated as on a GPU (what
    XLA:CPU's temporaries do not show: they hardly change with `--remat`; docs/plan.md).

    Per layer and microbatch, 16-bit activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", Table 2; s tokens, b sequences, h hidden, a heads, t tensor ranks): `--remat none` s·b·h·(10 +
    24/t + 5·a·s/(h·t)), with sequence parallelism s·b·h·(34/t + 5·a·s/(h·t)); `block` (matmul outputs kept, attention
    recomputed, their "selective" recomputation) the same without the 5·a·s/(h·t) term; `full` (layer input kept)
    2·s·b·h (/t with sequence parallelism). Times the stage's layers and the microbatches in flight (GPipe: all m; 1F1B:
    min(m, stages)). The formula is for a GPT layer with dropout: an upper estimate for these models (no dropout; GQA
    and SwiGLU shift the constants). Returns {"per_layer", "layers", "in_flight", "activations" (bytes), "remat"}."""
    axes = cfg.parallelism.axes
    mc = cfg.model_config
    t, pp, dp, m = axes.get("tensor", 1), axes.get("stage", 1), axes.get("data", 1), cfg.parallelism.microbatches
    s, b, h, a = cfg.data.seq_len, cfg.data.batch_size // (dp * m), mc.d_model, getattr(mc, mc.HEADS_FIELD)
    attn = 5 * a * s / (h * t)
    if mc.remat == "full":
        per = 2 * s * b * h / (t if cfg.parallelism.sequence_parallel else 1)
    else:
        base = 34 / t if cfg.parallelism.sequence_parallel else 10 + 24 / t
        per = s * b * h * (base + (attn if mc.remat == "none" else 0))
    layers = -(-mc.n_layers // pp)
    in_flight = m if cfg.parallelism.schedule == "gpipe" else min(m, pp)
    return {"per_layer": int(per), "layers": layers, "in_flight": in_flight,
            "activations": int(per * layers * in_flight), "remat": mc.remat}


#: XLA:GPU's peak per device over `memory_estimate`, lowest and highest on the compiles of docs/plan.md "How far the
#: estimate is from the compiler". Not a bound either way (one layer's transients and XLA:GPU's schedule are not in it).
ESTIMATE_RATIO = (0.9, 7.8)


def memory_estimate(cfg: TrainConfig) -> dict:
    """Per-device bytes a run keeps, without compiling: "state" = 16 bytes per parameter of the device's
    share (FP32 parameters and gradients, Adam's two FP32 moments; n_params / (tensor x stage)) plus
    `activation_estimate`'s saved activations = "total"; "ratio": `ESTIMATE_RATIO`, XLA:GPU's peak over
    it on the compiled configurations (lowest, highest)."""
    axes = cfg.parallelism.axes
    state = 16 * cfg.model_config.n_params() / (axes.get("tensor", 1) * axes.get("stage", 1))
    act = activation_estimate(cfg)
    return {"state": int(state), "activations": act["activations"], "total": int(state + act["activations"]),
            "ratio": list(ESTIMATE_RATIO)}


def resolve_policy(policy: CommPolicy, layout: model.Layout, hw: model.Hardware) -> CommPolicy:
    """`policy` with min_bytes "auto" replaced by the break-even size on `hw`: the resolver of a GPU run
    (`perf.resolve_min_bytes` on platform "cuda" with `hardware=hw`, `perf.calibration.auto_threshold`)."""
    from taco_jax.perf.calibration import resolve_min_bytes

    return resolve_min_bytes(policy, "cuda", tensor_size=layout.tp, itemsize=layout.act_bytes,
                             sequence_parallel=layout.sequence_parallel, hardware=hw)


def best_exact_layout(cfg: TrainConfig, spec: HardwareSpec) -> dict | None:
    """The fastest exact layout of the run's GPUs in the cost model (`model.step_time`, no policy): tensor × data ×
    stage = the run's GPU count, tensor inside a node (`with_tp_span`), tensor × stage at least the run's (memory is not
    otherwise checked), every microbatch count the batch and pipeline allow, each split checked as a run checks it
    (`check_tensor_parallel`, `check_pipeline`). Returns {"mesh", "microbatches", "step_s", "tokens_per_s", "min_split"
    (tensor × stage of the run)}, or None when the run has one GPU or no layout qualifies."""
    from taco_jax.parallel.schedule_math import check_pipeline

    layout = layout_of(cfg)
    gpus, split, batch = layout.gpus, layout.tp * layout.pp, cfg.data.batch_size
    if gpus == 1:
        return None
    mcfg, node = cfg.model_config, spec.hardware.gpus_per_node
    best = None
    for tp in (t for t in range(1, min(node, gpus) + 1) if gpus % t == 0):
        try:
            hw = with_tp_span(spec.hardware, tp, None, gpus=gpus)
            mc = dataclasses.replace(mcfg, vocab_multiple=cfg.model.make_vocab_size_divisible_by * tp)
            mc.check_tensor_parallel(tp, seq_len=cfg.data.seq_len, sequence_parallel=layout.sequence_parallel)
        except ValueError:
            continue
        for pp in (q for q in range(1, gpus // tp + 1) if gpus // tp % q == 0 and tp * q >= split):
            dp = gpus // (tp * pp)
            for m in (k for k in range(1, batch // dp + 1) if batch % (dp * k) == 0):
                try:
                    check_pipeline(mc.n_layers, pp, m, cfg.parallelism.schedule)
                except ValueError:
                    continue
                t = model.step_time(mc, layout_of(cfg, {"data": dp, "stage": pp, "tensor": tp}, m), hw)
                key = (t["step_s"], pp, m, -tp)
                if best is None or key < best[0]:
                    mesh = ",".join(f"{a}={n}" for a, n in (("data", dp), ("stage", pp), ("tensor", tp)) if n > 1)
                    best = key, {"mesh": mesh, "microbatches": m, "step_s": t["step_s"],
                                 "tokens_per_s": t["tokens_per_s"], "min_split": split}
    return None if best is None else best[1]


def predict(cfg: TrainConfig, spec: HardwareSpec, *, tp_span_nodes: int | None = None) -> dict:
    """The cost model's prediction of one training step of `cfg` on `spec`'s hardware.

    TP ranks sit in one node while they fit (Megatron placement), or span `tp_span_nodes` nodes
    (`perf.hardware.with_tp_span`). Returns a JSON-ready dict: "hardware", "layout", "links" (per axis), "exact" and
    "policy" step times {"step_s", "compute_s", "tensor_s", "stage_s", "data_s", "tokens_per_s"} (per-axis times
    exposed), "speedup" with its "range" per error source (`perf.uncertainty.speedup_range`; None when no site of the
    mesh is compressed), "compressed_sites" (`model.compressed_sites`), "step_range_s", "errors", "sites"
    (`_site_rows`), "auto_threshold_bytes" (None when the policy declares no codec for a site of the mesh),
    "auto_speedup" (`model.auto_policy`) and "best_exact" (`best_exact_layout`). Raises ValueError for a layout the
    model cannot take (e.g. tp_span_nodes not dividing tp)."""
    layout = layout_of(cfg)
    hw = with_tp_span(spec.hardware, layout.tp, tp_span_nodes, gpus=layout.gpus)
    mcfg = cfg.model_config
    policy = resolve_policy(cfg.communication.policy, layout, hw)
    slots = layout.n_micro + layout.pp - 1

    def times(pol):
        t = model.step_time(mcfg, layout, hw, pol)
        return {"step_s": t["step_s"], "compute_s": slots * t["compute_s"], "tensor_s": slots * t["tp_s"],
                "stage_s": slots * t["pp_s"], "data_s": (1 - layout.dp_overlap) * t["dp_s"],
                "tokens_per_s": t["tokens_per_s"], "comm_fraction": t["comm_fraction"]}

    exact, comp = times(CommPolicy()), times(policy)
    speed = exact["step_s"] / comp["step_s"]
    errors = uncertainty.summary()
    lk = model.links(layout, hw)
    auto = model.auto_policy(mcfg, layout, hw, dataclasses.replace(policy, min_bytes=0))
    given = cfg.communication.policy
    sites, threshold = _site_rows(mcfg, layout, hw, given if given.min_bytes != "auto" else
                                  dataclasses.replace(given, min_bytes=0))
    result = {
        "hardware": spec.describe(),
        "layout": dataclasses.asdict(layout) | {"gpus": layout.gpus, "tp_span_nodes": tp_span_nodes
                                                or -(-layout.tp // spec.hardware.gpus_per_node)},
        "links": {"tensor": lk["tp"].name, "data": lk["dp"].name, "stage": lk["pp"].name},
        "model": cfg.model.name, "n_params": mcfg.n_params(), "n_layers": mcfg.n_layers,
        "policy_min_bytes": policy.min_bytes,
        "exact": exact, "policy": comp, "speedup": speed,
        "range": uncertainty.speedup_range(speed, errors),
        "step_range_s": {"exact": uncertainty.step_range(exact["step_s"], errors),
                         "policy": uncertainty.step_range(comp["step_s"], errors)},
        "errors": errors,
        "sites": sites, "auto_threshold_bytes": threshold,
        "auto_speedup": exact["step_s"] / model.step_time(mcfg, layout, hw, auto)["step_s"],
        "auto_sites": [s for s in SITES if getattr(auto, s).kind != "none"],
        "compressed_sites": model.compressed_sites(mcfg, layout, policy), "min_bytes_auto": given.min_bytes == "auto",
        "best_exact": best_exact_layout(cfg, spec),
        "memory": memory_estimate(cfg),
    }
    if nothing_to_bound(result):  # exact against exact: no speedup range
        result["range"] = None
        if not declares_codec(result):  # nor a threshold for --min-bytes auto to give
            result["auto_threshold_bytes"] = None
    return result


def declares_codec(p: dict) -> bool:
    """Whether the policy of the prediction `p` declares a codec for a site of its mesh."""
    return any(s["auto"] != "exact (declared)" for s in p["sites"])


def nothing_to_bound(p: dict) -> tuple[str, str] | None:
    """(why, threshold text) when the prediction `p` compares exact with exact: no site on the mesh (one
    device), no codec declared for one, or every declared one's messages below `--min-bytes` (given,
    or "auto" resolved on this hardware); None otherwise."""
    if not p["sites"]:
        return "no communication site on this mesh (nothing to compress)", "none (no site)"
    if not declares_codec(p):
        return ("this policy compresses no site of this mesh (--comm, --dp-comm, --pp-comm or a --policy choose "
                "codecs)", "none (no compressed site)")
    if p["compressed_sites"]:
        return None
    threshold = "never" if p["auto_threshold_bytes"] is None else format_bytes(p["auto_threshold_bytes"])
    if p["min_bytes_auto"]:
        why = ("compression never pays here" if p["auto_threshold_bytes"] is None else
               f"threshold {threshold}, above each message")
        return f"nothing is compressed (--min-bytes auto keeps every site exact on this hardware: {why})", threshold
    return (f"nothing is compressed (each message of a site with a codec is below --min-bytes "
            f"{p['policy_min_bytes']:,} bytes)", threshold)


# The compiled step
def abstract_state(trainer):
    """(params, opt_state) of `trainer.init()` as `jax.ShapeDtypeStruct`s with the mesh shardings
    the step runs with (the optimizer's per-parameter leaves take their parameter's sharding, its
    counters are replicated; `optax.tree_map_params`). Nothing is allocated (`jax.eval_shape`)."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params, opt_state = jax.eval_shape(trainer.init)
    shardings = trainer.shardings
    rep = NamedSharding(trainer.mesh, P())

    def sds(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    params = jax.tree.map(sds, params, shardings)
    opt_state = optax.tree_map_params(trainer.tx, sds, opt_state, shardings,
                                      transform_non_params=lambda a: sds(a, rep))
    return params, opt_state


def _device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s (the largest shard)."""
    import jax
    import numpy as np

    return int(sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(tree)))


def _declared_check(policy: CommPolicy, rows: list[dict]) -> list[dict]:
    """The collectives whose wire dtype is not the declared one: a compressing site's collective
    that moves float messages and no 1-byte codes although its message is at least `min_bytes`, or
    an exact site's collective that moves codes. One entry per (site, axis, op, dtype) with its
    count. (Integer or predicate collectives, e.g. flags, are neither.)"""
    bad = collections.Counter()
    for c in rows:
        if not c["site"] or "+" in c["site"]:
            continue
        codec = getattr(policy, c["site"])
        dtypes = c["dtype"].split("+")
        codes = any(d in CODE_DTYPES for d in dtypes)
        floats = any(d in FLOAT_DTYPES for d in dtypes)
        if codec.kind != "none" and floats and not codes and c["message_bytes"] >= int(policy.min_bytes or 0):
            bad[(c["site"], c["axis"], c["op"], c["dtype"], f"{codec.name}: 1-byte codes (u8)")] += 1
        elif codec.kind == "none" and codes:
            bad[(c["site"], c["axis"], c["op"], c["dtype"], "exact: float messages")] += 1
    return [{"site": s, "axis": a, "op": o, "dtype": d, "declared": want, "count": n}
            for (s, a, o, d, want), n in sorted(bad.items())]


def compiled_report(hlo_text: str, mesh, policy: CommPolicy) -> dict:
    """What a compiled program's HLO says about its communication: {"wire": `collective_bytes`,
    "by_site": [{"axis", "site", "collectives", "compressed", "bytes", "dtypes"}], "codec": {site:
    {"kernel_calls": {kind: n}, "scoped_ops": {kind: n}}}, "mismatches": `_declared_check`}. Site "" holds
    collectives under no site scope (the model's own: vocabulary-parallel loss, embedding; and any XLA inserts)."""
    from taco_jax.collectives.hlo import async_overlap, codec_calls, collective_bytes, collectives, overlap_by_site

    rows = collectives(hlo_text, mesh)
    by = {}
    for c in rows:
        r = by.setdefault((c["axis"], c["site"]), {"axis": c["axis"], "site": c["site"], "collectives": 0,
                                                   "compressed": 0, "bytes": 0.0, "dtypes": set()})
        r["collectives"] += 1
        r["compressed"] += any(d in CODE_DTYPES for d in c["dtype"].split("+"))
        r["bytes"] += c["sent"]
        r["dtypes"].add(c["dtype"])
    by_site = [{**r, "bytes": int(r["bytes"]), "dtypes": sorted(r["dtypes"])} for _, r in sorted(by.items())]
    codec: dict = {}
    for call in codec_calls(hlo_text):
        entry = codec.setdefault(call["site"], {"kernel_calls": collections.Counter(),
                                                "scoped_ops": collections.Counter()})
        entry["kernel_calls" if call["target"].startswith("taco_") else "scoped_ops"][call["kind"]] += 1
    codec = {s: {k: dict(v) for k, v in e.items()} for s, e in sorted(codec.items())}
    return {"wire": collective_bytes(hlo_text, mesh), "by_site": by_site, "codec": codec,
            "mismatches": _declared_check(policy, rows), "overlap": overlap_by_site(async_overlap(hlo_text, mesh))}


#: `compile_step`'s progress lines: one every `STILL_COMPILING_S` s, and one `XLA_ALARM_S` + 1 s into `.compile()`
#: explaining the alarm XLA logs when its compile passes 2 minutes (xla/service/slow_operation_alarm.cc).
STILL_COMPILING_S = 300.0
XLA_ALARM_S = 120.0
XLA_ALARM_NOTE = ("plan: XLA's compile of the step has run {minutes:.1f} min; if XLA's own compile of the module "
                  "passes 2 minutes, XLA prints \"Very slow compile? If you want to file a bug, run with envvar "
                  "XLA_FLAGS=--xla_dump_to=...\" (and \"The operation took ...\" when done): its generic alarm for any "
                  "long compile, harmless here, nothing to file")


@contextlib.contextmanager
def progress_lines(say, text: str, first_s: float, every_s: float | None = None):
    """While the block runs, `say(text.format(minutes=...))` (the minutes since entering it) `first_s` seconds after
    entering it, then every `every_s` seconds (None: once), from a daemon thread; none after the block ends."""
    import threading

    done, t0 = threading.Event(), time.perf_counter()

    def lines():
        wait = first_s
        while not done.wait(wait):
            say(text.format(minutes=(time.perf_counter() - t0) / 60))
            if every_s is None:
                return
            wait = every_s

    thread = threading.Thread(target=lines, name="plan-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _compiling_line(cfg: TrainConfig, n: int, platform: str) -> str:
    """`compile_step`'s start line: what it compiles (model, depth, size, mesh, devices) and how long that may take."""
    mc = cfg.model_config
    n_params = mc.n_params()
    size = f"{n_params / 1e9:.2f} B" if n_params >= 1e9 else f"{n_params / 1e6:.2f} M"
    where = f"{n} simulated CPU devices" if platform == "cpu" else f"{n} {platform} devices"
    layers = f"{mc.n_layers} layer" + "s" * (mc.n_layers != 1)
    return (f"plan: compiling the train step of {cfg.model.name} ({layers}, {size} parameters) for --mesh "
            f"{cfg.parallelism.mesh}, --microbatches {cfg.parallelism.microbatches}, on {where}: seconds for a tiny "
            "model, minutes for a large one (docs/plan.md: Qwen3-8B on 32 devices, 2-4 min on a 2-core VM, 17 min on "
            f"a busy one; --layers L compiles a shallower copy sooner); a line every {STILL_COMPILING_S / 60:.0f} min "
            "until done")


@contextlib.contextmanager
def _no_cache(off: bool):
    """jax's persistent compilation cache off while compiling for abstract devices: it writes their
    executables but cannot read them back without a GPU client (it warns and compiles again)."""
    import jax

    was = jax.config.jax_enable_compilation_cache
    if off:
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def compile_step(cfg: TrainConfig, devices=None, say=None) -> dict:
    """Lowers and compiles `cfg`'s real train step on abstract inputs and reads it (module docstring).

    devices: the mesh's devices (default: the default backend's when it has enough, else the CPU
    devices; the mesh size must fit). say: a line printer for progress (`taco-jax plan`: stderr):
    a start line (`_compiling_line`), a line every `STILL_COMPILING_S`, `XLA_ALARM_NOTE` just after
    XLA's slow-compile alarm, and the wall time when done; None: silent. Returns a JSON-ready dict:
    "platform", "devices", "compile_s", "memory" (per device, bytes: XLA's "temp", "argument", "output", "alias",
    "generated_code", "peak" = argument + output - alias + temp; "params", "opt_state", "batch" from the argument
    shapes), `compiled_report`'s entries, and "wire_issued" (the uncompiled HLO's bytes by axis). Raises ValueError
    when the mesh does not fit the devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax.collectives.hlo import collective_bytes
    from taco_jax.parallel.mesh import DATA
    from taco_jax.train.step import compiled_memory, make_trainer

    n = int(np.prod(list(cfg.parallelism.axes.values())))
    if devices is None:
        devices = jax.devices() if len(jax.devices()) >= n else jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(f"mesh={cfg.parallelism.mesh!r} needs {n} devices; {len(devices)} {devices[0].platform} "
                         f"devices here (give --devices {n})")
    devices = devices[:n]
    say = say or (lambda line: None)
    say(_compiling_line(cfg, n, devices[0].platform))
    start = time.perf_counter()
    pin = contextlib.nullcontext()
    if devices[0].platform != "cpu":  # abstract CUDA devices (`deviceless.gpu_devices`): trace the codec for CUDA
        from taco_jax.codec.backends import pin_platform

        pin = pin_platform("cuda")
    with pin, progress_lines(say, "plan: still compiling ({minutes:.1f} min so far)", STILL_COMPILING_S,
                             STILL_COMPILING_S):
        trainer = make_trainer(cfg, devices)
        params, opt_state = abstract_state(trainer)
        axes = tuple(a for a in (DATA,) if a in trainer.mesh.axis_names)
        batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), np.int32,
                                     sharding=NamedSharding(trainer.mesh, P(axes or None)))
        t0 = time.perf_counter()
        lowered = trainer.train_step.lower(params, opt_state, batch, batch)
        gpu = devices[0].platform != "cpu"
        with progress_lines(say, XLA_ALARM_NOTE, XLA_ALARM_S + 1), _no_cache(gpu), \
                tempfile.TemporaryDirectory(prefix="taco-jax-schedule-") as dump:
            try:
                compiled = lowered.compile(deviceless.schedule_dump_options(dump) if gpu else None)
                schedule = deviceless.schedule_estimate(dump) if gpu else None
            except Exception as e:  # XLA:GPU refusing the declared GPU (e.g. a compute capability ptxas lacks)
                if not gpu:
                    raise
                raise ValueError(f"XLA:GPU could not compile the step for {devices[0].device_kind}: "
                                 f"{str(e).strip().splitlines()[0][:300]} (check the hardware's [KEY.target] table: "
                                 "compute_capability, runtime_version)") from e
        compile_s = time.perf_counter() - t0
    say(f"plan: compiled in {time.perf_counter() - start:.1f} s wall (tracing, lowering and XLA's compile of the step "
        f"{compile_s:.1f} s; building the trainer and its abstract state the rest)")
    mem = compiled_memory(compiled)
    if mem is not None:
        mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    parts = {"params": _device_bytes(params), "opt_state": _device_bytes(opt_state), "batch": 2 * _device_bytes(batch)}
    act = activation_estimate(cfg)
    parts["estimate"] = {**act, "grads": parts["params"],  # FP32 gradients, sharded as the parameters
                         "total": parts["params"] + parts["opt_state"] + parts["batch"] + parts["params"]
                         + act["activations"]}
    report = compiled_report(compiled.as_text(), trainer.mesh, trainer.policy)
    return {"platform": devices[0].platform, "devices": n, "compile_s": compile_s, "xla_schedule": schedule,
            "memory": {**(mem or {}), **parts, "analysis": mem is not None}, **report,
            "wire_issued": collective_bytes(lowered.as_text(dialect="hlo"), trainer.mesh)["by_axis"],
            "policy": trainer.policy.to_dict()}


def shallow_depths(cfg: TrainConfig) -> tuple[int, int]:
    """The two depths `plan --extrapolate` compiles: one and two decoder layers per pipeline stage.
    Raises ValueError when the model is no deeper than the second (nothing to extrapolate)."""
    from taco_jax.parallel.mesh import STAGE

    stages = cfg.parallelism.axes.get(STAGE, 1)
    depth = cfg.model_config.n_layers
    if depth <= 2 * stages:
        raise ValueError(f"--extrapolate compiles {stages} and {2 * stages} layers ({stages} pipeline stage(s)), but "
                         f"{cfg.model.name} has {depth}: compile it whole (leave out --extrapolate)")
    return stages, 2 * stages


def extrapolate_peak(peaks: dict[int, int], depth: int) -> int:
    """The peak per device at `depth` layers from the peaks of two shallow compiles ({layers: bytes}),
    linear in the depth (parameters, gradients, optimizer state and saved layer inputs grow by the same
    amount per layer). A lower bound, not an estimate: XLA:GPU's peak grows faster than linearly with the
    layers of a stage (docs/results.md)."""
    (l1, p1), (l2, p2) = sorted(peaks.items())
    return int(round(p2 + (p2 - p1) / (l2 - l1) * (depth - l2)))


def plan(cfg: TrainConfig, spec: HardwareSpec, *, tp_span_nodes: int | None = None, compile: bool = True,
         devices=None, say=None, extrapolate: bool = False) -> dict:
    """`predict` plus, with `compile`, `compile_step` of the same run (`say`: its progress lines): the
    policy compiled is the one the named hardware would run (`--min-bytes auto` resolved on its
    tensor link). On a GPU compile (`devices` abstract CUDA devices) the memory verdict
    (`deviceless.memory_verdict`) too. `extrapolate`: compile two shallow copies (`shallow_depths`)
    instead of the whole model and extrapolate the peak to its depth (`extrapolate_peak`); the
    compiled report is the deeper copy's, "extrapolated" says so. Raises ValueError as those."""
    out = {"format": PLAN_FORMAT, "config": cfg.to_dict(), "predict": predict(cfg, spec, tp_span_nodes=tp_span_nodes)}
    if compile:
        layout = layout_of(cfg)
        policy = resolve_policy(cfg.communication.policy, layout,
                                with_tp_span(spec.hardware, layout.tp, tp_span_nodes, gpus=layout.gpus))
        run_cfg = cfg.replace(policy=policy)
        run_cfg.__dict__["model_config"] = cfg.model_config  # keep a --layers override
        if not extrapolate:
            out["compiled"] = compiled = compile_step(run_cfg, devices, say)
            peak = compiled["memory"].get("peak")
        else:
            peaks = {}
            for depth in shallow_depths(cfg):
                shallow = with_layers(run_cfg.replace(), depth)
                out["compiled"] = compiled = compile_step(shallow, devices, say)
                peaks[depth] = compiled["memory"]["peak"]
            peak = extrapolate_peak(peaks, cfg.model_config.n_layers)
            compiled["extrapolated"] = {"layers": cfg.model_config.n_layers, "peak": peak,
                                        "from": {str(k): v for k, v in peaks.items()}}
        if compiled["platform"] != "cpu" and compiled["memory"].get("analysis"):
            compiled["verdict"] = deviceless.memory_verdict(peak, spec, lower_bound=extrapolate)
    return out


# The paper's GPU table (docs/emulated.md)
#: The TP links of docs/emulated.md's GPU table: (label, hardware, link).
def _paper_links():
    return [("H100/H200 NVLink 4 (450 GB/s)", hwt.H200, hwt.NVLINK4),
            ("H800 NVLink (200 GB/s)", hwt.H800, hwt.NVLINK_H800),
            ("PCIe Gen5 x16 (64 GB/s)", hwt.H200, hwt.PCIE_GEN5),
            ("InfiniBand NDR (50 GB/s per GPU)", hwt.H200, hwt.IB_NDR)]


def paper_table() -> list[dict]:
    """The cost model's predictions for the paper's GPT/Qwen settings (`perf.paper.settings`, TP
    inside a node) with the TP link set to each declared GPU link: docs/emulated.md "Predicted for
    GPU clusters". Rows: setting, tp_link, tp_comm_fraction (share of the exact step in TP
    collectives), taco_tp, taco_tp+dp+pp (speedups), published, range (of taco_tp, per source)."""
    from taco_jax.perf import paper

    pol = paper.policies()
    errors = uncertainty.summary()
    out = []
    for label, cfg, lay, _hw, published in paper.settings():
        if "FP32 wire" in label or "IB)" in label:
            continue
        for link_name, hw, tp_link in _paper_links():
            hw2 = dataclasses.replace(hw, intra=tp_link, gpus_per_node=max(hw.gpus_per_node, lay.tp))
            base = model.step_time(cfg, lay, hw2)
            s = model.speedup(cfg, lay, hw2, pol["taco_tp"])
            out.append({"setting": label, "tp_link": link_name,
                        "tp_comm_fraction": (lay.n_micro + lay.pp - 1) * base["tp_s"] / base["step_s"],
                        "taco_tp": s, "taco_tp+dp+pp": model.speedup(cfg, lay, hw2, pol["taco_tp+dp+pp"]),
                        "published": published, "range": uncertainty.speedup_range(s, errors)["all"]})
    return out
