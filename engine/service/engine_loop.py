"""The engine's own thread (`EngineLoop`): steps the engine while there is work and hands each
step's `RequestOutput`s to the subscriber of its request id (an asyncio stream, through
`loop.call_soon_threadsafe`). A step that raises fails every subscribed request with an
`EngineFailure` and aborts it (its pages are freed); the loop keeps serving.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from absl import logging

from engine.runtime.engine import Engine


@dataclasses.dataclass(frozen=True)
class EngineFailure:
  """Delivered to every in-flight stream when a step raises (or the replica stops serving:
  `retryable`, UNAVAILABLE / 503, another replica may answer it)."""
  message: str
  retryable: bool = False


class EngineLoop:
  """The engine's own thread: steps while there is work, waits on an event otherwise."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._subscribers: dict[str, Callable[[Any], None]] = {}
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="moejax-engine", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    """Stops the thread, then aborts what is still subscribed and delivers what the last step
    left queued (an abort that arrived during it), so the engine is left idle."""
    self._stop.set()
    self._wake.set()
    self._thread.join()
    for rid in self.subscribed():
      self.engine.abort(rid)
    self._deliver(self.engine.settle())

  def wake(self) -> None:
    self._wake.set()

  def subscribe(self, request_id: str, deliver: Callable[[Any], None]) -> bool:
    with self._lock:
      if request_id in self._subscribers:
        return False
      self._subscribers[request_id] = deliver
      return True

  def unsubscribe(self, request_id: str, deliver: Callable[[Any], None] | None = None) -> bool:
    """Removes the subscription (only if it is `deliver`'s, when given); True if removed."""
    with self._lock:
      if request_id not in self._subscribers or deliver not in (
          None, self._subscribers[request_id]):
        return False
      del self._subscribers[request_id]
      return True

  def subscribed(self) -> list[str]:
    with self._lock:
      return list(self._subscribers)

  def _run(self) -> None:
    while not self._stop.is_set():
      self._wake.clear()
      if not self.engine.has_unfinished():
        self._wake.wait(0.05)
        continue
      try:
        outputs = self.engine.step()
      except Exception as e:  # keep serving: fail what was in flight, free its pages
        logging.exception("engine step failed; failing the in-flight requests")
        self.fail_all(f"{type(e).__name__}: {e}")
        continue
      self._deliver(outputs)

  def _deliver(self, outputs) -> None:
    for out in outputs:
      if out.finished:  # before delivery: the client may reuse the id as soon as it reads
        self.engine.release(out.request_id)
      with self._lock:
        deliver = self._subscribers.get(out.request_id)
      if deliver is not None:
        deliver(out)

  def fail_all(self, message: str, retryable: bool = False) -> None:
    """Every subscribed request ends with `message` (an EngineFailure) and is aborted."""
    with self._lock:
      subscribers = list(self._subscribers.items())
    for rid, deliver in subscribers:
      deliver(EngineFailure(message, retryable))
      try:
        self.engine.abort(rid)
      except Exception:
        logging.exception("request %s: abort after a failed step failed", rid)
