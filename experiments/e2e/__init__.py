"""Studies of experiments/e2e/: the emulated cluster, real multi-process training on shaped links
(index: `experiments`)."""
