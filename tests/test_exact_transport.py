"""Exact collectives under gloo move the dtype a GPU run moves (`CodecConfig.transport` "gloo").

XLA:CPU widens narrow float collectives to float32 on the wire; with transport "gloo" the exact
all-reduce, all-gather, reduce-scatter and ppermute of a bfloat16 message move its bf16 bytes
(bit-cast to uint16; the all-reduce as all-to-all, FP32 rank-order sum, all-gather). In process:
the compiled collectives carry no f32 operand, and values and gradients equal the widened ones
(for these sums of P partial sums, the FP32 sum rounded once). With real processes (2 x gloo): the
exact bf16 train step compiles to collectives of the bytes it issues and trains bit-identically
to the plain one-process run.
"""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _procs import TINY, cli, losses, run, start
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.codec import NONE
from taco_jax.collectives import compressed as cc

pytestmark = pytest.mark.fast

GLOO = dataclasses.replace(NONE, transport="gloo")
WIDENED = dataclasses.replace(NONE, transport="gloo_widened")
_COLL = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
                   r"(?:-start)?\(")


def _collective_types(hlo: str) -> set[str]:
    """Element types of the operands of every collective in compiled HLO text."""
    return {dt for typ, _ in _COLL.findall(hlo) for dt in re.findall(r"\b([a-z]+\d+)\[", typ)}


def _fns(p):
    return {"psum": lambda v, c: cc.psum(v, "t", codec=c),
            "all_gather": lambda v, c: cc.all_gather(v, "t", codec=c, axis=1, tiled=True),
            "psum_scatter": lambda v, c: cc.psum_scatter(v, "t", codec=c, scatter_dimension=1),
            "ppermute": lambda v, c: cc.ppermute(v, "t", [(i, (i + 1) % p) for i in range(p)], codec=c)}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", ["psum", "all_gather", "psum_scatter", "ppermute"])
def test_bf16_exact_collectives_move_bf16_bytes(name, p):
    mesh = Mesh(np.array(jax.devices()[:p]), ("t",))
    x = jnp.asarray(np.random.default_rng(p).standard_normal((p * 4, 8 * p, 6)), jnp.bfloat16)
    f = _fns(p)[name]
    got = {}
    for codec in (GLOO, WIDENED):
        step = jax.jit(jax.shard_map(
            lambda v, c=codec: (f(v, c), jax.grad(lambda w: jnp.sum(f(w, c).astype(jnp.float32) ** 2))(v)),
            mesh=mesh, in_specs=P("t"), out_specs=(P() if name == "psum" else P("t"), P("t"))))
        types = _collective_types(step.lower(x).compile().as_text())
        if codec is GLOO:
            assert types == {"u16"}, types  # bf16 bytes only, forward and backward
        else:
            assert "f32" in types, types  # what XLA:CPU makes of a bf16 collective
        got[codec.transport] = [np.asarray(o).view(np.uint16) for o in step(x)]
    for a, b in zip(got["gloo"], got["gloo_widened"], strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit, value and gradient


def test_f32_messages_and_other_transports_are_unchanged():
    """float32 messages compile to the same program with "gloo" as with "gloo_widened"; transport
    "xla" keeps `lax`'s collectives for every dtype."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    xla = dataclasses.replace(NONE, transport="xla")
    for name, f in _fns(2).items():
        out = P() if name == "psum" else P("t")

        def hlo(fn, out=out):  # the computations, without metadata (source lines differ)
            text = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("t"), out_specs=out)).lower(x).compile().as_text()
            start = re.search(r"^(%|ENTRY)", text, flags=re.M).start()
            return re.sub(r",?\s*metadata=\{[^{}]*\}", "", text[start:])

        assert hlo(lambda v, f=f: f(v, GLOO)) == hlo(lambda v, f=f: f(v, WIDENED)), name
        assert "u16" not in _collective_types(hlo(lambda v, f=f: f(v.astype(jnp.bfloat16), xla))), name


#: An exact bf16 run on tensor=2 (2 processes x 1 device, or one process x 2 devices).
EXACT_BF16 = [*TINY, "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--mesh", "data=1,tensor=2",
              "--dtype", "bfloat16", "--no-progress"]


def _check_bf16_wire_and_losses(two, one) -> None:
    """The 2-process exact bf16 run in folder `two` against the plain one-process run in `one`: its
    compiled collectives move the bytes the program issues (bf16 as u16, nothing widened to f32; the
    one-process run's compiled step moves more), and its per-step losses and gradient norms equal the
    one-process run's bit for bit."""
    s2, s1 = (json.loads((d / "summary.json").read_text()) for d in (two, one))
    compiled, issued = s2["wire_bytes_per_step"]["tensor"], s2["wire_bytes_per_step_issued"]["tensor"]
    assert abs(compiled - issued) <= 0.02 * issued  # XLA may merge the few small f32 all-reduces
    assert s1["wire_bytes_per_step"]["tensor"] > 1.9 * s1["wire_bytes_per_step_issued"]["tensor"]  # widened
    tensor = [r for r in s2["wire_detail"] if r["axis"] == "tensor"]
    assert {r["dtype"] for r in tensor} <= {"u16", "f32"}, tensor  # no bf16 widened, no other type
    # the bf16 messages move as u16; the f32 ones are FP32 values (loss terms, replicated parameters' gradients)
    assert sum(r["bytes"] for r in tensor if r["dtype"] == "u16") >= 0.95 * compiled, tensor
    assert s2["wire_bytes_per_step"]["tensor"] <= 0.55 * s1["wire_bytes_per_step"]["tensor"]  # 2 bytes, not 4
    a, b = losses(one), losses(two)
    assert [r[0] for r in a] == [r[0] for r in b] == [1, 2]
    assert a == b, (a, b)
    assert all(math.isfinite(v) for _, v, _ in b)


def test_two_gloo_processes_move_bf16_and_match_one_with_sequence_parallelism(tmp_path, cache):
    """2 processes x 1 device (gloo), mesh tensor=2, exact bf16 step with sequence parallelism
    (all-gathers and reduce-scatters): `_check_bf16_wire_and_losses` against the plain one-process
    run (XLA's in-process collectives, bf16 widened to f32): a sum of two partial sums in FP32,
    rounded once, either way."""
    args = ["train", *EXACT_BF16, "--comm", "none", "--sequence-parallel"]
    p2 = start(cli(*args, "--out", tmp_path / "p2", processes=2), cache, tmp_path / "p2.log")
    ref = run(cli(*args, "--out", tmp_path / "ref"), cache)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert p2.wait(timeout=420) == 0, (tmp_path / "p2.log").read_text()[-3000:]
    _check_bf16_wire_and_losses(tmp_path / "p2", tmp_path / "ref")


def test_launch_compare_with_the_tensor_axis_spanning_two_processes(tmp_path, cache):
    """`launch --processes 2 -- compare` with tensor=2 over 2 processes x 1 device: both runs (exact,
    then TACO) on the distributed runtime; process 0 writes one summary.json naming both runs, with
    the tensor-axis wire bytes attributed to the tensor axis (replica groups are logical ids, not the
    processes' device ids). Its exact run (all-reduces) passes `_check_bf16_wire_and_losses` against
    the plain one-process `train --comm none`."""
    out = tmp_path / "cmp"
    p2 = start(cli("compare", *EXACT_BF16, "--out", out, processes=2), cache, tmp_path / "cmp.log")
    ref = run(cli("train", *EXACT_BF16, "--comm", "none", "--out", tmp_path / "ref"), cache)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert p2.wait(timeout=420) == 0, (tmp_path / "cmp.log").read_text()[-3000:]
    stdout = (tmp_path / "cmp.log").read_text()
    s = json.loads((out / "summary.json").read_text())
    assert s["processes"] == 2 and s["mesh"] == "data=1,tensor=2"
    assert set(s["tokens_per_s"]) == {"none", "taco"} and all(v > 0 for v in s["tokens_per_s"].values())
    assert math.isfinite(s["val_loss_none"]) and math.isfinite(s["val_loss_taco"])
    assert s["compressed_axes"] == ["tensor"]
    wire = s["tensor_wire_bytes_per_step"]
    assert wire["none"] > 0 and 0 < wire["taco"] < wire["none"]
    assert "?" not in s["wire_bytes_per_step"]["none"]
    for run_ in ("none", "taco"):
        assert len(losses(out / run_)) == 2
        assert json.loads((out / run_ / "summary.json").read_text())["processes"] == 2
    assert stdout.count("val loss taco:") == 1  # one summary printed (process 0)
    _check_bf16_wire_and_losses(out / "none", tmp_path / "ref")


@pytest.mark.slow
def test_one_process_step_with_transport_gloo_is_the_multiprocess_program():
    """`--transport gloo` in one process (mesh tensor=2, exact bf16 step, sequence parallel) compiles
    the program a 2-process gloo run compiles: the activations' all-gathers move u16 (bf16 bytes),
    the reduce-scatters are u16 all-to-alls, and no all-gather / reduce-scatter / all-to-all carries
    f32 (the plain one-process step widens all of them to f32); only all-reduces of f32 values
    (loss terms, parameter gradients) stay f32. Its two steps' losses and gradient norms equal the
    plain step's bit for bit: either way each reduce-scatter is a sum of two bf16 partial sums in
    FP32, rounded to bf16 once."""
    from jax.sharding import NamedSharding

    from taco_jax.cli import config_from_argv
    from taco_jax.train.step import make_trainer

    argv = ["train", "--model", "gpt2-tiny", "--mesh", "data=1,tensor=2", "--batch-size", "8", "--seq-len", "32",
            "--dtype", "bfloat16", "--sequence-parallel", "--comm", "none", "--vocab-size", "512"]
    kinds, numbers = {}, {}
    for transport in ("auto", "gloo"):
        trainer = make_trainer(config_from_argv([*argv, "--transport", transport]), jax.devices()[:2])
        params, opt_state = trainer.init()
        sharding = NamedSharding(trainer.mesh, P())
        spec = jax.ShapeDtypeStruct((8, 32), np.int32, sharding=sharding)
        compiled = trainer.train_step.lower(params, opt_state, spec, spec).compile()
        kinds[transport] = {(dt, kind) for typ, kind in _COLL.findall(compiled.as_text())
                            for dt in re.findall(r"\b([a-z]+\d+)\[", typ)}
        rng = np.random.default_rng(0)
        numbers[transport] = []
        for _ in range(2):
            tok = jax.device_put(rng.integers(0, 512, (8, 33), dtype=np.int32), sharding)
            params, opt_state, m = compiled(params, opt_state, tok[:, :-1], tok[:, 1:])
            numbers[transport].append((float(m["loss"]).hex(), float(m["grad_norm"]).hex()))
    moving = ("all-gather", "reduce-scatter", "all-to-all")
    assert {("f32", "all-gather"), ("f32", "reduce-scatter")} <= kinds["auto"]  # XLA:CPU's widened bf16
    assert {("u16", "all-gather"), ("u16", "all-to-all")} <= kinds["gloo"], kinds["gloo"]
    assert not {k for k in kinds["gloo"] if k[1] in moving and k[0] != "u16"}, kinds["gloo"]
    assert {k for k in kinds["gloo"] if k[1] not in moving} == {("f32", "all-reduce")}, kinds["gloo"]
    assert numbers["gloo"] == numbers["auto"], numbers
