"""Sequence: one generated continuation, the unit the scheduler and KV cache manager work on.

A request with `n > 1` owns several sequences (one per sample) that share the prompt.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pagedcore.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV blocks wait in the CPU pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # read a few times per sequence a step: no enum lookups


_FINISHED = frozenset(s.value for s in SequenceStatus if s.name.startswith("FINISHED_"))


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # hard cap: model context and KV capacity
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output, kept flat for slicing
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)  # while swapped out
    block_hashes: list[int] = field(default_factory=list)  # of full blocks of token_ids, chained
    num_published_blocks: int = 0  # full blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    cache_salt: object = None  # hashed into its blocks: a request's salt (tenant), or anything else that changes the KV
    lora: object = None  # the LoRAModel (lora/peft_adapter.py) its tokens run under; None: the base model
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    # Speculative decoding: the last `num_draft_tokens` of token_ids are proposals, not yet verified.
    num_draft_tokens: int = 0
    stop_reason: int | str | None = None
    detokenizer: object | None = None
    # Structured output: the sequence's grammar matcher (structured_output/backend.py), advanced on each
    # appended token; `waiting_for_grammar` keeps it out of the batch while its grammar compiles.
    grammar: object | None = None
    waiting_for_grammar: bool = False
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def lora_uid(self) -> int | None:
        return None if self.lora is None else self.lora.uid

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    def drop_draft_tokens(self, num: int | None = None) -> None:
        """Take back the last `num` proposals (all by default) before they were computed."""
        num = self.num_draft_tokens if num is None else num
        if num:
            del self.token_ids[len(self.token_ids) - num:]
            self.num_draft_tokens -= num

    def append_token(self, token_id: int, logprob: float | None, top_logprobs: dict | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:  # None: the greedy head's token (argmax_only requests report no logprob)
            self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.logprobs.append(top_logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
