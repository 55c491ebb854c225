"""AsyncLLMEngine: many coroutines (from any event loops) stream from one engine.

The engine steps in its own thread; the model's forward releases the GIL, so event loops stay
responsive. Only that thread touches engine state: callers hand it "add" and "abort" commands
through a queue, drained before every step. Each request's outputs travel to its caller's loop
through `call_soon_threadsafe`.

Shutdown is deterministic: `shutdown()` (also `with` / `async with`, and an atexit hook for engines
still running when the interpreter exits) stops the thread and joins it, so no step is inside torch
while the interpreter tears down. `shutdown(grace_period=s)` first stops admitting and lets the
requests in flight finish for up to `s` seconds.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import threading
import weakref
from typing import AsyncIterator

from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.limits import EngineDeadError, RequestFailedError
from pagedcore.sampling_params import InvalidRequestError

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

logger = logging.getLogger("pagedcore")

# Engines whose thread may still run: shut down at interpreter exit (atexit runs after Python has
# joined its non-daemon threads, while daemon ones still run), before torch's teardown.
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_LIVE):
        engine.shutdown()


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
        # A queued command (an arrival, an abort) ends a multi-step decode at its next forward. The queue only:
        # the engine must not hold this object.
        engine.stop_multi_step = lambda commands=self._commands: not commands.empty()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._accepting = True
        self._shutdown_lock = threading.Lock()
        self._last_stats = None
        self._thread = threading.Thread(target=self._loop, name="pagedcore-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def __enter__(self) -> "AsyncLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLMEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    @classmethod
    def from_settings(cls, model: str | None = None, plugins=(), **settings) -> "AsyncLLMEngine":
        return cls(LLMEngine(model=model, plugins=plugins, **settings))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def healthy(self) -> bool:
        """Readiness: admitting requests, its thread alive, and not marked unhealthy by failed steps."""
        return self._accepting and self._thread.is_alive() and self.engine.healthy

    # ---- LoRA adapters: the registry has its own lock, so these run in the caller's thread ----
    def add_lora(self, lora_request) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        return self.engine.remove_lora(lora_name)

    def list_loras(self) -> list:
        return self.engine.list_loras()

    async def generate(self, prompt, sampling_params=None, request_id: str | None = None,
                       output_kind: OutputKind = OutputKind.DELTA, timeout: float | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (deltas by default). Invalid input raises
        `InvalidRequestError`, overload `OverloadedError`, before anything is queued; leaving the
        loop early aborts the request. `timeout`: seconds to the request's deadline
        (`RequestTimeoutError` past it); a failed step raises `RequestFailedError`. `priority` and
        `cache_salt` as in `LLMEngine.add_request`; `lora_request`: a LoRARequest (its adapter is loaded
        here, before queuing: an unknown or bad one raises InvalidRequestError)."""
        if not self._accepting:
            e = EngineDeadError("the engine is shut down" if self._stopped else "the engine is shutting down")
            self.engine.reject(e)
            raise e
        processed = self.engine.process_prompt(prompt, sampling_params)  # pure: no lock needed
        await self._check_grammar(processed.params)
        self.engine.check_request_options(priority, cache_salt)  # reads config only
        lora = self.engine.resolve_lora(lora_request)  # the adapter registry has its own lock
        request_id = request_id or f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.engine.check_capacity(len(self._streams))  # counts requests queued but not yet added
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, processed, output_kind, timeout, priority, cache_salt, lora))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine ended it: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled, or the caller stopped iterating
                self.abort(request_id)

    async def _check_grammar(self, params) -> None:
        """A constrained request waits for its grammar here (compiled in the engine's pool, cached), so a
        bad schema, regex or grammar is refused before anything is queued."""
        future = self.engine.compile_grammar(params)
        if future is None:
            return
        try:  # shielded: a caller that goes away must not cancel a compile other requests share
            await asyncio.shield(asyncio.wrap_future(future))
        except InvalidRequestError as e:
            self.engine.reject(e)
            raise

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

    def shutdown(self, grace_period: float = 0.0) -> None:
        """Stop admitting; give the requests in flight up to `grace_period` seconds to finish; end
        the rest (their streams raise EngineDeadError, their blocks are freed); join the thread.
        Idempotent, and safe from any thread but the engine's own."""
        with self._shutdown_lock:
            self._accepting = False
            if grace_period > 0 and not self._stopped and self._thread.is_alive():
                self.wait_idle(grace_period)
            self._stopped = True
            self._commands.put(("wake",))
            self._thread.join(timeout=60)
            _LIVE.discard(self)
            self.engine.shutdown()  # tensor-parallel workers, if any

    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()  # fails only a failed step's requests, itself
                self._last_stats = self.engine.stats()
            except Exception as e:  # a bug outside the step's own guard: fail everything in flight
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)
        self._close_streams()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is None:
            return
        if not stream.put(out.error if out.error is not None else out) and not out.finished:
            self._streams.pop(out.request_id, None)  # nobody can read it
            self.engine.abort_request(out.request_id)

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
        self.engine.abort_request(list(self.engine.requests), reason="shutdown")
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
            _, request_id, processed, output_kind, timeout, priority, cache_salt, lora = cmd
            stream = self._streams.get(request_id)
            if stream is None:  # aborted before it was queued
                return
            try:
                self.engine.add_request(request_id, processed, output_kind=output_kind, timeout=timeout,
                                        priority=priority, cache_salt=cache_salt, lora_request=lora)
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
        self.engine.abort_request(list(self.engine.requests), reason="error")
        for stream in streams.values():
            stream.put(RequestFailedError(f"generation failed: {type(error).__name__}: {error}"))
