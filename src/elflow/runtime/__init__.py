"""Where elflow runs: devices and precision, distributed processes, the bf16 fast path, the fused
head loss, keyed randomness, profiling, lazy exports."""
