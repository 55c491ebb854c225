"""Verification of drafts against the target's logits: one row of logits per draft position + 1.

Row j of a sequence with k drafts holds the target's logits for the token after its first j
drafts. Greedy rows accept a draft while it equals the (processed) argmax and emit the argmax at
the first mismatch, or after the last draft (the bonus token). Random rows accept draft d with
probability min(1, p(d) / q(d)) and at the first rejection draw from the residual
max(0, p - q) / sum (speculative sampling, Leviathan et al. 2023): every emitted token is then an
exact draw from p, the distribution the sampler itself would have drawn from (temperature, top-k/p,
min-p, penalties, min_tokens: `Sampler.process_logits` and `Sampler.probs` on rows whose output
tokens include the drafts before them). q is the draft's distribution, or a point mass on the draft
(n-gram and greedy drafts: accept with probability p(d), residual = p without d).

Vectorised over all rows; the per-sequence work is slicing the results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.sampler import Sampler, SamplingBatch, _logsumexp, sample_from_probs, uniforms


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per sequence: its accepted drafts, then one more token
    logprobs: list[list[float]]  # raw logprob of each
    num_accepted: list[int]
    topk_token_ids: list[list[list[int]]] | None = None  # per sequence, per token: top-N ids
    topk_logprobs: list[list[list[float]]] | None = None


class RejectionSampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, draft_token_ids: list[list[int]], batch: SamplingBatch,
                 draft_probs: torch.Tensor | None = None) -> VerifyOutput:
        """logits [N, V]: sequence i's len(draft_token_ids[i]) + 1 rows one after another; `batch`
        one row per logits row; draft_probs [N, V] (rows of bonus positions unused) or None."""
        dev = logits.device
        counts = torch.tensor([len(d) + 1 for d in draft_token_ids], device=dev)
        num_seqs, num_rows = len(draft_token_ids), logits.shape[0]
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=dev), counts)
        firsts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(num_rows, device=dev) - firsts[seq_of_row]  # j: drafts before the row
        is_draft = pos < counts[seq_of_row] - 1
        # the draft each row judges (bonus rows: a placeholder never accepted)
        drafts = torch.zeros(num_rows, dtype=torch.long, device=dev)
        drafts[is_draft] = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=dev)

        raw = logits.float()
        processed = Sampler.process_logits(raw, batch)
        accept, recovered = self._judge(processed, drafts, is_draft, batch, draft_probs)

        # accepted drafts per sequence: the leading run of accepts
        width = int(counts.max())
        padded = torch.zeros(num_seqs, width, dtype=torch.bool, device=dev)
        padded[seq_of_row, pos] = accept & is_draft
        num_accepted = padded.to(torch.long).cumprod(dim=1).sum(dim=1)
        tokens = torch.where(pos < num_accepted[seq_of_row], drafts, recovered)

        top = None
        if batch.max_num_logprobs is None:  # a reduction, not a [N, V] log_softmax
            token_lps = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - _logsumexp(raw)
        else:
            raw_logprobs = torch.log_softmax(raw, dim=-1)
            token_lps = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            top = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
        return self._split(tokens, token_lps, top, firsts.tolist(), num_accepted.tolist())

    @staticmethod
    def _judge(logits, drafts, is_draft, batch: SamplingBatch, draft_probs):
        """Per row: whether its draft is accepted, and the token emitted if it is the first row not
        accepted (a residual draw; on a bonus row a draw from p itself)."""
        greedy_accept = greedy_token = None
        if not batch.all_random:
            greedy_token = logits.argmax(dim=-1)
            greedy_accept = greedy_token == drafts
            if batch.all_greedy:
                return greedy_accept, greedy_token
        probs = Sampler.probs(logits, batch)
        p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        if draft_probs is None:  # a point mass on the draft
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        # bonus rows (after the last draft) draw from p itself
        residual = torch.where(is_draft.unsqueeze(1), RejectionSampler.residual(probs, drafts, draft_probs), probs)
        # p <= q everywhere means p == q: accepted with probability 1, its residual never drawn
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, probs, residual)
        u = uniforms(logits.shape[0], batch.generators, batch.needs_default_rng).to(probs.device)
        accept = u * q_draft.double() < p_draft.double()
        recovered = sample_from_probs(residual, batch.generators, batch.needs_default_rng)
        if greedy_accept is not None:
            accept = torch.where(batch.greedy_mask, greedy_accept, accept)
            recovered = torch.where(batch.greedy_mask, greedy_token, recovered)
        return accept, recovered

    @staticmethod
    def residual(probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
        """max(0, p - q), unnormalised (the draw normalises); a point mass q: p without the draft."""
        if draft_probs is None:
            return probs.scatter(1, drafts.unsqueeze(1), 0.0)
        return (probs - draft_probs).clamp_(min=0.0)

    @staticmethod
    def _split(tokens, token_lps, top, firsts: list[int], num_accepted: list[int]) -> VerifyOutput:
        tokens, token_lps = tokens.tolist(), token_lps.tolist()
        spans = [(f, f + a + 1) for f, a in zip(firsts, num_accepted)]
        out = VerifyOutput([tokens[a:b] for a, b in spans], [token_lps[a:b] for a, b in spans], num_accepted)
        if top is not None:
            ids, lps = top.indices.tolist(), top.values.tolist()
            out.topk_token_ids = [ids[a:b] for a, b in spans]
            out.topk_logprobs = [lps[a:b] for a, b in spans]
        return out
