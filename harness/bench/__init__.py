"""Latency benchmarks: cells, the open loop, hardware floors, the transformers peer, prompt sets."""
