"""The cost model (`taco_jax.perf`): fits recover known parameters, FLOP counts, monotonic behaviour,
`min_bytes="auto"`, the auto policy, and clear errors. Pure arithmetic: no timing, no devices."""

import argparse
import dataclasses
import math

import pytest

from taco_jax import perf
from taco_jax.codec import NONE, TACO, CodecConfig
from taco_jax.collectives.policy import TENSOR_SITES, CommPolicy
from taco_jax.models import get_config
from taco_jax.perf import model
from taco_jax.perf.model import CodecSpeed, Hardware, Layout, Link

pytestmark = pytest.mark.fast

SLOW = Link("slow", 1e-4, 1e-9)  # 1 GB/s
FAST_CODEC = CodecSpeed(50.0, 50.0, 1e-5)


def _hw(link, codec=FAST_CODEC):
    return Hardware("test", 1e14, 0.5, 8, link, link, {"default": codec})


def test_fit_link_recovers_alpha_beta_from_synthetic_rows():
    alpha, beta = 2e-4, 3e-9
    rows = [{"collective": "psum", "codec": "none", "backend": "none", "transport": "gloo", "processes": p,
             "size_bytes": n, "time_s_median": 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta}
            for p in (2, 4) for n in (1 << 16, 1 << 20, 1 << 24)]
    rows.append({"collective": "psum", "codec": "taco", "backend": "ffi", "processes": 2, "size_bytes": 1,
                 "time_s_median": 99.0})  # compressed rows are not part of the link fit
    link = perf.fit_link(rows)
    assert link.alpha_s == pytest.approx(alpha, rel=1e-6) and link.beta_s_per_byte == pytest.approx(beta, rel=1e-6)


def test_fit_codec_and_validate_recover_the_generating_model():
    link, speed = Link("l", 1e-3, 2e-9), CodecSpeed(4.0, 2.0, 5e-5)
    rows = []
    for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
        rows.append({"collective": "codec", "backend": "ffi", "size_bytes": n,
                     "encode_s": speed.encode_s(n), "decode_s": speed.decode_s(n)})
        for codec in (NONE, dataclasses.replace(TACO, backend="ffi")):
            t = model.collective_time("all_reduce", n, 2, link, codec, speed)
            rows.append({"collective": "psum", "codec": codec.kind, "backend": codec.backend if codec.kind != "none"
                         else "none", "transport": "gloo", "dtype": "float32", "processes": 2, "size_bytes": n,
                         "time_s_median": t})
    cal = perf.fit_calibration(rows)
    got = cal.codec["ffi"]
    assert got.encode_GBps == pytest.approx(4.0, rel=1e-6) and got.decode_GBps == pytest.approx(2.0, rel=1e-6)
    assert got.overhead_s == pytest.approx(5e-5, rel=1e-6)
    checks = perf.validate(cal, rows)
    assert len(checks) == 8 and max(abs(c["error"]) for c in checks) < 1e-6


def test_flops_of_gpt2_124m_are_6_n_tokens_plus_attention():
    cfg = get_config("gpt2-124m")
    b, t = 8, 1024
    n = perf.param_count(cfg)
    assert n == 124_439_808  # GPT-2 small, published (= models.count_params, tests/test_model.py)
    f = perf.flops(cfg, b, t)
    attention = 3 * 4 * t * cfg.n_embd * cfg.n_layer * b * t  # QK^T and AV, forward + backward
    assert f["total"] == pytest.approx(6 * n * b * t + attention, rel=0.01)
    assert perf.flops(cfg, b, t, backward=False)["total"] == pytest.approx(f["total"] / 3)


@pytest.mark.parametrize("name, published", [("qwen3-0.6b", 596_049_920), ("qwen2.5-7b", 7_615_616_512)])
def test_qwen_param_count_close_to_the_published_one(name, published):
    # published counts as checked against the model in tests/test_qwen.py (models.count_params)
    assert perf.param_count(get_config(name)) == pytest.approx(published, rel=2e-3)


def test_times_grow_with_size_and_speedup_with_slower_links():
    taco = dataclasses.replace(TACO, backend="ffi")
    sizes = [2**k for k in range(10, 28, 2)]
    for op in model.OPS:
        ts = [model.collective_time(op, n, 4, SLOW, taco, FAST_CODEC) for n in sizes]
        assert ts == sorted(ts)
    cfg, lay = get_config("gpt2-350m"), Layout(tp=4, micro_batch=4, seq_len=1024)
    s = [perf.speedup(cfg, lay, _hw(Link.from_bandwidth("l", 1e-5, bw)), CommPolicy.taco(taco))
         for bw in (1e12, 1e11, 1e10, 1e9)]
    assert s == sorted(s) and s[-1] > 1.5 and s[0] < 1.0
    # more compute per byte (larger MFU-adjusted FLOPs per message): the gain shrinks
    fast = _hw(SLOW)
    slow = dataclasses.replace(fast, peak_flops=1e12)
    assert perf.speedup(cfg, lay, fast, CommPolicy.taco(taco)) > perf.speedup(cfg, lay, slow, CommPolicy.taco(taco))


def test_break_even_is_where_the_two_times_cross():
    taco = dataclasses.replace(TACO, backend="ffi")
    n = perf.break_even_bytes("all_reduce", 2, SLOW, taco, FAST_CODEC)
    assert 0 < n < model.NEVER
    t = lambda m, c: model.collective_time("all_reduce", m, 2, SLOW, c, FAST_CODEC)  # noqa: E731
    assert t(n, taco) <= t(n, NONE) and t(n - 16, taco) > t(n - 16, NONE)
    free = Link("free", 0.0, 0.0)
    assert perf.break_even_bytes("all_reduce", 2, free, taco, FAST_CODEC) == model.NEVER


def test_min_bytes_auto_resolution():
    taco = dataclasses.replace(TACO, backend="ffi")
    pol = CommPolicy.taco(taco, min_bytes="auto")
    with pytest.raises(ValueError, match="min_bytes='auto' is unresolved"):
        pol.codec_for("ar_fwd", __import__("numpy").zeros(4, "float32"))
    cal = perf.Calibration(SLOW, {"ffi": FAST_CODEC})
    got = perf.resolve_min_bytes(pol, "cpu", tensor_size=2, calibration=cal, sequence_parallel=False)
    assert got.min_bytes == perf.break_even_bytes("all_reduce", 2, SLOW, taco, FAST_CODEC)
    sp = perf.resolve_min_bytes(pol, "cpu", tensor_size=2, calibration=cal, sequence_parallel=True).min_bytes
    assert sp == max(-(-perf.break_even_bytes("all_gather", 2, SLOW, taco, FAST_CODEC) // 2),
                     perf.break_even_bytes("reduce_scatter", 2, SLOW, taco, FAST_CODEC))
    assert perf.resolve_min_bytes(dataclasses.replace(pol, min_bytes=4096), "cpu", calibration=cal).min_bytes == 4096
    shipped = perf.resolve_min_bytes(pol, "cpu")  # the calibration file shipped with the package
    assert isinstance(shipped.min_bytes, int) and shipped.min_bytes >= 0
    assert isinstance(perf.resolve_min_bytes(CommPolicy.taco(min_bytes="auto"), "cuda", tensor_size=8).min_bytes, int)
    with pytest.raises(ValueError, match="platform='tpu'"):
        perf.resolve_min_bytes(pol, "tpu")
    with pytest.raises(ValueError, match="min_bytes='-1'"):
        CommPolicy(min_bytes="-1")


def test_cli_min_bytes_accepts_auto_and_integers():
    from taco_jax.train.settings import int_or_auto

    parse = int_or_auto("min_bytes", 0)
    assert parse("auto") == "auto" and parse("65536") == 65536
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", type=parse)
    for bad in ("-1", "big"):
        with pytest.raises(SystemExit):
            p.parse_args(["--min-bytes", bad])
    from taco_jax.train.config import TrainConfig

    assert TrainConfig.from_flags(min_bytes="auto").communication.policy.min_bytes == "auto"


def test_auto_policy_exact_on_free_links_and_compressed_on_slow_ones():
    taco = dataclasses.replace(TACO, backend="ffi")
    cfg, lay = get_config("gpt2-124m"), Layout(tp=4, micro_batch=4, seq_len=1024)
    cand = CommPolicy.taco(taco, dp_grads=CodecConfig(kind="int8"))
    free = perf.auto_policy(cfg, lay, _hw(Link("free", 0.0, 0.0)), cand)
    assert all(getattr(free, s).kind == "none" for s in model.SITES)
    slow = perf.auto_policy(cfg, lay, _hw(SLOW), cand)
    assert slow.ar_fwd == taco and slow.ar_bwd == taco
    assert slow.dp_grads.kind == "none"  # dp = 1: the site does not run
    assert perf.speedup(cfg, lay, _hw(SLOW), slow) >= 1.0


@pytest.mark.parametrize("make, match", [
    (lambda: Link("x", -1.0, 1e-9), "alpha_s=-1.0"),
    (lambda: Link("x", 0.0, math.nan), "beta_s_per_byte=nan"),
    (lambda: CodecSpeed(0.0, 1.0), "encode_GBps=0.0"),
    (lambda: Hardware("x", 1e12, 1.5, 8, SLOW, SLOW), "mfu=1.5"),
    (lambda: Layout(tp=0), "tp=0"),
    (lambda: Layout(act_bytes=3), "act_bytes=3"),
    (lambda: model.collective_time("bcast", 1, 2, SLOW), "op='bcast'"),
    (lambda: model.collective_time("send", -5, 2, SLOW), "nbytes=-5"),
    (lambda: model.collective_time("send", 5, 2, SLOW, TACO, FAST_CODEC, chunks=0), "chunks=0"),
    (lambda: perf.flops(get_config("gpt2-tiny"), 0, 8), "batch=0"),
    (lambda: perf.fit_link([{"collective": "psum", "codec": "none", "size_bytes": 8, "time_s_median": 1.0}]),
     "at >= 2 sizes"),
    (lambda: perf.fit_link([{"collective": "psum", "codec": "none", "size_bytes": 8, "time_s_median": -1.0}]),
     "time_s_median=-1.0"),
    (lambda: _hw(SLOW, None).codec_speed(TACO) if False else Hardware("x", 1e12, .5, 8, SLOW, SLOW).codec_speed(TACO),
     f"backend={TACO.backend!r}"),
])
def test_bad_inputs_raise_value_error_naming_the_value(make, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        make()


def test_paper_predictions_are_finite_and_tp_sites_only_touch_tp_time():
    from taco_jax.perf import paper

    rows = paper.predictions()
    assert rows and all(math.isfinite(r["taco_tp"]) and r["taco_tp"] > 0 for r in rows)
    cfg, lay, hw = paper.GPT_13B, Layout(tp=8, pp=4, n_micro=8), perf.H800
    a, b = perf.step_time(cfg, lay, hw), perf.step_time(cfg, lay, hw, CommPolicy.taco())
    assert a["pp_s"] == b["pp_s"] and a["dp_s"] == b["dp_s"] and b["tp_s"] < a["tp_s"]
    assert set(TENSOR_SITES) >= {"ar_fwd", "ar_bwd"}


def test_fit_codec_sim_recovers_the_local_work_of_the_collective():
    speed = CodecSpeed(3.0, 3.0, 2e-5)
    rows = []
    for n in (1 << 18, 1 << 20, 1 << 22):
        base = 1e-4 + n * 1e-10
        work = speed.encode_s(n * 1.5, 2) + speed.decode_s(2 * n, 2)
        rows += [{"collective": "psum", "codec": "none", "backend": "lax", "transport": "sim", "processes": 1,
                  "devices": 2, "size_bytes": n, "time_s_median": base},
                 {"collective": "psum", "codec": "taco", "backend": "ffi", "transport": "sim", "processes": 1,
                  "devices": 2, "size_bytes": n, "time_s_median": base + work}]
    got = perf.fit_codec_sim(rows, "ffi")
    assert got.encode_GBps == pytest.approx(3.0, rel=1e-6) and got.overhead_s == pytest.approx(2e-5, rel=1e-6)
    with pytest.raises(ValueError, match="backend='ffi'|at >= 2 sizes"):
        perf.fit_codec_sim(rows[:2], "ffi")
    with pytest.raises(ValueError, match="codec_from='x'"):
        perf.fit_calibration(rows, codec_from="x")


def test_trainer_resolves_min_bytes_auto_before_tracing():
    import jax

    from taco_jax.train.config import TrainConfig
    from taco_jax.train.step import make_trainer

    cfg = TrainConfig.from_flags(model="gpt2-tiny", mesh="tensor=2", batch_size=2, seq_len=16, backend="ffi",
                                 min_bytes="auto")
    trainer = make_trainer(cfg, jax.devices()[:2])
    cal = perf.Calibration.from_json(perf.CPU_CALIBRATION)
    want = perf.site_break_even(trainer.policy, cal.link, cal.codec, 2, itemsize=2, sequence_parallel=False)  # bf16
    assert isinstance(trainer.policy.min_bytes, int) and trainer.policy.min_bytes == want


def test_decomposed_fit_subtracts_the_sim_local_work():
    link = Link("l", 3e-4, 2e-9)
    taco = dataclasses.replace(TACO, backend="ffi")
    rows = []
    for n in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
        local = {"none": 1e-4 + (n / 1e6) ** 1.5 * 1e-4, "taco": 5e-4 + (n / 1e6) ** 1.3 * 3e-4}  # not affine
        for kind, c in (("none", NONE), ("taco", taco)):
            common = {"collective": "psum", "algorithm": "two_shot", "codec": kind, "dtype": "float32",
                      "backend": "ffi" if kind == "taco" else "lax", "size_bytes": n}
            rows.append({**common, "transport": "sim", "processes": 1, "devices": 2, "time_s_median": local[kind]})
            rows.append({**common, "transport": "gloo", "processes": 2, "devices": 2, "time_s_median":
                         local[kind] + model.comm_time("all_reduce", n, 2, link, perf.wire_ratio(c))})
    got = perf.fit_link(rows, subtract_sim=True)
    assert got.alpha_s == pytest.approx(3e-4, rel=1e-6) and got.beta_s_per_byte == pytest.approx(2e-9, rel=1e-6)
    cal = perf.Calibration(got, {})
    checks = perf.validate(cal, rows, local="sim")
    assert len(checks) == 8 and max(abs(c["error"]) for c in checks) < 1e-6
    with pytest.raises(ValueError, match="local='x'"):
        perf.validate(cal, rows, local="x")


def test_break_even_codec_speed_is_where_speedup_crosses_one_and_target_beats_today_on_slow_links():
    from taco_jax.perf import paper  # noqa: PLC0415

    rows = paper.codec_outlook()
    assert {r["tp_link"] for r in rows} == {label for label, _, _ in paper.TP_LINKS}
    _, cfg, lay, _, _ = paper.settings()[0]
    pol = paper.policies()["taco_tp"]
    for label, hw, link in paper.TP_LINKS:
        hw2 = paper._with_codec(hw, perf.H200_CODEC, link, lay.tp)
        be = paper.break_even_codec_GBps(cfg, lay, hw2, pol)
        if be is None:
            continue
        def at(gbps, hw=hw, link=link):
            return model.speedup(cfg, lay, paper._with_codec(hw, CodecSpeed(gbps, gbps, 8e-6), link, lay.tp), pol)

        assert at(be * 0.99) < 1.0 <= at(be * 1.01), label
    slow = [r for r in rows if "PCIe" in r["tp_link"] or "InfiniBand" in r["tp_link"]]
    assert all(r["speedup_target"] >= r["speedup_today"] > 1 for r in slow)
    assert paper.target_codec(0.8, 2).encode_GBps == pytest.approx(0.8 * 4.8e12 / (1 + 1.0625 / 2) / 1e9)
    with pytest.raises(ValueError, match="fraction=1.5"):
        paper.target_codec(1.5)
