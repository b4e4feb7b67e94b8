"""Issue 25 (resume anywhere, fail cleanly): a busy coordinator port, flag abbreviations, a corrupt
latest checkpoint, another vocabulary padding, x64, a SIGKILL during an async save, another process
count. Process tests run real `taco_jax.cli` processes (bounded by timeouts; `_procs`)."""

import socket
import time

import pytest
from _procs import TINY, cli, run

from taco_jax.cli import _parser, main


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


# -----------------------------------------------------------------------------
# flags: no abbreviations; --policy FILE is the flag (--policy-file its other name)


def test_flag_abbreviations_are_refused(capsys):
    """A typo or a prefix never selects another flag (argparse allow_abbrev=False on every parser)."""
    for argv, why in ((["train", "--checkpoint-e", "2"], "unrecognized arguments: --checkpoint-e"),
                      (["train", "--pol", "p.json"], "unrecognized arguments: --pol"),
                      (["launch", "--proc", "2"], "the following arguments are required: --processes"),
                      (["calibrate", "--captures", "c", "--budg", "1"], "unrecognized arguments: --budg")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert why in capsys.readouterr().err
    for flag in ("--policy", "--policy-file"):
        assert _parser().parse_args(["train", flag, "p.json"]).policy_file == "p.json"


# -----------------------------------------------------------------------------
# a busy coordinator port


def _listener(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


def test_busy_coordinator_port_is_one_clear_error(tmp_path, cache):
    """Something listens on 127.0.0.1:PORT: exit 2 with one `taco-jax: error:` line naming the address
    (checked before JAX's gRPC service starts: it crashed by SIGSEGV or a raw traceback)."""
    with _listener("127.0.0.1") as busy:
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        t = time.monotonic()
        r = run(cli("train", *TINY, "--steps", "1", "--out", tmp_path / "run", "--coordinator", addr,
                    "--num-processes", "1", "--process-id", "0"), cache, timeout=120)
        took = time.monotonic() - t
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines == [f"taco-jax: error: coordinator {addr} is in use (another process listens on it); "
                     "stop it or give --coordinator another port"], r.stderr[-3000:]
    assert not (tmp_path / "run").exists() and took < 60


def test_launch_retries_a_taken_port_and_the_coordinator_binds_the_address_given(tmp_path, cache, monkeypatch):
    """`taco-jax launch`: the first port it picks is taken (127.0.0.1:P1 listened on) -> it starts the
    processes again on the next; that one, P2, is listened on at 127.0.0.2 only, so the run succeeds
    only if the coordinator binds 127.0.0.1:P2 (the address given) and not every interface ([::]:P2)."""
    import io

    from _procs import env

    from taco_jax import launch

    with _listener("127.0.0.1") as taken, _listener("127.0.0.2") as other:
        ports = [taken.getsockname()[1], other.getsockname()[1]]
        busy = ports[0]
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop(0))
        out = io.StringIO()
        status = launch.launch(1, ["train", *TINY, "--steps", "1", "--mesh", "data=1,tensor=2", "--no-progress",
                                   "--out", str(tmp_path / "run")], env=env(cache), out=out)
    text = out.getvalue()
    assert status == 0, text[-3000:]
    assert f"coordinator 127.0.0.1:{busy} is in use" in text
    assert "retrying with another (attempt 2 of 3)" in text
    assert (tmp_path / "run" / "summary.json").exists() and not ports
