"""The decode plan of a step for the C++ paged attention kernels (cpu_decode_attention.cpp): which rows are decodes,
their block table and lengths, built once per step and shared by every layer (and by the decode stack)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.attention.backend import AttentionMetadata


@dataclass
class ExtDecodePlan:
    """All decode rows of the step for the C++ kernel: it reads blocks in place, so no buckets."""

    rows: torch.Tensor  # int64 [n] query rows
    block_table: torch.Tensor  # int32 [n, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [n]


def one_token_prompt_rows(metadata: AttentionMetadata) -> list[int]:
    """Rows that are a prompt's only query token this step: its last token alone after a prefix-cache hit, or a
    last chunk of one token. Where the C++ prefill kernel runs they go to it, not to the decode kernel: it gives a
    prompt's rows the values they get in one piece (the decode kernel's sums differ in last bits, so a prompt's
    first token moved by ulps between a cache hit and a miss)."""
    prompts = metadata.num_prompt_tokens_cpu
    if prompts is None:
        return []
    qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    return [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1 and lens[i] <= prompts[i]]


_ROWS: dict[int, torch.Tensor] = {}  # arange(n), int64: the rows of an all-decode step of n sequences


def plan_ext_decode(metadata: AttentionMetadata, skip: list[int] = ()) -> ExtDecodePlan | None:
    """Every row of one query token but `skip`'s."""
    qsl = metadata.query_start_loc_cpu
    n = len(metadata.seq_lens_cpu)
    bt, lens = metadata.block_table, metadata.seq_lens
    if not skip and qsl[-1] == n > 0 and bt.dtype == torch.int32 and bt.is_contiguous() and lens.dtype == torch.int32 \
            and bt.device.type == "cpu":
        # All decodes (the usual step): the batch's own block table and lengths as they are; no per-row Python and
        # no copies (each torch op here runs with cold caches, after the step streamed the weights: ~20 us).
        rows = _ROWS.get(n)
        if rows is None:
            rows = _ROWS[n] = torch.arange(n, dtype=torch.long)
        return ExtDecodePlan(rows, bt, lens)
    skip = set(skip)
    decode = [i for i in range(len(metadata.seq_lens_cpu)) if qsl[i + 1] - qsl[i] == 1 and i not in skip]
    if not decode:
        return None
    idx = torch.tensor(decode, dtype=torch.long)
    return ExtDecodePlan(torch.tensor([qsl[i] for i in decode], dtype=torch.long),
                         metadata.block_table.index_select(0, idx).to(torch.int32).contiguous(),
                         torch.tensor([metadata.seq_lens_cpu[i] for i in decode], dtype=torch.int32))


def _ext_plan(metadata: AttentionMetadata, plans: dict | None, skip: list[int] = ()) -> ExtDecodePlan | None:
    """The step's decode plan, built by the first layer and kept in `plans` for the others."""
    plan = plans.get("ext", False) if plans is not None else False
    if plan is False:
        plan = plan_ext_decode(metadata, skip)
        if plans is not None:
            plans["ext"] = plan
    return plan


def prompt_rows_of_one_token(ext, metadata: AttentionMetadata, head_dim: int, plans: dict | None) -> list[int]:
    """one_token_prompt_rows where the C++ prefill kernel runs for head_dim, else none; kept in `plans`."""
    rows = plans.get("one_token_prompts") if plans is not None else None
    if rows is None:
        rows = one_token_prompt_rows(metadata) if ext.paged_prefill_supported(head_dim) else []
        if plans is not None:
            plans["one_token_prompts"] = rows
    return rows
