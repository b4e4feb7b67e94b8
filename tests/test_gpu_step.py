"""Every GPU codec backend compiles into the real CUDA train step (issue 51, item 3).

XLA:GPU compiles the gpt2-tiny `data=2,tensor=4` TACO step (at one layer: `LAYERS`) for 8 abstract H100s
on this CPU-only machine (`train.deviceless`, `train.plan.compile_step`) once per codec backend and message
dtype, in one child process with the CUDA plugin on its path (`make gpu-compile` puts it, and jax-triton, in
`.venv/gpu-compile`, outside the suite's venv), which writes a JSON summary that the tests below read:

  reference  the jnp specification: XLA fusions, no codec kernel;
  pallas     Pallas kernels lowered to Triton: `__gpu$xla.gpu.triton` custom calls;
  triton     the jax-triton kernels (`kernels.triton_codec`): `triton_kernel_call` custom calls (a cubin
             built for the devices' compute capability while lowering);
  ffi        the CUDA FFI handlers of `make cuda` (`kernels/_lib/libtaco_codec_cuda.so`): `taco_encode` /
             `taco_decode` custom calls.

Asserted: each backend's kernels and no other backend's; one encode and one decode per compressed collective;
1-byte codes (u8) on the wire of every compressed collective; and no bf16 message widened to f32: the kernels
read and write bf16 messages as they are, and the only f32 collectives of the bf16 step are the model's own,
which are f32 in the f32 step too. The child records why a backend could not be tried (no jax-triton or
Triton, no CUDA FFI library) and its test skips with that reason.

Run as a script (the child): `python tests/test_gpu_step.py OUT.json BACKEND:DTYPE...`.
"""

import collections
import json
import os
import pathlib
import re
import sys

DTYPES = ("bfloat16", "float32")
#: gpt2-tiny's step at one of its four layers (`plan --layers 1`): every site and codec kernel of the full
#: step, at half its compile time (5-6 CPU s a compile here, 10-19 s at four layers).
LAYERS = 1
BACKENDS = ("reference", "pallas", "triton", "ffi")
#: The custom-call targets of each backend's codec kernels in XLA:GPU's program.
TARGETS = {"reference": set(), "pallas": {"__gpu$xla.gpu.triton"}, "triton": {"triton_kernel_call"},
           "ffi": {"taco_encode", "taco_decode"}}
KERNEL_TARGETS = set().union(*TARGETS.values())
#: The XLA dtype names of the message dtypes.
SHORT = {"bfloat16": "bf16", "float32": "f32"}
_CALL = re.compile(r"=\s+(.+?)\s+custom-call\(.*?custom_call_target=\"([^\"]+)\""
                   r"(?:.*?operand_layout_constraints=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$))?")
_DTYPE = re.compile(r"\b([a-z][a-z0-9]*)\[")


def kernel_calls(hlo_text: str) -> list[dict]:
    """The codec kernel custom calls (`KERNEL_TARGETS`) of a compiled GPU module: {"target", "kind"
    (encode: FP8 codes among the results; decode: among the operands), "results", "operands" (their
    dtypes, XLA's names)}. XLA:GPU prints each custom call's operand types in its
    `operand_layout_constraints`."""
    out = []
    for line in hlo_text.splitlines():
        m = _CALL.search(line)
        if not m or m[2] not in KERNEL_TARGETS:
            continue
        results, operands = _DTYPE.findall(m[1]), _DTYPE.findall(m[3] or "")
        kind = "encode" if any(d.startswith("f8") for d in results) else "decode"
        out.append({"target": m[2], "kind": kind, "results": results, "operands": operands})
    return out


def _child(out: str, cases: list[str]) -> None:
    """Compiles each BACKEND:DTYPE case of the gpt2-tiny step for 8 abstract H100s; writes {case: summary}."""
    import importlib.util
    import time
    import traceback

    from taco_jax.perf.hardware import get_hardware
    from taco_jax.train import deviceless, plan
    from taco_jax.train.config import TrainConfig

    texts = {}
    report = plan.compiled_report

    def keep(hlo_text, mesh, policy):  # compile_step's compiled text, for the kernels' operand types
        texts["hlo"] = hlo_text
        return report(hlo_text, mesh, policy)

    plan.compiled_report = keep
    devices = deviceless.gpu_devices(get_hardware("h100"), 8)
    summary = {}
    for case in cases:
        backend, dtype = case.split(":")
        why = None
        if backend == "triton":
            why = next((f"module {m!r} is not installed (jax-triton: make gpu-compile; triton: make gpu-sim)"
                        for m in ("triton", "jax_triton") if importlib.util.find_spec(m) is None), None)
        elif backend == "ffi":
            from taco_jax.kernels import ffi_codec

            why = ffi_codec.unavailable_reason("cuda")
        if why:
            summary[case] = {"skip": why}
            continue
        cfg = plan.with_layers(TrainConfig.from_flags(model="gpt2-tiny", mesh="data=2,tensor=4", backend=backend,
                                                      dtype=dtype), LAYERS)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            r = plan.compile_step(cfg, devices)
        except Exception as e:  # recorded: the test of this case fails with it
            summary[case] = {"error": f"{type(e).__name__}: {e}"[:3000], "trace": traceback.format_exc()[-3000:]}
            continue
        hlo = texts.pop("hlo")
        targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
        summary[case] = {"platform": r["platform"], "wall_s": time.perf_counter() - wall,
                         "cpu_s": time.process_time() - cpu, "by_site": r["by_site"], "mismatches": r["mismatches"],
                         "targets": dict(targets), "kernels": kernel_calls(hlo)}
    pathlib.Path(out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
    sys.exit(0)

import _procs  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.fast

PLUGIN = pathlib.Path(os.environ.get("TACO_GPU_COMPILE_PATH", _procs.ROOT / ".venv" / "gpu-compile"))


@pytest.fixture(scope="module")
def compiled(cache, tmp_path_factory):
    """{"BACKEND:DTYPE": the child's summary} for every backend and dtype, compiled in one child process."""
    if not PLUGIN.is_dir():
        pytest.skip(f"the CUDA plugin for the deviceless compile is not in {PLUGIN} (make gpu-compile)")
    out = tmp_path_factory.mktemp("gpu_step") / "summary.json"
    cases = [f"{b}:{d}" for d in DTYPES for b in BACKENDS]
    # no persistent cache: jax writes the deviceless GPU executables but cannot read them back without a GPU
    # client ("PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable")
    r = _procs.run([sys.executable, __file__, out, *cases], cache, timeout=1200,
                   PYTHONPATH=f"{_procs.ROOT}{os.pathsep}{PLUGIN}", JAX_ENABLE_COMPILATION_CACHE="false")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def _case(compiled, backend, dtype) -> dict:
    c = compiled[f"{backend}:{dtype}"]
    if "skip" in c:
        pytest.skip(f"backend {backend!r} cannot be compiled here: {c['skip']}")
    assert "error" not in c, f"{backend} {dtype}: {c['error']}\n{c['trace']}"
    assert c["platform"] == "gpu"
    return c


def _sites(c) -> list[dict]:
    return [s for s in c["by_site"] if s["site"]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backend_s_kernels_are_in_the_gpu_step(compiled, backend, dtype):
    """The step holds the backend's codec kernels and no other's, one encode and one decode (or fused
    decode-sum) per compressed collective: the codes sent by each all-to-all and all-gather are encoded
    once and decoded once by the receiver."""
    c = _case(compiled, backend, dtype)
    assert set(c["targets"]) & KERNEL_TARGETS == TARGETS[backend], c["targets"]
    kinds = collections.Counter(k["kind"] for k in c["kernels"])
    compressed = sum(s["compressed"] for s in _sites(c))
    assert compressed > 0
    if backend != "reference":
        assert kinds == {"encode": compressed, "decode": compressed}, (kinds, compressed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_compressed_site_sends_u8_codes(compiled, backend, dtype):
    """Every collective at a TACO site of the GPU program moves 1-byte codes (u8) and nothing else, both
    tensor-parallel sites are there, the program moves what the policy declares (no mismatch), and the
    backend changes nothing on the wire: the sites' collectives and bytes are the reference's."""
    c = _case(compiled, backend, dtype)
    sites = _sites(c)
    assert {s["site"] for s in sites} == {"ar_fwd", "ar_bwd"}, sites
    for s in sites:
        assert s["axis"] == "tensor" and s["dtypes"] == ["u8"] and s["compressed"] == s["collectives"] > 0, s
    assert not c["mismatches"]
    ref = compiled[f"reference:{dtype}"]
    if "by_site" in ref:
        assert sites == _sites(ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_bf16_message_is_widened_to_f32(compiled, backend):
    """In the bf16 step the kernels read and write bf16 messages as they are (no convert to f32 before an
    encode or after a decode), as they read and write f32 ones in the f32 step. The FFI backend has no fused
    decode-sum: for the reduce-scatter it decodes the P ranks' codes to f32 and sums them in f32 in rank
    order (`codec.dispatch.decode_sum`, the contract's f32 sum), so half of its decodes write f32 in both
    steps. On the wire, the bf16 step's f32 collectives are only the model's own (the loss's vocabulary-parallel
    reductions, the FP32 gradients' data-parallel all-reduce), the same ones as in the f32 step, and the
    compressed sites send the same bytes in both."""
    got = {d: _case(compiled, backend, d) for d in DTYPES}
    for dtype, c in got.items():
        msg = SHORT[dtype]
        for k in c["kernels"]:
            floats = k["operands"] if k["kind"] == "encode" else k["results"]
            assert floats == [msg] or (backend == "ffi" and k["kind"] == "decode" and floats == ["f32"]), k
        decodes = collections.Counter(tuple(k["results"]) for k in c["kernels"] if k["kind"] == "decode")
        if backend == "ffi" and dtype == "bfloat16":
            assert decodes == {("f32",): len(c["kernels"]) // 4, ("bf16",): len(c["kernels"]) // 4}, decodes
    model = {d: [s for s in c["by_site"] if not s["site"]] for d, c in got.items()}
    assert model["bfloat16"] == model["float32"]
    assert all(s["dtypes"] == ["f32"] for s in model["bfloat16"]), model
    assert [(s["site"], s["bytes"]) for s in _sites(got["bfloat16"])] == [(s["site"], s["bytes"])
                                                                          for s in _sites(got["float32"])]


def test_triton_kernels_are_built_for_the_capability_of_the_devices_lowered_for():
    """jax-triton builds a cubin while lowering, for device 0's compute capability unless told one; the
    Triton codec's lowering tells it the capability of the devices the step is lowered for (a jit's device
    assignment, a shard_map's mesh), which abstract CUDA devices carry; none for CPU devices or an abstract
    mesh (then jax-triton asks device 0 as before)."""
    from types import SimpleNamespace as NS

    import jax
    import numpy as np

    from taco_jax.kernels import triton_codec as tc

    h100 = NS(compute_capability="9.0")
    assert tc._capability_of([h100]) == 90 and tc._capability_of([NS(compute_capability="12.0")]) == 120
    assert tc._capability_of(jax.devices("cpu")) is None and tc._capability_of([]) is None

    def lowering(axis):
        return NS(module_context=NS(axis_context=axis))

    assert tc._lowering_capability(lowering(NS(device_assignment=(h100, h100)))) == 90
    assert tc._lowering_capability(lowering(NS(mesh=NS(devices=np.array([[h100, h100]]))))) == 90
    assert tc._lowering_capability(lowering(NS(mesh=jax.sharding.AbstractMesh((2,), ("x",))))) is None
    assert tc._lowering_capability(lowering(NS(device_assignment=None))) is None
