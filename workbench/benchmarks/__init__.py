"""Benchmarks that print a table beside a peer, and the GPU machine's selftest."""
