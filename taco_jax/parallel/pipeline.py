"""Pipeline parallelism over the `stage` mesh axis: GPipe and 1F1B microbatch schedules in one SPMD program.

One import for the pipeline's public names (`schedule_math`, `staged`, `schedules`, `send`).
"""

from taco_jax.collectives.pipeline_send import send
from taco_jax.parallel.schedule_math import (
    SCHEDULES,
    bubble_fraction,
    check_pipeline,
    pipelined_layout,
    schedule_stats,
)
from taco_jax.parallel.schedules import gpipe_loss, one_f_one_b, value_and_grad
from taco_jax.parallel.staged import StagedModel

__all__ = ["SCHEDULES", "StagedModel", "bubble_fraction", "check_pipeline", "gpipe_loss", "one_f_one_b",
           "pipelined_layout", "schedule_stats", "send", "value_and_grad"]
