"""Benchmarks behind ``fedsweep bench``: synthetic server steps (aggregation, consensus, transport),
one actor's memory and throughput, the checkpoint writer, whole runs. Each writes JSON under results/bench/."""
