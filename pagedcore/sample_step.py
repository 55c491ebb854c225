"""SampleStep: a step's logits -> its sampled tokens (SampledOutput). Only decides; the scheduler applies it.

Most sequences go through the Sampler (after the logits processors and the grammar's bitmask);
drafted ones through the spec decoder's verification; beams through their request's BeamGroup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from pagedcore.beam_search import BeamGroup
from pagedcore.greedy_head import ArgmaxTokens
from pagedcore.output_processor import RequestState
from pagedcore.sampler import Sampler, SamplingBatch
from pagedcore.sampling_params import SamplingParams
from pagedcore.scheduler import SampledOutput, SequenceSample
from pagedcore.sequence import Sequence
from pagedcore.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pagedcore.spec_decode.spec_decoder import SpecDecoder


@dataclass
class SampleStep:
    logits_processors: list
    structured_output: StructuredOutputManager
    eos_token_ids: set[int]
    make_logprobs: Callable  # OutputProcessor.make_logprobs
    spec: SpecDecoder | None  # None: no speculation
    seq_counter: Iterator[int]  # the engine's: beams forked here get unique seq ids

    def argmax_only(self, seqs: list[Sequence]) -> bool:
        """Whether the step's rows need only their logits' argmax: each request's own settings say so
        (`SamplingParams.argmax_only`), and nothing engine-wide edits or reads logits."""
        return not self.logits_processors and self.spec is None and all(seq.params.argmax_only for seq in seqs)

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor | ArgmaxTokens, requests: dict[str, RequestState],
                 sampler: Sampler) -> SampledOutput:
        """The next token of every sequence that reached its end: `sampler`'s for most, the request's
        beam group's for beam search. The sampler is passed each step, not held: it is the engine's
        attribute, which `bench step` wraps with a timer."""
        out = SampledOutput()
        if isinstance(logits, ArgmaxTokens):  # the greedy head's tokens: no logprob to report (argmax_only)
            if logits.token_ids.dim() == 1:
                out.samples += [SequenceSample(seq, [token], [None]) for seq, token in zip(seqs, logits.token_ids.tolist())]
            else:  # a multi-step decode's tokens, [rows, steps]: all but the last were fed back
                out.samples += [SequenceSample(seq, tokens, [None] * len(tokens), num_fed_back=len(tokens) - 1)
                                for seq, tokens in zip(seqs, logits.token_ids.tolist())]
            return out
        if self.spec is not None and any(seq.num_draft_tokens for seq in seqs):
            samples, seqs, logits = self.spec.verify_drafted(seqs, logits, self.eos_token_ids, self.make_logprobs)
            out.samples += samples
        is_beam = [requests[seq.request_id].beam is not None for seq in seqs]
        beam_rows = [(seq, logits[i]) for i, seq in enumerate(seqs) if is_beam[i]]
        if beam_rows:  # beams leave the sampler's batch
            keep = [i for i, beam in enumerate(is_beam) if not beam]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            seqs = [seqs[i] for i in keep]
        if seqs:
            out.samples += self.sample_tokens(sampler, *with_forks(seqs, logits, requests))
        for group in ready_beam_groups(beam_rows, requests):
            state = requests[group.beams[0].request_id]
            group.step_into(out, self.seq_counter)
            state.seqs = list(group.beams)
        return out

    @torch.inference_mode()  # logits are inference tensors; processors may edit them in place
    def sample_tokens(self, sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor,
                      parents: list) -> list[SequenceSample]:
        for proc in self.logits_processors:
            logits = proc(logits, seqs)
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            [s.generator for s in seqs], self.eos_token_ids, logits.shape[-1], logits.device)
        batch.token_bitmask = self.structured_output.bitmask([s.grammar for s in seqs])
        out = sampler(logits, batch)
        token_ids = out.sampled_token_ids.tolist()
        token_logprobs = out.sampled_logprobs.tolist()
        top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        samples = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            top = None if seq.logprobs is None else [
                self.make_logprobs(token_ids[i], token_logprobs[i], top_ids[i][:k], top_lps[i][:k])]
            samples.append(SequenceSample(seq, [token_ids[i]], [token_logprobs[i]], top, fork_of=parents[i]))
        return samples


def with_forks(seqs: list[Sequence], logits: torch.Tensor, requests: dict[str, RequestState]):
    """When a request's prompt is done, its other samples join it: they sample from the same
    logits, and the scheduler forks the prompt's blocks to them (ref counts; only the shared
    partial block is copied, on write)."""
    forks = []
    for row, seq in enumerate(seqs):
        state = requests[seq.request_id]
        if state.pending_forks and seq.num_output_tokens == 0:
            forks += [(row, seq, child) for child in state.pending_forks]
            state.pending_forks = []
    parents = [None] * len(seqs) + [parent for _, parent, _ in forks]
    if forks:
        rows = list(range(len(seqs))) + [row for row, _, _ in forks]
        logits = logits[torch.tensor(rows, device=logits.device)]
    return seqs + [child for _, _, child in forks], logits, parents


def ready_beam_groups(beam_rows, requests: dict[str, RequestState]) -> list[BeamGroup]:
    """Beams hand their logits to their group; a group steps once every live beam has them."""
    ready = {}
    for seq, row in beam_rows:
        group = requests[seq.request_id].beam
        if group.add_logits(seq, row):
            ready[seq.request_id] = group
    return list(ready.values())


def seq_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of a request's `index`-th sample, or None for an unseeded request."""
    if params.seed is None:
        return None
    # Each sample of a seeded request gets its own stream, reproducible whatever the batch.
    return torch.Generator(device=device).manual_seed(params.seed + index * 1_000_003)


def eos_token_ids(model, tokenizer) -> set[int]:
    """The model's generation_config eos id(s) and the tokenizer's."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
