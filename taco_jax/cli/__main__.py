"""`python -m taco_jax.cli`: the `taco-jax` command (`taco_jax.cli.run`)."""

from taco_jax.cli import run

run()
