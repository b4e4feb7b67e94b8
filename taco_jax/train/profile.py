"""`taco-jax train --profile-steps A:B`: a `jax.profiler` trace of steps A..B (a loop hook).

The trace goes to `--profile-dir` (default `<out>/profile`; process i: `<dir>/process<i>`) in the layout
TensorBoard's profile plugin and XProf read (`plugins/profile/<time>/<host>.xplane.pb`), plus
`perfetto_trace.json.gz`. Each traced step is a `StepTraceAnnotation` ("train_step", its number); op names carry the
compressed collectives' named scopes (`taco_encode`, `taco_psum`, ...), which `op_events` reads back from the trace."""

from __future__ import annotations

import pathlib

import jax

from taco_jax.train.hooks import Hook


def profile_dir(cfg) -> pathlib.Path:
    """Where the trace of a `TrainConfig` goes (see the module docstring)."""
    base = pathlib.Path(cfg.logging.profile_dir or pathlib.Path(cfg.checkpoint.out) / "profile")
    return base / f"process{jax.process_index()}" if jax.process_count() > 1 else base


class ProfileSteps(Hook):
    """Traces steps `first`..`last` into `directory` (a resumed run past `first` starts at its first step)."""

    def __init__(self, first: int, last: int, directory):
        self.first, self.last, self.directory = first, last, pathlib.Path(directory)
        self.tracing, self.step_annotation = False, None

    def before_step(self, state, step):
        if not self.tracing and self.first <= step <= self.last:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True
        if self.tracing:
            self.step_annotation = jax.profiler.StepTraceAnnotation("train_step", step_num=step)
            self.step_annotation.__enter__()

    def on_step(self, state, step, rec):
        if self.step_annotation is not None:
            self.step_annotation.__exit__(None, None, None)
            self.step_annotation = None
        if self.tracing and step >= self.last:
            self.close()

    def end(self, state):
        self.close()

    def close(self):
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


# --- Reading a trace back: an XSpace (`*.xplane.pb`) without its .proto, from the protobuf wire format
# (field numbers from tsl/profiler/protobuf/xplane.proto and xla/service/hlo.proto).


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return n, i


def _fields(buf: bytes, number: int) -> list:
    """The values of field `number` of a protobuf message (ints for varints, bytes otherwise)."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:  # fixed 64 / 32 bits
            size = 8 if wire == 1 else 4
            v, i = buf[i:i + size], i + size
        if key >> 3 == number:
            out.append(v)
    return out


def hlo_op_names(xspace: bytes) -> dict[str, dict[str, str]]:
    """{HLO module: {instruction: op_name metadata}} of the HLO protos the profiler stores in its
    "/host:metadata" plane of the XSpace bytes `xspace` (XSpace.planes=1; XPlane.name=2,
    event_metadata=4 (map: value=2); XEventMetadata.stats=5; XStat.bytes_value=6 = HloProto;
    HloProto.hlo_module=1; module name=1, computations=3; computation instructions=2; instruction
    name=1, metadata=7; OpMetadata.op_name=2). The op name holds the named scopes (`taco_encode`, ...)."""
    modules = {}
    for plane in _fields(xspace, 1):
        if _fields(plane, 2) != [b"/host:metadata"]:
            continue
        for entry in _fields(plane, 4):
            for stat in (s for meta in _fields(entry, 2) for s in _fields(meta, 5)):
                for module in (m for hlo in _fields(stat, 6) for m in _fields(hlo, 1)):
                    ops = modules.setdefault(_fields(module, 1)[0].decode(), {})
                    for ins in (i for comp in _fields(module, 3) for i in _fields(comp, 2)):
                        meta = _fields(ins, 7)
                        name = _fields(meta[0], 2) if meta else []
                        ops[_fields(ins, 1)[0].decode()] = name[0].decode() if name else ""
    return modules


def op_events(xplane_path, module_prefix: str = "jit_train_step") -> list[tuple[int, int, str, str]]:
    """The executed HLO ops of the modules named `module_prefix...` in the trace file `xplane_path`
    (`*.xplane.pb`), sorted by start: (start ns, duration ns, HLO instruction, op_name with its
    named scopes). On XLA:CPU each simulated device's ops appear once per execution."""
    from jax.profiler import ProfileData

    names = hlo_op_names(pathlib.Path(xplane_path).read_bytes())
    events = []
    for plane in ProfileData.from_file(str(xplane_path)).planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                module, op = stats.get("hlo_module"), stats.get("hlo_op")
                if module and op and module.startswith(module_prefix):
                    events.append((ev.start_ns, ev.duration_ns, op, names.get(module, {}).get(op, "")))
    return sorted(events)
