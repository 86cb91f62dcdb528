"""An InferenceServer on its own event-loop thread, for tests, notebooks and benchmarks."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.runtime.engine import Engine
from engine.service.server import InferenceServer, ServerConfig


class BackgroundServer:
  """An InferenceServer on its own event-loop thread, for tests and notebooks.

      with BackgroundServer(engine, ServerConfig(port=0)) as bg:
        client = InferenceClient(f"127.0.0.1:{bg.port}")
  """

  def __init__(self, engine: Engine, config: ServerConfig = ServerConfig(port=0),
               metrics_port: int | None = None, wait_ready: bool = True):
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, name="moejax-grpc",
                                    daemon=True)
    self._thread.start()
    self.server = InferenceServer(engine, config)
    self.starting = asyncio.run_coroutine_threadsafe(self.server.start(metrics_port), self.loop)
    if wait_ready:
      self.starting.result(600)

  @property
  def port(self) -> int | None:
    """The bound port (known before warm-up ends)."""
    return self.server.port

  def call(self, coro: Any, timeout: float | None = 300) -> Any:
    """Runs a coroutine on the server's loop and waits for its result."""
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def close(self) -> None:
    if self.loop.is_running():
      self.call(self.server.stop())
      self.loop.call_soon_threadsafe(self.loop.stop)
      self._thread.join()

  def __enter__(self) -> "BackgroundServer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
