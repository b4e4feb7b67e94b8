"""Your own corpus: `prepare-data` (text, folders, JSONL; a given tokenizer or a BPE trained on the data),
the memory-mapped token files, the one training stream over them, and the checks against the model."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from taco_jax.data import (
    TokenStream,
    check_data,
    load_prepared,
    prepare_data,
    tokenizer_hash,
)
from taco_jax.data import prepared as prep
from taco_jax.data.shakespeare import EOT, play_text

pytestmark = pytest.mark.fast

QWEN3 = pathlib.Path(__file__).parent / "fixtures" / "hf" / "qwen3"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(play_text("macbeth")[:30000])
    (d / "b.md").write_text(play_text("othello")[:20000])
    return d


def _stream(folder):
    ds = load_prepared(folder)
    return np.concatenate([np.asarray(ds.train), np.asarray(ds.val)]), ds


def test_prepare_with_the_checkpoint_tokenizer(corpus, tmp_path):
    """Token files equal the tokenizer's own encoding of each document followed by the end-of-text
    id; meta.json records tokenizer hash, vocabulary, dtype, end-of-text id, sources and split."""
    meta = prepare_data([str(corpus)], tmp_path, init_from=str(QWEN3), val_fraction=0.2, progress=False)
    tok = Tokenizer.from_file(str(QWEN3 / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    want = []
    for name in ("a.txt", "b.md"):  # a folder: its files sorted by path
        want += tok.encode((corpus / name).read_text(), add_special_tokens=False).ids + [eot]
    ids, ds = _stream(tmp_path)
    np.testing.assert_array_equal(ids, want)
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    assert len(ds.val) == round(0.2 * len(want)) and len(ds.train) + len(ds.val) == len(want)
    assert meta["tokenizer"]["sha256"] == tokenizer_hash(QWEN3 / "tokenizer.json")
    assert (meta["vocab_size"], meta["dtype"], meta["eot_id"]) == (tok.get_vocab_size(), "uint16", eot)
    assert [(pathlib.Path(s["path"]).name, s["bytes"], s["documents"]) for s in meta["sources"]] == \
        [("a.txt", (corpus / "a.txt").stat().st_size, 1), ("b.md", (corpus / "b.md").stat().st_size, 1)]
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    assert tokenizer_hash(tmp_path / "tokenizer.json") == meta["tokenizer"]["sha256"]


@pytest.mark.parametrize("tokenizer", ["bpe", "qwen3"])
def test_long_documents_are_cut_at_line_starts_without_changing_ids(corpus, tmp_path, monkeypatch, tokenizer):
    """Long documents are encoded in pieces (parallel batch encode) cut where the pre-tokenizer splits
    anyway: the ids equal those of the whole document (GPT-2 byte-level BPE; Qwen's split regex)."""
    if tokenizer == "bpe":
        prepare_data([str(corpus / "a.txt")], tmp_path / "whole", vocab_size=400, progress=False)
        args = dict(tokenizer=str(tmp_path / "whole" / "tokenizer.json"))
    else:
        args = dict(init_from=str(QWEN3))
        prepare_data([str(corpus / "a.txt")], tmp_path / "whole", progress=False, **args)
    assert prep._splits_at_line_starts(Tokenizer.from_file(str(tmp_path / "whole" / "tokenizer.json")))
    pieces = list(prep._pieces((corpus / "a.txt").read_text(), 500))
    assert len(pieces) > 20 and "".join(pieces) == (corpus / "a.txt").read_text()
    monkeypatch.setattr(prep, "PIECE_CHARS", 500)
    monkeypatch.setattr(prep, "BATCH_CHARS", 4000)  # several batches too
    prepare_data([str(corpus / "a.txt")], tmp_path / "cut", progress=False, **args)
    np.testing.assert_array_equal(_stream(tmp_path / "cut")[0], _stream(tmp_path / "whole")[0])


def test_trained_bpe_round_trips_and_jsonl(tmp_path):
    """No tokenizer given: a byte-level BPE trained on the data (saved with it); JSONL documents come
    from --text-field, each followed by the end-of-text id; decoding gives the text back."""
    docs = [play_text("hamlet")[i * 3000:(i + 1) * 3000] for i in range(6)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)) + "\n")
    meta = prepare_data([str(src)], tmp_path / "out", vocab_size=300, text_field="body", progress=False)
    ids, ds = _stream(tmp_path / "out")
    assert meta["vocab_size"] == 300 and meta["sources"][0]["documents"] == 6
    tok = ds.tokenizer
    assert tok.decode([int(i) for i in ids], skip_special_tokens=False) == "<|endoftext|>".join(docs) + "<|endoftext|>"
    assert int((ids == ds.eot_id).sum()) == 6


def test_uint32_for_large_vocabularies(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    words = [*range(0, 70_000, 7), 69_999]
    (tmp_path / "t.txt").write_text(" ".join(f"w{i}" for i in words))
    meta = prepare_data([str(tmp_path / "t.txt")], tmp_path / "out", tokenizer=str(tmp_path / "big.json"),
                        progress=False)
    ids, ds = _stream(tmp_path / "out")
    assert meta["dtype"] == "uint32" and ds.train.dtype == np.uint32
    np.testing.assert_array_equal(ids, words + [70_000])


def test_bad_inputs_are_named(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no string field text_field='text'"):
        prepare_data([str(bad)], tmp_path / "o1", progress=False)
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON"):
        prepare_data([str(bad)], tmp_path / "o1", progress=False)
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        prepare_data([str(tmp_path / "missing.txt")], tmp_path / "o1", progress=False)
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        prepare_data([str(corpus)], tmp_path / "o1", val_fraction=1.5, progress=False)
    with pytest.raises(ValueError, match="eot_token='<eos>' is not in the tokenizer's vocabulary"):
        prepare_data([str(corpus)], tmp_path / "o1", init_from=str(QWEN3), eot_token="<eos>", progress=False)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        prepare_data([str(corpus)], tmp_path / "o1", init_from=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match="not a prepared folder"):
        load_prepared(tmp_path)
    prepare_data([str(corpus)], tmp_path / "ok", init_from=str(QWEN3), progress=False)
    with open(tmp_path / "ok" / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="val.bin: .* bytes, meta.json says"):
        load_prepared(tmp_path / "ok")


def test_memmap_stream_is_the_stream_and_resumes(corpus, tmp_path):
    """The trainer's stream over the memory-mapped file draws the windows a `TokenStream` draws from
    the same tokens in memory (same seed), and its state continues it exactly."""
    prepare_data([str(corpus)], tmp_path, init_from=str(QWEN3), progress=False)
    ds = load_prepared(tmp_path)
    ref = TokenStream(np.asarray(ds.train, np.int32).copy(), 4, 16, seed=5)
    stream = TokenStream(ds.train, 4, 16, seed=5)
    for _ in range(3):
        (x, y), (rx, ry) = next(stream), next(ref)
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        assert x.dtype == np.int32
    again = TokenStream(ds.train, 4, 16, seed=0)
    again.restore(stream.state())
    np.testing.assert_array_equal(next(again)[0], next(ref)[0])
    assert again.position == 4


def test_check_data_refuses_a_larger_vocabulary_and_another_tokenizer(corpus, tmp_path):
    prepare_data([str(corpus)], tmp_path / "bpe", vocab_size=300, progress=False)
    ds = load_prepared(tmp_path / "bpe")
    with pytest.raises(ValueError, match="tokenizer vocab 300 exceeds the model's vocab_size=99"):
        check_data(ds, 99, str(QWEN3))
    with pytest.raises(ValueError, match=r"the data's tokenizer .*bpe/tokenizer.json differs from the tokenizer of "
                                         r"init_from=.*qwen3"):
        check_data(ds, 512, str(QWEN3))
    check_data(ds, 300, "")  # no checkpoint: nothing to compare
    prepare_data([str(corpus)], tmp_path / "q", tokenizer=str(QWEN3 / "tokenizer.json"), progress=False)
    check_data(load_prepared(tmp_path / "q"), 99, str(QWEN3))  # the checkpoint's own tokenizer


def test_cli_prepare_data_and_sample_errors(corpus, tmp_path, capsys):
    from taco_jax.cli import main

    assert main(["prepare-data", str(corpus / "a.txt"), "--init-from", str(QWEN3), "--out", str(tmp_path / "d"),
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 99
    assert main(["prepare-data", str(tmp_path / "missing"), "--out", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().err.strip() == f"taco-jax: error: input {str(tmp_path / 'missing')!r} is neither " \
                                              "a file nor a folder"
    assert main(["sample", "--from", str(tmp_path / "d"), "--prompt", "x"]) == 2  # a data folder: no config.json
    assert "is neither a run folder nor an HF checkpoint" in capsys.readouterr().err
    assert main(["sample", "--from", str(QWEN3), "--prompt", "MACBETH:", "--max-new-tokens", "60"]) == 2
    assert "exceeds the model's block_size=64" in capsys.readouterr().err
    for flag, value in (("--temperature", "nan"), ("--top-k", "-1"), ("--max-new-tokens", "-3"),
                        ("--temperature", "inf")):  # each named alone, before the checkpoint is read
        assert main(["sample", "--from", str(tmp_path / "missing"), "--prompt", "x", flag, value]) == 2
        want = f"{float(value)} must be a finite number >= 0" if flag == "--temperature" else \
            f"{int(value)} must be an integer >= 0"
        assert capsys.readouterr().err.strip() == f"taco-jax: error: {flag} {want}"
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("{}")  # the run's config file given instead of its folder
    (tmp_path / "r" / "summary.json").write_text("{}")
    for inside in ("config.json", "summary.json"):  # a file of the run given instead of its folder
        assert main(["sample", "--from", str(tmp_path / "r" / inside), "--prompt", "x"]) == 2
        assert f"give the folder that holds it, --from {str(tmp_path / 'r')!r}" in capsys.readouterr().err


def test_symlinked_folders_are_read_once_and_the_sources_counted(corpus, tmp_path, capsys):
    """A symlinked sub-folder is followed as a symlinked file is read (`Path.rglob` skipped it without
    a word); a link back up (a loop) or to a folder already read adds nothing; the count of sources
    is printed; a dangling symlink named as a source, or with no suffix (a folder, maybe), is refused
    naming it."""
    from taco_jax.cli import main

    top, outside = tmp_path / "top", tmp_path / "outside"
    top.mkdir()
    outside.mkdir()
    (top / "a.txt").symlink_to(corpus / "a.txt")
    (outside / "b.md").write_text((corpus / "b.md").read_text())
    (top / "sub").symlink_to(outside, target_is_directory=True)
    (top / "sub2").symlink_to(outside, target_is_directory=True)  # the same folder again: read once
    (top / "up").symlink_to(top, target_is_directory=True)  # a loop
    assert main(["prepare-data", str(top), "--init-from", str(QWEN3), "--out", str(tmp_path / "d"),
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["sources"] == 2
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert [pathlib.Path(s["path"]) for s in meta["sources"]] == [corpus / "a.txt", outside / "b.md"]
    (top / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    assert main(["prepare-data", str(top), "--init-from", str(QWEN3), "--out", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().err.strip() == (f"taco-jax: error: {str(top / 'gone.txt')!r} is a symlink to "
                                              f"{str(tmp_path / 'nowhere.txt')!r}, which does not exist")
    assert not (tmp_path / "e").exists()
    (top / "gone.txt").unlink()
    (top / "gone").symlink_to(tmp_path / "nowhere")  # no suffix: it may have been a folder of sources
    assert main(["prepare-data", str(top), "--init-from", str(QWEN3), "--out", str(tmp_path / "f")]) == 2
    assert f"{str(top / 'gone')!r} is a symlink to" in capsys.readouterr().err


def test_init_from_a_missing_folder_says_so_and_that_nothing_is_downloaded(corpus, tmp_path, capsys, monkeypatch):
    """`prepare-data --init-from Qwen3-0.6B` (the README's name, which reads as a Hub id) without such a
    folder: said, with that nothing is downloaded; a folder without tokenizer.json is still named as such."""
    from taco_jax.cli import main

    monkeypatch.chdir(tmp_path)
    why = (f"the folder {str(tmp_path / 'Qwen3-0.6B')!r} does not exist; --init-from takes a local Hugging Face "
           "checkpoint folder (config.json, *.safetensors, tokenizer.json) and nothing is downloaded: fetch it "
           "first (e.g. `huggingface-cli download ORG/Qwen3-0.6B --local-dir Qwen3-0.6B`)")
    assert main(["prepare-data", str(corpus / "a.txt"), "--init-from", "Qwen3-0.6B", "--out", "d"]) == 2
    assert capsys.readouterr().err.strip() == f"taco-jax: error: init_from='Qwen3-0.6B': {why}"
    assert main(["prepare-data", str(corpus / "a.txt"), "--init-from", str(tmp_path), "--out", "d"]) == 2
    assert capsys.readouterr().err.strip() == (f"taco-jax: error: init_from={str(tmp_path)!r} has no tokenizer.json; "
                                              "give --tokenizer PATH")


def test_sample_seed_outside_jax_s_range_is_refused_naming_the_flag(tmp_path, capsys):
    """`sample --seed` beyond 2**63 - 1 (or negative) is refused as the other flags are, before the
    checkpoint is read (it was an OverflowError traceback from jax.random.key); `generate` refuses it too."""
    from taco_jax.cli import main
    from taco_jax.train.sample import sample_ids

    for seed in (2**63, -1):
        assert main(["sample", "--from", str(tmp_path / "missing"), "--prompt", "x", "--seed", str(seed)]) == 2
        assert capsys.readouterr().err.strip() == f"taco-jax: error: --seed {seed} must be in [0, 2**63) (JAX's seeds)"
    with pytest.raises(ValueError, match=r"^seed=9223372036854775808 must be in \[0, 2\*\*63\)"):
        sample_ids(QWEN3, "MACBETH", 2, seed=2**63)
    assert main(["sample", "--from", str(QWEN3), "--prompt", "MACBETH", "--max-new-tokens", "2", "--temperature", "1",
                 "--seed", str(2**63 - 1)]) == 0


def test_each_device_reads_only_its_own_rows():
    """`global_batch` reads, for each device, the windows of its own rows of the batch only (so a
    process of a multi-process run touches only its rows of the memory-mapped file)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax.data import global_batch

    class Spy:  # records which windows (their first token index) each read touches
        def __init__(self, a):
            self.a, self.reads = a, []

        def __getitem__(self, idx):
            self.reads.append(set(np.asarray(idx)[:, 0].tolist()))
            return self.a[idx]

    tokens = Spy(np.arange(1000, dtype=np.uint16))
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))
    starts = np.array([10, 200, 30, 400, 50, 600, 70, 800])
    x, y = global_batch(tokens, starts, 16, NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(np.asarray(x), starts[:, None] + np.arange(16))
    np.testing.assert_array_equal(np.asarray(y), starts[:, None] + 1 + np.arange(16))
    halves = [set(starts[:4].tolist()), set(starts[4:].tolist())]
    halves += [{s + 1 for s in h} for h in halves]  # targets start one later
    assert tokens.reads and all(r in halves for r in tokens.reads), tokens.reads


def _holed_tokenizer(path: pathlib.Path, eot_id: int) -> pathlib.Path:
    """A 300-entry byte-level BPE whose end-of-text token sits at `eot_id` (ids 1..299 and eot_id)."""
    spec = json.loads(prep._train_tokenizer([play_text("hamlet")[:20000]], 300).to_str())
    spec["model"]["vocab"][EOT] = eot_id
    for t in spec["added_tokens"]:
        if t["content"] == EOT:
            t["id"] = eot_id
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("eot_id, dtype", [(70_000, "uint32"), (60_000, "uint16")])
def test_vocabulary_with_holes_counts_to_its_largest_id(tmp_path, capsys, eot_id, dtype):
    """A 300-entry tokenizer with its end-of-text token at a large id: the vocabulary is that id + 1,
    the token dtype holds it, `--data` sizes the model from it, and a smaller model is refused
    before compiling, naming both sizes."""
    from taco_jax.cli import main
    from taco_jax.train.config import TrainConfig

    tok = _holed_tokenizer(tmp_path / "holed.json", eot_id)
    assert Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True) == 300
    (tmp_path / "t.txt").write_text(play_text("macbeth")[:8000])
    meta = prepare_data([str(tmp_path / "t.txt")], tmp_path / "d", tokenizer=str(tok), progress=False)
    ids, ds = _stream(tmp_path / "d")
    assert (meta["vocab_size"], meta["dtype"], ds.vocab_size, ds.train.dtype) == (eot_id + 1, dtype, eot_id + 1, dtype)
    assert ids[-1] == eot_id and int((ids == eot_id).sum()) == 1 and ids[:-1].max() < 300
    cfg = TrainConfig.from_flags(data=str(tmp_path / "d"), mesh="data=2,tensor=4", batch_size=8, seq_len=16)
    assert cfg.model.vocab_size == cfg.model_config.vocab_size == eot_id + 1
    with pytest.raises(ValueError, match=rf"tokenizer vocab {eot_id + 1} exceeds the model's vocab_size=2048"):
        check_data(ds, 2048)
    if eot_id < 1 << 16:  # the command: refused (exit 2) before compiling
        assert main(["train", "--data", str(tmp_path / "d"), "--vocab-size", "2048", "--mesh", "data=2,tensor=4",
                     "--batch-size", "8", "--seq-len", "16", "--steps", "1", "--out", str(tmp_path / "run"),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"taco-jax: error: vocab_size=2048 is smaller than the {eot_id + 1:,} ids of data=" in err, err


def test_special_token_text_inside_a_document_is_text(tmp_path):
    """A document holding the end-of-text token's text is encoded as text: one separator per
    document (a trained BPE, which decodes back to the documents; the checkpoint's tokenizer). An
    end-of-text token that is not special, and so matches inside text, is refused naming the document."""
    docs = ["ROMEO: " + " and ".join(["<|endoftext|>"] * 6) + " end", "JULIET: no separator here"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for name, args in (("bpe", dict(vocab_size=300)), ("qwen3", dict(init_from=str(QWEN3)))):
        prepare_data([str(src)], tmp_path / name, progress=False, **args)
        ids, ds = _stream(tmp_path / name)
        assert int((ids == ds.eot_id).sum()) == 2 and ids[-1] == ds.eot_id, name
    ids, ds = _stream(tmp_path / "bpe")
    assert ds.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False) == EOT.join(docs) + EOT
    spec = json.loads((tmp_path / "bpe" / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        t["special"] = False
    (tmp_path / "plain.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"docs.jsonl: document 1 encodes to the end-of-text id"):
        prepare_data([str(src)], tmp_path / "plain", tokenizer=str(tmp_path / "plain.json"), progress=False)


def _files(folder: pathlib.Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_refused_inputs_write_nothing(corpus, tmp_path):
    """An input refused while encoding (a bad JSONL line, too few tokens, a non-special end-of-text
    in the text) leaves an existing prepared folder byte for byte as it was, with no temporary
    file, and creates no new folder."""
    good = tmp_path / "good"
    prepare_data([str(corpus / "a.txt")], good, init_from=str(QWEN3), progress=False)
    before = _files(good)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": play_text("hamlet")[:5000]}) + "\n" + '{"txt": "b"}\n')
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    for inputs, match in (([bad], "bad.jsonl:2 has no string field"), ([tiny], "too few to split")):
        for out in (good, tmp_path / "new" / "sub"):
            with pytest.raises(ValueError, match=match):
                prepare_data([str(p) for p in inputs], out, init_from=str(QWEN3), progress=False)
            assert _files(good) == before, match
            assert not (tmp_path / "new").exists(), match


_READER = """
import pathlib, sys, time
import numpy as np
from taco_jax.data.prepared import load_prepared
ds = load_prepared(sys.argv[1])  # as `train --data`: memory-mapped, never read whole
first = int(np.asarray(ds.train, np.int64).sum())
pathlib.Path(sys.argv[2]).write_text(str(first))
while not pathlib.Path(sys.argv[3]).exists():
    time.sleep(0.02)
print(first, int(np.asarray(ds.train, np.int64).sum()), int(np.asarray(ds.val, np.int64).sum()))
"""


@pytest.mark.procs
def test_rewrite_under_a_running_reader(corpus, tmp_path):
    """`prepare-data` into the folder a running process memory-maps (a `train --data`): the files
    are replaced, not truncated, so the reader keeps reading the old tokens (no SIGBUS), and a new
    load reads the new ones."""
    import subprocess
    import sys
    import time

    from _procs import ROOT

    from taco_jax.cli import main

    d = tmp_path / "d"
    prepare_data([str(corpus)], d, init_from=str(QWEN3), progress=False)
    old = load_prepared(d)
    want = (int(np.asarray(old.train, np.int64).sum()), int(np.asarray(old.val, np.int64).sum()))
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(d), str(tmp_path / "ready"), str(tmp_path / "go")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if (tmp_path / "ready").exists() or reader.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "ready").read_text() == str(want[0])
        (tmp_path / "small.txt").write_text(play_text("hamlet")[:3000])  # fewer tokens: truncation would SIGBUS
        assert main(["prepare-data", str(tmp_path / "small.txt"), "--tokenizer", str(d / "tokenizer.json"),
                     "--out", str(d), "--no-progress"]) == 0
        (tmp_path / "go").write_text("")
        out, err = reader.communicate(timeout=60)
    finally:
        reader.kill()
    assert reader.returncode == 0, (reader.returncode, err[-2000:])
    assert out.split() == [str(want[0]), str(want[0]), str(want[1])]
    new = load_prepared(d)
    assert len(new.train) < len(old.train) and [p.name for p in d.iterdir() if ".tmp" in p.name] == []


def test_short_validation_split_is_refused_before_compiling(corpus, tmp_path):
    """A validation split shorter than one validation batch is refused while the run is prepared
    (nothing compiled yet), naming val.bin, the tokens it holds and those a batch needs."""
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.loop import prepare

    meta = prepare_data([str(corpus / "a.txt")], tmp_path / "d", init_from=str(QWEN3), val_fraction=0.01,
                        progress=False)
    n_val = meta["val_tokens"]
    assert 2 <= n_val < 32 * 64 + 1
    cfg = TrainConfig.from_flags(data=str(tmp_path / "d"), mesh="data=2,tensor=4", batch_size=32, seq_len=64,
                      out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'd' / 'val.bin'} holds {n_val} tokens; one validation "
                                         rf"batch of batch_size=32 × seq_len=64 needs 2049"):
        prepare(cfg)
    with pytest.raises(ValueError, match=r"train.bin holds \d+ tokens; one training window of seq_len=64 needs 65"):
        check_data(dataclasses.replace(load_prepared(tmp_path / "d"), train=np.zeros(64, np.uint16)), 99,
                   batch_size=1, seq_len=64)
