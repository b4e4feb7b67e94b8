"""The cost model's predictions for the paper's setting (docs/TACO_SPEC.md §5), beside the published
numbers: TACO up to 1.87× end to end (3D-parallel GPT and Qwen, multi-node GPUs; cluster not specified in the spec)
and COCCL 1.24× (GPT-13B), 1.10× (GPT-6.7B), 1.05× (Qwen2.5-7B) on 32 H800 over InfiniBand.

Assumptions (all parameters of `model`, stated in each row): BF16 activations on the TP/PP wire, FP32 gradients on the
DP wire; no overlap of TP communication with compute; DP all-reduce exposed; MFU 0.40 of 989 TFLOP/s; codec at the
measured H200 speed (`hardware.H200_CODEC`: CUDA FFI, 256 MB) for every kind; Megatron placement (TP inside a node, then
DP, then PP); b = 1, T = 2048, 1F1B with m = 32 microbatches. Run: `python -m taco_jax.perf.paper`; the codec outlook
(break-even codec speed per TP link, today's codec beside a target one): `python -m taco_jax.perf.paper --codec`.
"""

from __future__ import annotations

import dataclasses

from taco_jax.codec import TACO, CodecConfig
from taco_jax.collectives.policy import CommPolicy
from taco_jax.models import GPTConfig, get_config
from taco_jax.perf import model
from taco_jax.perf.hardware import H200, H200_CODEC, H800, IB_NDR, NVLINK4, NVLINK_H800, PCIE_GEN5, shipped
from taco_jax.perf.model import Layout

#: GPT-3 family sizes (Brown et al. 2020, Table 2.1) with the GPT-2 vocabulary; T = 2048.
GPT_6_7B = GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048)
GPT_13B = GPTConfig(n_layer=40, n_head=40, n_embd=5120, block_size=2048)
#: The paper's pairing for the other axes (spec §4): SDP4Bit-style 4-bit gradients with Hadamard,
#: TAH-Quant-style 4-bit tiles on pipeline sends.
DP_CODEC = CodecConfig(kind="int4", hadamard=True)
PP_CODEC = CodecConfig(kind="tah")


def policies() -> dict:
    """{"exact", "taco_tp" (TACO on every TP site), "taco_tp+dp+pp" (and 4-bit DP / PP codecs)}."""
    tp = CommPolicy.taco(TACO)
    return {"exact": CommPolicy(), "taco_tp": tp,
            "taco_tp+dp+pp": dataclasses.replace(tp, dp_grads=DP_CODEC, pp_send=PP_CODEC)}


def settings() -> list[tuple[str, object, Layout, model.Hardware, str]]:
    """(label, model config, layout, hardware, published reference) of each predicted setting."""
    lay = dict(micro_batch=1, seq_len=2048, n_micro=32, act_bytes=2, grad_bytes=4)
    return [
        ("GPT-6.7B tp8 pp4 (32 H800)", GPT_6_7B, Layout(tp=8, pp=4, dp=1, **lay), H800, "COCCL 1.10x"),
        ("GPT-13B tp8 pp4 (32 H800)", GPT_13B, Layout(tp=8, pp=4, dp=1, **lay), H800, "COCCL 1.24x"),
        ("Qwen2.5-7B tp4 pp2 dp4 (32 H800)", get_config("qwen2.5-7b"), Layout(tp=4, pp=2, dp=4, **lay), H800,
         "COCCL 1.05x"),
        ("GPT-13B tp8 pp2 dp2 (32 H800)", GPT_13B, Layout(tp=8, pp=2, dp=2, **lay), H800, "COCCL 1.24x"),
        ("GPT-13B tp16 (TP over IB) pp2 (32 H800)", GPT_13B, Layout(tp=16, pp=2, dp=1, **lay), H800,
         "TACO up to 1.87x"),
        ("GPT-13B tp16 (TP over IB) pp2, FP32 wire", GPT_13B, Layout(tp=16, pp=2, dp=1, **{**lay, "act_bytes": 4}),
         H800, "TACO up to 1.87x"),
        ("Qwen2.5-7B tp8 pp4 (32 H200)", get_config("qwen2.5-7b"), Layout(tp=8, pp=4, dp=1, **lay), H200,
         "TACO up to 1.87x"),
    ]


def predictions() -> list[dict]:
    """One row per setting: label, GPUs, exact comm fraction, predicted speedup per policy, reference."""
    out = []
    for label, cfg, lay, hw, ref in settings():
        base = model.step_time(cfg, lay, hw)
        row = {"setting": label, "gpus": lay.gpus, "exact_step_s": base["step_s"],
               "comm_fraction": base["comm_fraction"], "published": ref}
        for name, pol in policies().items():
            if name != "exact":
                row[name] = model.speedup(cfg, lay, hw, pol)
        row["auto"] = model.speedup(cfg, lay, hw, model.auto_policy(cfg, lay, hw, policies()["taco_tp+dp+pp"]))
        out.append(row)
    return out


def main() -> None:
    print(__doc__.split("\n\n")[1].replace("\n", " "))
    print(f"{'setting':42s} {'GPUs':>4s} {'comm%':>6s} {'taco_tp':>8s} {'+dp+pp':>8s} {'auto':>6s}  published")
    for r in predictions():
        print(f"{r['setting']:42s} {r['gpus']:4d} {100 * r['comm_fraction']:5.1f}% {r['taco_tp']:7.2f}x "
              f"{r['taco_tp+dp+pp']:7.2f}x {r['auto']:5.2f}x  {r['published']}")




# Codec speed: break-even and target (the GPU TP links of docs/emulated.md)
#: The TP links the codec outlook sweeps: (label, hardware, link).
TP_LINKS = (("NVLink 4 (450 GB/s)", H200, NVLINK4),
            ("H800 NVLink (200 GB/s)", H800, NVLINK_H800),
            ("PCIe Gen5 x16 (64 GB/s)", H200, PCIE_GEN5),
            ("InfiniBand NDR (50 GB/s)", H200, IB_NDR))
#: H200 HBM3e peak, bytes/s (`[h200.target]` memory_bandwidth_GBps of the hardware table: 4.8 TB/s).
H200_HBM_BPS = shipped()["h200"].target["memory_bandwidth_GBps"] * 1e9


def target_codec(fraction: float = 0.8, itemsize: int = 2, hbm_Bps: float = H200_HBM_BPS) -> model.CodecSpeed:
    """A codec at `fraction` of the HBM-bound rate for messages of `itemsize`-byte elements: encode
    reads itemsize and writes 1 + 8/128 wire bytes per element (decode the reverse), so the bound is
    hbm / (1 + 1.0625 / itemsize) bytes of message per second; `H200_CODEC`'s 8 µs per call."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]")
    gbps = fraction * hbm_Bps / (1 + TACO.wire_bytes_per_element() / itemsize) / 1e9
    return model.CodecSpeed(gbps, gbps, H200_CODEC.overhead_s,
                            f"{fraction:g} x the HBM bound ({hbm_Bps / 1e12:g} TB/s), itemsize {itemsize}")


def _with_codec(hw: model.Hardware, speed: model.CodecSpeed, tp_link: model.Link, tp: int) -> model.Hardware:
    return dataclasses.replace(hw, intra=tp_link, gpus_per_node=max(hw.gpus_per_node, tp), codec={"default": speed})


def break_even_codec_GBps(cfg, lay: Layout, hw: model.Hardware, policy: CommPolicy, *,
                          overhead_s: float = H200_CODEC.overhead_s) -> float | None:
    """Codec throughput (GB/s, encode = decode) at which `policy` is predicted exactly as fast as the exact step on
    `hw` (speedup 1), by bisection on a log scale over 1 GB/s .. 1 PB/s; None when even a codec at 1 PB/s does not
    pay (the saved bytes do not cover the per-call overhead), 1.0 when the slowest one already pays."""
    def gain(gbps):
        hw2 = dataclasses.replace(hw, codec={"default": model.CodecSpeed(gbps, gbps, overhead_s, "sweep")})
        return model.speedup(cfg, lay, hw2, policy) - 1.0

    lo, hi = 1.0, 1e6
    if gain(hi) <= 0:
        return None
    if gain(lo) >= 0:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gain(mid) < 0 else (lo, mid)
    return hi


def codec_outlook(target: model.CodecSpeed | None = None) -> list[dict]:
    """For each BF16 setting of `settings()` and each TP link of `TP_LINKS`: the break-even codec
    speed of TACO on the TP sites (GB/s), and the predicted speedup with today's measured codec
    (`H200_CODEC`) beside a codec at `target` (default `target_codec()`: 0.8 of the HBM bound)."""
    target = target or target_codec()
    pol = policies()["taco_tp"]
    out = []
    for label, cfg, lay, _hw, _ in settings():
        if lay.act_bytes != 2 or "IB)" in label:
            continue
        for link_name, hw, link in TP_LINKS:
            today = _with_codec(hw, H200_CODEC, link, lay.tp)
            out.append({"setting": label, "tp_link": link_name,
                        "break_even_GBps": break_even_codec_GBps(cfg, lay, today, pol),
                        "today_GBps": (H200_CODEC.encode_GBps, H200_CODEC.decode_GBps),
                        "speedup_today": model.speedup(cfg, lay, today, pol),
                        "target_GBps": target.encode_GBps,
                        "speedup_target": model.speedup(cfg, lay, _with_codec(hw, target, link, lay.tp), pol)})
    return out


def print_codec_outlook() -> None:
    """`codec_outlook()` as a table (`python -m taco_jax.perf.paper --codec`)."""
    rows = codec_outlook()
    print(f"target codec: {target_codec().source}: {rows[0]['target_GBps']:,.0f} GB/s; today: "
          f"{H200_CODEC.source}")
    print(f"{'setting':34s} {'TP link':26s} {'break-even':>11s} {'today':>7s} {'target':>7s}")
    for r in rows:
        be = "never" if r["break_even_GBps"] is None else f"{r['break_even_GBps']:,.0f}"
        print(f"{r['setting']:34s} {r['tp_link']:26s} {be:>11s} {r['speedup_today']:6.2f}x "
              f"{r['speedup_target']:6.2f}x")


if __name__ == "__main__":
    import sys

    print_codec_outlook() if "--codec" in sys.argv else main()
