"""experiments.collectives.bench_collectives: a --quick run on tiny messages over both transports (one process
with 2 simulated devices; 2 real processes over gloo), its JSON schema, exactness of codec "none"
and the wire bytes of taco; option parsing. Real processes, no mocks; no timing asserts."""

from __future__ import annotations

import json
import math
import sys

import pytest
from _procs import run

from experiments.collectives import bench_collectives as bc

CASES = {("psum", "two_shot"), ("psum", "one_shot"), ("all_gather", "default"), ("psum_scatter", "default"),
         ("ppermute", "default")}


@pytest.mark.parametrize(("transport", "donate"), [("sim", False), ("gloo", True)])
def test_quick_run(tmp_path, cache, transport, donate):
    """sim: 1 process × 2 devices (and the PNG); gloo: 2 processes × 1 device over 127.0.0.1, with
    --donate (every call consumes a fresh copy of the input, with the same results)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "experiments.collectives.bench_collectives", "--out", str(out), "--quick",
           "--transports", transport, "--ranks", "2", "--sizes", "16K", "--codecs", "none,taco",
           "--backends", "ffi", "--dtypes", "float32", "--warmup", "0", "--timeout", "240",
           *(["--no-plot"] if transport == "gloo" or donate else []), *(["--donate"] if donate else [])]
    res = run(cmd, cache, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "bench_collectives.json").read_text())  # strict JSON: json reads it
    assert doc["schema"] == "taco_jax.bench_collectives/1"
    assert doc["config"]["donate"] is donate
    if transport == "sim" and not donate:
        assert (out / "bench_collectives.png").stat().st_size > 1000
    rows = doc["rows"]
    for r in rows:
        assert set(bc.ROW_KEYS) <= set(r), set(bc.ROW_KEYS) - set(r)
        assert r["transport"] == transport and r["size_bytes"] == 16384 and r["dtype"] == "float32"
        assert r["devices"] == 2 and r["processes"] == (2 if transport == "gloo" else 1)
        assert r["runs"] == 5 == len(r["times_s"])
        assert 0 < r["time_s_min"] <= r["time_s_median"]
        assert math.isclose(r["algbw_gbps"], r["size_bytes"] * (2 if r["collective"] == "all_gather" else 1)
                            / r["time_s_median"] / 1e9)
        factor = {"psum": 1.0, "ppermute": 1.0}.get(r["collective"], 0.5)  # 2(P-1)/P, (P-1)/P, 1 at P = 2
        assert math.isclose(r["busbw_gbps"], r["algbw_gbps"] * factor)
    by = {(r["collective"], r["algorithm"], r["codec"], r["backend"]): r for r in rows}
    assert len(by) == len(rows) == len(CASES) * 2
    for coll, alg in CASES:
        exact, taco = by[(coll, alg, "none", "lax")], by[(coll, alg, "taco", "ffi")]
        assert exact["rel_err"] == 0.0 and exact["speedup_vs_exact"] == 1.0
        assert 0 < taco["wire_bytes"] < exact["wire_bytes"], (coll, alg)
        assert 0 < taco["rel_err"] < 0.1, (coll, alg, taco["rel_err"])  # FP8 error, not garbage
        assert math.isclose(taco["speedup_vs_exact"], exact["time_s_median"] / taco["time_s_median"])
        assert taco["exact_time_s_median"] == exact["time_s_median"]
    # exact wire bytes: the bandwidth-optimal counts of hlo.collective_bytes at P = 2
    assert by[("psum", "two_shot", "none", "lax")]["wire_bytes"] == 16384  # 2(P-1)/P × 16 KB
    assert by[("ppermute", "default", "none", "lax")]["wire_bytes"] == 16384
    assert by[("psum_scatter", "default", "none", "lax")]["wire_bytes"] == 8192  # (P-1)/P × 16 KB
    # taco: 16 KB f32 = 4096 elements = 32 groups of 128, each 128 FP8 codes + 2 FP32 scales
    assert by[("ppermute", "default", "taco", "ffi")]["wire_bytes"] == 32 * (128 + 8)
    be = doc["summary"]["break_even"]
    assert len(be) == len(CASES) and all("break_even_bytes" in b for b in be)
    assert doc["env"]["git_commit"] and doc["env"]["workers"][0]["process_count"] == rows[0]["processes"]
    assert doc["run"]["commit"] == doc["env"]["git_commit"]
    assert doc["run"]["command"].startswith("python -m experiments.collectives.bench_collectives --out ")


def test_options_are_checked_before_running():
    with pytest.raises(ValueError, match="no option"):  # psum has no `tiled`
        bc.parse_variants("k4:algorithm=one_shot:tiled=true")
    with pytest.raises(ValueError, match="given twice"):
        bc.parse_variants("one_shot,one_shot")
    v = bc.parse_variants("one_shot,all_gather/t:tiled=false")
    assert v["psum"] == [("one_shot", {"algorithm": "one_shot"})]
    assert v["all_gather"] == [("t", {"tiled": False})] and v["ppermute"] == [("default", {})]
    with pytest.raises(ValueError, match="not one of"):
        bc.parse_variants("allreduce/x")
    assert bc.parse_size("64K") == 65536 and bc.parse_size("2M") == 2 << 20 and bc.parse_size("100") == 100
    for bad in ("", "1X", "-4K", "0"):
        with pytest.raises(ValueError, match="size"):
            bc.parse_size(bad)
    for flags, match in ((["--runs", "3"], "runs"), (["--codecs", "zip"], "codecs"), (["--ranks", "1"], "ranks"),
                         (["--transports", "mpi"], "transports"), (["--dtypes", "float16"], "dtypes")):
        with pytest.raises(ValueError, match=match):
            bc.build_config(bc.parse_args(["--out", "x", *flags]))


def _case(codec, size, times, sq_err=0.0):
    return dict(collective="psum", algorithm="two_shot", variant_kwargs={"algorithm": "two_shot"}, codec=codec,
                backend="lax" if codec == "none" else "ffi", dtype="float32", size_bytes=size,
                wire_bytes=100 if codec == "none" else 27, sq_err=sq_err, sq_ref=4.0, sq_err_last=sq_err,
                times_s=times)


def test_merge_and_break_even():
    """A round's time is the slowest process's; cases not every process finished (a --timeout) are
    dropped; the break-even size is the smallest from which every larger size is faster."""
    p0 = [_case("none", 1024, [1.0] * 5), _case("taco", 1024, [2.0] * 5, 1.0),
          _case("none", 4096, [4.0] * 5), _case("taco", 4096, [1.0, 1.0, 1.0, 1.0, 9.0], 1.0),
          _case("none", 16384, [8.0] * 5), _case("taco", 16384, [2.0] * 5, 1.0)]
    p1 = [dict(c, times_s=[t * (3 if i == 0 else 1) for i, t in enumerate(c["times_s"])]) for c in p0[:4]]
    rows = bc.merge([{"cases": p0}, {"cases": p1}], "gloo", 2)
    assert [r["size_bytes"] for r in rows] == [1024, 1024, 4096, 4096]  # 16384 only on process 0
    taco = rows[3]
    assert taco["times_s"] == [3.0, 1.0, 1.0, 1.0, 9.0] and taco["time_s_median"] == 1.0 and taco["time_s_min"] == 1.0
    assert taco["speedup_vs_exact"] == 4.0 and taco["speedup_vs_exact_min"] == 4.0  # exact [12, 4, 4, 4, 4]
    assert taco["rel_err"] == taco["rel_err_last"] == 0.5  # sqrt((1 + 1) / (4 + 4))
    assert taco["busbw_gbps"] == taco["algbw_gbps"] == 4096 / 1.0 / 1e9  # 2(P-1)/P = 1 at P = 2
    assert taco["exact_wire_bytes"] == 100 and taco["wire_bytes"] == 27
    (be,) = bc.break_even(rows)
    assert be["break_even_bytes"] == 4096 and be["speedup_at_largest"] == 4.0 and be["largest_bytes"] == 4096
    (be,) = bc.break_even(bc.merge([{"cases": p0}], "sim", 2)[:2])
    assert be["break_even_bytes"] is None  # slower at its only size
