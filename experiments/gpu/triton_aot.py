"""Ahead-of-time compile of the Triton codec kernels (`taco_jax.kernels.triton_codec`) for a CUDA
target, on any host (no GPU needed): resources, SASS counts and a bandwidth bound per kernel variant.

    python -m experiments.gpu.triton_aot --out runs/triton_aot.json                 # sm_90, all variants
    python -m experiments.gpu.triton_aot --out x.json --variants encode-bf16-e4m3-128,decode-f32-128-a
    python -m experiments.gpu.triton_aot --out x.json --markdown docs_table.md      # also the table

`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` runs Triton's whole pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships), with the constexprs and launch
options (`num_warps`, `num_stages=1`) that `encode_groups` / `decode_groups` / `decode_sum_groups`
pass to jax-triton, and pointers 16-byte aligned (XLA's buffers are). Per variant:
  resources   `cuobjdump --dump-resource-usage` (registers REG, per-thread STACK, static SHARED,
              LOCAL), Triton's dynamic shared memory (`metadata.shared`), `ptxas -v` spill bytes;
  SASS        `cuobjdump -sass` (both tools ship in Triton's wheel): global loads / stores by
              width (bits), shared-memory and shuffle instructions, barriers, and SASS
              instructions per element (the kernels are straight-line code: one pass over a block
              of `ELEMENTS` elements; decode-sum's loop over ranks runs P - 1 = 3 times, counted
              once);
  bound       an H200 throughput bound from those counts (`bound`; assumptions in its docstring).
Variants: encode-{f32,bf16,f16}-{e4m3,e5m2}-G, decode-{f32,bf16,f16}-G-{a,noa} (output dtype; a:
dual scale layout, noa: folded) and decode_sum-{f32,bf16,f16}-G-a (P = 4 ranks) for G in 32..512.
Must run without TRITON_INTERPRET (the interpreter replaces `triton.jit`).
"""

from __future__ import annotations

import argparse
import collections
import importlib.resources
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import run_record
from taco_jax.util.jsonio import read_table

HARDWARE_FILE = importlib.resources.files("taco_jax") / "perf" / "hardware.toml"

N_ROWS = 4096  # groups per launch (a constexpr of the kernels: rows are masked against it)
P_RANKS = 4  # decode_sum: ranks summed
GROUPS = (32, 64, 128, 256, 512)
DTYPES = {"f32": ("float32", "fp32", 4), "bf16": ("bfloat16", "bf16", 2), "f16": ("float16", "fp16", 2)}
VARIANTS = (
    [f"encode-{d}-{f}-{g}" for d in DTYPES for f in ("e4m3", "e5m2") for g in GROUPS]
    + [f"decode-{d}-{g}-{a}" for d in DTYPES for g in GROUPS for a in ("a", "noa")]
    + [f"decode_sum-{d}-{g}-a" for d in DTYPES for g in GROUPS]
)
#: H200 SXM figures of `bound`: SMs, clock and HBM bandwidth from the hardware table's `[h200.target]`
#: (taco_jax/perf/hardware.toml); warp instructions issued and shared-memory bytes per clock per SM
#: from the Hopper tuning guide.
_T = read_table(HARDWARE_FILE, "hardware file")["h200"]["target"]
H200 = dict(sms=_T["sm_count"], clock_hz=_T["clock_ghz"] * 1e9, issue_per_sm_clk=4, smem_bytes_per_sm_clk=128,
            hbm_bytes_per_s=_T["memory_bandwidth_GBps"] * 1e9)


def _tool(name: str) -> str | None:
    """`name` from Triton's bundled CUDA tools (cuobjdump, nvdisasm, ptxas), else from PATH."""
    import triton.backends.nvidia as nv  # noqa: PLC0415

    bundled = Path(nv.__file__).parent / "bin" / name
    return str(bundled) if bundled.exists() else shutil.which(name)


def _width(op: str) -> int:
    """Bits moved per thread by a global load/store opcode (LDG.E.128 -> 128, LDG.E -> 32)."""
    for suffix, bits in ((".128", 128), (".64", 64), (".U16", 16), (".S16", 16), (".U8", 8), (".S8", 8)):
        if suffix in op:
            return bits
    return 32


def sass_counts(sass: str) -> dict:
    """Counts from `cuobjdump -sass` text: instructions, global loads/stores by width in bits,
    shared-memory loads/stores, shuffles, barriers, local-memory (spill) accesses."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m[1])
    gl = collections.Counter(f"{op[:3]}.{_width(op)}" for op in ops if op.startswith(("LDG", "STG")))
    pre = lambda *p: sum(op.startswith(p) for op in ops)  # noqa: E731
    return dict(instructions=sum(op not in ("NOP",) for op in ops), global_by_width=dict(sorted(gl.items())),
                shared_ld=pre("LDS"), shared_st=pre("STS"), shuffles=pre("SHFL"), barriers=pre("BAR"),
                local=pre("LDL", "STL"), fp_add=pre("FADD"))


def _shared_bytes(sass: str) -> int:
    """Bytes per thread moved by shared-memory instructions (LDS/STS .128/.64/32, LDSM/STSM x4)."""
    total = 0
    for line in sass.splitlines():
        m = re.search(r"\s(LDS|STS|LDSM|STSM)(\.[A-Z0-9_.]+)?\s", line)
        if m:
            suf = m[2] or ""
            total += 16 if (".128" in suf or ".4" in suf) else 8 if (".64" in suf or ".2" in suf) else 4
    return total


def bound(row: dict, elements: int, threads: int, in_bytes: float, out_bytes: float) -> dict:
    """H200 bound on one kernel's throughput from its SASS counts, GB/s of the message (the side in
    the message dtype), as the minimum of three: HBM (in + out bytes per element at 4.8 TB/s),
    instruction issue (4 warp instructions per clock per SM, 132 SMs at 1.98 GHz; every static
    instruction issued once per warp) and shared memory (128 B per clock per SM). Assumes full
    occupancy and perfect overlap of the three, so it is an upper bound, not a prediction."""
    hw = H200
    msg_bytes = in_bytes if row["kind"] == "encode" else out_bytes
    per_el_hbm = in_bytes + out_bytes
    warp_instr_per_el = row["sass"]["instructions"] * (threads // 32) / elements
    smem_per_el = row["shared_bytes_per_thread"] * threads / elements
    rates = {  # elements per second
        "hbm": hw["hbm_bytes_per_s"] / per_el_hbm,
        "issue": hw["sms"] * hw["clock_hz"] * hw["issue_per_sm_clk"] / warp_instr_per_el,
        "shared": hw["sms"] * hw["clock_hz"] * hw["smem_bytes_per_sm_clk"] / smem_per_el if smem_per_el else math.inf,
    }
    limit = min(rates, key=rates.get)
    return dict(bound_GBps=rates[limit] * msg_bytes / 1e9, limit=limit, hbm_bytes_per_element=per_el_hbm,
                warp_instructions_per_element=warp_instr_per_el, shared_bytes_per_element=smem_per_el,
                sass_instructions_per_element=row["sass"]["instructions"] * threads / elements)


def compile_variant(variant: str, arch: int) -> dict:
    """Compiles one kernel variant (see VARIANTS) for sm_`arch`. Raises ValueError for an unknown name."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from the {len(VARIANTS)} of VARIANTS")
    import ml_dtypes  # noqa: F401, PLC0415  (jnp dtypes by name)
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from taco_jax.codec.config import CodecConfig  # noqa: PLC0415
    from taco_jax.kernels import triton_codec as tc  # noqa: PLC0415

    encode_kernel, decode_kernel, decode_sum_kernel = tc._kernels()
    kind, dt, *rest = variant.split("-")
    dtype, tdt, itemsize = DTYPES[dt]
    if kind == "encode":
        fmt, g = rest[0], int(rest[1])
        cfg = CodecConfig(fmt=fmt, group_size=g)
        meta = tc.encode_meta(cfg, N_ROWS, N_ROWS, g)
        code = "*fp8e4nv" if fmt == "e4m3" else "*fp8e5"
        sig = {"x_ptr": f"*{tdt}", "codes_ptr": code, "s_ptr": "*fp32", "a_ptr": "*fp32"}
        fn, in_b, out_b = encode_kernel, itemsize, 1 + 8 / g
    else:
        g, has_a = int(rest[0]), rest[1] == "a"
        p = P_RANKS if kind == "decode_sum" else None
        meta = tc.decode_meta(N_ROWS, g, has_a=has_a, dtype=dtype, p=p)
        sig = {"codes_ptr": "*fp8e4nv", "s_ptr": "*fp32", "a_ptr": "*fp32", "out_ptr": f"*{tdt}"}
        fn = decode_kernel if p is None else decode_sum_kernel
        in_b, out_b = (p or 1) * (1 + (8 if has_a else 4) / g), itemsize
    sig.update({k: "constexpr" for k in meta})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # XLA buffers: 16-byte aligned
    opts = {"num_warps": tc.NUM_WARPS, "num_stages": 1}
    t = time.perf_counter()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=meta, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    row = dict(variant=variant, kind=kind, dtype=dtype, group_size=g, arch=f"sm_{arch}", num_warps=tc.NUM_WARPS,
               elements_per_program=tc.block_groups(g) * g, compile_s=time.perf_counter() - t,
               dynamic_shared_bytes=int(k.metadata.shared))
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = Path(d) / "k.cubin", Path(d) / "k.ptx"
        cubin.write_bytes(k.asm["cubin"])
        ptx.write_text(k.asm["ptx"])
        cuobjdump = _tool("cuobjdump")
        out = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
        row.update(registers=int(m[1]), stack_bytes=int(m[2]), static_shared_bytes=int(m[3]), local_bytes=int(m[4]))
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        row["sass"] = sass_counts(sass)
        row["shared_bytes_per_thread"] = _shared_bytes(sass)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run([_tool("ptxas"), "-v", f"--gpu-name={gpu}", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        row.update(spill_store_bytes=int(m[1]) if m else 0, spill_load_bytes=int(m[2]) if m else 0)
    row.update(bound(row, row["elements_per_program"], 32 * tc.NUM_WARPS, in_b, out_b))
    return row


def markdown(rows: list[dict]) -> str:
    """The table of docs/results.md "GPU path" from `compile_variant` rows."""
    lines = ["| kernel | regs | spill st/ld B | stack B | shared B (dyn + static) | global ld / st (count × bits) | "
             "shfl / lds+sts / bar | SASS instr / element | H200 bound GB/s (limit) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["sass"]
        gl = ", ".join(f"{k.split('.')[0][:2]}{v}×{k.split('.')[1]}" for k, v in s["global_by_width"].items())
        lines.append(f"| {r['variant']} | {r['registers']} | {r['spill_store_bytes']} / {r['spill_load_bytes']} | "
                     f"{r['stack_bytes']} | {r['dynamic_shared_bytes']} + {r['static_shared_bytes']} | {gl} | "
                     f"{s['shuffles']} / {s['shared_ld'] + s['shared_st']} / {s['barriers']} | "
                     f"{r['sass_instructions_per_element']:.1f} | {r['bound_GBps']:,.0f} ({r['limit']}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    p.add_argument("--markdown", help="also write the Markdown table here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET=1 is set: the interpreter replaces triton.jit; unset it")
    run, rows = run_record(__spec__.name, argv), []
    for v in args.variants.split(","):
        rows.append(compile_variant(v, args.arch))
        r = rows[-1]
        print(f"{v:<24} sm_{args.arch}: {r['registers']} regs, stack {r['stack_bytes']} B, spills "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} B, shared {r['dynamic_shared_bytes']} B, "
              f"global {r['sass']['global_by_width']}, {r['sass_instructions_per_element']:.1f} instr/el, "
              f"bound {r['bound_GBps']:,.0f} GB/s ({r['limit']}), {r['compile_s']:.1f} s", flush=True)
    import triton  # noqa: PLC0415

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(run=run, triton=triton.__version__, n_rows=N_ROWS, p_ranks=P_RANKS,
                                              h200=H200, kernels=rows), indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
