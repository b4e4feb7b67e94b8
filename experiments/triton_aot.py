"""Ahead-of-time compile of the Triton codec kernels (`taco_jax.kernels.triton_codec`) for a CUDA
target, on any host (no GPU needed): registers, stack, shared memory and spills per kernel.

    python -m experiments.triton_aot --out runs/triton_aot.json                 # sm_90, all variants
    python -m experiments.triton_aot --out x.json --variants encode-e4m3-128,decode-128-a

`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` runs Triton's whole pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships), with the same constexprs and
launch options (`num_warps=4, num_stages=1`) that `encode_groups` / `decode_groups` pass to
jax-triton. From the cubin: `cuobjdump --dump-resource-usage` (registers REG, per-thread STACK,
static SHARED); from Triton: the dynamic shared memory it launches with (`metadata.shared`); from
`ptxas -v` on the PTX: spill stores / loads. Must run without TRITON_INTERPRET (the interpreter
replaces `triton.jit`). Variants: encode-{e4m3,e5m2}-G and decode-G-{a,noa} for G in 32, 128, 512.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_ROWS = 4096  # groups per launch (a constexpr of the kernels: rows are masked against it)
GROUPS = (32, 128, 512)
VARIANTS = [f"encode-{f}-{g}" for f in ("e4m3", "e5m2") for g in GROUPS] + [
    f"decode-{g}-{a}" for g in GROUPS for a in ("a", "noa")
]


def _tool(name: str) -> str | None:
    """`name` from Triton's bundled CUDA tools, else from PATH."""
    import triton.backends.nvidia as nv  # noqa: PLC0415

    bundled = Path(nv.__file__).parent / "bin" / name
    return str(bundled) if bundled.exists() else shutil.which(name)


def compile_variant(variant: str, arch: int) -> dict:
    """Compiles one kernel variant (see VARIANTS) for sm_`arch`. Raises ValueError for an unknown name."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from taco_jax.codec.config import CodecConfig  # noqa: PLC0415
    from taco_jax.kernels import triton_codec  # noqa: PLC0415

    encode_kernel, decode_kernel = triton_codec._kernels()
    kind, *rest = variant.split("-")
    if kind == "encode":
        fmt, g = rest[0], int(rest[1])
        cfg = CodecConfig(fmt=fmt, group_size=g)
        meta = triton_codec.encode_meta(cfg, N_ROWS, N_ROWS, g)
        code = "*fp8e4nv" if fmt == "e4m3" else "*fp8e5"
        sig = {"x_ptr": "*fp32", "h_ptr": "*fp32", "codes_ptr": code, "s_ptr": "*fp32", "a_ptr": "*fp32"}
        fn = encode_kernel
    else:
        g, has_a = int(rest[0]), rest[1] == "a"
        meta = triton_codec.decode_meta(N_ROWS, g, has_a=has_a)
        # the code dtype does not change decode's register use much; E4M3 as in training
        sig = {"codes_ptr": "*fp8e4nv", "s_ptr": "*fp32", "a_ptr": "*fp32", "h_ptr": "*fp32", "out_ptr": "*fp32"}
        fn = decode_kernel
    sig.update({k: "constexpr" for k in meta})
    t = time.perf_counter()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=meta), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": 4, "num_stages": 1})
    row = dict(variant=variant, arch=f"sm_{arch}", num_warps=4, compile_s=time.perf_counter() - t,
               dynamic_shared_bytes=int(k.metadata.shared))
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = Path(d) / "k.cubin", Path(d) / "k.ptx"
        cubin.write_bytes(k.asm["cubin"])
        ptx.write_text(k.asm["ptx"])
        if cuobjdump := _tool("cuobjdump"):
            out = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                                 check=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
            row.update(registers=int(m[1]), stack_bytes=int(m[2]), static_shared_bytes=int(m[3]),
                       local_bytes=int(m[4]))
        if ptxas := _tool("ptxas"):
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", str(ptx), "-o", os.devnull],
                                 capture_output=True, text=True, check=True).stderr
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
            if m:
                row.update(spill_store_bytes=int(m[1]), spill_load_bytes=int(m[2]))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET=1 is set: the interpreter replaces triton.jit; unset it")
    rows = []
    for v in args.variants.split(","):
        rows.append(compile_variant(v, args.arch))
        r = rows[-1]
        print(f"{v:<18} sm_{args.arch}: {r.get('registers')} regs, stack {r.get('stack_bytes')} B, "
              f"shared {r['dynamic_shared_bytes']} B dynamic + {r.get('static_shared_bytes')} B static, "
              f"spills {r.get('spill_store_bytes')}/{r.get('spill_load_bytes')} B, {r['compile_s']:.1f} s", flush=True)
    import triton  # noqa: PLC0415

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(triton=triton.__version__, n_rows=N_ROWS, kernels=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
