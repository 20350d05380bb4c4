"""Executors: the engine's one handle on its Workers, one rank in this process or N tensor-parallel
ranks (rank 0 here, the others in processes of their own). The engine calls the same methods either
way; only rank 0's Worker samples."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from roseinfer.executor.rank_processes import RankProcesses
from roseinfer.worker.model_runner import LaunchedStep, StepResult
from roseinfer.worker.worker import Worker, WorkerSpec

if TYPE_CHECKING:
    from roseinfer.engine.scheduler import SchedulerOutput


class Executor:
    """One rank: rank 0's Worker, in this process."""

    # a step launched before the last one's ids reach the host (overlap scheduling); the other
    # tensor-parallel ranks would need those ids sent to them first
    launches_ahead = True

    def __init__(self, spec: WorkerSpec, device: torch.device) -> None:
        self.driver = Worker(spec, device)
        self.driver.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.driver.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int, eos_token_ids: set[int], capture: bool) -> None:
        """Every rank's pool and runner; capture: what the backend records for later steps too."""
        self.driver.init_kv_cache(num_blocks, eos_token_ids)
        if capture:
            self.driver.capture()

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.driver.execute(out)

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        return self.driver.launch(out, previous)

    def collect(self, launched: LaunchedStep) -> StepResult:
        return self.driver.collect(launched)

    def shutdown(self) -> None:
        """Stop what runs elsewhere (nothing here); the engine runs no steps afterwards."""


class TensorParallelExecutor(Executor):
    """spec.world_size ranks: the same Worker on each; rank 0's prepares each step and samples."""

    launches_ahead = False

    def __init__(self, spec: WorkerSpec, device: torch.device, num_threads: int) -> None:
        """num_threads: each rank's torch threads."""
        self.driver = Worker(spec, device)
        # rank 0's choice of backend, by name: every rank runs the same
        self.ranks = RankProcesses(dataclasses.replace(spec, backend=self.driver.backend.name), device, num_threads)
        try:
            self.driver.load_model(self.ranks.tp)  # the other ranks load their shares meanwhile
            self.ranks.wait_ready()
        except BaseException:
            self.ranks.close()
            raise

    def determine_num_kv_blocks(self) -> int:
        self.ranks.call("determine_num_kv_blocks")  # they size theirs now; every rank takes the smallest
        return self.driver.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int, eos_token_ids: set[int], capture: bool) -> None:
        self.ranks.call("init_kv_cache", num_blocks)
        if capture:
            self.ranks.call("capture")
        super().init_kv_cache(num_blocks, eos_token_ids, capture)

    def execute(self, out: SchedulerOutput) -> StepResult:
        try:
            step = self.driver.prepare(out)
            self.ranks.call("follow", step.layout, step.logit_rows)  # the same forward and LM head calls
            return self.driver.run(step)
        except BaseException as exc:
            error = self.ranks.failed(exc)  # which rank died and how; the ranks are stopped
            if not isinstance(exc, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt (the ranks are stopped all the same)
            raise error from exc

    def shutdown(self) -> None:
        self.ranks.close()


def make_executor(spec: WorkerSpec, device: torch.device, num_threads: int) -> Executor:
    """num_threads: each rank's torch threads (under tensor parallelism)."""
    if spec.world_size == 1:
        return Executor(spec, device)
    return TensorParallelExecutor(spec, device, num_threads)
