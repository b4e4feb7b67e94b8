"""A run's vocabulary and data: `--data` sizes the model from meta.json, published presets keep their
own vocabulary and context, `sample` draws only ids the tokenizer has, and `--resume` refuses
another tokenizer (other data with the same tokenizer resumes, with a note)."""

import json

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from taco_jax.data import load_prepared, prepare_data
from taco_jax.data import prepared as prep
from taco_jax.data.shakespeare import EOT, play_text
from taco_jax.train.config import TrainConfig

pytestmark = pytest.mark.fast

RUN = dict(mesh="data=2,tensor=4", batch_size=8, seq_len=16, eval_batches=1, warmup_steps=0)


@pytest.fixture(scope="module")
def bpe300(tmp_path_factory):
    """A prepared folder with a 300-entry BPE trained on it."""
    d = tmp_path_factory.mktemp("bpe300")
    (d / "a.txt").write_text(play_text("macbeth")[:20000])
    prepare_data([str(d / "a.txt")], d / "data", vocab_size=300, progress=False)
    return d / "data"


def test_data_sets_the_model_vocabulary(bpe300):
    """`--data` without `--vocab-size`: the model's vocabulary is meta.json's (300), its rows padded
    for the tensor axis (512 at tensor=4); config.json records 300."""
    cfg = TrainConfig.from_flags(data=str(bpe300), **RUN)
    assert (cfg.model.vocab_size, cfg.model_config.vocab_size, cfg.model_config.padded_vocab_size) == (300, 300, 512)
    assert cfg.to_dict()["model"]["vocab_size"] == 300 and "vocabulary 300 (512 rows)" in cfg.vocab_note()
    assert TrainConfig.from_flags(data=str(bpe300), vocab_size=400, **RUN).model_config.vocab_size == 400  # given: kept
    assert TrainConfig.from_flags(**RUN).model_config.vocab_size == 2048  # Shakespeare: its 2048-entry BPE


def test_published_presets_keep_their_vocabulary_and_context(bpe300, tmp_path, capsys):
    """A published preset (qwen3-8b, gpt2-124m, ...) is the published model: its own vocabulary and
    context, said at the start of the run; on Shakespeare the BPE keeps 2048 entries (the first ids
    of the vocabulary). A dataset whose vocabulary exceeds the preset's is refused naming both."""
    from taco_jax.train.loop import prepare

    for name, vocab, context in (("qwen3-8b", 151_936, 40_960), ("qwen2.5-7b", 152_064, 32_768),
                                 ("gpt2-124m", 50_257, 1024)):
        cfg = TrainConfig.from_flags(model=name, **RUN)
        assert (cfg.model_config.vocab_size, cfg.model_config.block_size, cfg.bpe_vocab_size) == (vocab, context, 2048)
        assert f"vocabulary {vocab:,}" in cfg.vocab_note() and f"context {context:,}: {name}'s own" in cfg.vocab_note()
    assert TrainConfig.from_flags(model="qwen3-8b", data=str(bpe300), **RUN).model_config.vocab_size == 151_936
    assert TrainConfig.from_flags(model="gpt2-tiny", **RUN).vocab_note() == ""  # CPU-sized: the BPE's vocabulary
    small = TrainConfig.from_flags(model="gpt2-124m", vocab_size=4096, **RUN)  # given: not the published vocabulary
    assert (small.model_config.vocab_size, small.bpe_vocab_size) == (4096, 4096)
    from taco_jax.models import PRESETS, PUBLISHED

    assert set(PUBLISHED) <= set(PRESETS)
    run = prepare(TrainConfig.from_flags(model="gpt2-124m", out=str(tmp_path / "run"), **RUN))
    assert run.dataset.vocab_size == 2048 and run.cfg.model_config.padded_vocab_size == 50_688
    assert "[taco-jax] vocabulary 50,257 (50,688 rows) and context 1,024: gpt2-124m's own" in capsys.readouterr().err

    spec = json.loads(Tokenizer.from_file(str(bpe300 / "tokenizer.json")).to_str())
    spec["model"]["vocab"][EOT] = spec["added_tokens"][0]["id"] = 60_000
    (tmp_path / "big.json").write_text(json.dumps(spec))
    prepare_data([str(bpe300.parent / "a.txt")], tmp_path / "big", tokenizer=str(tmp_path / "big.json"),
                 progress=False)
    with pytest.raises(ValueError, match=r"vocabulary of 60,001 ids \(meta.json\) and gpt2-124m \(a published "
                                         r"model\) has 50,257"):
        TrainConfig.from_flags(model="gpt2-124m", data=str(tmp_path / "big"), **RUN)


@pytest.mark.slow
def test_sample_draws_only_the_tokenizers_ids(tmp_path):
    """A model whose vocabulary is larger than its tokenizer's, which has holes (300 entries, the
    end-of-text token at id 60000): sampling at temperature 1 from random weights draws only ids the
    tokenizer has; unmasked, most draws have no token (they would vanish from the text)."""
    from flax import nnx

    from taco_jax.models import GPTConfig, generate, hf, load_hf, make_model
    from taco_jax.train.sample import sample_ids, tokenizer_ids

    spec = json.loads(prep._train_tokenizer([play_text("hamlet")[:20000]], 300).to_str())
    spec["model"]["vocab"][EOT] = spec["added_tokens"][0]["id"] = 60_000
    cfg = GPTConfig(vocab_size=60_001 + 999, block_size=64, n_layer=1, n_head=2, n_embd=16)  # and 999 more rows
    hf.save_hf(tmp_path, cfg, nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1]))
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    have = set(tok.get_vocab(with_added_tokens=True).values())
    prompt = np.asarray(tok.encode("ROMEO:", add_special_tokens=False).ids)
    model, params = load_hf(tmp_path)
    allowed = tokenizer_ids(tok, model.vocab_size)
    assert allowed.sum() == 300 and allowed[60_000] and not allowed[300:60_000].any() and not allowed[60_001:].any()
    masked = generate(model, params, prompt, 40, temperature=1.0, seed=0, allowed=allowed)
    free = generate(model, params, prompt, 40, temperature=1.0, seed=0)
    assert set(masked.tolist()) <= have, sorted(set(masked.tolist()) - have)
    assert len(set(free[len(prompt):].tolist()) - have) > 20
    ids, _ = sample_ids(tmp_path, "ROMEO:", 40, temperature=1.0, seed=0)  # what `taco-jax sample` prints
    np.testing.assert_array_equal(ids, masked)


@pytest.mark.parametrize(("flags", "says"), [
    (dict(final_checkpoint=False), "kept no checkpoint: it ran with --no-final-checkpoint and --checkpoint-every 0"),
    (dict(final_checkpoint=False, checkpoint_every=9, steps=4), "--checkpoint-every 9 (more than its 4 steps)"),
    (dict(), "has no --export-hf folder and no complete checkpoint"),
])
def test_sample_names_why_a_run_has_no_weights(tmp_path, flags, says):
    """`sample --from RUN` of a run folder without weights says why (its checkpoint flags) and which
    flags keep them."""
    from taco_jax.train.sample import load_for_sampling

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig.from_flags(out=str(tmp_path), **flags).to_dict()))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="train it with --export-hf DIR, --checkpoint-every N or a final checkpoint") \
            as e:
        load_for_sampling(tmp_path)
    assert says in str(e.value)


@pytest.mark.slow
def test_resume_refuses_another_tokenizer_and_notes_other_data(bpe300, tmp_path, capsys):
    """A run on `--data` with a checkpoint: resuming with data of another tokenizer is refused naming
    both tokenizers (the run's tokenizer.json untouched); data with the same tokenizer is accepted,
    with a note naming both folders (both decided before anything is compiled)."""
    import jax

    from taco_jax.collectives import CommPolicy
    from taco_jax.train.loop import prepare, train

    out = tmp_path / "run"
    one = dict(RUN, model="gpt2-narrow", mesh="data=1", policy=CommPolicy.none(), steps=2, eval_every=2,
               vocab_size=300)
    summary = train(TrainConfig.from_flags(data=str(bpe300), out=str(out), checkpoint_every=2, **one), progress=False,
                    devices=jax.devices()[:1])
    assert np.isfinite(summary["final_val_loss"])
    assert Image.open(out / "loss.png").info["Title"].startswith(f"gpt2-narrow on data='{bpe300}', mesh data=1")
    run_tok = (out / "tokenizer.json").read_bytes()

    (tmp_path / "b.txt").write_text(play_text("othello")[:20000])
    prepare_data([str(tmp_path / "b.txt")], tmp_path / "other", vocab_size=300, progress=False)  # another BPE
    assert load_prepared(tmp_path / "other").vocab_size == 300
    with pytest.raises(ValueError, match=rf"--resume: the data's tokenizer {tmp_path / 'other' / 'tokenizer.json'} "
                                         rf"\(data='{tmp_path / 'other'}'\) differs from the run's tokenizer "
                                         rf"{out / 'tokenizer.json'} \(data='{bpe300}'\)"):
        prepare(TrainConfig.from_flags(data=str(tmp_path / "other"), out=str(out), resume=True, **one),
                devices=jax.devices()[:1])
    assert (out / "tokenizer.json").read_bytes() == run_tok

    prepare_data([str(tmp_path / "b.txt")], tmp_path / "same", tokenizer=str(bpe300 / "tokenizer.json"),
                 progress=False)
    capsys.readouterr()
    run = prepare(TrainConfig.from_flags(data=str(tmp_path / "same"), out=str(out), resume=True, **one),
                  devices=jax.devices()[:1])
    assert run.resuming and run.dataset.tokenizer_path == str(tmp_path / "same" / "tokenizer.json")
    assert (f"[taco-jax] --resume with data='{tmp_path / 'same'}': the run trained on data='{bpe300}' (the same "
            "tokenizer)") in capsys.readouterr().err
