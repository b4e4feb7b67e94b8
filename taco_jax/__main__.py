"""`python -m taco_jax`: the `taco-jax` command, as `python -m taco_jax.cli` (taco_jax.cli.run)."""

from taco_jax.cli import run

run()
