"""Training: typed config, jitted steps over a mesh, the loop and the none-vs-taco comparison.

`TrainConfig` is loaded on first use, so that a light submodule (`train.distributed`) imports without the models."""

__all__ = ["TrainConfig"]


def __getattr__(name: str):
    if name == "TrainConfig":
        from taco_jax.train.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'taco_jax.train' has no attribute {name!r}")
