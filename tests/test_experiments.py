"""`experiments/` is a package run as `python -m experiments.NAME`: no `sys.path` edits in the
studies or the tests, every study imports as `experiments.NAME`, every command in the docs names a
study that exists, and the shared helpers of `experiments.common` behave as documented."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from experiments import common

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem not in ("__init__", "common"))
DOCS = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]


def _sys_path_uses(path: Path) -> list[int]:
    """Line numbers where `sys.path` is read or changed in the file's code (strings do not count)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
            and isinstance(n.value, ast.Name) and n.value.id == "sys"]


@pytest.mark.parametrize("folder", ["experiments", "tests"])
def test_no_sys_path_edits(folder):
    uses = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / folder).rglob("*.py"))
            if (lines := _sys_path_uses(p))}
    assert uses == {}, f"sys.path used at {uses}: import as a package instead"


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_imports_as_a_package_module_with_a_main(name):
    mod = importlib.import_module(f"experiments.{name}")
    assert callable(mod.main), f"experiments.{name} has no main()"


def test_doc_commands_name_existing_studies():
    """`python -m experiments.NAME` names a study; `python experiments/NAME.py` is left only for a
    probe that experiments/ does not hold (the doc says so next to it)."""
    for doc in DOCS:
        text = doc.read_text()
        for name in re.findall(r"-m experiments\.(\w+)", text):
            assert name in STUDIES, f"{doc.name}: `python -m experiments.{name}` names no study"
        for name in re.findall(r"python experiments/(\w+)\.py", text):
            assert name not in STUDIES, f"{doc.name}: run `python -m experiments.{name}`, not the file"
            assert not (ROOT / "experiments" / f"{name}.py").exists()


def test_cpu_devices_keeps_a_count_already_set_unless_forced(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    common.cpu_devices(4)
    assert common.os.environ["XLA_FLAGS"].endswith("device_count=2")
    assert common.os.environ["JAX_PLATFORMS"] == "cpu"
    common.cpu_devices(4, force=True)
    assert common.os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4"
    monkeypatch.delenv("XLA_FLAGS")
    common.cpu_devices(8)
    assert common.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_cpu_devices_refuses_a_count_below_one():
    with pytest.raises(ValueError, match="device count must be >= 1, got 0"):
        common.cpu_devices(0)


def test_child_env_puts_the_checkout_first():
    env = common.child_env({"PYTHONPATH": "/elsewhere", "X": "1"})
    assert env["PYTHONPATH"].split(common.os.pathsep) == [str(ROOT), "/elsewhere"] and env["X"] == "1"
    assert common.module_command("experiments.step_time", "--steps", "3")[1:] == ["-m", "experiments.step_time",
                                                                                   "--steps", "3"]


@pytest.mark.procs
def test_a_light_train_module_imports_without_the_models():
    """`taco_jax.train.distributed` (the studies' gloo set-up) does not load the config and the models."""
    import subprocess
    import sys

    code = ("import sys; import taco_jax.train.distributed; "
            "print('taco_jax.train.config' in sys.modules, 'taco_jax.models' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_studies_start_the_cli_shadow_proof():
    """No study spells its own `python -m taco_jax.cli` command: each starts the CLI through
    `taco_jax.launch.cli_command` (`python -P`: a folder holding another taco_jax does not shadow it)."""
    own = {str(p.relative_to(ROOT)): n.lineno for p in sorted((ROOT / "experiments").glob("*.py"))
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value == "taco_jax.cli"}
    assert own == {}, f"own CLI command lines at {own}: use taco_jax.launch.cli_command"
    from taco_jax.launch import cli_command

    assert cli_command("train", "--steps", "1")[1:] == ["-P", "-m", "taco_jax.cli", "train", "--steps", "1"]


def test_shell_scripts_start_the_package_without_the_working_folder():
    """A script's `python -m taco_jax...` runs with -P: a `taco_jax` folder in the working folder
    cannot shadow the installed package."""
    bare = [f"{p.name}:{i}" for p in sorted((ROOT / "experiments").glob("*.sh"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"-m taco_jax\b", line) and not re.search(r"\s-P\s+-m taco_jax\b", line)]
    assert bare == [], f"start the package with `python -P -m taco_jax...` at {bare}"
