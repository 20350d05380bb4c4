"""One rank's share of the engine: worker.py (Worker: the model, its backend, the KV pool and the
runner, built the same way on every tensor-parallel rank and for a draft model) and model_runner.py
(a step's flat batch, its forward and sampling). The executor (roseinfer/executor) drives them."""
