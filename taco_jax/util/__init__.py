"""Ground-floor utilities that import nothing else of taco_jax: strict JSON / TOML I/O (`jsonio`), the lines a
run prints (`console`), child processes (`procs`) and the emulated-link description (`links`)."""
