"""EngineCore: one step = schedule -> execute -> update -> propose; what comes out is plain data
(engine/outputs.py): token ids, logprobs, finish reasons and timestamps, never text.

With async scheduling (overlap), a step schedules and launches the next batch before it reads the
tokens of the one in flight: the device runs ahead while the host schedules, and each launched
token stands in the requests as a placeholder that the next forward reads on the device."""
from __future__ import annotations

from dataclasses import dataclass

from roseinfer.engine.outputs import EngineCoreOutput, aborted_output
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.sampler import samples_on_device
from roseinfer.engine.scheduler import Scheduler, SchedulerOutput
from roseinfer.executor.executor import Executor
from roseinfer.worker.model_runner import LaunchedStep


@dataclass
class InFlight:
    """A launched step not read yet: what the scheduler gave it and what the executor queued."""

    out: SchedulerOutput
    launched: LaunchedStep


class EngineCore:
    """Owns the requests in flight. A finished request stays queryable until its id is returned by
    pop_finished_ids()."""

    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = False) -> None:
        """async_scheduling: overlap each step's scheduling with the forward before it (the engine turns it
        off where the executor cannot launch ahead or drafts are proposed from each step's tokens)."""
        self.scheduler = scheduler
        self.executor = executor
        self.requests: dict[str, Request] = {}
        self.async_scheduling = async_scheduling
        self.in_flight: InFlight | None = None

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> EngineCoreOutput | None:
        """End a waiting or running request and free its blocks at once; its final output, or None
        if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.scheduler.abort(req)
        return aborted_output(req)

    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._overlapped_step()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        outputs = self.scheduler.update(out, *self.executor.execute(out))
        self._propose(out)
        return outputs

    def _overlapped_step(self) -> list[EngineCoreOutput]:
        """Launch step N + 1, then read and apply step N's tokens: what N finished is dropped from
        N + 1's results (update skips finished requests). A batch whose next tokens need its ids on
        the host (samples_on_device) is read at once, as without overlap."""
        out = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        launched = self.executor.launch(out, previous.launched if previous else None) if out.scheduled else None
        outputs = self._collect(previous) if previous else []
        if launched is not None:
            self.scheduler.advance(out)
            current = InFlight(out, launched)
            if all(samples_on_device(item.request) for item in out.scheduled):
                self.in_flight = current
            else:
                outputs += self._collect(current)
        return outputs

    def _collect(self, flight: InFlight) -> list[EngineCoreOutput]:
        return self.scheduler.update(flight.out, *self.executor.collect(flight.launched))

    def _propose(self, out: SchedulerOutput) -> None:
        """Drafts for the next step, for every running decode at once, while the decodes are few: a
        larger batch's forward is no longer bound by reading the weights, so rejected positions cost
        compute. The scheduler budgets them."""
        proposer = self.scheduler.proposer
        if proposer is None:
            return
        decodes = [r for r in self.scheduler.running if not r.in_prefill]
        if len(decodes) > proposer.config.disable_by_batch_size:
            for req in decodes:
                req.draft = []
            return
        stepped = [s.request for s in out.scheduled if s.request.status is RequestStatus.RUNNING]
        fresh = [r for r in stepped if not r.in_prefill]
        for req, draft in zip(fresh, proposer.propose(fresh)):
            req.draft = draft

    def pop_finished_ids(self) -> list[str]:
        ids = self.scheduler.pop_finished_ids()
        for request_id in ids:
            self.requests.pop(request_id, None)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None
