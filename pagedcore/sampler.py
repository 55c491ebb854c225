"""Sampler: turns one step's logits [B, V] into one token per row (row = sequence).

Processing order follows vLLM:

    structured-output bitmask -> logit_bias -> min_tokens EOS/stop masking -> repetition penalty -> presence/frequency penalties
    -> greedy rows: argmax
    -> random rows: temperature -> top-k -> top-p -> min-p -> one draw from the probabilities

Logprobs are those of the RAW model distribution (log_softmax of the incoming
logits, before any processing), as vLLM v1 does by default: beam search and
comparisons against reference implementations need the model's own numbers.

Everything is vectorised over the batch. The only Python loop is over seeded
rows, so that each seeded request draws its noise from its own generator and gets
the same sample whatever else is in the batch.

On the CPU, with the C++ ops built (kernels/cpu_ext.py), two row reductions run there: greedy
batches get argmax and logsumexp in one read of the logits, and the draw is inverse-CDF
sampling with fp64 running sums (one uniform per row). Elsewhere the draw is the exponential
race (V exponentials per row); both are exact draws from the same probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedcore.kernels import cpu_ext
from pagedcore.logits_processors import apply_min_p, apply_penalties, apply_top_k, apply_top_p
from pagedcore.sampling_params import SamplingParams
from pagedcore.structured_output.bitmask import apply_token_bitmask

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- batch


@dataclass
class SamplingBatch:
    """Per-step, per-row sampling tensors. Unused features leave their tensors None."""

    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] bool, True for greedy rows; only set for a mixed batch.
    greedy_mask: torch.Tensor | None = None
    # [B] float32; greedy rows hold 1.0 so the shared random path stays finite
    # (their draws are discarded). None when all rows are greedy.
    temperature: torch.Tensor | None = None
    # Truncation, per row. Greedy rows are neutral (k=0, p=1, min_p=0), so the
    # no_* flags reflect only the rows that actually sample.
    top_k: torch.Tensor | None = None  # [B] long, 0 = off
    top_p: torch.Tensor | None = None  # [B] float32, 1 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0 = off
    no_top_k: bool = True
    no_top_p: bool = True
    no_min_p: bool = True
    # Penalties. Token ids are padded with vocab_size (scattered into a spare column).
    no_penalties: bool = True
    repetition_penalties: torch.Tensor | None = None  # [B] float32, None when all 1
    presence_penalties: torch.Tensor | None = None  # [B] float32, None when all
    frequency_penalties: torch.Tensor | None = None  # presence/frequency are 0
    prompt_token_ids: torch.Tensor | None = None  # [B, Lp] long, only for repetition
    output_token_ids: torch.Tensor | None = None  # [B, Lo] long, any penalty
    # Structured output: an int32 bitmask [B, ceil(V / 32)] and the rows it constrains (the engine fills it).
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None
    # logit_bias: (row indices, token ids, biases) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # min_tokens: (row indices, token ids) of logits to force to -inf this step.
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None = None
    # Seeded random rows only: advancing a generator for a greedy row would make
    # a request's samples depend on history that is not its own.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Whether some random row has no generator and draws from the default RNG.
    needs_default_rng: bool = False
    # Largest top-N logprobs any row asked for; None when no row asked.
    max_num_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int] | set[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> "SamplingBatch":
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators must have one entry per row")
        V = vocab_size
        greedy = [p.greedy for p in params]
        batch = cls(vocab_size=V, all_greedy=all(greedy), all_random=not any(greedy))

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        if not batch.all_greedy:
            if not batch.all_random:
                batch.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            batch.temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            # k >= V keeps everything: treat it as off so no top-k pass runs for it.
            top_k = [0 if g or p.top_k >= V else p.top_k for p, g in zip(params, greedy)]
            top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
            min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
            batch.no_top_k = all(k == 0 for k in top_k)
            batch.no_top_p = all(p >= 1.0 for p in top_p)
            batch.no_min_p = all(m == 0.0 for m in min_p)
            if not batch.no_top_k:
                batch.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
            if not batch.no_top_p:
                batch.top_p = f32(top_p)
            if not batch.no_min_p:
                batch.min_p = f32(min_p)
            batch.generators = {i: g for i, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr}
            batch.needs_default_rng = sum(not g for g in greedy) > len(batch.generators)

        # Penalties apply to greedy rows too (they change the argmax).
        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        use_output = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        batch.no_penalties = not (use_repetition or use_output)
        if use_repetition:
            batch.repetition_penalties = f32([float(p.repetition_penalty) for p in params])
            batch.prompt_token_ids = _pad_token_ids(prompt_token_ids, V, device)
        if use_output:
            batch.presence_penalties = f32([float(p.presence_penalty) for p in params])
            batch.frequency_penalties = f32([float(p.frequency_penalty) for p in params])
        if not batch.no_penalties:
            batch.output_token_ids = _pad_token_ids(output_token_ids, V, device)

        biased = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < V]
        if biased:
            rows_, toks_, biases = zip(*biased)
            batch.logit_bias = (torch.tensor(rows_, dtype=torch.long, device=device),
                                torch.tensor(toks_, dtype=torch.long, device=device), f32(list(biases)))

        # min_tokens blocks EOS and stop ids (ignore_eos only changes stopping, not this). Not for
        # constrained rows: their grammar says where the output ends (its only next token may be EOS).
        eos = list(eos_token_ids)
        rows: list[int] = []
        toks: list[int] = []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) < p.min_tokens and p.structured_outputs is None:
                blocked = sorted({t for t in (*eos, *p.stop_token_ids) if 0 <= t < V})
                rows += [i] * len(blocked)
                toks += blocked
        if rows:
            batch.min_tokens_block = (
                torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(toks, dtype=torch.long, device=device),
            )

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        # A tiny test vocabulary can be smaller than the N asked for.
        batch.max_num_logprobs = min(max(wanted), V) if wanted else None
        return batch


def _pad_token_ids(ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, L] long, padded with vocab_size (a column the count buffer then drops)."""
    width = max((len(x) for x in ids), default=0)
    padded = [list(x) + [vocab_size] * (width - len(x)) for x in ids]
    return torch.tensor(padded, dtype=torch.long, device=device).view(len(ids), width)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator a seeded request keeps for its whole life."""
    return torch.Generator(device=device).manual_seed(seed)


def _cpu_ext():
    return cpu_ext.load()


def sample_from_probs(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    needs_default_rng: bool = True,
) -> torch.Tensor:
    """One exact draw per row of probs [B, V] (rows need not sum to 1; zeros are never drawn)."""
    ext = _cpu_ext() if probs.device.type == "cpu" else None
    if ext is None:
        return exponential_race(probs, generators, needs_default_rng)
    return ext.sample_inverse_cdf(probs.float(), uniforms(probs.shape[0], generators, needs_default_rng))


def uniforms(B: int, generators: dict[int, torch.Generator], needs_default_rng: bool) -> torch.Tensor:
    """u ~ U[0, 1) per row, fp64; seeded rows draw theirs from their own generator."""
    u = torch.rand(B, dtype=torch.float64) if needs_default_rng else torch.zeros(B, dtype=torch.float64)
    for i, g in generators.items():
        u[i] = torch.rand(1, dtype=torch.float64, generator=g)[0]
    return u


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    needs_default_rng: bool = True,
) -> torch.Tensor:
    """Sample argmax(probs / q), q ~ Exponential(1): an exact draw from probs.

    Seeded rows draw their own q from their generator (a fresh [V] tensor, so
    the draw does not depend on the row index or the batch); the rest share one
    draw from the default RNG.
    """
    q = torch.empty_like(probs)
    if needs_default_rng:
        q.exponential_()
    else:
        q.fill_(1.0)  # every random row is seeded; what greedy rows get is discarded
    V = probs.shape[-1]
    for i, g in generators.items():
        q[i] = torch.empty(V, dtype=probs.dtype, device=probs.device).exponential_(generator=g)
    # exponential_ can return exactly 0; a masked token (prob 0) would then give 0/0 = NaN.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


# --------------------------------------------------------------------------- sampler


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    sampled_logprobs: torch.Tensor  # [B] float32, raw logprob of the sampled token
    topk_token_ids: torch.Tensor | None = None  # [B, K] long, K = max_num_logprobs
    topk_logprobs: torch.Tensor | None = None  # [B, K] float32, descending


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        fast = self.plain_greedy(logits, batch)
        if fast is not None:
            return fast
        raw = logits.float()  # may alias the caller's tensor: never modified in place
        raw_logprobs = torch.log_softmax(raw, dim=-1) if batch.max_num_logprobs is not None else None

        logits = self.process_logits(raw, batch)
        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self.sample_random(logits, batch)
            if not batch.all_random:
                sampled = torch.where(batch.greedy_mask, logits.argmax(dim=-1), sampled)

        index = sampled.unsqueeze(1)
        if raw_logprobs is None:
            # logsumexp is a reduction: no [B, V] log_softmax when nobody wants top-N.
            sampled_logprobs = raw.gather(1, index).squeeze(1) - _logsumexp(raw)
            return SamplerOutput(sampled, sampled_logprobs)
        sampled_logprobs = raw_logprobs.gather(1, index).squeeze(1)
        top = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
        return SamplerOutput(sampled, sampled_logprobs, top.indices, top.values)

    @staticmethod
    def plain_greedy(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput | None:
        """All rows greedy with nothing to process or report but the sampled logprob: argmax and
        logsumexp in one C++ read of the logits, in their own dtype. None where that does not apply
        (or a row is not finite: the torch path then gives torch's own answer for it)."""
        if not (batch.all_greedy and batch.no_penalties and batch.min_tokens_block is None
                and batch.logit_bias is None and batch.max_num_logprobs is None and logits.device.type == "cpu"
                and logits.dim() == 2):
            return None
        ext = _cpu_ext()
        if ext is None:
            return None
        sampled, lse = ext.argmax_logsumexp(logits)
        if not torch.isfinite(lse).all():
            return None
        if batch.token_bitmask is not None:
            # Grammar rows: argmax over the allowed tokens; the logprob stays the model's own (raw lse).
            masked = logits.to(torch.float32, copy=True)
            apply_token_bitmask(masked, *batch.token_bitmask)
            sampled, _ = ext.argmax_logsumexp(masked)
        return SamplerOutput(sampled, logits.gather(1, sampled.unsqueeze(1)).squeeze(1).float() - lse)

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The grammar's mask, logit bias, min_tokens masking and penalties: what greedy and random rows
        share."""
        if batch.token_bitmask is not None:
            logits = logits.clone()  # the raw logits stay raw: logprobs are the model's own
            apply_token_bitmask(logits, *batch.token_bitmask)
        if batch.logit_bias is not None:
            rows, toks, biases = batch.logit_bias
            logits = logits.index_put((rows, toks), biases, accumulate=True)
        if batch.min_tokens_block is not None:
            logits = logits.index_put(batch.min_tokens_block, torch.tensor(_NEG_INF, device=logits.device))
        if not batch.no_penalties:
            logits = apply_penalties(
                logits,
                batch.prompt_token_ids,
                batch.output_token_ids,
                batch.presence_penalties,
                batch.frequency_penalties,
                batch.repetition_penalties,
            )
        return logits

    @staticmethod
    def sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, truncation, then one draw per row over the whole batch."""
        return sample_from_probs(Sampler.probs(logits, batch), batch.generators, batch.needs_default_rng)

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution random rows draw from: temperature, top-k, top-p, min-p, softmax."""
        logits = logits / batch.temperature.unsqueeze(1)
        if not batch.no_top_k:
            logits = apply_top_k(logits, batch.top_k)
        if not batch.no_top_p:
            logits = apply_top_p(logits, batch.top_p)
        if not batch.no_min_p:
            logits = apply_min_p(logits, batch.min_p)
        return logits.softmax(dim=-1)


def _logsumexp(raw: torch.Tensor) -> torch.Tensor:
    """Row logsumexp of fp32 logits [B, V] (one C++ read on the CPU)."""
    ext = _cpu_ext() if raw.device.type == "cpu" else None
    if ext is not None:
        lse = ext.argmax_logsumexp(raw)[1]
        if torch.isfinite(lse).all():
            return lse
    return raw.logsumexp(dim=-1)
