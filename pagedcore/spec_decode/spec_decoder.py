"""SpecDecoder: the engine's one seam for speculative decoding.

Before scheduling, `propose` appends up to k drafts to running decode sequences (marking them in
`Sequence.num_draft_tokens`), so the scheduler gives each 1 + k tokens under the step's budget
(dropping drafts that do not fit) and the runner returns logits at every draft position + 1.
After the forward, `verify` turns those rows into each sequence's accepted drafts plus one token
(`SequenceSample.num_draft_tokens`), and the scheduler rolls the rejected drafts back.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from pagedcore.sampler import SamplingBatch
from pagedcore.scheduler import SequenceSample
from pagedcore.sequence import Sequence
from pagedcore.spec_decode.config import SpeculativeConfig
from pagedcore.spec_decode.cost_model import SpecPolicy, StepCosts, measure_step_costs
from pagedcore.spec_decode.rejection_sampler import RejectionSampler

logger = logging.getLogger("pagedcore")


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified sequence emits per step: 1 + accepted drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def make_proposer(spec: SpeculativeConfig, engine):
    if spec.method == "ngram":
        from pagedcore.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pagedcore.spec_decode.draft_model_proposer import DraftModelProposer

    return DraftModelProposer(spec, engine)


class SpecDecoder:
    def __init__(self, spec: SpeculativeConfig, engine):
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.proposer = make_proposer(spec, engine)
        self.rejection_sampler = RejectionSampler()
        self.stats = SpecDecodeStats()
        costs = None
        if spec.disable_by_batch_size is None:
            draft = getattr(self.proposer, "runner", None)
            costs = measure_step_costs(engine, self.k, (draft, self.proposer.kv) if draft is not None else None)
        self.costs: StepCosts | None = costs
        self.policy = SpecPolicy(self.k, spec.disable_by_batch_size, costs)

    # ---- before the step ----------------------------------------------------------------------------
    def propose(self, running: list[Sequence], can_speculate) -> int:
        """Append drafts to the running decode sequences `can_speculate` allows; returns how many got some."""
        if not running or not self.policy.should_speculate(len(running)):
            return 0
        seqs, ks = [], []
        for seq in running:
            if seq.num_draft_tokens or seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
                continue
            # Room: the KV of the last draft must fit the sequence's cap, and max_tokens ends it anyway.
            k = min(self.k, seq.max_total_tokens - 1 - seq.num_tokens)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return 0
        num = 0
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            if drafts:
                seq.token_ids += drafts
                seq.num_draft_tokens = len(drafts)
                num += 1
        return num

    # ---- after the forward ----------------------------------------------------------------------------
    def verify_drafted(self, seqs: list[Sequence], logits: torch.Tensor, eos_token_ids, make_logprobs):
        """Verify the sequences with drafts (1 + k logits rows each); return their samples and the
        others with their one row each."""
        counts = [1 + s.num_draft_tokens for s in seqs]
        starts = list(itertools.accumulate(counts, initial=0))
        drafted = [i for i, s in enumerate(seqs) if s.num_draft_tokens]
        plain = [i for i, s in enumerate(seqs) if not s.num_draft_tokens]
        dev = logits.device
        rows = [r for i in drafted for r in range(starts[i], starts[i + 1])]
        samples = self.verify([seqs[i] for i in drafted], logits[torch.tensor(rows, device=dev)], eos_token_ids,
                              make_logprobs)
        plain_logits = logits[torch.tensor([starts[i] for i in plain], dtype=torch.long, device=dev)]
        return samples, [seqs[i] for i in plain], plain_logits

    def verify(self, seqs: list[Sequence], logits: torch.Tensor, eos_token_ids, make_logprobs) -> list[SequenceSample]:
        """`logits`: each sequence's 1 + num_draft_tokens rows, in order."""
        params, prompts, outputs, generators, drafts = [], [], [], [], []
        for seq in seqs:
            p, d = seq.params, seq.num_draft_tokens
            penalised = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            num_out = seq.num_output_tokens - d
            out = seq.token_ids[seq.num_prompt_tokens:] if penalised else None
            for j in range(d + 1):
                params.append(p)
                prompts.append(seq.prompt_token_ids)
                # row j follows j drafts; without penalties only the count matters (min_tokens)
                outputs.append(out[:num_out + j] if penalised else range(num_out + j))
                generators.append(seq.generator)
            drafts.append(seq.draft_token_ids)
        batch = SamplingBatch.build(params, prompts, outputs, generators, eos_token_ids, logits.shape[-1],
                                    logits.device)
        res = self.rejection_sampler(logits, drafts, batch)
        samples = []
        for i, seq in enumerate(seqs):
            top = None
            if seq.logprobs is not None:
                n = seq.params.logprobs
                top = [make_logprobs(t, lp, ids[:n], lps[:n]) for t, lp, ids, lps in
                       zip(res.token_ids[i], res.logprobs[i], res.topk_token_ids[i], res.topk_logprobs[i])]
            samples.append(SequenceSample(seq, res.token_ids[i], res.logprobs[i], top,
                                          num_draft_tokens=seq.num_draft_tokens))
        accepted = sum(res.num_accepted)
        self.stats.num_drafts += len(seqs)
        self.stats.num_draft_tokens += sum(len(d) for d in drafts)
        self.stats.num_accepted_tokens += accepted
        self.policy.observe(len(seqs), len(seqs) + accepted)
        return samples

    def release_finished(self) -> None:
        """Free the draft's state of finished sequences."""
        release = getattr(self.proposer, "release_finished", None)
        if release is not None:
            release()

    @property
    def max_batch_size(self) -> int | None:
        return self.policy.max_batch_size()
