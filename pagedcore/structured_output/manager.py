"""StructuredOutputManager: compiles grammars off the step loop and fills each step's bitmask.

Compiles run in a small thread pool, cached by the spec (a repeated schema compiles once); a
request waits in the scheduler's queue until its future is done, without holding up the batch.
The backend itself (for xgrammar: the tokenizer's vocabulary tables, ~0.2 s) is built on first
use, in the pool: an engine that never sees a constrained request pays nothing. The manager also
holds each queued request's future until the engine attaches its grammar (`add_request`, `pop_done`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from pagedcore.sampling_params import InvalidRequestError
from pagedcore.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from pagedcore.structured_output.params import StructuredOutputsParams


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], vocab_size: int,
                 max_workers: int = 2, cache_size: int = 1024):
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedcore-grammar")
        self._make_backend = make_backend
        self._backend: Future | None = None  # submitted with the first compile: engines that never constrain pay nothing
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_times: list[float] = []  # seconds per compiled spec (cache misses), for the benchmark
        self._compiling: dict[str, Future] = {}  # request id -> its grammar's future, until attached

    @property
    def backend(self) -> StructuredOutputBackend:
        return self._backend_future().result()

    def _backend_future(self) -> Future:
        # Queued before any compile that needs it (the pool is FIFO), so a compile thread waiting on it
        # never holds the only worker that could build it.
        with self._lock:
            if self._backend is None:
                self._backend = self._executor.submit(self._make_backend)
            return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The spec's compiled grammar, as a future (shared by every request with the same spec). Its
        exception, if any, is an InvalidRequestError naming the problem."""
        key = spec.key
        self._backend_future()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._executor.submit(self._compile, spec)
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> object:
        try:
            backend = self.backend
        except (ImportError, ValueError) as e:  # the library is not installed, or no such backend
            raise InvalidRequestError(f"structured outputs are unavailable: {e}", "structured_outputs") from e
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from e
        self.compile_times.append(time.perf_counter() - t0)
        return compiled

    # ---- requests waiting for their grammar -------------------------------------------------------------
    def add_request(self, request_id: str, future: Future) -> None:
        self._compiling[request_id] = future

    def pop_done(self) -> list[tuple[str, Future]]:
        """The waiting requests whose grammar is compiled (or failed), no longer waited for."""
        done = [(rid, future) for rid, future in self._compiling.items() if future.done()]
        for rid, _ in done:
            del self._compiling[rid]
        return done

    def wait_for_compiles(self, timeout: float = 0.05) -> None:
        """Nothing to run but grammars compiling: wait for one (briefly) rather than spin."""
        if self._compiling:
            concurrent.futures.wait(list(self._compiling.values()), timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def matcher(self, compiled: object) -> StructuredOutputGrammar:
        return self.backend.matcher(compiled)

    def bitmask(self, grammars: list[StructuredOutputGrammar | None]) -> tuple[torch.Tensor, list[int]] | None:
        """One int32 bitmask [B, ceil(V / 32)] for a step's rows, filled for the constrained ones
        (their indices are returned with it); None when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        mask = torch.full((len(grammars), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.backend.fill_bitmask([grammars[i] for i in rows], mask, rows)
        return mask, rows

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def make_backend(hook, name: str, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> StructuredOutputBackend:
    """The backend `name`, through the hook, so a plugin may add one."""
    backend = hook.pagedcore_structured_output_backend(name=name, tokenizer=tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids)
    if backend is None:
        raise ValueError(f"no structured outputs backend {name!r} (built in: xgrammar, llguidance)")
    return backend
