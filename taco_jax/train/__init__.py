"""Training: typed config, jitted steps over a mesh, the loop and the none-vs-taco comparison."""

from taco_jax.train.config import TrainConfig

__all__ = ["TrainConfig"]
