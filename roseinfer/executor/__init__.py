"""What runs the engine's steps: executor.py (Executor: rank 0's Worker in this process;
TensorParallelExecutor: the same Worker on every rank, ranks 1..N-1 in processes of their own,
rank_processes.py). Below the engine, above the Worker (roseinfer/worker)."""
