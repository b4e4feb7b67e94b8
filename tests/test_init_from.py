"""`--init-from` records the checkpoint's model: its architecture (family and sizes) in the start line,
config.json, summary.json and the checkpoint metadata, with the source folder; a `--model` that
disagrees is refused naming both; resuming compares the recorded architecture and names the
checkpoint the run started from (a whole run: test_continue_pretraining.py)."""

import pathlib

import pytest

from taco_jax.models import get_config, hf
from taco_jax.train.config import TrainConfig

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
QWEN3_LABEL = "qwen3(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, mlp=64, vocab=99, context=64, tied)"
RUN = dict(mesh="data=2,tensor=4", batch_size=4, seq_len=16, steps=2, warmup_steps=0, eval_every=2, eval_batches=1)


def test_recorded_model_is_the_checkpoints_architecture():
    cfg = TrainConfig.from_flags(init_from=str(FIXTURES / "qwen3"), **RUN)
    assert cfg.model.name == QWEN3_LABEL == hf.architecture_label(hf.config_from_hf(FIXTURES / "qwen3"))
    assert cfg.to_dict()["model"]["name"] == QWEN3_LABEL
    assert cfg.to_dict()["model"]["init_from"] == str(FIXTURES / "qwen3")
    gpt2 = TrainConfig.from_flags(init_from=str(FIXTURES / "gpt2"), **RUN)
    assert gpt2.model.name.startswith("gpt2(layers=2, hidden=32, heads=4")
    assert TrainConfig.from_flags(**RUN).model.name == "gpt2-tiny"  # no --model, no --init-from: the default preset
    # the recorded label given back (a run's config.json) is accepted
    assert TrainConfig.from_flags(model=QWEN3_LABEL, init_from=str(FIXTURES / "qwen3"), **RUN).model.name == QWEN3_LABEL


def test_model_that_disagrees_with_init_from_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"model='qwen3-tiny' disagrees with init_from='.*gpt2', a gpt2\(layers=2"):
        TrainConfig.from_flags(model="qwen3-tiny", init_from=str(FIXTURES / "gpt2"), **RUN)
    with pytest.raises(ValueError, match=r"model='gpt2-tiny' disagrees with init_from='.*qwen3', a qwen3\("):
        TrainConfig.from_flags(model="gpt2-tiny", init_from=str(FIXTURES / "qwen3"), **RUN)
    # a preset that describes the checkpoint (vocabulary aside) is accepted; the architecture is recorded
    from flax import nnx

    from taco_jax.models import make_model

    src = get_config("qwen3-tiny", vocab_size=300)
    hf.save_hf(tmp_path, src, nnx.to_pure_dict(nnx.split(make_model(src, rngs=nnx.Rngs(0)), nnx.Param)[1]))
    cfg = TrainConfig.from_flags(model="qwen3-tiny", init_from=str(tmp_path), **dict(RUN, mesh="data=2"))
    assert cfg.model.name == hf.architecture_label(src)


def test_cli_refuses_with_one_line(capsys):
    from taco_jax.cli import main

    assert main(["train", "--model", "qwen3-tiny", "--init-from", str(FIXTURES / "gpt2"), "--mesh", "data=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taco-jax: error: model='qwen3-tiny' disagrees with init_from=")
