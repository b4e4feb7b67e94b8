"""`experiments/` is a package of theme folders run as `python -m experiments.THEME.NAME`: no `sys.path`
edits in the studies or the tests, every study imports as `experiments.THEME.NAME`, the index
(`experiments/__init__.py`) names every study and nothing else, every command and path in the docs
names a study that exists, and the shared helpers of `experiments.common` behave as documented."""

from __future__ import annotations

import ast
import importlib
import re
from datetime import datetime
from pathlib import Path

import pytest

from experiments import common

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
#: Every study as "THEME.NAME" (a module of a theme folder; shared helpers live in experiments/common.py).
STUDIES = sorted(f"{p.parent.name}.{p.stem}" for p in EXP.glob("*/*.py") if p.stem != "__init__")
SCRIPTS = sorted(f"{p.parent.name}/{p.name}" for p in EXP.glob("*/*.sh"))
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
    """`python -m experiments.THEME.NAME` names a study and `experiments/THEME/FILE` a file that
    exists; `python experiments/NAME.py` (no theme) is left only for a removed probe (the doc says so
    next to it)."""
    for doc in DOCS:
        text = doc.read_text()
        for name in re.findall(r"-m experiments\.([\w.]+\w)", text):
            assert name in STUDIES, f"{doc.name}: `python -m experiments.{name}` names no study"
        for path in re.findall(r"experiments/(\w+/[\w.]+\w)", text):
            assert (EXP / path).is_file(), f"{doc.name}: experiments/{path} does not exist"
        for name in re.findall(r"python experiments/(\w+)\.py", text):
            assert not list(EXP.glob(f"*/{name}.py")), f"{doc.name}: run `python -m experiments.THEME.{name}`"


def _index() -> list[str]:
    """The studies the index (experiments/__init__.py's docstring) lists, as "THEME.NAME" (a script:
    "THEME/NAME.sh"), in its order: a line "THEME/  ..." opens a theme, "  NAME  ..." names a study of it."""
    import experiments

    listed, theme = [], None
    for line in experiments.__doc__.splitlines():
        if m := re.match(r"(\w+)/\s", line):
            theme = m[1]
        elif theme and (m := re.match(r"  (\w+)(\.sh)?\s{2,}\S", line)):
            listed.append(f"{theme}/{m[1]}.sh" if m[2] else f"{theme}.{m[1]}")
        elif not line.strip():
            theme = None
    return listed


def test_the_index_lists_every_study_and_nothing_else():
    listed = _index()
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({s for s in listed if listed.count(s) > 1})}"
    assert sorted(s for s in listed if "/" not in s) == STUDIES, (
        f"missing from the index: {sorted(set(STUDIES) - set(listed))}; "
        f"listed but absent: {sorted({s for s in listed if '/' not in s} - set(STUDIES))}")
    assert sorted(s for s in listed if "/" in s) == SCRIPTS


@pytest.mark.parametrize("theme", sorted({s.split(".")[0] for s in STUDIES}))
def test_every_theme_folder_is_a_package(theme):
    assert (EXP / theme / "__init__.py").is_file(), f"experiments/{theme}/ has no __init__.py"


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
    cmd = common.module_command("experiments.step.step_time", "--steps", "3")
    assert cmd[1:] == ["-m", "experiments.step.step_time", "--steps", "3"]


def test_run_record_names_the_command_commit_host_load_and_date():
    rec = common.run_record("experiments.step.step_time", ["--steps", "3", "--variants", "none, taco"])
    assert set(rec) == {"command", "commit", "host", "load", "date"}
    assert rec["command"] == "python -m experiments.step.step_time --steps 3 --variants 'none, taco'"
    assert rec["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", rec["commit"])
    assert rec["host"]["cpu"] and rec["host"]["cores"] == common.os.cpu_count() and len(rec["load"]) == 3
    assert rec["date"].endswith("+00:00") and datetime.fromisoformat(rec["date"]).tzinfo is not None


#: Studies that write JSON without the run record, and why.
NO_RECORD = {
    "step.hlo_dump": "numbers.json is diffed between two checkouts: a date or a commit would differ",
    "fidelity.fidelity": "table.json and ablation.json are a list of rows and a map of variants",
    "e2e.load_guard": "its JSON is the probe's calibration (load_probe.json), not a result",
}


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_that_writes_a_result_records_its_run(name):
    src = (EXP / f"{name.replace('.', '/')}.py").read_text()
    writes = re.search(r"write_text\((json|jsonio)\.dumps|json\.dump\(|jsonio\.write\(", src)
    if name in NO_RECORD:
        assert writes and "run_record(" not in src, f"{name} records its run now: drop it from NO_RECORD"
    elif writes:
        assert "run_record(__spec__.name" in src, f"{name} writes a result JSON without common.run_record"


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
    own = {str(p.relative_to(ROOT)): n.lineno for p in sorted(EXP.rglob("*.py"))
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value == "taco_jax.cli"}
    assert own == {}, f"own CLI command lines at {own}: use taco_jax.launch.cli_command"
    from taco_jax.launch import cli_command

    assert cli_command("train", "--steps", "1")[1:] == ["-P", "-m", "taco_jax.cli", "train", "--steps", "1"]


def test_shell_scripts_start_the_package_without_the_working_folder():
    """A script's `python -m taco_jax...` runs with -P: a `taco_jax` folder in the working folder
    cannot shadow the installed package."""
    bare = [f"{p.name}:{i}" for p in sorted(EXP.rglob("*.sh"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"-m taco_jax\b", line) and not re.search(r"\s-P\s+-m taco_jax\b", line)]
    assert bare == [], f"start the package with `python -P -m taco_jax...` at {bare}"


def test_hlo_dump_answers_help_and_refuses_a_flag_as_its_folder(capsys, tmp_path, monkeypatch):
    """`--help` prints the usage (no run, no folder named "--help"); a flag where OUT_DIR goes is refused."""
    from experiments.step import hlo_dump

    monkeypatch.chdir(tmp_path)
    assert hlo_dump.main(["--help"]) == 0 and "experiments.step.hlo_dump OUT_DIR" in capsys.readouterr().out
    assert hlo_dump.main(["--out", "--", "--comm", "taco"]) == 2 and not list(tmp_path.iterdir())
