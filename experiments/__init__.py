"""Studies of taco_jax, grouped by theme, each run from the repository root as
`python -m experiments.THEME.NAME --help` (shell scripts: `bash experiments/THEME/NAME.sh`).

codec/        the codec alone and its share of a step
  bench_codec          encode / decode throughput per backend beside a memcpy (JSON + PNG)
  codec_time           the codec's time in a training step, read from a profile (not a difference of steps)
collectives/  the compressed collectives
  bench_collectives    every compressed collective against the exact one (`make bench`)
  tp_overlap_fidelity  SQNR of the overlapped TP ring (--tp-overlap) vs the two-shot SP collectives
  tp_overlap_trace     profiler trace: does a ring step's ppermute run beside a partial matmul
costmodel/    the cost model of `taco_jax.perf`
  costmodel_measure    collective timings for the cost model
  costmodel_calibrate  fits the cost model's constants to those timings
e2e/          the emulated cluster: real multi-process training on shaped links
  bench_e2e            exact vs TACO tokens/s on emulated links, paired rounds (`make bench-e2e-link`)
  e2e_study            bench_e2e over every configuration, and the cost model against it (`make bench-e2e`)
  gloo_latency         what one gloo collective between two emulated processes costs beyond its bytes
  link_latency         the per-message cost of an emulated link, per shaping variant
  load_guard           is the machine quiet enough for these studies (probe, load; --calibrate-probe)
  veth_bytes.sh        (root) a 2-process training step's bytes on a veth pair between two namespaces
fidelity/     does compression change training
  fidelity             message-level codec fidelity tables and the short-run ablation
  fidelity_runs        paired-seed training runs: loss delta vs the exact run (`make fidelity`)
  fidelity_long        paired runs over thousands of steps on a real corpus (`make fidelity-long`)
  grad_fidelity        deterministic one-step gradient fidelity at training checkpoints
  prepare_corpus       the CPython-stdlib corpus of fidelity_long, prepared reproducibly
gpu/          the GPU path
  gpu_check            one JSON report of the GPU path (run by gpu_check.sh on a lent GPU)
  triton_aot           the Triton kernels compiled ahead of time for a GPU architecture
  gpu_check.sh         builds the FFI libraries, runs `pytest -m gpu` and gpu_check (device tool, repo root)
step/         one training step
  step_time            train step time, exact vs compressed, on one or more local processes
  hlo_dump             compiled train-step HLO (metadata stripped), two steps' losses, wire bytes: diff two checkouts

Shared helpers (paths, child processes, simulated CPU devices, the result record `run_record`) live in
`experiments.common`. Every study that writes a result JSON records its run there under "run": command,
commit, host (CPU model, cores), load average and UTC date. tests/test_experiments.py checks that this
index names every study and nothing else.
"""
