"""Test setup: an 8-device simulated CPU mesh (set before jax is imported), the test tiers, and shared
fixtures.

Tiers (docs/development.md): `make test-fast` runs the tests marked `fast`, `make test` runs every
test that can run here. Each test file declares its tier where its tests are: a module-level
`pytestmark` (after its imports) holding `fast` or the markers below, and a marker on a test (or a
`pytest.param`) where the file mixes tiers. A test is outside `fast` when one of these applies to it:
- `procs`: it starts child processes (through tests/_procs.py). A test that takes the `cache` fixture
  (the child processes' compilation cache; directly or through another fixture) is `procs` by that.
  A test in `fast` that starts a Python child fails (`_no_children_in_fast`) naming this rule.
- `netns`: it makes network namespaces (root; skipped with the reason where they cannot be made).
- `notebook`: it runs a notebook.
- `slow`: in-process but long (a training run, a sweep of compilations); `cover(k)` on a parametrized
  test makes the cases outside its cover `slow` (`_mark_cover`).
- `extras`: it needs the `gpu-sim` / `hf` extras (torch, triton, transformers); a `fast` test whose
  module holds them, or that imports them, fails naming this rule (`_no_extras_in_fast`).
- `gpu`: needs a CUDA GPU (the device machine; `pytest -m gpu`), in no tier here.
`fast` on a module means: its tests are `fast` unless one of these applies to a test; the collection
checks (`_check_tiers`) refuse a file that declares no tier. The files with `procs` tests run first
(by their number of `procs` tests), then those with `slow` / `extras` tests, then the others (by
number of tests): under pytest-xdist the long files start early.
"""

import builtins
import collections
import gc
import os
import pathlib
import resource
import subprocess
import sys
import types
import warnings

import _procs  # noqa: E402  (imports no jax)

# Bytecode caches are written even under PYTHONDONTWRITEBYTECODE: pytest then keeps the assertion-rewritten
# test modules in tests/__pycache__ rather than rewriting all of them in every worker of every run
# (collecting the suite: 8.7 instead of 16 CPU s per process on the 2-core AMD VM), and the child
# processes read taco_jax's cached bytecode instead of compiling its sources.
sys.dont_write_bytecode = False

os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), _procs.TEST_XLA_FLAGS,
                                    "--xla_force_host_platform_device_count=8")).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from _pytest.mark.structures import ParameterSet  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

# Python's cyclic garbage collector in the test workers: tracing and lowering allocate millions of
# short-lived objects, and at Python's default thresholds (700, 10, 10) the collector ran 5,742 times
# and took 4.9 of 48 CPU s in tests/test_qwen.py + tests/test_model.py (one process, 2-core Zen 4 VM);
# at these thresholds, with the imported modules frozen, 22 times and 1.3 s. Only the test processes:
# the package and the child processes keep Python's defaults.
gc.freeze()
gc.set_threshold(50_000, 50, 1_000)

#: The markers that take a test out of `fast` (module docstring).
OUT_OF_FAST = ("procs", "netns", "notebook", "slow", "extras", "gpu")
#: The markers a test file's `pytestmark` may declare its tier with.
TIERS = ("fast", *OUT_OF_FAST)
#: The packages of the `gpu-sim` / `hf` extras (pyproject.toml), which `make test-fast` does not install.
EXTRAS = ("torch", "triton", "transformers")
#: In-process files of few but long tests (seconds each): handed out before the others of their group, so
#: that no worker ends the run on one of them while the other is idle.
FEW_LONG = ("tests/test_codec_kinds.py", "tests/test_codec_properties.py")


def _cover_indices(item) -> tuple[int, ...]:
    """One index per `parametrize` decorator of `item` (a decorator over several names counts once)."""
    out = []
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        got = tuple(item.callspec.params[n] for n in names)
        rows = [tuple(v.values) if isinstance(v, ParameterSet) else (tuple(v) if len(names) > 1 else (v,))
                for v in mark.args[1]]
        out.append(next(i for i, row in enumerate(rows)
                        if all(a is b or (type(a) is type(b) and a == b) for a, b in zip(row, got))))
    return tuple(out)


def _mark_cover(items) -> None:
    """`@pytest.mark.cover(k)` on a parametrized sweep: its whole cross-product runs in `make test`, while
    `make test-fast` runs a cover, the cases whose parameter indices (one per `parametrize` decorator) sum
    to 0 modulo k; the others are marked `slow`. Raises `pytest.UsageError` naming the parameter value
    that the cover would leave out of `make test-fast` (every value of every parameter runs there)."""
    sweeps = collections.defaultdict(list)
    for it in items:
        mark = it.get_closest_marker("cover")
        if mark is not None and not it.get_closest_marker("slow"):
            sweeps[(it.nodeid.split("[")[0], mark.args[0])].append(it)
    for (name, k), cases in sweeps.items():
        kept = [it for it in cases if sum(_cover_indices(it)) % k == 0]
        for it in cases:
            if it not in kept:
                it.add_marker(pytest.mark.slow)
        for j, n in enumerate(len(set(ix)) for ix in zip(*(_cover_indices(it) for it in cases))):
            covered = {_cover_indices(it)[j] for it in kept}
            if len(covered) != n:
                raise pytest.UsageError(f"{name}: cover({k}) leaves parameter {j} values "
                                        f"{sorted(set(range(n)) - covered)} out of `make test-fast`: lower k")


def _extras_held(module) -> list[str]:
    """The extras' modules (`EXTRAS`) that `module`'s globals hold."""
    return sorted({v.__name__ for v in vars(module).values()
                   if isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in EXTRAS})


def _check_tiers(items, undeclared) -> None:
    """The tier rules that collection can check; raises `pytest.UsageError` listing every offence:
    a test file without a tier in its module-level `pytestmark` (`undeclared`: their Module nodes),
    and a `fast` test whose module holds one of the extras' packages."""
    errors = [f"{node.nodeid} declares no tier: add `pytestmark = pytest.mark.fast` (or one of {OUT_OF_FAST}) "
              "after its imports (docs/development.md, Tiers and markers)" for node in undeclared]
    for module in {it.module for it in items if isinstance(it, pytest.Function)}:
        held = _extras_held(module)
        fast = [i.nodeid for i in items if i.module is module and i.get_closest_marker("fast")]
        if held and fast:
            errors.append(f"{fast[0]} is in the `fast` tier but its module imports {held}: mark it `extras` "
                          "(`make test-fast` runs without the gpu-sim / hf extras)")
    if errors:
        raise pytest.UsageError("\n".join(errors))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    netns_reason = None
    _mark_cover(items)
    modules = {item.getparent(pytest.Module) for item in items}
    undeclared = sorted((m for m in modules if m is not None and not any(k.name in TIERS for k in m.own_markers)),
                        key=lambda m: m.nodeid)
    for node in {n for item in items for n in item.listchain()[:-1]}:  # a module's (class's) `fast` is
        node.own_markers = [m for m in node.own_markers if m.name != "fast"]  # its tests' default: set below
    for item in items:
        if "cache" in item.fixturenames:
            item.add_marker(pytest.mark.procs)
        if item.get_closest_marker("netns"):
            if netns_reason is None:
                from taco_jax import emulate

                try:
                    emulate.check_available()
                    netns_reason = ""
                except emulate.EmulationUnavailable as e:
                    netns_reason = str(e)
            if netns_reason:
                item.add_marker(pytest.mark.skip(reason=netns_reason))
        if not any(item.get_closest_marker(m) for m in OUT_OF_FAST):
            item.add_marker(pytest.mark.fast)
    _check_tiers(items, undeclared)
    # long files first (pytest-xdist, `--dist loadfile --no-loadscope-reorder`, hands them out in this
    # order): those with process tests, by their number of process tests (seconds to a minute each);
    # then those with `slow` tests, then the others, by number of tests: the many short files of the
    # inner loop come last and even out the two workers' ends. Each file's tests stay in their order.
    def file(item):
        return item.nodeid.split("::")[0]

    count = collections.Counter(file(item) for item in items)
    procs = collections.Counter(file(item) for item in items if item.get_closest_marker("procs"))
    slow = {file(item) for item in items if item.get_closest_marker("slow") or item.get_closest_marker("extras")}
    first = len(items)  # FEW_LONG files: before every file of their group

    def order(item):
        f = file(item)
        if f in procs:
            return (0, -procs[f], f)
        return (1 if f in slow else 2, -first if f in FEW_LONG else -count[f], f)

    items.sort(key=order)


@pytest.fixture(autouse=True)
def _no_children_in_fast(request, monkeypatch):
    """A test marked `fast` may not start a Python child (it would slow the inner loop down): it fails
    naming the tier rule (take the `cache` fixture, or mark the test `procs`)."""
    if request.node.get_closest_marker("fast") is None:
        return
    popen = subprocess.Popen.__init__

    def guarded(self, args, *a, **k):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        prog = os.path.basename(str(argv[0])) if argv else ""
        if str(argv[0]) == sys.executable or prog.startswith(("python", "bash")):
            raise AssertionError(f"{request.node.nodeid} is in the `fast` tier but starts {argv[:3]}: take the "
                                 "`cache` fixture (tests/_procs.py) or mark it `procs` (tests/conftest.py)")
        popen(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture(autouse=True)
def _no_extras_in_fast(request, monkeypatch):
    """A test marked `fast` may not import the extras' packages (`EXTRAS`: `make test-fast` runs without
    them): the import fails naming the tier rule (mark the test `extras`)."""
    if request.node.get_closest_marker("fast") is None:
        return
    real = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in EXTRAS:
            raise AssertionError(f"{request.node.nodeid} is in the `fast` tier but imports {name!r}: mark it "
                                 "`extras` (tests/conftest.py; `make test-fast` runs without the gpu-sim / hf extras)")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", guarded)


def pytest_addoption(parser):
    parser.addoption("--per-file", action="store_true",
                     help="one line per test file once its tests have run (outcomes, wall and CPU seconds) "
                          "instead of one character per test, and a table of the slowest files at the end")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    _CPU_AT_START[nodeid] = _cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """CPU seconds of the test (setup to teardown, this process and its finished child processes) on
    its teardown report, as the user property `cpu_s` (it crosses to pytest-xdist's controller)."""
    outcome = yield
    if call.when == "teardown" and item.nodeid in _CPU_AT_START:
        outcome.get_result().user_properties.append(("cpu_s", _cpu() - _CPU_AT_START.pop(item.nodeid)))


_CPU_AT_START: dict[str, float] = {}


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class _PerFile:
    """`--per-file`: a line per test file once all its tests have reported (in pytest-xdist's
    controller too), and the slowest files at the end."""

    def __init__(self, config):
        self.config = config
        self.expected: dict[str, int] = {}
        self.files: dict[str, dict] = {}
        self.done = 0
        self.total = 0

    def _count(self, nodeids):
        if self.expected:
            return  # every xdist worker collects the same items
        for nodeid in nodeids:
            path = nodeid.split("::")[0]
            self.expected[path] = self.expected.get(path, 0) + 1
        self.total = len(nodeids)

    def pytest_collection_finish(self, session):
        if not hasattr(self.config, "workerinput"):
            self._count([item.nodeid for item in session.items])

    def pytest_xdist_node_collection_finished(self, node, ids):
        self._count(ids)

    def pytest_report_teststatus(self, report, config):
        """No character for a passed or skipped test (failures and xfails print as usual)."""
        if hasattr(report, "wasxfail"):
            return None
        if report.when == "call" and report.passed:
            return "passed", "", ""
        if report.skipped:
            return "skipped", "", ""
        return None

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        rec = self.files.setdefault(path, {"wall": 0.0, "cpu": 0.0, "n": 0, "outcomes": {}})
        rec["wall"] += report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            rec["outcomes"][outcome] = rec["outcomes"].get(outcome, 0) + 1
        elif report.when == "teardown" and report.outcome != "passed":
            rec["outcomes"]["error"] = rec["outcomes"].get("error", 0) + 1
        if report.when != "teardown":
            return
        rec["cpu"] += dict(report.user_properties).get("cpu_s", 0.0)
        rec["n"] += 1
        self.done += 1
        if rec["n"] == self.expected.get(path, -1):
            outcomes = ", ".join(f"{n} {k}" for k, n in sorted(rec["outcomes"].items()))
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            tr.ensure_newline()
            tr.write_line(f"[{self.done:4d}/{self.total}] {path:<40} {outcomes:<24} "
                          f"{rec['wall']:6.1f} s wall {rec['cpu']:6.1f} s CPU")

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tr.section("slowest files (wall and CPU seconds, child processes included)")
        rows = sorted(self.files.items(), key=lambda kv: -kv[1]["wall"])
        for path, rec in rows[:15]:
            tr.write_line(f"{rec['wall']:7.1f} {rec['cpu']:7.1f}  {path}")
        wall, cpu = sum(r["wall"] for _, r in rows), sum(r["cpu"] for _, r in rows)
        tr.write_line(f"{wall:7.1f} {cpu:7.1f}  all {len(rows)} files (sums over tests)")


def _compilation_cache(config):
    """JAX's persistent compilation cache of the test runs: under pytest's cache folder
    (.pytest_cache/d/jax-compilation-cache, kept between runs: a rerun compiles only what changed), or
    a folder of this run's temporary files under `-p no:cacheprovider`."""
    if getattr(config, "cache", None) is not None:
        return config.cache.mkdir("jax-compilation-cache")
    return config._tmp_path_factory.mktemp("jax-compilation-cache")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if config.getoption("per_file") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_PerFile(config), "taco-per-file")
    if hasattr(config, "workerinput"):  # execnet ends a pytest-xdist worker by KeyboardInterrupt, which
        # may land in jax's garbage-collection callback at exit: not a test's warning
        warnings.filterwarnings("ignore", message=".*_xla_gc_callback",
                                category=pytest.PytestUnraisableExceptionWarning)
    folder = str(_compilation_cache(config))
    # this process, and every child process that inherits the environment (tests/_procs.py sets the same);
    # source locations in the key: a program is taken from the cache only with its own op names (named
    # scopes, which tests read in compiled HLO), not those of an equal program traced elsewhere
    os.environ.update(_procs.CACHE_ENV, JAX_COMPILATION_CACHE_DIR=folder)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)


@pytest.fixture(scope="session")
def cache(pytestconfig):
    """The compilation cache folder for child processes (tests/_procs.py): the one of this test process
    (`_compilation_cache`), so that a configuration compiled once, here or in any child, is not
    compiled again. Taking this fixture marks a test `procs`."""
    return pathlib.Path(jax.config.jax_compilation_cache_dir)


@pytest.fixture(scope="session")
def mesh():
    """data=2 × tensor=4 over the 8 simulated CPU devices."""
    assert len(jax.devices()) == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))


def tp_value_and_grad(mesh, cfg, policy, sp=False, tp_overlap="none"):
    """Jitted (params, ids, targets) -> (loss, grads) of `cfg`'s model under `shard_map` on `mesh`:
    TP over "tensor" with `policy` (± sequence parallelism, ± `tp_overlap`), loss pmean'd over
    "data", gradient taken outside `shard_map` (the data-axis gradient psum comes from its transpose)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from taco_jax.models import make_model
    from taco_jax.parallel import ParallelContext, param_specs

    ctx = ParallelContext("tensor", policy, sp, tp_overlap=tp_overlap)
    abstract = nnx.eval_shape(lambda: make_model(cfg, ctx, rngs=nnx.Rngs(0), tensor_size=mesh.shape["tensor"]))
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = param_specs(state, mesh.axis_names)

    def local(params, ids, tgt):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        return jax.lax.pmean(nnx.merge(graphdef, st).loss(ids, tgt), "data")

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    return jax.jit(jax.value_and_grad(fn))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A tokenizer cache folder of this test session (one per pytest-xdist worker): each Shakespeare
    tokenizer is trained once in it (seconds) rather than once per module."""
    return tmp_path_factory.getbasetemp() / "tokenizer_cache"


@pytest.fixture(scope="session")
def shakespeare512(tokenizer_dir):
    """Shakespeare with a 512-entry BPE tokenizer (`taco_jax.data.load_shakespeare`), from `tokenizer_dir`."""
    from taco_jax.data import load_shakespeare

    return load_shakespeare(512, cache_dir=str(tokenizer_dir))
