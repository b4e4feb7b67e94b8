"""Declared GPU hardware as data: `hardware.toml` beside this module (H100 SXM, H200, H800, A100 80GB,
B200, L40S), or a user's own file of the same schema (`taco-jax plan --hardware-file FILE`).
The shipped table is the one place GPU numbers live (FLOP rates, links, codec speeds): `H200`, `H800`,
`H200_CODEC`, `NVLINK4`, `NVLINK_H800`, `IB_NDR` and `PCIE_GEN5` below are read from it.

Each entry becomes a cost-model `model.Hardware` (peak FLOP/s, MFU, GPUs per node, intra- and inter-node `Link`,
codec speed) plus what the numbers rest on (`HardwareSpec`): the source of each, and whether the codec speed was
measured or is assumed. Schema: the comment at the top of `hardware.toml`; docs/plan.md "Your own cluster"."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import tomllib

from taco_jax.perf import model
from taco_jax.util.jsonio import read_table

#: The shipped hardware table.
HARDWARE_FILE = pathlib.Path(__file__).with_name("hardware.toml")
_TOP = {"name": str, "peak_tflops": float, "mfu": float, "gpus_per_node": int, "source": str}
_LINK = {"name": str, "bandwidth_GBps": float, "efficiency": float, "alpha_us": float, "source": str}
_CODEC = {"encode_GBps": float, "decode_GBps": float, "overhead_us": float, "status": str, "source": str}
_TARGET = {"gpu_name": str, "compute_capability": str, "sm_count": int, "fpus_per_sm": int, "memory_bytes": int,
           "memory_bandwidth_GBps": float, "clock_ghz": float, "l2_cache_bytes": int, "shared_memory_per_sm": int,
           "shared_memory_per_block_optin": int, "runtime_version": str, "dnn_version": str, "source": str}
CODEC_STATUS = ("measured", "assumed")
#: `[KEY.codec.backends.NAME]`: another codec backend's speed on the same GPU (`auto`'s ranking).
_BACKEND = {"encode_GBps": float, "decode_GBps": float, "status": str, "source": str}
BACKEND_STATUS = ("measured", "assumed", "bound")
#: The hardware a GPU run resolves `--min-bytes auto` on (`calibration.resolve_min_bytes`), and the
#: `--hardware` of `plan` / `predict` when none is given.
DEFAULT_GPU = "h200"
#: The top-level table of named links (`declared_link`); every other top-level table is a hardware.
LINKS = "links"


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One declared hardware: its lower-case `key` (`--hardware KEY`), the cost model's `hardware` (codec speed as
    "default"), and the provenance of its numbers: `codec_status` ("measured" or "assumed"), `sources` ({"hardware",
    "intra", "inter", "codec": text}), `where` (the file it was read from).

    Attributes:
      target: the `[KEY.target]` table (`_TARGET`'s fields: the GPU for XLA:GPU's deviceless
        compiler, `target_config`), or None when the entry has none.
      codec_backends: {backend: {"encode_GBps", "decode_GBps", "status", "source"}}: `[KEY.codec]`
        under its `backend` (when named) and each `[KEY.codec.backends.NAME]`; what codec backend
        `auto` ranks GPU backends by (`taco_jax.kernels.gpu_speed_table` reads the shipped h200's).
    """

    key: str
    hardware: model.Hardware
    codec_status: str
    sources: dict
    where: str
    target: dict | None = None
    codec_backends: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> dict:
        """JSON-ready summary: name, links (GB/s per direction achieved, α µs), codec speed and status."""
        hw = self.hardware
        speed = hw.codec["default"]

        def link(lk):
            return {"name": lk.name, "GBps": lk.bandwidth_GBps, "alpha_us": lk.alpha_s * 1e6}

        return {"key": self.key, "name": hw.name, "peak_tflops": hw.peak_flops / 1e12, "mfu": hw.mfu,
                "gpus_per_node": hw.gpus_per_node, "intra": link(hw.intra), "inter": link(hw.inter),
                "codec": {"encode_GBps": speed.encode_GBps, "decode_GBps": speed.decode_GBps,
                          "overhead_us": speed.overhead_s * 1e6, "status": self.codec_status},
                "sources": self.sources, "file": self.where}


def _fields(table, spec: dict, where: str) -> dict:
    """`table`'s values checked against `spec` ({key: type}): every key present, none unknown,
    numbers finite and > 0. Raises ValueError naming `where` and the key."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table of {sorted(spec)}, not {type(table).__name__}")
    unknown = sorted(set(table) - set(spec) - {"intra", "inter", "codec", "target"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; the keys are {sorted(spec)}")
    out = {}
    for key, typ in spec.items():
        if key not in table:
            raise ValueError(f"{where}: missing key {key!r} ({typ.__name__})")
        value = table[key]
        if typ is str:
            if not isinstance(value, str):
                raise ValueError(f"{where}.{key}={value!r} must be a string")
        elif typ is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{key}={value!r} must be an integer >= 1")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where}.{key}={value!r} must be a finite number > 0")
        out[key] = typ(value)
    return out


def _link(table, where: str) -> tuple[model.Link, str]:
    f = _fields(table, _LINK, where)
    if f["efficiency"] > 1:
        raise ValueError(f"{where}.efficiency={f['efficiency']!r} must be in (0, 1] (achieved / datasheet bandwidth)")
    return model.Link.from_bandwidth(f["name"], f["alpha_us"] / 1e6, f["efficiency"] * f["bandwidth_GBps"] * 1e9,
                                     f["source"]), f["source"]


def _codec(table, where: str) -> tuple[dict, dict]:
    """`[KEY.codec]` checked: (its `_CODEC` fields, {backend: speed row} of its optional `backend` and
    `[KEY.codec.backends.NAME]` tables). Raises ValueError naming `where` and the bad key."""
    table = dict(table) if isinstance(table, dict) else table
    backend = table.pop("backend", None) if isinstance(table, dict) else None
    others = table.pop("backends", {}) if isinstance(table, dict) else {}
    c = _fields(table, _CODEC, where)
    if c["status"] not in CODEC_STATUS:
        raise ValueError(f"{where}.status={c['status']!r} must be one of {CODEC_STATUS}")
    rows = {}
    if backend is not None:
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"{where}.backend={backend!r} must be a backend name")
        rows[backend] = {"encode_GBps": c["encode_GBps"], "decode_GBps": c["decode_GBps"], "status": c["status"],
                         "source": c["source"]}
    if not isinstance(others, dict):
        raise ValueError(f"{where}.backends must be a table of [{where}.backends.NAME] tables")
    for name, row in others.items():
        r = _fields(row, _BACKEND, f"{where}.backends.{name}")
        if r["status"] not in BACKEND_STATUS:
            raise ValueError(f"{where}.backends.{name}.status={r['status']!r} must be one of {BACKEND_STATUS}")
        rows[name] = r
    return c, rows


def parse_hardware(data: dict, where: str) -> dict[str, HardwareSpec]:
    """{key: HardwareSpec} of a parsed hardware table (`hardware.toml`'s schema). Raises ValueError naming `where`,
    the entry and the bad key or value, or both entries whose names differ only in case (keys are lower-cased)."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: holds no hardware table ([name] with peak_tflops, mfu, gpus_per_node, "
                         "[name.intra], [name.inter], [name.codec]; see taco_jax/perf/hardware.toml)")
    data = {k: v for k, v in data.items() if k != LINKS}
    same = {}
    for key in data:  # the key is case-insensitive (`--hardware H100`): two spellings of one name would merge
        if key.lower() in same:
            raise ValueError(f"{where}: [{same[key.lower()]}] and [{key}] name one hardware (names are "
                             "case-insensitive); rename or remove one")
        same[key.lower()] = key
    out = {}
    for key, table in data.items():
        at = f"{where}: [{key}]"
        top = _fields(table, _TOP, at)
        if top["mfu"] > 1:
            raise ValueError(f"{at}.mfu={top['mfu']!r} must be in (0, 1]")
        for part in ("intra", "inter", "codec"):
            if part not in table:
                raise ValueError(f"{at}: missing table [{key}.{part}]")
        intra, intra_src = _link(table["intra"], f"{at}.intra")
        inter, inter_src = _link(table["inter"], f"{at}.inter")
        c, backends = _codec(table["codec"], f"{at}.codec")
        speed = model.CodecSpeed(c["encode_GBps"], c["decode_GBps"], c["overhead_us"] / 1e6, c["source"])
        hw = model.Hardware(top["name"], top["peak_tflops"] * 1e12, top["mfu"], top["gpus_per_node"], intra, inter,
                            {"default": speed})
        target = _target(table["target"], f"{at}.target") if "target" in table else None
        out[key.lower()] = HardwareSpec(key.lower(), hw, c["status"], {"hardware": top["source"], "intra": intra_src,
                                        "inter": inter_src, "codec": c["source"]}, where, target, backends)
    return out


def _version(text: str, where: str, parts: int) -> tuple[int, ...]:
    """"9.0" -> (9, 0) (padded with zeros to `parts`). Raises ValueError naming `where`."""
    bits = text.split(".")
    if not 1 <= len(bits) <= parts or not all(b.isdigit() for b in bits):
        raise ValueError(f"{where}={text!r} must be a version like {'.'.join(['9', '0', '0'][:parts])!r}")
    return tuple(int(b) for b in bits) + (0,) * (parts - len(bits))


def _target(table, where: str) -> dict:
    t = _fields(table, _TARGET, where)
    _version(t["compute_capability"], f"{where}.compute_capability", 2)
    _version(t["runtime_version"], f"{where}.runtime_version", 3)
    _version(t["dnn_version"], f"{where}.dnn_version", 3)
    return t


def target_config(spec: HardwareSpec) -> str:
    """The `[KEY.target]` table of `spec` as XLA's `GpuTargetConfigProto` text, what
    `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` takes
    (fields of openxla/xla's `xla/backends/gpu/target_config/specs/*.txtpb`; `runtime_version` is
    required, openxla/xla PR #25919). Raises ValueError when the entry has no target table."""
    t = spec.target
    if t is None:
        raise ValueError(f"hardware {spec.key!r} ({spec.where}) has no [{spec.key}.target] table, which "
                         "--compiler gpu needs (the GPU's SM count, memory, compute capability: see "
                         "taco_jax/perf/hardware.toml)")
    cc = _version(t["compute_capability"], "compute_capability", 2)
    rt = _version(t["runtime_version"], "runtime_version", 3)
    dnn = _version(t["dnn_version"], "dnn_version", 3)
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
            "shared_memory_per_core": t["shared_memory_per_sm"],
            "threads_per_core_limit": 2048 if cc >= (8, 0) else 1024,
            "core_count": t["sm_count"], "fpus_per_core": t["fpus_per_sm"], "block_dim_limit_x": 2147483647,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": int(round(t["memory_bandwidth_GBps"] * 1e9)), "l2_cache_size": t["l2_cache_bytes"],
            "clock_rate_ghz": t["clock_ghz"], "device_memory_size": t["memory_bytes"],
            "shared_memory_per_block_optin": t["shared_memory_per_block_optin"],
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
    body = "".join(f"  {k}: {v}\n" for k, v in info.items())
    return ("gpu_device_info {\n" + body + f"  cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }}\n}}\n"
            'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}\n"
            f"runtime_version {{ major: {rt[0]} minor: {rt[1]} patch: {rt[2]} }}\n"
            f"device_description_str: {t['gpu_name']!r}\n".replace("'", '"'))


def load_hardware(path=None) -> dict[str, HardwareSpec]:
    """The hardware of a TOML (or ".json") file, default the shipped `hardware.toml`. Raises ValueError naming the
    file (a given one as `--hardware-file`) when it cannot be read or parsed, or holds a bad entry."""
    what = "--hardware-file" if path else "hardware file"
    path = pathlib.Path(path or HARDWARE_FILE)
    data = read_table(path, what)
    return parse_hardware(data, f"{what} {str(path)!r}")


def get_hardware(name: str = "", path=None) -> HardwareSpec:
    """The hardware `name` among the shipped ones and those of `path` (a user's file; its entries win). Without `name`:
    the file's entry when it holds exactly one. Raises ValueError naming an unknown name with the known ones."""
    known = load_hardware()
    if path:
        own = load_hardware(path)
        if not name:
            if len(own) != 1:
                raise ValueError(f"hardware file {str(path)!r} holds {sorted(own)}; choose one with --hardware")
            return next(iter(own.values()))
        known.update(own)
    key = (name or DEFAULT_GPU).lower()
    if key not in known:
        raise ValueError(f"hardware={name!r} is not declared; choose one of {sorted(known)} or give --hardware-file")
    return known[key]


def with_tp_span(hw: model.Hardware, tp: int, tp_span_nodes: int | None, gpus: int | None = None) -> model.Hardware:
    """`hw` with its node size set so that a tensor-parallel group of `tp` ranks spans `tp_span_nodes` nodes (the
    cost model then puts TP, and the axes outside it, on the inter-node link). None: Megatron placement (TP inside a
    node while it fits: ceil(tp / gpus_per_node) nodes). Raises ValueError when `tp_span_nodes` does not divide
    `tp`, or the ranks per node exceed or (K > 1) do not divide the node's GPUs, or (None) a `tp` larger than a node
    is not a multiple of its GPUs, or (None or 1) a smaller `tp` does not divide a node's GPUs and the run (`gpus`)
    fills more than one node (a tensor group would cross a node boundary)."""
    if tp_span_nodes is None and tp > hw.gpus_per_node and tp % hw.gpus_per_node:
        raise ValueError(f"the tensor axis ({tp} ranks) does not fit nodes of {hw.gpus_per_node} GPUs ({hw.name}) "
                         f"evenly; give a tensor size of at most {hw.gpus_per_node} or a multiple of it, or "
                         "--tp-span-nodes K with K dividing it")
    if tp_span_nodes is None or tp_span_nodes == 1:
        if tp < hw.gpus_per_node and hw.gpus_per_node % tp and gpus is not None and gpus > hw.gpus_per_node:
            raise ValueError(f"the tensor axis ({tp} ranks) does not divide nodes of {hw.gpus_per_node} GPUs "
                             f"({hw.name}): of a run on {gpus} GPUs, some tensor groups would cross a node boundary "
                             f"(ranks {hw.gpus_per_node - 1} and {hw.gpus_per_node}); give a tensor size dividing "
                             f"{hw.gpus_per_node}, or a multiple of it")
        if tp_span_nodes is None:
            return hw
    if not (isinstance(tp_span_nodes, int) and tp_span_nodes >= 1):
        raise ValueError(f"tp_span_nodes={tp_span_nodes!r} must be an integer >= 1")
    if tp % tp_span_nodes:
        raise ValueError(f"tp_span_nodes={tp_span_nodes} does not divide the tensor axis ({tp} ranks)")
    per_node = tp // tp_span_nodes
    if per_node > hw.gpus_per_node:
        raise ValueError(f"tp_span_nodes={tp_span_nodes} puts {per_node} tensor ranks in a node of {hw.gpus_per_node} "
                         f"GPUs ({hw.name}); give at least {-(-tp // hw.gpus_per_node)} nodes")
    if tp_span_nodes == 1:
        return hw
    if hw.gpus_per_node % per_node:
        raise ValueError(f"tp_span_nodes={tp_span_nodes} puts {per_node} tensor ranks in each node of "
                         f"{hw.gpus_per_node} GPUs ({hw.name}), which {per_node} does not divide: the next group "
                         "would cross a node boundary; give K with tp / K dividing the node's GPUs")
    return dataclasses.replace(hw, gpus_per_node=per_node)


@functools.cache
def shipped() -> dict[str, HardwareSpec]:
    """{key: HardwareSpec} of the shipped `hardware.toml` (read once)."""
    return load_hardware()


def declared_link(name: str) -> model.Link:
    """The shipped table's `[links.NAME]` link. Raises ValueError naming an unknown name."""
    table = read_table(HARDWARE_FILE, "hardware file").get(LINKS, {})
    if name not in table:
        raise ValueError(f"link {name!r} is not declared in {HARDWARE_FILE}; known: {sorted(table)}")
    return _link(table[name], f"hardware file {str(HARDWARE_FILE)!r}: [{LINKS}.{name}]")[0]


#: The shipped entries the paper's predictions use (`perf.paper`, `plan.paper_table`), read from
#: `hardware.toml`. The paper's predictions assume the measured H200 codec on every GPU, so its `H800`
#: is the table's h800 with `H200_CODEC` (the table's own h800 codec speed is assumed, scaled by HBM).
H200 = shipped()["h200"].hardware
#: The TACO codec measured on an H200 (CUDA FFI, 256 MB f32; 8 µs per call assumed): `[h200.codec]`.
H200_CODEC = H200.codec["default"]
H800 = dataclasses.replace(shipped()["h800"].hardware, codec={"default": H200_CODEC})
NVLINK4, NVLINK_H800, IB_NDR = H200.intra, H800.intra, H200.inter
PCIE_GEN5 = declared_link("pcie-gen5")



def _toml_value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else repr(v)


def _set_table(lines: list[str], header: str, values: dict, after: str) -> None:
    """Sets the keys of TOML table `[header]` in `lines` to `values` (other keys and comments kept); a
    missing table is added after the last table whose header starts with `[after`."""
    head = f"[{header}]"
    if head not in lines:
        last = max(i for i, x in enumerate(lines) if x.startswith(f"[{after}"))
        end = next((i for i in range(last + 1, len(lines)) if lines[i].startswith("[")), len(lines))
        while end > last + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
            end -= 1  # before the blank lines and comments that open the next table
        lines[end:end] = ["", head]
    start = lines.index(head) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    keys = {x.split("=")[0].strip(): i for i, x in enumerate(lines[start:end], start) if "=" in x}
    for k, v in values.items():
        if k in keys:
            lines[keys[k]] = f"{k} = {_toml_value(v)}"
    last = max(keys.values(), default=start - 1)
    lines[last + 1:last + 1] = [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in keys]


def update_codec_speeds(speeds: dict, key: str = DEFAULT_GPU, path=None) -> pathlib.Path:
    """Writes measured codec speeds into the hardware table (default: the shipped `hardware.toml`)
    under `[key.codec]`: `speeds` as `experiments/gpu/gpu_check.py`'s speed table ({"backends": {backend:
    {"encode_GBps", "decode_GBps", "measured", "source"}}}); the backend `[key.codec]` names gets its
    encode / decode speed and source there (its per-call overhead stays), every other backend its
    `[key.codec.backends.NAME]` table (status "measured", or "bound" where not measured). The result
    is parsed back before it is written. Raises ValueError for an entry without a codec `backend`."""
    path = pathlib.Path(path or HARDWARE_FILE)
    main = read_table(path, "hardware file")[key]["codec"].get("backend")
    if not main:
        raise ValueError(f"[{key}.codec] in {path} names no backend; add backend = \"NAME\"")
    lines = path.read_text().splitlines()
    for name, row in speeds["backends"].items():
        values = {"encode_GBps": row["encode_GBps"], "decode_GBps": row["decode_GBps"]}
        if name == main:
            _set_table(lines, f"{key}.codec", {**values, "status": "measured",
                                               "source": f"{row['source']}; overhead_us assumed"}, key)
        else:
            _set_table(lines, f"{key}.codec.backends.{name}", {**values, "status": "measured" if row["measured"]
                                                               else "bound", "source": row["source"]}, f"{key}.codec")
    text = "\n".join(lines) + "\n"
    parse_hardware(tomllib.loads(text), f"the updated {path}")
    path.write_text(text)
    return path
