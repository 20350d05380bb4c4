"""Tensor parallelism: parallel.py (the group, each rank's share of the weights, the collectives the
models call; torch only) and workers.py (rank 0's worker processes: start, one message per step,
failure and shutdown). See docs/distributed.md."""
