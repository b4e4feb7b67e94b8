"""`taco-jax compare`: the same model trained twice (same seed and data order), exact on every axis
and with the run's communication policy, with both runs' losses and wire bytes side by side."""

from __future__ import annotations

from taco_jax.collectives.policy import CommPolicy
from taco_jax.data import data_label, training_data
from taco_jax.train import distributed as dist
from taco_jax.train.comm_flags import AXIS_SITES, policy_label
from taco_jax.train.config import OUT_DIR, TrainConfig, flag_values
from taco_jax.train.loop import check_export_dir, check_out_dir, check_resumable, train
from taco_jax.train.plots import plot_losses
from taco_jax.util import jsonio


def _ratio(runs: dict, key: str) -> float | None:
    """Compressed / exact tensor-axis wire bytes of `compare`'s two runs under summary key `key`."""
    exact = runs["none"][key].get("tensor", 0)
    return runs["taco"][key].get("tensor", 0) / exact if exact else None


def compare(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Trains the same model twice (same seed and data order): exact on every axis ("none"), then
    with `cfg.communication.policy` ("taco": `--comm` and its codec flags, `--dp-comm`, `--pp-comm`,
    `--policy`, `--site`; whatever its codecs, its folder and summary keys say "taco").

    Writes `<out>/none/`, `<out>/taco/` (each a `train` output), `<out>/loss.png` and `<out>/summary.json`: both
    final validation losses, their relative difference, and each run's wire bytes per step by mesh axis with the
    compressed / exact ratio. Multi-process: every process trains both runs; process 0 writes the files.
    Raises: as `train`; ValueError before any training when `<out>` cannot be written, the policy
    compresses no site, `--eval-batches 0`, or both runs would export into one `--export-hf` folder
    (`{out}/hf` gives each its own) or a run's export is refused (`loop.check_export_dir`)."""
    if not cfg.logging.eval_batches:
        raise ValueError("eval_batches=0 evaluates nothing, and compare compares the two runs' validation losses: "
                         "give 1 or more; set by --eval-batches or [logging] eval_batches")
    policy, axes = cfg.communication.policy, cfg.parallelism.axes
    compressed = sorted({a for a, sites in AXIS_SITES.items() for s in sites if getattr(policy, s).kind != "none"})
    if not compressed:
        raise ValueError("compare trains the exact run and a compressed one, and this policy compresses no site "
                         "(--comm none, no --dp-comm / --pp-comm): both runs would be exact. Give a codec "
                         "(e.g. --comm taco, --comm int8, --dp-comm taco), or run `taco-jax train --comm none`")
    if all(axes.get(a, 1) == 1 for a in compressed):
        raise ValueError(f"compare: the policy compresses the {' and '.join(compressed)} axis, which mesh="
                         f"{cfg.parallelism.mesh!r} does not have (or has size 1): both runs would be exact. Give a "
                         "mesh with that axis (e.g. --mesh data=2,tensor=4), or a codec for an axis it has "
                         "(e.g. --dp-comm taco)")
    out = check_out_dir(cfg.checkpoint.out)
    ds = training_data(cfg.data.path, cfg.bpe_vocab_size)
    configs = {"none": cfg.replace(policy=CommPolicy.none(), out=str(out / "none")),
               "taco": cfg.replace(out=str(out / "taco"))}
    export = configs["none"].checkpoint.export_dir
    if export and export == configs["taco"].checkpoint.export_dir:
        raise ValueError(f"export_hf={cfg.checkpoint.export_hf!r}: both runs of compare would export into that "
                         f"folder, the second over the first; give --export-hf '{OUT_DIR}/hf' (each run's folder: "
                         f"{out / 'none' / 'hf'}, {out / 'taco' / 'hf'}); set by --export-hf or [checkpoint] "
                         "export_hf")
    for c in configs.values():  # both runs' folders, before either trains
        check_out_dir(c.checkpoint.out)
        check_resumable(c)
        check_export_dir(c)
    runs = {c: train(run_cfg, dataset=ds, progress=progress) for c, run_cfg in configs.items()}
    base, taco = runs["none"]["final_val_loss"], runs["taco"]["final_val_loss"]
    wire = {c: r["wire_bytes_per_step"] for c, r in runs.items()}
    ratio = {a: wire["taco"].get(a, 0) / n for a, n in wire["none"].items() if n}
    axes = runs["taco"]["compressed_axes"]
    codecs = ", ".join(f"{a}: {policy_label(policy, AXIS_SITES[a])}" for a in axes) or "nothing compressed"
    summary = {
        "model": cfg.model.name,
        "mesh": cfg.parallelism.mesh,
        "steps": cfg.training.steps,
        "val_loss_none": base,
        "val_loss_taco": taco,
        "val_loss_rel_diff": (taco - base) / base,
        "within_1pct": abs(taco - base) / base <= 0.01,
        "compressed_axes": axes,
        "policy_taco": runs["taco"]["policy"],
        "codecs_taco": codecs,  # the compressed run (folder taco/) by mesh axis, e.g. "tensor: int8-G128"
        "tensor_wire_bytes_per_step": {c: w.get("tensor", 0) for c, w in wire.items()},
        "tensor_wire_ratio_taco_over_none": ratio.get("tensor"),
        "wire_ratio_taco_over_none": ratio,  # per mesh axis: compressed / exact wire bytes per step
        "wire_bytes_per_step": wire,
        # wire ratio against the exact run's messages as issued (bf16 with --dtype bfloat16) and as if
        # they were FP32 (the uncompiled HLO; XLA:CPU's compiled exact all-reduces are f32 either way)
        "tensor_wire_ratio_vs_exact_issued": _ratio(runs, "wire_bytes_per_step_issued"),
        "tensor_wire_ratio_vs_exact_f32": _ratio(runs, "wire_bytes_per_step_issued_as_f32"),
        "dtype": cfg.model.dtype,
        "tokens_per_s": {c: r["tokens_per_s"] for c, r in runs.items()},
        "step_tokens_per_s": {c: r["step_tokens_per_s"] for c, r in runs.items()},
        "config": {k: v for k, v in flag_values(cfg.to_dict()).items() if k not in ("policy", "out")},
        "processes": runs["taco"]["processes"],
    }
    if not dist.is_writer():
        return summary
    jsonio.write(out / "summary.json", summary)
    taco_label = f"compressed ({codecs})" if axes else "taco (nothing compressed)"
    plot_losses(out / "loss.png", {"exact (every axis)": out / "none" / "metrics.jsonl",
                                   taco_label: out / "taco" / "metrics.jsonl"},
                title=f"{cfg.model.name} on {data_label(cfg.data.path)}, mesh {cfg.parallelism.mesh}: "
                      "exact vs compressed")
    return summary
