"""Policy files (`taco-jax calibrate` -> `train --policy FILE`): round trip, clear errors, calibration's contract."""

import json

import numpy as np
import pytest

from taco_jax.codec import CodecConfig
from taco_jax.collectives.policy import SITES, CommPolicy
from taco_jax.train.calibrate import calibrate, candidates, split_messages
from taco_jax.train.capture import load_captures
from taco_jax.train.comm_flags import CommFlags
from taco_jax.train.config import TrainConfig

pytestmark = pytest.mark.fast


def test_json_round_trip(tmp_path):
    pol = CommPolicy(ar_fwd=CodecConfig(kind="int8", group_size=64, group_axis="token"),
                     ar_bwd=CodecConfig(scale_layout="folded", fmt="e5m2"),
                     pp_send=CodecConfig(kind="tah"), dp_grads=CodecConfig(kind="int4", hadamard=True),
                     all_reduce_algorithm="one_shot", min_bytes=1024)
    path = pol.to_json(tmp_path / "p.json", note="anything")
    assert CommPolicy.from_json(path) == pol
    assert json.loads(path.read_text())["sites"]["ar_fwd"] == {"kind": "int8", "group_size": 64, "group_axis": "token"}


def test_sites_absent_from_the_file_keep_the_base_codec(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"sites": {"ar_bwd": {"kind": "int8"}}}))
    base = CommPolicy.taco(all_reduce_algorithm="one_shot")
    pol = CommPolicy.from_json(path, base=base)
    assert pol.ar_bwd == CodecConfig(kind="int8") and pol.ar_fwd == base.ar_fwd
    assert pol.all_reduce_algorithm == "one_shot"


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"sites": {"ar_fwdd": {"kind": "int8"}}}, r"site='ar_fwdd' is not one of"),
        ({"sites": {"ar_fwd": {"kind": "int8", "groupsize": 64}}},
         r"site 'ar_fwd': unknown codec field\(s\) \['groupsize'\]"),
        ({"sites": {"ar_fwd": {"kind": "int8", "group_size": 100}}}, r"site 'ar_fwd': group_size=100"),
        ({"sites": {"ar_bwd": {"kind": "zstd"}}}, r"kind='zstd'"),
        ({"sites": {"ar_fwd": "int8"}}, r"expected a mapping of codec fields"),
        ({"ar_fwd": {"kind": "int8"}}, r"'sites' object"),
        ({"format": "taco_jax.policy/9", "sites": {}}, r"format='taco_jax.policy/9'"),
    ],
)
def test_bad_policy_file_raises_naming_the_file_and_value(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as e:
        CommPolicy.from_json(path)
    assert "bad.json" in str(e.value)


def test_unreadable_policy_file(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        CommPolicy.from_json(tmp_path / "x.json")
    with pytest.raises(ValueError, match="missing.json"):
        CommPolicy.from_json(tmp_path / "missing.json")


def test_train_config_uses_the_policy_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"sites": {"ar_fwd": {"kind": "int8", "group_axis": "token"}}}))
    cfg = TrainConfig.from_flags(comm="taco", policy_file=str(path), algorithm="one_shot")
    assert cfg.communication.policy.ar_fwd == CodecConfig(kind="int8", group_axis="token")
    assert cfg.communication.policy.ar_bwd == CommFlags().tensor_codec()  # from --comm taco
    assert cfg.communication.policy.all_reduce_algorithm == "one_shot"
    none_cfg = TrainConfig.from_flags(comm="none", policy_file=str(path))
    assert none_cfg.communication.policy.ar_fwd.kind == "int8" and none_cfg.communication.policy.ar_bwd.kind == "none"


def test_train_config_and_cli_reject_unknown_site(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"sites": {"attention": {"kind": "int8"}}}))
    with pytest.raises(ValueError, match="site='attention'"):
        TrainConfig.from_flags(policy_file=str(path))
    from taco_jax.cli import main

    assert main(["train", "--policy", str(path), "--no-progress"]) == 2
    assert "site='attention' is not one of" in capsys.readouterr().err


def test_train_config_codec_fields():
    cfg = TrainConfig.from_flags(codec_kind="int8", group_axis="token", group_size=64)
    assert cfg.communication.policy.ar_fwd == CodecConfig(kind="int8", group_axis="token", group_size=64)
    with pytest.raises(ValueError, match="kind='int3'"):
        TrainConfig.from_flags(codec_kind="int3")
    with pytest.raises(ValueError, match="capture=-1"):
        TrainConfig.from_flags(capture=-1)


# ------------------------------------------- calibration -------------------------------------------


def _fake_captures(root, steps=(10, 20, 30, 40), seed=0, edit=None):
    """Messages shaped like TP activations: heavy channels (ar_fwd), tiny gradients (ar_bwd).
    edit(step, arrays) may change a step's arrays before they are saved."""
    rng = np.random.default_rng(seed)
    cap = root / "captures"
    cap.mkdir(parents=True)
    chan = np.exp(rng.normal(0, 1.5, 64)).astype(np.float32)
    for s in steps:
        arrays = {f"ar_fwd__exit{i:02d}": (rng.standard_normal((4, 2, 32, 64)) * chan).astype(np.float32)
                  for i in range(3)}
        arrays.update({f"ar_bwd__enter{i:02d}": (rng.standard_normal((4, 2, 32, 64)) * 1e-6).astype(np.float32)
                       for i in range(3)})
        if edit:
            edit(s, arrays)
        np.savez(cap / f"step{s:05d}.npz", **arrays)
    (cap / "meta.json").write_text(json.dumps({"model": "fake", "captured_steps": list(steps), "roles": {}}))
    return cap


def test_split_alternates_steps(tmp_path):
    _, msgs = load_captures(_fake_captures(tmp_path))
    sp = split_messages(msgs, max_per_split=None)
    assert {m.step for m in sp["calib"]["ar_fwd"]} == {10, 30}
    assert {m.step for m in sp["heldout"]["ar_fwd"]} == {20, 40}
    assert len(sp["calib"]["ar_fwd"]) == 2 * 3 * 4  # steps × roles × tensor ranks


def test_candidates_cover_the_family():
    cands = candidates()
    assert len(cands) == len(set(cands)) == 132
    assert {c.kind for c in cands} == {"fp8_tensor", "fp8_group", "int8", "int4", "taco", "tah"}
    assert {c.group_axis for c in cands} == {"hidden", "token"}


def test_calibrate_writes_a_policy_at_least_as_good_as_every_fixed_choice(tmp_path):
    cap = _fake_captures(tmp_path)
    cands = [CodecConfig(kind="fp8_group"), CodecConfig(kind="fp8_group", group_axis="token"),
             CodecConfig(kind="int8", group_size=64), CodecConfig(kind="int8", group_size=64, group_axis="token"),
             CodecConfig(kind="int4", hadamard=True), CodecConfig(kind="int8", group_size=32)]  # last: over budget
    rep = calibrate(cap, tmp_path / "policy.json", cands=cands, progress=False)
    pol = CommPolicy.from_json(tmp_path / "policy.json")
    for site in ("ar_fwd", "ar_bwd"):
        assert getattr(pol, site).wire_bytes_per_element() <= 1.0625
        assert getattr(pol, site).name == rep["sites"][site]["choice"]
    # heavy channels: one channel across tokens is the better group for ar_fwd
    assert pol.ar_fwd.group_axis == "token"
    h = rep["heldout_mean_sqnr_db"]
    assert rep["calibrated_at_least_best_fixed"] and h["calibrated"] >= h["best_fixed_hindsight"]
    assert all(f["heldout_mean_sqnr_db"] <= h["calibrated"] for f in rep["fixed"] if f["feasible"])
    assert "int8-G32" in {f["codec"] for f in rep["fixed"] if not f["feasible"]}
    assert (tmp_path / "policy.report.md").read_text().startswith("Objective:")
    assert TrainConfig.from_flags(policy_file=str(tmp_path / "policy.json")).communication.policy.ar_fwd == pol.ar_fwd
    assert set(json.loads((tmp_path / "policy.json").read_text())["sites"]) <= set(SITES)


def test_calibrate_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="holds no meta.json"):
        calibrate(tmp_path, tmp_path / "p.json", progress=False)
    cap = _fake_captures(tmp_path)
    with pytest.raises(ValueError, match="no candidate codec fits"):
        calibrate(cap, tmp_path / "p.json", budget=0.3, cands=[CodecConfig(kind="int8")], progress=False)
    import taco_jax.train.calibrate as cal_mod

    def no_evaluation(*a, **k):
        raise AssertionError("a budget no candidate meets is refused before any candidate is evaluated")

    with monkeypatch.context() as m:
        m.setattr(cal_mod, "evaluate", no_evaluation)
        with pytest.raises(ValueError, match=r"budget=0.1 bytes/element: no candidate codec fits site"):
            calibrate(cap, tmp_path / "p.json", budget=0.1, progress=False)
    from taco_jax.cli import main

    assert main(["calibrate", "--captures", str(tmp_path / "nowhere")]) == 2
    for bad in (-1, -3):  # failed inside numpy, without the flag's name (0 means all, as its help says)
        with pytest.raises(ValueError, match=f"max_messages={bad} must be an integer >= 0"):
            calibrate(cap, tmp_path / "p.json", max_messages=bad, progress=False)
        assert main(["calibrate", "--captures", str(cap), "--max-messages", str(bad)]) == 2
        assert f"--max-messages {bad} must be >= 0" in capsys.readouterr().err  # the flag, not the keyword
    assert main(["calibrate", "--captures", str(cap), "--budget", "0"]) == 2
    assert "--budget 0 must be > 0" in capsys.readouterr().err


TIE_CANDIDATES = [CodecConfig(kind="fp8_tensor"), CodecConfig(kind="int8"), CodecConfig(kind="int4", group_size=512),
                  CodecConfig(kind="tah"), CodecConfig()]


def test_calibrate_infinite_ties_go_to_fewest_bytes(tmp_path):
    """A site whose messages are all zeros (every codec exact, SQNR +inf) takes the fewest
    bytes (int4-G512, 0.5078 B/elt), not the first candidate (fp8_tensor, 1.0002 B/elt)."""
    def zero_bwd(step, arrays):
        for k in arrays:
            if k.startswith("ar_bwd"):
                arrays[k][:] = 0

    cap = _fake_captures(tmp_path, edit=zero_bwd)
    rep = calibrate(cap, tmp_path / "p.json", cands=TIE_CANDIDATES, progress=False)
    assert rep["sites"]["ar_bwd"]["calib"]["sqnr_db"] == float("inf")
    assert rep["sites"]["ar_bwd"]["choice"] == "int4-G512"
    assert rep["sites"]["ar_bwd"]["calib"]["bytes_per_elt"] == min(c.wire_bytes_per_element(n=2 * 32 * 64)
                                                                   for c in TIE_CANDIDATES)
    def refuse(token):
        pytest.fail(f"non-JSON token {token}")

    for name in ("p.json", "p.report.json"):  # strict JSON: +inf written as the string "Infinity"
        doc = json.loads((tmp_path / name).read_text(), parse_constant=refuse)
    assert doc["sites"]["ar_bwd"]["calib"]["sqnr_db"] == "Infinity"


def test_calibrate_reports_and_excludes_a_nonfinite_message(tmp_path, capsys):
    """One calibration message with a NaN is reported and left out: the candidates are scored on the
    finite messages (not every one -inf, which would take the first candidate)."""
    def nan_once(step, arrays):
        if step == 10:
            arrays["ar_fwd__exit01"][2, 0, 3, 5] = np.nan

    cap = _fake_captures(tmp_path, edit=nan_once)
    rep = calibrate(cap, tmp_path / "p.json", cands=TIE_CANDIDATES, max_messages=0, progress=False)
    assert rep["excluded"] == [{"site": "ar_fwd", "step": 10, "role": "exit01", "what": "exit01", "rank": 2}]
    assert "('ar_fwd', 10)" in capsys.readouterr().err
    chosen = rep["sites"]["ar_fwd"]["calib"]["sqnr_db"]
    assert np.isfinite(chosen)
    assert all(row["calib"]["ar_fwd"]["sqnr_db"] <= chosen + 0.01 for row in rep["table"]
               if row["calib"]["ar_fwd"]["bytes_per_elt"] <= 1.0625)
    assert rep["messages"]["calib"]["ar_fwd"] == 2 * 3 * 4 - 1


def test_reduce_domain_and_chunks_flags_reach_the_policy_and_bad_values_name_themselves(capsys):
    from taco_jax import cli
    from taco_jax.train.config import TrainConfig

    pol = TrainConfig.from_flags(reduce_domain="hadamard", chunks=2).communication.policy
    assert (pol.reduce_domain, pol.chunks) == ("hadamard", 2)
    args = cli._parser().parse_args(["train", "--reduce-domain", "hadamard", "--chunks", "auto", "--min-bytes", "auto"])
    assert (args.reduce_domain, args.chunks, args.min_bytes) == ("hadamard", "auto", "auto")
    for flag, value, msg in (("--chunks", "0", "chunks=0 must be an integer >= 1"),
                             ("--min-bytes", "-3", "min_bytes=-3 must be an integer >= 0"),
                             ("--min-bytes", "1e3", "min_bytes='1e3' must be an integer >= 0")):
        with pytest.raises(SystemExit) as e:
            cli._parser().parse_args(["train", flag, value])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="reduce_domain='foo'"):
        _ = TrainConfig.from_flags(reduce_domain="foo").communication.policy


def test_start_line_says_when_a_compressing_axis_is_not_in_the_mesh():
    """The run's first line (`describe_policy`) names each axis's codec, and says so when that axis
    is absent or of size 1, so nothing is sent or compressed on it (e.g. --comm taco on data=8)."""
    from taco_jax.train.loop import describe_policy

    policy = CommPolicy.taco()
    assert "nothing sent" not in describe_policy(policy, {"data": 2, "tensor": 4})
    line = describe_policy(policy, {"data": 8})
    assert "tensor: taco" in line and "(no tensor axis in the mesh: nothing sent, nothing compressed)" in line
    assert "data: none;" in line  # an exact axis gets no note
