"""AsyncLLMEngine: many coroutines (from any event loops) stream from one engine.

The engine steps in its own thread; the model's forward releases the GIL, so event loops stay
responsive. Only that thread touches engine state: callers hand it "add" and "abort" commands
through a queue, drained before every step. Each request's outputs travel to its caller's loop
through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator

from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.sampling_params import InvalidRequestError

logger = logging.getLogger("pagedcore")


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> bool:
        """False when the caller's event loop is closed: nobody will ever read this stream."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": must not kill the engine thread
            return False
        return True


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._last_stats = None
        self._thread = threading.Thread(target=self._loop, name="pagedcore-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, model: str | None = None, plugins=(), **settings) -> "AsyncLLMEngine":
        return cls(LLMEngine(model=model, plugins=plugins, **settings))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt, sampling_params=None, request_id: str | None = None,
                       output_kind: OutputKind = OutputKind.DELTA) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (deltas by default). Invalid input raises
        `InvalidRequestError` before anything is queued; leaving the loop early aborts the request."""
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        processed = self.engine.process_prompt(prompt, sampling_params)  # pure: no lock needed
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, processed, output_kind))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled, or the caller stopped iterating
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def stats(self):
        """A snapshot of the last step's stats (read without stopping the engine)."""
        return self._last_stats or self.engine.stats()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every queued command is applied and no request is unfinished."""
        done = threading.Event()
        self._commands.put(("barrier", done))
        return done.wait(timeout)

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
                self._last_stats = self.engine.stats()
            except Exception as e:  # fail the requests in flight, keep the engine thread alive
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if stream is not None and not stream.put(out) and not out.finished:
                    self._streams.pop(out.request_id, None)
                    self.engine.abort_request(out.request_id)
        self._close_streams()

    def _close_streams(self) -> None:
        """After shutdown: end every open stream with EngineDeadError (a caller mid-stream must
        not wait forever), free what their requests hold, and release wait_idle() callers."""
        try:
            while True:
                cmd = self._commands.get_nowait()
                if cmd[0] == "barrier":
                    cmd[1].set()
        except queue.Empty:
            pass
        streams, self._streams = self._streams, {}
        self.engine.abort_request(list(self.engine.requests))
        for stream in streams.values():
            stream.put(EngineDeadError("the engine is shut down"))

    def _apply_commands(self, block: bool) -> None:
        cmds = []
        try:
            cmds.append(self._commands.get(timeout=1.0) if block else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        for cmd in cmds:
            self._apply(cmd)
        if cmds:  # adds and aborts change the queues and the pool: keep stats() current
            self._last_stats = self.engine.stats()

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, processed, output_kind = cmd
            stream = self._streams.get(request_id)
            if stream is None:  # aborted before it was queued
                return
            try:
                self.engine.add_request(request_id, processed, output_kind=output_kind)
            except Exception as e:
                self._streams.pop(request_id, None)
                stream.put(e)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "barrier":
            if self.engine.has_unfinished_requests():
                self._commands.put(cmd)  # re-check after the next step
            else:
                cmd[1].set()

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        self.engine.abort_request(list(streams))
        for stream in streams.values():
            stream.put(RuntimeError(f"engine step failed: {error}"))
