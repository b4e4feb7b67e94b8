"""Compiling the real train step with XLA:GPU on a machine without a GPU, and the memory verdict.

XLA compiles for CUDA without a device when the CUDA PJRT plugin (`jax-cuda12-plugin` /
`jax-cuda12-pjrt`, the same version as jaxlib) and ptxas (`nvidia-cuda-nvcc-cu12`) are installed:
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT, topology="NODESx1xGPUS")` gives
abstract devices, a mesh over them takes the step's `ShapeDtypeStruct`s, and `lower(...).compile()` runs XLA:GPU's
whole pipeline (fusion, the latency-hiding scheduler, buffer assignment) and gives its `memory_analysis()` and
scheduled HLO. Upstream tests it since jax 0.9 (jax-ml/jax PR #33542); TEXT is the `[KEY.target]` table of the
hardware entry (`perf.hardware.target_config`). Install: `pip install -e '.[gpu-compile]'` (`jax[cuda12-local]` pins
the plugin to jax's version).

What such a compile does not know: no GEMM autotuning (no device to time: untuned Triton tiles or
cuBLAS), no allocator fragmentation, nothing allocated outside XLA's buffers (`RESERVE`)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re

from taco_jax.perf.hardware import HardwareSpec, target_config

GIB = 2**30
EXTRA = "pip install -e '.[gpu-compile]'"

#: Device memory a training process uses outside XLA's buffers, per GPU (bytes, with its source). None
#: of these was measured here; they are sizes from the libraries' documentation, rounded up.
RESERVE = {
    "cuda_context": (int(0.5 * GIB), "CUDA context with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default "
                                     "since CUDA 12.2): a few hundred MiB on Hopper; 0.5 GiB assumed"),
    "nccl": (1 * GIB, "NCCL buffers: NCCL_BUFFSIZE 4 MiB per channel and peer (NCCL's environment-variable "
                      "documentation), up to 32 channels on NVLink, for each communicator (TP, DP, PP); 1 GiB assumed"),
    "cublas_workspace": (32 * 2**20, "cuBLAS workspace: 32 MiB on Hopper and newer (cuBLAS documentation, "
                                     "cublasSetWorkspace; 4 MiB before)"),
}
#: Fraction of a GPU's memory JAX's allocator takes at start-up unless XLA_PYTHON_CLIENT_MEM_FRACTION
#: says otherwise (JAX documentation, "GPU memory allocation": 75 % preallocated).
JAX_DEFAULT_FRACTION = 0.75


def plugin_error() -> str | None:
    """None when the CUDA PJRT plugin and ptxas can be imported here; else a one-line reason naming
    the extra to install."""
    for module, package in (("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
                            ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (f"--compiler gpu needs XLA's CUDA plugin and ptxas ({package} is not installed); "
                    f"install them with `{EXTRA}` (the plugin's version must equal jaxlib's)")
    return None


def keep_jax_on_cpu() -> None:
    """With the CUDA plugin installed and no GPU driver (libcuda), jax's first backend query fails
    ("Unable to load CUDA"): then pin the running backend to the CPU, unless JAX_PLATFORMS is set
    already. Call before jax creates its backends. Without the plugin, or with a driver, nothing changes."""
    import ctypes.util  # noqa: PLC0415

    if os.environ.get("JAX_PLATFORMS") is not None or ctypes.util.find_library("cuda") is not None:
        return
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        plugin = False
    if plugin:
        os.environ["JAX_PLATFORMS"] = "cpu"  # child processes
        import sys  # noqa: PLC0415

        if "jax" in sys.modules:  # jax read the variable at its import
            sys.modules["jax"].config.update("jax_platforms", "cpu")


def topology(spec: HardwareSpec, n: int) -> str:
    """XLA's topology string for `n` GPUs of `spec` ("<nodes>x1x<GPUs per node>"): whole nodes, or
    one node's first `n`. Raises ValueError for a count that fills no whole number of nodes."""
    per = spec.hardware.gpus_per_node
    if n <= per:
        return f"1x1x{n}"
    if n % per:
        raise ValueError(f"devices={n} is not a whole number of {spec.hardware.name} nodes of {per} GPUs; give a "
                         f"multiple of {per} (or at most {per})")
    return f"{n // per}x1x{per}"


def gpu_devices(spec: HardwareSpec, n: int) -> list:
    """The `n` abstract CUDA devices of `spec`'s GPU (its `[KEY.target]`) on `topology(spec, n)`,
    for `jax.sharding.Mesh` and `jit(...).lower(...).compile()`; nothing runs on them.
    Raises ValueError: no CUDA plugin here (`plugin_error`), no target table, a bad count."""
    why = plugin_error()
    if why:
        raise ValueError(why)
    text = target_config(spec)
    topo = topology(spec, n)
    from jax.experimental import topologies  # noqa: PLC0415

    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topo)
    except Exception as e:  # the plugin's own error (e.g. a target field its version does not know)
        raise ValueError(f"XLA's CUDA plugin refused the target of hardware {spec.key!r} on topology {topo}: "
                         f"{str(e).splitlines()[0]}") from e
    return list(desc.devices)[:n]


def memory_verdict(peak: int, spec: HardwareSpec, reserve: dict | None = None, *, lower_bound: bool = False) -> dict:
    """Whether a step whose XLA:GPU peak per device is `peak` bytes fits `spec`'s GPU.

    The budget is the GPU's memory (`[KEY.target] memory_bytes`) less `reserve` ({name: (bytes,
    source)}, default `RESERVE`). `lower_bound`: `peak` is a lower bound (an extrapolation,
    `plan.extrapolate_peak`), so only "does not fit" can be decided: "fits" is then False when even
    it exceeds the budget and None otherwise. Returns a JSON-ready dict: "fits" (bool or None), "peak", "memory",
    "reserve" (bytes), "budget" = memory - reserve, "headroom_gib" = (budget - peak) / 2^30 (negative:
    short by that much), "reserve_parts" {name: {"bytes", "source"}}, and "mem_fraction": the
    XLA_PYTHON_CLIENT_MEM_FRACTION the run needs when the peak exceeds JAX's default 75 % pool
    (None otherwise). Raises ValueError when `spec` has no target table."""
    if spec.target is None:
        target_config(spec)  # raises, naming the missing table
    reserve = RESERVE if reserve is None else reserve
    memory = int(spec.target["memory_bytes"])
    held = sum(b for b, _ in reserve.values())
    budget = memory - held
    fraction = None
    if peak > JAX_DEFAULT_FRACTION * memory and peak <= budget:
        fraction = min(0.99, -(-peak * 100 // memory) / 100 + 0.01)  # the next hundredth above, with 1 % slack
    fits = None if lower_bound and peak <= budget else bool(peak <= budget)
    return {"fits": fits, "lower_bound": lower_bound, "peak": int(peak), "memory": memory, "reserve": held,
            "budget": budget,
            "headroom_gib": (budget - peak) / GIB, "mem_fraction": fraction,
            "reserve_parts": {k: {"bytes": b, "source": s} for k, (b, s) in reserve.items()}}


def verdict_lines(v: dict, gpu: str) -> list[str]:
    """`memory_verdict`'s result as plan's lines."""
    gib = GIB
    word = {True: "true", False: "false", None: "not decided"}[v["fits"]]
    what = "extrapolated XLA:GPU peak, a lower bound," if v.get("lower_bound") else "XLA:GPU peak"
    head = (f"fits: {word}: {what} {v['peak'] / gib:.2f} GiB per device against "
            f"{v['budget'] / gib:.2f} GiB ({gpu}: {v['memory'] / gib:.2f} GiB less {v['reserve'] / gib:.2f} GiB "
            f"for the CUDA context, NCCL and cuBLAS); headroom {v['headroom_gib']:+.2f} GiB")
    out = [head]
    if v["mem_fraction"] is not None:
        out.append(f"  above JAX's default pool of {JAX_DEFAULT_FRACTION:.0%} of the GPU: run with "
                   f"XLA_PYTHON_CLIENT_MEM_FRACTION={v['mem_fraction']:.2f}")
    if v["fits"] is None:
        out.append("  a shallow copy's extrapolation decides only what does not fit (at qwen3-8b on 32 H100 it gave "
                   "32.4 GiB where the whole model's compile gives 61.7, docs/plan.md): compile the whole model")
    if v["fits"] is False:
        out.append("  does not fit: more tensor or pipeline parallelism, --remat full, a smaller --batch-size or more "
                   "--microbatches lower the peak")
    return out


def schedule_dump_options(folder: str) -> dict:
    """`lowered.compile(...)` options that make XLA:GPU write its latency-hiding scheduler's schedule into
    `folder` (`<module>.schedule.txt`, a text `ScheduleProto`): dump options, the program is unchanged."""
    return {"xla_dump_to": folder, "xla_dump_latency_hiding_schedule": True, "xla_dump_hlo_as_text": False,
            "xla_dump_hlo_module_re": "train_step"}


_STAT = re.compile(r"^\s*(\w+): ([-+0-9.eE]+)\s*$", flags=re.M)


def schedule_estimate(folder: str) -> dict | None:
    """XLA:GPU's own estimate of the step, from the latency-hiding scheduler's dump in `folder`
    (`schedule_dump_options`): the entry computation's `scheduler_statistics` (XLA's
    `ScheduleProto.SchedulerStatisticsProto`) in seconds: {"step_s": total, "waiting_s": time the
    schedule stalls on collectives, "waiting_by_op": {"all_gather": s, ...}}; None when no schedule was
    written. XLA's latency estimator (its default on this XLA: the analytical speed-of-light model of
    each kernel and collective, no autotuning) gives the times; `cycles_per_microsecond` converts."""
    dumps = sorted(pathlib.Path(folder).glob("*train_step*.schedule.txt"))
    if not dumps:
        return None
    with open(dumps[-1], "rb") as f:  # the statistics close the file; the schedule before them is large
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        tail = f.read().decode(errors="replace")
    block = tail[tail.rfind("scheduler_statistics"):]
    stats = {k: float(v) for k, v in _STAT.findall(block)}
    if "total_cycles" not in stats:
        return None
    per_us = stats.get("cycles_per_microsecond") or 1.0
    seconds = {k: v / per_us * 1e-6 for k, v in stats.items() if k.endswith("_cycles")}
    return {"step_s": seconds["total_cycles"], "waiting_s": seconds.get("total_wasted_cycles", 0.0),
            "waiting_by_op": {k[:-len("_wasted_cycles")]: v for k, v in seconds.items()
                              if k.endswith("_wasted_cycles") and k != "total_wasted_cycles"}}
