"""Greedy rows' next tokens without their logits: the LM head's argmax from int8 codes and a few exact logits.

A greedy request that asks for no logprobs needs only the argmax of its logits row, yet the LM head is the
largest linear of a small model (the bundled SmolLM2's: 113 MB of fp32, ~11 ms of a 64-row decode step). The C++
kernel (kernels/csrc/cpu_greedy_head.cpp) scores every token from int8 codes of the head (a quarter of the bytes,
twice the fp32 rate through VNNI), bounds their error for any input, and computes exactly, as the fp32 panels do,
only the logits the bound cannot rule out: the token is the full logits' argmax, bit for bit. AVX2 CPUs run the
fp32 head's own port (cpu_greedy_head_avx2.cpp: vpmaddwd on the codes widened to int16; AMD Zen 3, bundled model:
one row 2.48 -> 0.48 ms, 64 rows 22.2 -> 15.0 ms for the LM head and its argmax), and there a bf16 head in plain
panels too: codes of its values widened, the candidates' logits rounded to bf16 as its panels store them (one row
~1.9 -> ~0.5 ms), their source a bf16 copy of the head by rows (56 MB on the bundled model). What it costs:
such requests report no cumulative logprob (`SamplingParams.argmax_only`; vLLM v1's contract); logprobs=0 asks
for it.
A bf16 head in VNNI pairs (vnni_layout.py), where the AVX512-BF16 tiles run it, has its own kernel: uint8 x
codes against int8 W codes (vpdpbusd, twice vdpbf16ps's rate), the candidates' logits as those tiles give and
round them to bf16; its argmax is the bf16 logits' argmax, bit for bit. It keeps the head's values by rows too
(the candidates' exact logits read them there: a column of the pairs spans K / 2 cache lines), V * K bf16 more
memory (56 MB on the bundled model). On AMX CPUs the pairs run on AMX tiles, whose fp32 sums no other instruction
reproduces bit for bit (neither a sequential nor a blockwise exact sum matched them): there the head's own tiles
compute every logit and fold it into the argmax unstored (cpu_gemm_vnni.cpp, greedy_head_amx), so the token is the
bf16 logits' argmax by construction; what it saves is the logits' store and torch's argmax, and it lets multi-step
decode and the stack's ids path run there too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedcore import huge_pages, vnni_layout
from pagedcore.packed_linear import BF16_SLOTS

PANEL = 16
# x's dims the bf16 head keeps out of its uint8 codes (the largest |x|: LLMs' massive activations), summed exactly two
# dims a vdpbf16ps. On the bundled model's final hidden states (one dim ~40, the median ~0.4), 64 decode rows of the
# bench's random prompts (Zen 4): 16 left ~410 candidate logits a row (8.2-8.7 ms), 24 ~175, 32 ~140 (7.1-7.6 ms
# with fp32 sums, which cost one and eight rows more: the pairs keep 32 dims at 16's cost), 64 ~90; 4 left ~750,
# none half the vocabulary.
OUTLIER_DIMS = 32


def _pair_rows(panels: torch.Tensor, vocab: int) -> torch.Tensor:
    """VNNI pairs [P, K / 2, 16 columns x 2] -> the head's rows [V, K] (vnni_layout.rows, as one copy)."""
    count, pairs = panels.shape[:2]
    return panels.view(count, pairs, PANEL, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:vocab].contiguous()


@dataclass
class ArgmaxTokens:
    """A step's sampled rows as token ids only: what the decode stack returns instead of logits."""

    token_ids: torch.Tensor  # int64 [rows], or [rows, steps] from a multi-step decode (ModelRunner.execute)


class GreedyHead:
    def __init__(self, ext, head: nn.Module, vocab_size: int, embedding: torch.Tensor | None = None,
                 tied: bool = False):
        self.ext, self.head, self.vocab_size = ext, head, vocab_size
        self.amx = False
        self.forward = head.__dict__.get("forward")  # the packed forward the head had when the codes were made
        panels = head._pagedcore_packed
        self.dtype = panels.dtype
        self.colsum = None
        self.dims = self.wo = None  # the bf16 head's outlier dims and their weights, kept while they stay the largest
        self.panels = panels  # the codes' source: a head re-pointed since (fused_projections) takes the logits path
        if self.dtype == torch.bfloat16 and not vnni_layout.is_packed(panels):  # plain panels (AVX2): bf16 rows
            self.weight = panels[:, :, list(BF16_SLOTS)].permute(0, 2, 1).reshape(-1, panels.shape[1])[:vocab_size]
            self.weight = self.weight.contiguous()
            self.codes, self.stats = ext.greedy_head_pack(self.weight.float())
            head._pagedcore_rows = (panels, self.weight)  # a tied input embedding's rows, as for VNNI pairs
        elif self.dtype == torch.bfloat16 and ext.greedy_head_amx_supported():
            # VNNI pairs on AMX tiles: every logit as the head's own tiles give it (no codes: their sums are AMX's
            # own, which no other instruction reproduces bit for bit), folded into the argmax unstored.
            self.amx, self.codes, self.weight = True, None, None
            if tied:  # the tied input embedding's rows, as below (a lookup from the pairs is ~10x slower)
                self.weight = _pair_rows(panels, vocab_size)
                head._pagedcore_rows = (panels, self.weight)
        elif self.dtype == torch.bfloat16:  # VNNI pairs: the exact logits read a copy of their values by rows
            self.codes, self.stats, self.colsum = ext.greedy_head_pack_bf16(panels, vocab_size)
            self.weight = _pair_rows(panels, vocab_size)
            # A tied input embedding looks its rows up here too (packed_linear._panel_lookup): plain rows, not pairs.
            head._pagedcore_rows = (panels, self.weight)
        else:
            weight = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:vocab_size].contiguous()  # fp32: in order
            self.codes, self.stats = ext.greedy_head_pack(weight)
            # The exact logits read the weight by rows: a tied input embedding holding the same values serves.
            same = embedding is not None and embedding.dtype == torch.float32 and embedding.is_contiguous() \
                and embedding.shape == weight.shape and torch.equal(embedding, weight)
            self.weight = embedding if same else weight
        self.rows = self.exact = 0  # rows answered, logits computed exactly for them (stats)
        # Every call streams the codes (28 MB on the bundled model) and reads the candidates' rows: in 4 KiB pages
        # each 4 KiB of them is a TLB miss (as for the packed weights, huge_pages.py).
        huge_pages.adopt([t for t in (self.codes, self.weight) if t is not None and t is not embedding])

    @classmethod
    def build(cls, ext, model: nn.Module) -> "GreedyHead | None":
        """For an LM head without bias in fp32 panels, bf16 panels (AVX2) or bf16 VNNI pairs, where its kernel runs;
        else None."""
        head = getattr(model, "lm_head", None)
        panels = getattr(head, "_pagedcore_packed", None)
        if ext is None or not ext.greedy_head_supported() or panels is None or getattr(head, "bias", None) is not None:
            return None
        vocab = head.out_features
        if panels.dtype == torch.bfloat16 and vnni_layout.is_packed(panels):
            if not (ext.greedy_head_bf16_supported() or ext.greedy_head_amx_supported()):
                return None
            depth = 2 * panels.shape[1]
        elif panels.dtype == torch.bfloat16 and panels.dim() == 3 and panels.shape[2] == PANEL:
            if not ext.greedy_head_bf16_panels_supported():
                return None
            depth = panels.shape[1]
        elif panels.dtype == torch.float32 and panels.dim() == 3 and panels.shape[2] == PANEL:
            depth = panels.shape[1]
        else:
            return None
        if vocab > panels.shape[0] * PANEL or depth > 1032:
            return None
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        tied = "_panel_lookup" in getattr(getattr(embed, "__dict__", {}).get("forward"), "__qualname__", "")
        return cls(ext, head, vocab, getattr(embed, "weight", None), tied=tied)

    def argmax(self, hidden: torch.Tensor) -> ArgmaxTokens | None:
        """The argmax of lm_head(hidden) per row; None where the head was replaced since, or a row (its input or
        a logit the bound kept) is not finite: the caller then computes the logits."""
        if self.head.__dict__.get("forward") is not self.forward or hidden.dtype != self.dtype:
            return None
        if self.head.__dict__.get("_pagedcore_packed") is not self.panels:  # re-pointed since
            return None
        if self.amx:
            tokens = self.ext.greedy_head_amx(hidden, self.panels, self.vocab_size)
            if int(tokens.min()) < 0:
                return None
            exact = len(tokens) * self.vocab_size  # every logit, as the head's tiles give it
        elif self.colsum is not None:
            # The outlier dims are picked again (and their weights gathered: ~0.5 ms, strided) only when the step's
            # largest |x| lies outside them (the kernel says so before computing anything): massive activations keep
            # to their dims, and which dims are out changes the bound only. The checks run in the kernel's call: as
            # torch ops they ran with the caches cold, after the weights streamed.
            if self.dims is None:
                self._pick_outliers(hidden)
            step = self.ext.greedy_head_bf16_step
            tokens, exact, _ = step(hidden, self.codes, self.stats, self.colsum, self.weight, self.dims, self.wo)
            if exact < 0:
                self._pick_outliers(hidden)
                tokens, exact, _ = step(hidden, self.codes, self.stats, self.colsum, self.weight, self.dims, self.wo,
                                        check_dims=False)
            if tokens is None:
                return None
        else:  # bf16 rows: x widened, exactly
            tokens, counts = self.ext.greedy_head(hidden.float(), self.codes, self.stats, self.weight)
            if int(tokens.min()) < 0:
                return None
            exact = int(counts.sum())
        self.rows += len(tokens)
        self.exact += exact
        return ArgmaxTokens(tokens)

    def _pick_outliers(self, hidden: torch.Tensor) -> None:
        """The dims of the step's largest |x| (OUTLIER_DIMS of them), and their weights."""
        top = hidden.abs().amax(0).float()
        self.dims = top.topk(min(OUTLIER_DIMS, top.numel())).indices.sort().values.to(torch.int32)
        self.wo = self.ext.greedy_head_outliers(self.panels, self.dims)
