"""The environment variables the package reads: exactly an allowlist, each with its reason. What
changes a run's numbers or behaviour is a run config field (in config.json), not a variable; test-only
faults live in `taco_jax.testing.faults`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PKG = Path(__file__).resolve().parents[1] / "taco_jax"

#: Variable -> why the package may read it.
ALLOWED = {
    "XLA_FLAGS": "XLA's own flags: `--devices` adds the simulated CPU device count before JAX starts",
    "JAX_PLATFORMS": "JAX's own: set to cpu (unless already set) where the CUDA plugin is installed but no driver is",
    "JAX_COORDINATOR_ADDRESS": "JAX's own distributed variable (jax.distributed.initialize reads it too)",
    "JAX_NUM_PROCESSES": "JAX's own distributed variable (jax.distributed.initialize reads it too)",
    "JAX_PROCESS_ID": "JAX's own distributed variable (jax.distributed.initialize reads it too)",
    "TACO_KERNELS_LIB_DIR": "where the built FFI libraries are (a folder; a missing library is an error naming it)",
    "TACO_FFI_THREADS": "the C++ codec library's own thread cap (it reads it; checked here): speed only, same bytes",
    "TACO_FFI_SPIN_US": "the C++ codec library's own helper-thread spin time (it reads it; checked here): speed only",
    "TACO_JAX_NETNS_PREFIX": "name prefix of the emulated cluster's network namespaces (keeps test runs apart)",
    "TACO_JAX_CACHE": "download cache folder of the Shakespeare text (the same bytes wherever it is)",
    "TACO_JAX_TEST_STALL": "test-only fault: a process stalls at a step or evaluation (taco_jax.testing.faults)",
    "TACO_JAX_TEST_SLOW_SAVE": "test-only fault: checkpoint saves stay in flight (taco_jax.testing.faults)",
}
#: Files handing the whole environment on (children inherit it) or to a reader of `ALLOWED` names.
WHOLE_ENVIRONMENT = {
    "launch.py": "the launched processes inherit the launcher's environment",
    "emulate.py": "the namespace reaper inherits the environment",
    "train/distributed.py": "DistConfig.resolve reads JAX's distributed variables from a given mapping",
}


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _env_names(tree) -> dict[str, set[str]]:
    """Module-level names holding variable names (ENV_* / *_ENV): name -> the strings it holds."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            for t, v in pairs:
                if isinstance(t, ast.Name) and "ENV" in t.id:
                    values = v.keys if isinstance(v, ast.Dict) else [v]
                    out[t.id] = {x.value for x in values if isinstance(x, ast.Constant) and isinstance(x.value, str)}
    return out


def _reads() -> tuple[dict[str, str], set[str], list[tuple[str, str]]]:
    """(variable -> first file reading it, files using the whole environment, (file, name) of reads
    whose key is a local name)."""
    names, whole, unresolved = {}, set(), []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        tree = ast.parse(path.read_text(), rel)
        consts = _env_names(tree)
        for values in consts.values():
            for v in values:
                names.setdefault(v, rel)
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not _is_environ(node):
                continue
            up = parents.get(node)
            call = parents.get(up) if isinstance(up, ast.Attribute) else up
            key = (call.args[0] if isinstance(call, ast.Call) and call.args else
                   up.slice if isinstance(up, ast.Subscript) else None)
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.setdefault(key.value, rel)
            elif isinstance(key, ast.Name) and key.id in consts:
                pass  # a module constant, counted above
            elif isinstance(key, ast.Name):
                unresolved.append((rel, key.id))
            else:
                whole.add(rel)
    return names, whole, unresolved


def test_the_package_reads_only_allowlisted_environment_variables():
    names, whole, unresolved = _reads()
    extra = {n: f for n, f in names.items() if n not in ALLOWED}
    assert set(names) == set(ALLOWED), f"read but not allowed: {extra}; allowed, not read: {set(ALLOWED) - set(names)}"
    assert whole <= set(WHOLE_ENVIRONMENT), f"whole-environment uses outside the list: {whole - set(WHOLE_ENVIRONMENT)}"
    assert unresolved == [("kernels/ffi_codec.py", "name")]  # the loop over ENV_KNOBS' names
    assert all(len(why) > 20 for why in [*ALLOWED.values(), *WHOLE_ENVIRONMENT.values()])


def test_the_emulated_link_is_a_config_field_recorded_in_config_json():
    from taco_jax.train.config import TrainConfig

    recorded = TrainConfig.from_flags(emulated_link='{"tiers": {}}').to_dict()["communication"]
    assert recorded["emulated_link"] == '{"tiers": {}}'
    assert "TACO_JAX_EMULATED_LINK" not in ALLOWED


def test_stall_fault_names_a_malformed_value_and_leaves_other_processes_alone(monkeypatch, capsys):
    from taco_jax.testing import faults

    monkeypatch.setenv(faults.ENV_STALL, "1:eval@2")
    with pytest.raises(ValueError, match="TACO_JAX_TEST_STALL='1:eval@2' must be PROCESS:WHEN:SECONDS"):
        faults.stall("eval@2", 1, "at the evaluation")
    monkeypatch.setenv(faults.ENV_STALL, "1:3:0")
    faults.stall("3", 0, "before step 3")  # another process: nothing
    faults.stall("2", 1, "before step 2")  # another point: nothing
    assert capsys.readouterr().err == ""
    faults.stall("3", 1, "before step 3")
    assert "[taco-jax] TACO_JAX_TEST_STALL: process 1 sleeps 0 s before step 3" in capsys.readouterr().err
    monkeypatch.delenv(faults.ENV_SLOW_SAVE, raising=False)
    assert faults.meta_handler() is None


def test_the_suite_s_llvm_o0_compiles_the_users_program_with_its_bytes(cache, tmp_path):
    """The suite and its children compile with `_procs.TEST_XLA_FLAGS` (LLVM -O0, loop emitters),
    users with XLA:CPU's defaults (-O3). The same 3-step TACO run (bf16) both ways: the compiled step's
    wire bytes per axis and the issued ones are equal, and every loss and grad norm agrees within
    bf16's rounding (5e-3 relative; measured: losses 1e-4, grad norms up to 9.5e-4). The code
    generation differs (e.g. in FMA fusion) in the last bits, which bf16 roundings and FP8 codes carry."""
    import json

    import _procs
    import numpy as np

    runs = {}
    for opt, flags in (("0", _procs.TEST_XLA_FLAGS), ("3", "--xla_backend_optimization_level=3")):
        out = tmp_path / f"O{opt}"
        r = _procs.run(_procs.cli("train", *_procs.TINY, "--steps", "3", "--comm", "taco", "--out", out), cache,
                       XLA_FLAGS=flags)
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        runs[opt] = (summary["wire_bytes_per_step"], summary["wire_bytes_per_step_issued"], _procs.losses(out))
    assert runs["0"][:2] == runs["3"][:2] and runs["0"][0]["tensor"] > 0
    np.testing.assert_allclose(np.array(runs["0"][2]), np.array(runs["3"][2]), rtol=5e-3)
