"""Worker: one rank's model (its share under tensor parallelism), attention backend, KV pool and runner.

The one build path: the engine's rank 0, every other tensor-parallel rank (in its own process) and a
draft model each build a Worker from a WorkerSpec, in the same steps: the backend (from the model's
config alone), then the weights, then the pool sized from the budget every rank shares."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from roseinfer.backends import select_backend
from roseinfer.backends.base import Backend, BatchLayout
from roseinfer.config import EngineConfig
from roseinfer.distributed.parallel import SINGLE, TensorParallel
from roseinfer.loader.model_loader import load_model, load_model_config
from roseinfer.models.config import ModelConfig
from roseinfer.worker.model_runner import LaunchedStep, ModelRunner, PreparedStep, StepResult
from roseinfer.worker.sharding import shard_config

if TYPE_CHECKING:
    from roseinfer.engine.scheduler import SchedulerOutput


@dataclass
class WorkerSpec:
    """What a Worker is built from; the same for every rank (pickled to the other ranks' processes)."""

    config: EngineConfig
    model_folder: Path
    backend: str  # a backend's name, or auto; the executor resolves it once, so every rank runs the same
    dtype: torch.dtype
    max_model_len: int
    quantization: str  # EngineConfig.quantization's values
    world_size: int = 1


class Worker:
    def __init__(self, spec: WorkerSpec, device: torch.device) -> None:
        """Reads the model's config and picks the backend; the weights load in `load_model`."""
        self.spec = spec
        self.device = device
        self.model_config = load_model_config(spec.model_folder)
        self.local_config = shard_config(self.model_config, spec.world_size)  # what this rank computes
        self.backend = select_backend(spec.backend, device, spec.dtype, self.local_config, spec.world_size)
        self.tp = SINGLE
        self.runner: ModelRunner | None = None
        self.num_state_slots = 0  # a hybrid model's state pool, sized with the KV blocks
        self.num_draft_slots = 0  # and its scratch slots for verified drafts (draft_state_slots)

    def load_model(self, tp: TensorParallel = SINGLE) -> None:
        """This rank's share of the weights; `tp` is its place in the group (the models' collectives)."""
        self.tp = tp
        self.model = load_prepared_model(self.spec.model_folder, self.model_config, self.spec.dtype, self.device,
                                         self.backend, tp, self.spec.quantization,
                                         self.spec.config.cpu_activations)

    def determine_num_kv_blocks(self) -> int:
        """The blocks every rank's pool can hold: config.num_kv_blocks, else the smallest of the ranks'
        budgets (a collective: every rank calls it at once); 0 when not even one fits. A hybrid model's
        state slots (the drafts' scratch, then num_state_slots) come out of the same budget first."""
        config = self.spec.config
        slot_bytes = ModelRunner.state_bytes_per_slot(self.local_config, self.backend.dtype)
        self.num_draft_slots = draft_state_slots(config) if slot_bytes else 0
        if config.num_kv_blocks:
            self.num_state_slots = config.max_num_seqs if slot_bytes else 0
            return config.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.local_config, config.block_size, self.backend.dtype)
        step_tokens = min(config.max_num_batched_tokens, self.spec.max_model_len)
        # on CUDA, what is left after a profiling forward of the largest step (Platform.kv_pool_bytes)
        budget = self.backend.platform.kv_pool_bytes(config, self.spec.world_size, lambda: ModelRunner.profile(
            self.model, self.local_config, self.backend, config.block_size, step_tokens, config.max_num_seqs))
        if slot_bytes:
            # the drafts' scratch slots first, then a slot per sequence that may run within half of the
            # rest; KV gets what is left
            budget -= self.num_draft_slots * slot_bytes
            self.num_state_slots = max(0, min(config.max_num_seqs, int(budget // 2 // slot_bytes)))
            budget -= self.num_state_slots * slot_bytes
        # never more than every sequence at full length could use
        ceiling = config.max_num_seqs * -(-self.spec.max_model_len // config.block_size)
        return self.tp.min(max(0, min(int(budget // per_block), ceiling)))

    def init_kv_cache(self, num_blocks: int, eos_token_ids: set[int] | None = None) -> None:
        """The pool and the runner. With eos_token_ids this worker samples (rank 0 and a draft model)."""
        sampler = None
        if eos_token_ids is not None:
            # imported here: a tensor-parallel rank never samples, so it never loads the sampler
            from roseinfer.engine.sampler import Sampler

            sampler = Sampler(eos_token_ids, self.device, self.spec.config.seed, self.backend.argmax)
        self.runner = ModelRunner(self.model, self.local_config, num_blocks, self.spec.config.block_size,
                                  self.backend, sampler, self.num_state_slots, self.num_draft_slots)

    def capture(self) -> None:
        """What the backend records for later steps (CUDA graphs of decode steps, where it has them)."""
        self.runner.capture(self.spec.config.max_num_seqs, self.spec.max_model_len)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute(out)

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        return self.runner.prepare(out)

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Overlap scheduling: the step queued, its placeholders read from `previous`'s tokens on the device."""
        return self.runner.launch(self.runner.prepare(out, previous))

    def collect(self, launched: LaunchedStep) -> StepResult:
        return self.runner.collect(launched)

    def run(self, step: PreparedStep) -> StepResult:
        return self.runner.run(step)

    def follow(self, layout: BatchLayout, logit_rows: list[list[int] | slice]) -> None:
        """A rank other than 0: its part in the step rank 0 runs (ModelRunner.follow)."""
        self.runner.follow(layout, logit_rows)


def draft_state_slots(config: EngineConfig) -> int:
    """A hybrid model's scratch slots for speculative decoding: a verified draft of k tokens keeps its
    state after each of its first k positions in one slot each (the state after the last goes to the
    request's own slot), for as many drafts as one step verifies (the scheduler's cap)."""
    spec = config.speculative
    if spec is None:
        return 0
    return min(spec.disable_by_batch_size, config.max_num_seqs) * spec.num_speculative_tokens


def load_prepared_model(folder: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                        backend: Backend, tp: TensorParallel = SINGLE, quantization: str = "auto",
                        cpu_activations: str = "auto") -> nn.Module:
    """The model with the checkpoint's weights (loader/model_loader.py; GGUF blocks kept where
    `backend` computes with them), prepared by `backend`, which may swap its own layers in
    (cpu_activations: EngineConfig's, for the backend that has that choice)."""
    if quantization == "gguf" and not backend.quantized_types:
        raise ValueError(f"quantization gguf: the {backend.name} backend computes with fp32 weights only; "
                         "use --attention-backend cpu, or --quantization none (or auto) to dequantize at load")
    model = load_model(folder, model_config, dtype, device, tp, quantization, backend.quantized_types)
    backend.prepare_model(model, cpu_activations)
    return model
