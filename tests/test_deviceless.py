"""`taco-jax plan --compiler gpu`: XLA:GPU compiles the real train step for a declared GPU on this CPU-only
machine (taco_jax/train/deviceless.py), and the memory verdict against the GPU's memory.

The CUDA plugin lives outside the test venv (`make gpu-compile` puts it in `.venv/gpu-compile`, which
`make test` runs first), so only the child processes that put it on their path see it: everywhere else
jax stays the CPU-only install the suite tests.
"""

import json
import os
import pathlib
import subprocess

import _procs
import pytest

from taco_jax.perf.hardware import get_hardware, load_hardware, parse_hardware, target_config
from taco_jax.train import deviceless

pytestmark = pytest.mark.fast

PLUGIN = pathlib.Path(os.environ.get("TACO_GPU_COMPILE_PATH", _procs.ROOT / ".venv" / "gpu-compile"))
GIB = 2**30


def test_every_shipped_gpu_has_a_target_for_the_gpu_compiler():
    for key, spec in load_hardware().items():
        text = target_config(spec)
        t = spec.target
        assert f"core_count: {t['sm_count']}\n" in text and f"device_memory_size: {t['memory_bytes']}\n" in text
        major, minor = t["compute_capability"].split(".")
        assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text, key
        assert "runtime_version { major: 12" in text and 'platform_name: "CUDA"' in text
    assert set(load_hardware()) >= {"h100", "h200", "b200", "a100", "h800"}
    assert get_hardware("h100").target["memory_bytes"] == 84942979072  # XLA's h100_sxm.txtpb


def _entry(**target):
    table = {k: v for k, v in load_hardware_raw()["h100"].items()}
    table["target"] = {**table["target"], **target}
    return table


def load_hardware_raw():
    import tomllib

    from taco_jax.perf.hardware import HARDWARE_FILE

    return tomllib.loads(HARDWARE_FILE.read_text())


def test_a_target_table_is_checked_and_optional():
    own = {"mine": {k: v for k, v in load_hardware_raw()["h100"].items() if k != "target"}}
    spec = parse_hardware(own, "--hardware-file 'x.toml'")["mine"]
    assert spec.target is None
    with pytest.raises(ValueError, match=r"no \[mine.target\] table, which --compiler gpu needs"):
        target_config(spec)
    for bad, match in ((dict(compute_capability="sm90"), "compute_capability='sm90' must be a version"),
                       (dict(memory_bytes=0), "memory_bytes=0 must be an integer >= 1"),
                       (dict(sm_count=1.5), "sm_count=1.5 must be an integer")):
        with pytest.raises(ValueError, match=match):
            parse_hardware({"mine": _entry(**bad)}, "f")


def test_memory_verdict_against_the_gpu_less_its_reserve():
    h100 = get_hardware("h100")
    memory = h100.target["memory_bytes"]
    reserve = sum(b for b, _ in deviceless.RESERVE.values())
    v = deviceless.memory_verdict(int(61.5 * GIB), h100)  # the qwen3-8b example of issue 51
    assert v["fits"] and v["budget"] == memory - reserve and v["reserve"] == reserve
    assert v["headroom_gib"] == pytest.approx((memory - reserve) / GIB - 61.5)
    assert v["mem_fraction"] is not None and 61.5 * GIB / memory < v["mem_fraction"] <= 0.99  # above JAX's 75 % pool
    lines = deviceless.verdict_lines(v, "H100")
    assert lines[0].startswith("fits: true") and "XLA_PYTHON_CLIENT_MEM_FRACTION" in lines[1]
    v = deviceless.memory_verdict(979 * GIB, h100)
    assert not v["fits"] and v["headroom_gib"] < -900 and v["mem_fraction"] is None
    assert deviceless.verdict_lines(v, "H100")[0].startswith("fits: false")
    assert deviceless.memory_verdict(10 * GIB, h100)["mem_fraction"] is None  # inside JAX's default pool
    assert all(s for _, s in deviceless.RESERVE.values())  # every reserve names its source


def test_topology_is_whole_nodes():
    h100 = get_hardware("h100")
    assert deviceless.topology(h100, 8) == "1x1x8" and deviceless.topology(h100, 4) == "1x1x4"
    assert deviceless.topology(h100, 32) == "4x1x8"
    with pytest.raises(ValueError, match="devices=12 is not a whole number of .* nodes of 8 GPUs"):
        deviceless.topology(h100, 12)


def test_gpu_compiler_without_the_plugin_names_the_extra(capsys, monkeypatch):
    from taco_jax.cli import main

    monkeypatch.setattr(deviceless, "plugin_error", lambda: "no plugin; install it with `" + deviceless.EXTRA + "`")
    assert main(["plan", "--model", "gpt2-tiny", "--mesh", "data=2,tensor=4", "--compiler", "gpu"]) == 2
    assert "pip install -e '.[gpu-compile]'" in capsys.readouterr().err


def test_plan_compiles_the_step_with_xla_gpu_and_refuses_what_does_not_fit(cache, tmp_path):
    """The real gpt2-tiny TACO step compiled by XLA:GPU for an H100 whose memory is declared 16 MiB
    (less than the reserve alone): exit 3, `fits: false` in the output and plan.json, compressed sites moving
    u8 codes in the GPU program. JAX_PLATFORMS is not set: the CLI keeps jax on the CPU itself."""
    if not PLUGIN.is_dir():
        pytest.skip(f"the CUDA plugin for the deviceless compile is not in {PLUGIN} (make gpu-compile)")
    hw = tmp_path / "small.toml"
    raw = load_hardware_raw()["h100"]
    body = [f"[tiny]\n{_toml(raw, skip=('intra', 'inter', 'codec', 'target'))}"]
    for part in ("intra", "inter", "codec", "target"):
        values = {**raw[part], **({"memory_bytes": 16 * 2**20} if part == "target" else {})}
        body.append(f"[tiny.{part}]\n{_toml(values)}")
    hw.write_text("\n".join(body))
    env = _procs.env(cache, PYTHONPATH=f"{_procs.ROOT}{os.pathsep}{PLUGIN}")
    env.pop("JAX_PLATFORMS")
    out = tmp_path / "plan"
    r = subprocess.run(_procs.cli("plan", "--model", "gpt2-tiny", "--mesh", "data=2,tensor=4", "--hardware-file", hw,
                                  "--out", out), cwd=_procs.ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "fits: false" in r.stdout and "does not fit the H100 SXM 80GB's memory (exit 3)" in r.stderr
    plan = json.loads((out / "plan.json").read_text())
    c = plan["compiled"]
    assert c["platform"] == "gpu" and c["devices"] == 8
    v = c["verdict"]
    assert v["fits"] is False and v["peak"] == c["memory"]["peak"] > v["budget"] and v["memory"] == 16 * 2**20
    tensor = [s for s in c["by_site"] if s["axis"] == "tensor" and s["site"]]
    assert tensor and all(s["compressed"] == s["collectives"] and s["dtypes"] == ["u8"] for s in tensor)
    assert not c["mismatches"]
    x = c["xla_schedule"]  # XLA:GPU's own estimate, beside the cost model's
    assert 0 < x["waiting_s"] <= x["step_s"] < 1 and set(x["waiting_by_op"]) >= {"all_gather", "all_reduce"}
    assert "XLA:GPU scheduler" in r.stdout


def test_schedule_estimate_reads_the_statistics_at_the_end_of_the_dump(tmp_path):
    """`deviceless.schedule_estimate` reads the entry's `scheduler_statistics` (cycles over
    `cycles_per_microsecond`) from the tail of a large dump; no dump: None."""
    from taco_jax.train.deviceless import schedule_estimate

    assert schedule_estimate(str(tmp_path)) is None
    (tmp_path / "jit_train_step.schedule.txt").write_text(
        "hlo_module {\n" + "  x: 1\n" * 5000 + "}\ncomputation_schedules {\n  scheduler_statistics {\n"
        "    all_gather_wasted_cycles: 300\n    total_wasted_cycles: 500\n    total_cycles: 4000\n  }\n"
        "  cycles_per_microsecond: 2\n}\n")
    assert schedule_estimate(str(tmp_path)) == {"step_s": 2e-3, "waiting_s": 2.5e-4,
                                                "waiting_by_op": {"all_gather": 1.5e-4}}


def _toml(table, skip=()):
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items() if k not in skip)


def test_an_extrapolated_peak_decides_only_what_does_not_fit():
    from taco_jax.train.plan import extrapolate_peak

    assert extrapolate_peak({4: 12 * GIB, 8: 14 * GIB}, 36) == 28 * GIB  # the line through the two
    h100 = get_hardware("h100")
    v = deviceless.memory_verdict(30 * GIB, h100, lower_bound=True)
    assert v["fits"] is None and deviceless.verdict_lines(v, "H100")[0].startswith("fits: not decided")
    assert deviceless.memory_verdict(90 * GIB, h100, lower_bound=True)["fits"] is False


SCHEDULE = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[8,64]) -> f32[8,64] {
  %p = f32[8,64]{1,0} parameter(0)
  %all-gather-start = (u8[1,64]{1,0}, u8[4,64]{1,0}) all-gather-start(%p), channel_id=1, \
replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}, metadata={op_name="jit(f)/site_ar_fwd/all_gather"}, \
backend_config={"collective_backend_config":{"is_sync":false}}
  %fusion = f32[8,64]{1,0} fusion(%p), kind=kLoop, calls=%fused
  %custom-call = f32[8,64]{1,0} custom-call(%p), custom_call_target="__cublas$gemm"
  %all-gather-done = u8[4,64]{1,0} all-gather-done(%all-gather-start)
  %all-to-all-start = ((u8[4,64]{1,0}), u8[4,64]{1,0}) all-to-all-start(%p), channel_id=2, \
replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}, metadata={op_name="jit(f)/site_ar_bwd/all_to_all"}, \
backend_config={"collective_backend_config":{"is_sync":true}}
  %all-to-all-done = u8[4,64]{1,0} all-to-all-done(%all-to-all-start)
  ROOT %r = f32[8,64]{1,0} add(%fusion, %custom-call)
}
"""


def test_overlap_is_read_from_the_schedule_between_start_and_done():
    import numpy as np

    from taco_jax.collectives.hlo import async_overlap, collectives, overlap_by_site

    class Mesh:
        devices, axis_names = np.zeros((2, 4)), ("data", "tensor")

    recs = {r["site"]: r for r in async_overlap(SCHEDULE, Mesh)}
    assert recs["ar_fwd"]["between"] == {"compute": 1, "matmul": 1} and recs["ar_fwd"]["overlapped"]
    assert recs["ar_bwd"]["sync"] and not recs["ar_bwd"]["overlapped"] and recs["ar_bwd"]["between"] == {}
    # the bytes of an async start are its done's result, not the (operand, result) tuple
    assert {c["site"]: c["result_bytes"] for c in collectives(SCHEDULE, Mesh)} == {"ar_fwd": 256, "ar_bwd": 256}
    rows = {r["site"]: r for r in overlap_by_site(list(recs.values()))}
    assert rows["ar_fwd"]["overlapped_frac"] == 1.0 and rows["ar_bwd"]["overlapped_frac"] == 0.0
    assert all(r["axis"] == "tensor" for r in rows.values())
    from taco_jax.collectives.hlo import mesh_axis_groups

    assert mesh_axis_groups(Mesh)["data+tensor"] == {frozenset(range(8))}  # XLA:GPU's combined groups get a name


def test_extrapolate_needs_the_gpu_compiler(capsys):
    from taco_jax.cli import main

    for extra in (["--compiler", "cpu"], ["--no-compile"]):
        assert main(["plan", "--model", "gpt2-tiny", "--mesh", "data=2,tensor=4", "--extrapolate", *extra]) == 2
        assert "--extrapolate extrapolates XLA:GPU's peak: it needs --compiler gpu" in capsys.readouterr().err
