"""Cost model of compressed communication: α–β links, codec throughput, per-layer FLOPs
and an MFU give predicted collective and training-step times, the break-even message size
(`min_bytes="auto"`) and an `auto_policy` that compresses only the sites predicted to gain.

Modules: `model` (equations, step time), `hardware` (the declared GPUs of `hardware.toml`), `calibration` (fits to
benchmark rows, `resolve_min_bytes`), `paper` (the paper's setting)."""

from taco_jax.perf.calibration import (
           CPU_CALIBRATION,
           Calibration,
           fit_calibration,
           fit_codec,
           fit_codec_sim,
           fit_link,
           load_rows,
           resolve_min_bytes,
           sim_times,
           site_break_even,
           validate,
)
from taco_jax.perf.hardware import H200, H200_CODEC, H800, IB_NDR, NVLINK4, NVLINK_H800, PCIE_GEN5
from taco_jax.perf.model import (
           NEVER,
           CodecSpeed,
           Hardware,
           Layout,
           Link,
           auto_policy,
           break_even_bytes,
           collective_time,
           comm_time,
           flops,
           param_count,
           site_messages,
           speedup,
           step_time,
           wire_ratio,
)

__all__ = ["CPU_CALIBRATION", "H200", "H200_CODEC", "H800", "IB_NDR", "NEVER", "NVLINK4", "NVLINK_H800", "PCIE_GEN5",
           "Calibration", "CodecSpeed",
           "Hardware", "Layout", "Link", "auto_policy", "break_even_bytes", "collective_time", "comm_time",
           "fit_calibration", "fit_codec", "fit_codec_sim", "fit_link", "flops", "load_rows", "param_count",
           "resolve_min_bytes", "sim_times", "site_break_even", "site_messages", "speedup", "step_time", "validate",
           "wire_ratio"]
