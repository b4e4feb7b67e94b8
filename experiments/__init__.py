"""Studies of taco_jax, each run from the repository root as `python -m experiments.NAME --help`.

  bench_codec          codec encode / decode throughput per backend beside a memcpy (JSON + PNG)
  bench_collectives    every compressed collective against the exact one (`make bench`)
  costmodel_measure    collective timings for the cost model (`taco_jax.perf`)
  costmodel_calibrate  fits the cost model's constants to those timings
  fidelity             message-level codec fidelity tables and the short-run ablation
  fidelity_runs        paired-seed training runs: loss delta vs the exact run (`make fidelity`)
  grad_fidelity        deterministic one-step gradient fidelity at training checkpoints
  step_time            train step time, exact vs compressed, on one or more local processes
  tp_overlap_fidelity  SQNR of the overlapped TP ring (--tp-overlap) vs the two-shot SP collectives
  tp_overlap_trace     profiler trace: does a ring step's ppermute run beside a partial matmul
  hlo_dump             compiled train-step HLO (metadata stripped), two steps' losses, wire bytes: diff two checkouts
  gpu_check            one JSON report of the GPU path (run by gpu_check.sh on a lent GPU)
  triton_aot           the Triton kernels compiled ahead of time for a GPU architecture
  load_guard           is the machine quiet enough for the emulated-cluster studies (probe, load; --calibrate-probe)

`veth_bytes.sh` (root) counts a 2-process training step's bytes on a veth pair between two network
namespaces (docs/results.md, "Honest exact baselines").

Shared helpers (paths, child processes, simulated CPU devices) live in `experiments.common`.
"""
