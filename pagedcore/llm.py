"""LLM: the offline API, `LLM(model=...).generate(prompts, params)` as in vLLM."""

from __future__ import annotations

import os
from typing import Sequence as Seq

from tqdm.auto import tqdm

from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind, RequestOutput
from pagedcore.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, plugins=(), **engine_settings):
        self.worker = None  # a torchrun rank other than 0 (distributed_executor_backend="external_launcher")
        if engine_settings.get("distributed_executor_backend") == "external_launcher" \
                and os.environ.get("RANK", "0") != "0" and engine_settings.get("tensor_parallel_size", 1) > 1:
            from pagedcore.config import EngineConfig
            from pagedcore.distributed.worker import ExternalWorker

            self.engine = None
            self.worker = ExternalWorker(EngineConfig(model=model, **engine_settings))
            return
        self.engine = LLMEngine(model=model, plugins=plugins, **engine_settings)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (also done when the LLM is dropped, and at exit)."""
        if self.engine is not None:
            self.engine.shutdown()

    def get_tokenizer(self):
        return self.worker.tokenizer if self.worker is not None else self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string or a list of token ids;
        `priority` (one per prompt) needs `scheduling_policy="priority"`. Under torchrun
        (external_launcher) every rank makes the same calls: rank 0's returns the outputs, the other
        ranks' run rank 0's steps on their shards and return []. `lora_request`: a LoRARequest for
        every prompt, or a list of them (None entries: the base model); needs `enable_lora=True`."""
        if self.worker is not None:
            self.worker.serve()
            return []
        try:
            return self._generate(prompts, sampling_params, use_tqdm, priority, lora_request)
        finally:
            executor = getattr(self.engine, "executor", None)
            if executor is not None:
                executor.end_call()  # external_launcher: the other ranks' call returns

    def _generate(self, prompts, sampling_params, use_tqdm, priority, lora_request=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything first: a bad prompt fails the call before any work is queued.
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        processed = [self.engine.process_prompt(p, sp) for p, sp in zip(prompts, params)]
        grammars = [self.engine.compile_grammar(p.params) for p in processed]  # all compile at once
        for future in filter(None, grammars):
            future.result()  # a bad schema, regex or grammar: InvalidRequestError, nothing queued
        loras = [self.engine.resolve_lora(lr) for lr in loras]  # a bad adapter fails before anything is queued
        ids = []
        try:
            for p, prio, lora in zip(processed, priority, loras):
                ids.append(self.engine.add_request(None, p, output_kind=OutputKind.FINAL_ONLY, priority=prio,
                                                   lora_request=lora))
        except BaseException:
            self.engine.abort_request(ids)  # a bad priority fails the call with nothing left queued
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if self.worker is not None:
            return self.generate([])
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        tokenize=True, return_dict=False)
        return list(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{self.engine.total_generated_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
        except BaseException:
            self.engine.abort_request(ids)  # never leave blocks held by a failed call
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
