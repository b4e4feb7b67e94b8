"""Every notebook's code cells run top to bottom (in a fresh interpreter, from notebooks/, importing this
checkout's taco_jax) and print the line that shows it reached its end. The environment is a user's:
no XLA_FLAGS (a notebook that needs simulated devices requests them itself, before importing jax);
JAX_PLATFORMS=cpu as in every test of the suite."""

import json
import pathlib
import subprocess
import sys

import pytest
from _procs import CACHE_ENV

pytestmark = [pytest.mark.notebook, pytest.mark.procs]

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: What each notebook prints once it has run through (every notebook must be listed here).
END_MARKERS = {"00_quickstart.ipynb": "quickstart OK", "01_codec_and_collectives.ipynb": "SQNR",
               "02_scaling.ipynb": "scaling OK", "03_continue_pretraining.ipynb": "continue pre-training OK"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, cache):
    cells = json.loads(path.read_text())["cells"]
    src = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    script = tmp_path / "nb.py"
    script.write_text("import matplotlib\nmatplotlib.use('Agg')\n" + src)
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "JAX_COMPILATION_CACHE_DIR": str(cache), **CACHE_ENV}  # no XLA_FLAGS: each notebook sets its devices
    r = subprocess.run([sys.executable, str(script)], cwd=path.parent, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert END_MARKERS[path.name] in r.stdout
