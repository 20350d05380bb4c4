"""Tensor parallelism as the models see it: parallel.py (the group, each rank's share of the weights,
the collectives the models call; torch only). The ranks' processes are the executor's
(roseinfer/executor/rank_processes.py). See docs/distributed.md."""
