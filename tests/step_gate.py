"""A gate in front of an engine's steps, so that a test decides how far a request gets rather than
the machine's speed: a request held at the gate is slow by construction, however busy the CPU."""
from __future__ import annotations

import threading

import pytest

from roseinfer.engine.llm_engine import LLMEngine


class StepGate:
    """Each `engine.step()` waits for a permit: `allow(n)` lets n more steps through, `allow()` all
    of them from then on. It starts closed."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, patience: float = 60.0) -> None:
        self._cond = threading.Condition()
        self._permits: int | None = 0  # None: open
        self._held = 0  # steps waiting at the gate now
        real_step = engine.step

        def step() -> list:
            with self._cond:
                self._held += 1
                self._cond.notify_all()
                # a test that forgets to open the gate fails its requests instead of hanging
                opened = self._cond.wait_for(lambda: self._permits != 0, timeout=patience)
                self._held -= 1
                if not opened:
                    raise TimeoutError(f"the step gate was held for {patience} s")
                if self._permits is not None:
                    self._permits -= 1
            return real_step()

        monkeypatch.setattr(engine, "step", step)

    def wait_until_held(self, timeout: float = 60.0) -> bool:
        """Whether a step reached the gate (and waits there) within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._held > 0, timeout=timeout)

    def allow(self, steps: int | None = None) -> None:
        with self._cond:
            if steps is None or self._permits is None:
                self._permits = None
            else:
                self._permits += steps
            self._cond.notify_all()
