"""EngineCore: one step = schedule -> execute -> update -> propose; what comes out is plain data
(engine/outputs.py): token ids, logprobs, finish reasons and timestamps, never text."""
from __future__ import annotations

from roseinfer.engine.outputs import EngineCoreOutput, aborted_output
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.scheduler import Scheduler, SchedulerOutput
from roseinfer.executor.executor import Executor


class EngineCore:
    """Owns the requests in flight. A finished request stays queryable until its id is returned by
    pop_finished_ids()."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.requests: dict[str, Request] = {}

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
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        outputs = self.scheduler.update(out, *self.executor.execute(out))
        self._propose(out)
        return outputs

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
        return self.scheduler.has_unfinished()
