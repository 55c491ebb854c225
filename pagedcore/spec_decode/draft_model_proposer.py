"""Proposals from a smaller model: a Hugging Face decoder sharing the target's tokenizer
("draft_model"), or the target's own first N layers and its LM head ("layer_skip", self-speculative:
no second model to load).

The draft keeps its own paged KV cache: its own ModelRunner (KV tensors, persistent input batch)
and KVCacheManager (block pool), with one shadow `Sequence` per target sequence. Before proposing,
a shadow is brought in line with its target: its KV is rewound to the tokens they still share (the
target rejected some drafts) and the target's new tokens are appended. It then runs k greedy steps
(the first also computes whatever the shadow has not seen: the whole prompt, the first time);
its drafts are a point mass for the rejection sampler.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch import nn

from pagedcore.kv_cache_manager import KVCacheManager
from pagedcore.scheduler import SchedulerOutput
from pagedcore.sequence import Sequence
from pagedcore.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("pagedcore")


def layer_skip_model(target: nn.Module, num_layers: int) -> nn.Module:
    """A model object running the target's first `num_layers` decoder layers, its final norm and
    LM head: shallow copies of the two outer modules; every weight is the target's."""
    prefix = target.base_model_prefix
    base = getattr(target, prefix, None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ValueError(f"layer_skip: {type(target).__name__} has no {prefix}.layers to take layers from")
    total = len(base.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"layer_skip: num_layers must be in 1..{total}, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft_base = copy.copy(base)
    draft_base._modules = dict(base._modules)  # copy.copy shares the submodule dict: split it
    draft_base.layers = nn.ModuleList(list(base.layers)[:num_layers])
    draft_base.config = config
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    setattr(draft, prefix, draft_base)
    draft.config = config
    return draft


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, engine):
        device = engine.device
        if spec.method == "layer_skip":
            total = engine.runner.shape.num_layers
            model = layer_skip_model(engine.model, spec.num_layers or max(1, total // 4))
        else:
            model = self._load(spec.model, engine)
        draft_config = dataclasses.replace(
            engine.config, num_kv_blocks=spec.draft_num_kv_blocks or engine.kv.num_blocks, num_cpu_blocks=0,
            compile=False, speculative_config=None, quantization=None)
        from pagedcore.model_runner import ModelRunner  # the runner imports the scheduler: import on use

        self.runner = ModelRunner(draft_config, model, engine.runner.backend, device, model.dtype)
        self.kv = KVCacheManager(self.runner.num_blocks, draft_config.block_size)
        self.max_len = min(self.runner.shape.max_position_embeddings, self.kv.num_blocks * draft_config.block_size)
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}  # target seq_id -> (target, shadow)
        self.num_synced: dict[int, int] = {}  # target tokens the shadow is known to share
        self._freed: list[int] = []  # shadow ids whose input-batch rows the draft runner must free
        logger.info("draft (%s): %d layers, KV %d blocks", spec.method, self.runner.shape.num_layers,
                    self.kv.num_blocks)

    @staticmethod
    def _load(model_name: str, engine):
        from pagedcore.model_loader import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(model_name, engine.model.dtype, engine.device)
        if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
            raise ValueError(f"draft model {model_name!r} does not share the target's tokenizer")
        if model.get_output_embeddings().weight.shape[0] != engine.vocab_size:
            raise ValueError(f"draft model {model_name!r}: vocabulary size differs from the target's")
        return model

    # ---- proposing --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        shadows = [self._sync(seq) for seq in seqs]
        active = [i for i, (s, k) in enumerate(zip(shadows, num_tokens)) if s.num_tokens + k <= self.max_len]
        for step in range(max(num_tokens, default=0)):
            sched = SchedulerOutput(finished_seq_ids=self._take_freed())
            live = []
            for i in active:
                shadow = shadows[i]
                n = shadow.num_tokens - shadow.num_computed_tokens
                if step >= num_tokens[i]:
                    continue
                if not self.kv.allocate_slots(shadow, n):  # the draft pool is full: no drafts for it
                    self.release([seqs[i].seq_id])
                    drafts[i] = []
                    continue
                sched.scheduled.append((shadow, n))
                live.append(i)
            if not live:
                break
            _, logits = self.runner.execute(sched)
            for (shadow, n), i, token in zip(sched.scheduled, live, logits.argmax(dim=-1).tolist()):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                drafts[i].append(token)
            active = live
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, holding its tokens, with KV only for tokens they share."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            if entry is not None:
                self.release([seq.seq_id])
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids, seq.params,
                              seq.max_total_tokens, token_ids=list(seq.token_ids))
            self.shadows[seq.seq_id] = (seq, shadow)
            self.num_synced[seq.seq_id] = seq.num_tokens
            return shadow
        shadow = entry[1]
        tokens, mine = seq.token_ids, shadow.token_ids
        common = self.num_synced[seq.seq_id]  # tokens before this never change
        end = min(len(tokens), len(mine))
        while common < end and tokens[common] == mine[common]:
            common += 1
        keep = min(common, len(tokens) - 1)  # the last token is fed again: its logits give the first draft
        if shadow.num_computed_tokens > keep:
            self.kv.rewind(shadow, shadow.num_computed_tokens - keep)
        if common < len(mine):
            # A new list: the runner's input batch copies a replaced list whole (it only follows growth).
            shadow.token_ids = list(tokens)
        else:
            mine.extend(tokens[len(mine):])
        self.num_synced[seq.seq_id] = len(tokens)
        return shadow

    # ---- lifetime ---------------------------------------------------------------------------------
    def release(self, seq_ids) -> None:
        """Free the shadows of these target sequences (finished, aborted, or no room for them)."""
        for seq_id in seq_ids:
            entry = self.shadows.pop(seq_id, None)
            self.num_synced.pop(seq_id, None)
            if entry is not None:
                self.kv.free(entry[1])
                self._freed.append(seq_id)

    def release_finished(self) -> None:
        self.release([sid for sid, (seq, _) in self.shadows.items() if seq.is_finished])

    def _take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed
