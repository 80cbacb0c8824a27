"""Developer tools that run against the engine: the differential fuzzer and its tiny model builder."""
