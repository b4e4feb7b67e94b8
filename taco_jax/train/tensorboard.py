"""`taco-jax train --tensorboard`: the scalars of `metrics.jsonl` as TensorBoard event files in
`<out>/tensorboard` (process 0; a loop hook), written with tensorboardX (no TensorFlow needed;
`pip install 'taco_jax[tensorboard]'`). Tags: `TAGS` (x axis: the step), `wire_bytes_per_step/<axis>` and
`monitor/<site>/...` (docs/training.md). Non-finite values are written as they are."""

from __future__ import annotations

import pathlib

from taco_jax.train.hooks import Hook

#: metrics.jsonl key -> TensorBoard tag.
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
        "step_s": "train/step_s", "val_loss": "val/loss"}


def check_available() -> None:
    """Raises ValueError when tensorboardX is not installed (before anything is compiled)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise ValueError("tensorboard=True needs the tensorboardX package: pip install 'taco_jax[tensorboard]'") \
            from None


class TensorBoard(Hook):
    """Writes each step's record (and the run's wire bytes per step by mesh axis) to `directory`.

    start: the step the run starts after (a resumed run: its checkpoint's step). Events of later
    steps already in `directory` are purged (tensorboardX `purge_step`), as metrics.jsonl."""

    def __init__(self, directory, wire_bytes: dict[str, int], *, start: int = 0):
        from tensorboardX import SummaryWriter

        self.directory = pathlib.Path(directory)
        self.writer = SummaryWriter(logdir=str(self.directory), flush_secs=10, purge_step=start + 1)
        self.wire = wire_bytes

    def on_step(self, state, step, rec):
        for key, tag in TAGS.items():
            if key in rec:
                self.writer.add_scalar(tag, float(rec[key]), step)
        for axis, n in self.wire.items():
            self.writer.add_scalar(f"wire_bytes_per_step/{axis}", n, step)
        for site, st in rec.get("monitor", {}).items():
            for k in ("sqnr_db", "min_sqnr_db"):
                self.writer.add_scalar(f"monitor/{site}/{k}", float(st[k]), step)

    def end(self, state):
        self.writer.flush()

    def close(self):
        self.writer.close()
