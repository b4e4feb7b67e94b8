"""Pipeline schedule arithmetic: validity checks, tick counts and bubbles (no jax).

S stages, M microbatches; a tick = one stage-step on every stage. GPipe: M + S - 1 forward ticks
then the mirrored backward; 1F1B: M + 2S - 2 ticks of (forward, recomputed forward, backward).
The analytic bubble of both on real asynchronous hardware is (S-1)/(M+S-1).
Source: GPipe (Huang et al. 2019), PipeDream-flush / 1F1B (Narayanan et al. 2021).
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")


def check_pipeline(n_layers: int, stages: int, microbatches: int, schedule: str = "gpipe") -> None:
    """Raises ValueError (naming the value) for a pipeline that cannot be built."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; choose one of {SCHEDULES}")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if n_layers % stages:
        raise ValueError(f"n_layer={n_layers} is not divisible by stage={stages} (layers are split evenly)")
    if stages > 1 and microbatches < stages:
        raise ValueError(f"microbatches={microbatches} must be >= stage={stages}, else a stage never works")


def pipelined_layout(stages: int, microbatches: int) -> bool:
    """Whether a run uses the pipeline layout (layers stacked, `parallel.staged.StagedModel`, run by a
    schedule): stage > 1, or microbatches > 1 on one stage. The one test every user asks."""
    return stages > 1 or microbatches > 1


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of each stage for GPipe and 1F1B on asynchronous devices: (S-1)/(M+S-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def schedule_stats(schedule: str, stages: int, microbatches: int) -> dict:
    """What one train step of `schedule` costs on this SPMD implementation, in stage-steps: ticks,
    stage forwards / backwards executed (masked included), useful (M), the SPMD bubble (1 - useful /
    executed work, a backward = two forwards), the analytic bubble, the stage inputs kept."""
    s, m = stages, microbatches
    if schedule == "gpipe":
        ticks, fwd, bwd, kept = m + s - 1, m + s - 1, m + s - 1, m + s - 1
    elif schedule == "1f1b":
        ticks = m + 2 * s - 2
        fwd, bwd, kept = 2 * ticks, ticks, min(m, 2 * s - 1)  # forward + recomputed forward per tick
    else:
        raise ValueError(f"schedule={schedule!r} is not supported; choose one of {SCHEDULES}")
    return dict(ticks=ticks, stage_forwards=fwd, stage_backwards=bwd, useful=m,
                spmd_bubble=1 - 3 * m / (fwd + 2 * bwd), analytic_bubble=bubble_fraction(s, m),
                activations_kept=kept)
