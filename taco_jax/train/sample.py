"""`taco-jax sample`: text from a run folder or a Hugging Face checkpoint, with the run's own tokenizer.

A run folder (`train --out`) holds its `tokenizer.json`; its weights are read from its `--export-hf`
folder when that exists, else from its latest complete checkpoint (parameters only, one device).
An HF checkpoint folder needs a `tokenizer.json`. Stderr names the weights read (folder and step).
Generation: `models.generate` (one device), drawing only ids the tokenizer has (`tokenizer_ids`)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import warnings

import numpy as np


def _int_keys(tree):
    """Orbax returns dict keys as strings: layer indices ("0", "1", ...) back to ints (the model's keys)."""
    if isinstance(tree, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}
    return tree


def _checkpoint_params(run: pathlib.Path, conf: dict):
    """(InferenceModel, params) of a run's latest complete checkpoint. Raises ValueError when it has none."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from taco_jax.models.generate import InferenceModel
    from taco_jax.train.checkpoint import Checkpoints
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.settings import FlagWarning
    from taco_jax.util.console import say

    with warnings.catch_warnings():  # the run's training flags (e.g. a schedule with no effect) are not this command's
        warnings.simplefilter("ignore", FlagWarning)
        cfg = TrainConfig.from_dict({k: v for k, v in conf.items() if k != "policy"}, where=str(run / "config.json"))
    ckpt = Checkpoints(run / "checkpoints", keep=cfg.checkpoint.keep_checkpoints)
    try:
        steps = ckpt.steps()
    finally:
        ckpt.close()
    if not steps:
        raise ValueError(_no_checkpoint(run, cfg))
    path = (run / "checkpoints" / str(steps[-1]) / "state").resolve()  # Orbax reads no metadata from a relative path
    # the item's metadata from its handler: a Checkpointer would also read the step's _CHECKPOINT_METADATA, which
    # the CheckpointManager keeps one folder up (absl warns "Metadata file does not exist"; nothing here uses it)
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path))["params"]
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), tree)
    args = ocp.args.PyTreeRestore(item={"params": target}, partial_restore=True,
                                  restore_args={"params": jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=dev),
                                                                       target)})
    params = _int_keys(ocp.PyTreeCheckpointer().restore(path, args=args)["params"])
    say(f"[taco-jax] sample: the weights of {run / 'checkpoints' / str(steps[-1])} (the run's latest checkpoint, "
        f"step {steps[-1]})")
    model_cfg = dataclasses.replace(cfg.model_config, dtype="float32", remat="none")
    if cfg.parallelism.pipelined:  # pipeline layout (stage > 1 or microbatches > 1): layers stacked on a leading axis
        key = "h" if "h" in params else "layers"
        stacked = params[key]
        n = jax.tree.leaves(stacked)[0].shape[0]
        params = {**params, key: {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}}
    return InferenceModel.from_config(model_cfg), params


def _no_checkpoint(run: pathlib.Path, cfg) -> str:
    """Why run `run` (its config `cfg`) has no weights to sample from, and what keeps them."""
    where = f"no --export-hf folder and no complete checkpoint in {run / 'checkpoints'}"
    keep = ("to sample from a run, train it with --export-hf DIR, --checkpoint-every N or a final checkpoint "
            "(the default)")
    ck, steps = cfg.checkpoint, cfg.training.steps
    if not ck.final_checkpoint and not 0 < ck.checkpoint_every <= steps:
        every = f"--checkpoint-every {ck.checkpoint_every}" + (" (none)" if not ck.checkpoint_every else
                                                               f" (more than its {steps} steps)")
        return f"run {run} kept no checkpoint: it ran with --no-final-checkpoint and {every}: {where}; {keep}"
    return f"run {run} has {where} (a run that has not finished, or whose checkpoints were removed); {keep}"


def _recorded_folder(run: pathlib.Path, conf: dict, key: str) -> pathlib.Path | None:
    """Folder `key` of run `run`'s config.json `conf` (absolute, or "{out}/REL": `run` / REL). A
    relative one (older runs) is resolved against the folder the run started from, told by the
    recorded relative `out` that ends `run`'s path; None when not recorded or not told."""
    from taco_jax.train.config import OUT_DIR

    if not conf.get(key):
        return None
    if conf[key].startswith(OUT_DIR + "/"):
        return run / conf[key].removeprefix(OUT_DIR + "/")
    path, out = pathlib.Path(conf[key]), pathlib.Path(conf.get("out") or "")
    if path.is_absolute():
        return path
    root, n = run.resolve().parts, len(out.parts)
    if out.is_absolute() or not n or ".." in out.parts or root[-n:] != out.parts:
        return None
    return pathlib.Path(*root[:-n]) / path


def _say_export(folder: pathlib.Path, run: pathlib.Path | None = None) -> None:
    """Says on stderr which HF folder `sample` reads and its step (`EXPORT_RECORD`); for run folder
    `run`'s export, warns when the run has a newer checkpoint than that step."""
    from taco_jax.models.hf import EXPORT_RECORD, read_record
    from taco_jax.train.checkpoint import saved_steps
    from taco_jax.util.console import say, warn

    step = (read_record(folder) or {}).get("step")
    said = f"step {step}" if step is not None else f"no training step recorded: no {EXPORT_RECORD}"
    if run is None:
        say(f"[taco-jax] sample: the weights of {folder} (an HF checkpoint{f', {said}' if step is not None else ''})")
        return
    say(f"[taco-jax] sample: the weights of {folder} (the run's --export-hf, {said})")
    newest = saved_steps(run / "checkpoints")
    if newest and (step is None or newest[-1] > step):
        ck = run / "checkpoints" / str(newest[-1])
        warn(f"[taco-jax] warning: the run's checkpoint {ck} (step {newest[-1]}) "
             + (f"is newer than its export (step {step})" if step is not None else "may be newer than its export")
             + f"; sample reads the export: move {folder} aside to sample the checkpoint")


def load_for_sampling(source):
    """(InferenceModel, params, tokenizer path) of a run folder or an HF checkpoint folder `source`,
    the weights read named on stderr (`_say_export`, or the checkpoint's step).
    Raises ValueError naming the folder when it is neither, or lacks its tokenizer or weights."""
    from taco_jax.models.generate import load_hf
    from taco_jax.train.config import flag_values

    src = pathlib.Path(source)
    conf_file = src / "config.json"
    if not conf_file.is_file():
        run = next((p for p in (src.parent, src.parent.parent) if src.exists() and (p / "config.json").is_file()), None)
        hint = f"; give the folder that holds it, --from {str(run)!r}" if run is not None else ""
        raise ValueError(f"--from {source!r} is neither a run folder nor an HF checkpoint (no config.json in it)"
                         f"{hint}")
    conf = json.loads(conf_file.read_text())
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"--from {source!r} has no tokenizer.json (runs write theirs; an HF checkpoint needs one)")
    if "architectures" in conf:  # an HF checkpoint
        model, params = load_hf(src)
        _say_export(src)
        return model, params, tokenizer
    conf = flag_values(conf, str(conf_file))  # sectioned, or flat as older runs wrote it
    export = _recorded_folder(src, conf, "export_hf")
    if export is not None and (export / "config.json").is_file():
        model, params = load_hf(export)
        _say_export(export, src)
        return model, params, tokenizer
    init_from = _recorded_folder(src, conf, "init_from")  # the architecture of a run started from a checkpoint
    model, params = _checkpoint_params(src, {**conf, "init_from": str(init_from or conf.get("init_from") or "")})
    return model, params, tokenizer


def tokenizer_ids(tok, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: the ids the tokenizer `tok` has a token for (added tokens included); a
    model's vocabulary can be larger, and ids without a token would vanish from the text."""
    allowed = np.zeros(vocab_size, bool)
    ids = np.fromiter(tok.get_vocab(with_added_tokens=True).values(), np.int64)
    allowed[ids[ids < vocab_size]] = True
    return allowed


def sample_ids(source, prompt: str, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
               seed: int = 0):
    """(ids int32 [T0 + max_new_tokens], the `tokenizers.Tokenizer`): the prompt's ids and the
    generated ones, each an id of the tokenizer (`tokenizer_ids`). Raises ValueError as
    `load_for_sampling` and `models.generate` (e.g. a prompt + count beyond the model's context)."""
    from tokenizers import Tokenizer

    from taco_jax.models.generate import generate

    model, params, tokenizer = load_for_sampling(source)
    tok = Tokenizer.from_file(str(tokenizer))
    ids = np.asarray(tok.encode(prompt, add_special_tokens=False).ids, np.int32)
    if ids.size == 0:
        raise ValueError(f"prompt={prompt!r} encodes to no tokens")
    out = generate(model, params, ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   allowed=tokenizer_ids(tok, model.vocab_size))
    return out, tok


def sample(source, prompt: str, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
           seed: int = 0) -> str:
    """The prompt and its continuation, decoded (`sample_ids`; see the module docstring). Raises
    ValueError as `sample_ids`."""
    out, tok = sample_ids(source, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode([int(i) for i in out], skip_special_tokens=False)
