"""A GGUF file served with its linears kept quantized: `LLM(model="x.gguf", quantization="gguf")`.

Per block of 32 weights along a row (one output), as llama.cpp stores them:
  Q4_0: fp16 d, 16 bytes of nibbles            w = (q - 8) * d   -> Int4Linear, scale d, lo -8d
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles    w = q * d + m     -> Int4Linear, scale d, lo m
  Q8_0: fp16 d, 32 int8                        w = q * d         -> Int8Linear, groups of 32
(nibbles: byte j holds element j in its low half and element j + 16 in its high half). At decode the 4-bit
linears take int8 activations per 32 inputs, as llama.cpp's Q4 x Q8 dot products do; prefill rows and
`PAGEDCORE_INT4_ACTIVATIONS=fp32` multiply by the exact de-quantized weights. Everything else
(norms, K-quants and other types) comes de-quantized from the HF directory that the default path converts
once (model_loader.gguf_to_hf_dir), so the skeleton and those tensors are transformers'; a tied Q8_0
token_embd stays Q8_0 as the LM head, and the input embedding reads its rows from it.

llama.cpp's converter permutes the rows of attn_q / attn_k (its rotary layout); transformers undoes it
when it reads a llama GGUF, and so does this, on the raw blocks (rows are independent).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

SUPPORTED = "GGUF llama-architecture models; linears in Q4_0, Q4_1 or Q8_0 are kept quantized"
BLOCK = 32
KEPT = ("Q4_0", "Q4_1", "Q8_0")
ARCH = "general.architecture"
# In a subfolder: other engines given the converted directory (vLLM, the bench's peers) load every top-level
# *.safetensors as model weights.
CACHE_NAME = "pagedcore-gguf/quantized-linears.safetensors"
OLD_CACHE_NAME = "gguf-quantized-linears.safetensors"  # where session 11 put it: removed on sight


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (transformers' LlamaTensorProcessor does the same on dense rows)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as fp32 [N, blocks]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def int4_linear(raw: np.ndarray, qtype: str, bias, dtype: torch.dtype) -> nn.Module:
    from pagedcore.quantization import Int4Linear

    q4_1 = qtype == "Q4_1"
    blocks = raw.reshape(raw.shape[0], -1, 20 if q4_1 else 18)
    d = f16(blocks, 0)
    lo = f16(blocks, 2) if q4_1 else -8 * d
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 4 if q4_1 else 2:]))  # [N, blocks, 16]
    q = torch.cat([qs & 0xF, qs >> 4], -1).reshape(raw.shape[0], -1)  # elements 0..15, then 16..31
    # llama.cpp multiplies its 4-bit blocks with int8-quantized activations (Q8 blocks of 32) at decode;
    # so does this (M <= quantization.INT8_ACTIVATION_ROWS): it halves the instructions per weight read.
    # PAGEDCORE_INT4_ACTIVATIONS=fp32 computes with the exact de-quantized weights instead.
    return Int4Linear.from_codes(q, d, lo, bias, dtype, BLOCK, int8_activations=True)


def int8_linear(raw: np.ndarray, bias, dtype: torch.dtype) -> nn.Module:
    from pagedcore.quantization import Int8Linear

    blocks = raw.reshape(raw.shape[0], -1, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(raw.shape[0], -1)
    return Int8Linear(q, f16(blocks, 0), bias, dtype, BLOCK, int8_activations=True)  # Q8_0 x Q8_0 at decode


def read_quantized(gguf_path: Path, hf_dir: Path) -> tuple[str, dict[str, tuple[str, np.ndarray]]]:
    """(architecture, {tensor name: (type name, raw blocks [N, bytes per row])}) of the Q4_0 / Q4_1 / Q8_0
    tensors. gguf's reader takes ~12 s on the bundled model (it parses 98k tokenizer strings in Python),
    so the blocks are copied once into a subfolder of the converted directory and read from there afterwards."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    cache = hf_dir / CACHE_NAME
    (hf_dir / OLD_CACHE_NAME).unlink(missing_ok=True)
    if not cache.is_file():
        from gguf import GGUFReader

        cache.parent.mkdir(exist_ok=True)
        reader = GGUFReader(str(gguf_path))
        kept = [t for t in reader.tensors if t.tensor_type.name in KEPT]
        meta = {t.name: t.tensor_type.name for t in kept}
        meta[ARCH] = str(reader.fields[ARCH].contents())
        tmp = cache.with_suffix(f".tmp-{os.getpid()}")
        save_file({t.name: np.asarray(t.data) for t in kept}, str(tmp), metadata=meta)
        os.replace(tmp, cache)  # atomic: a concurrent reader sees all of it or none
    with safe_open(str(cache), "np") as f:
        meta = f.metadata()
        return meta.pop(ARCH), {name: (meta[name], f.get_tensor(name)) for name in f.keys()}


def load(gguf_path: Path, hf_dir: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model from the converted `hf_dir`, its Q4_0 / Q4_1 / Q8_0 linears swapped for modules
    over `gguf_path`'s own blocks."""
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    arch, tensors = read_quantized(gguf_path, hf_dir)
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: architecture {arch!r}; quantization='gguf' supports {SUPPORTED}")
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        tensor_name = f"{names.get_name(name)}.weight"
        if tensor_name not in tensors:
            continue  # de-quantized by transformers (tied lm_head, F16/F32, other quant types)
        qtype, raw = tensors[tensor_name]
        if tensor_name.endswith(".attn_q.weight"):
            raw = unpermute_rows(raw, config.num_attention_heads)
        elif tensor_name.endswith(".attn_k.weight"):
            raw = unpermute_rows(raw, config.num_key_value_heads)
        module = int8_linear(raw, linear.bias, dtype) if qtype == "Q8_0" else int4_linear(raw, qtype, linear.bias, dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    tie_q8_0_head(model, tensors, dtype)
    return model


def tie_q8_0_head(model: nn.Module, tensors: dict, dtype: torch.dtype) -> None:
    """A tied LM head over the file's own Q8_0 token_embd blocks (as llama.cpp runs it, Q8 x Q8 at decode):
    8.5 bits a weight instead of 16, and the input embedding looks its rows up in the same panels (one
    copy; the values are the de-quantized ones the default path embeds)."""
    qtype, raw = tensors.get("token_embd.weight", (None, None))
    if qtype != "Q8_0" or not model.config.tie_word_embeddings:
        return
    head = int8_linear(raw, None, dtype)
    if head.ext is None:  # torch's int8 layout: keep transformers' de-quantized head
        return
    model.set_output_embeddings(head)
    embedding = model.get_input_embeddings()
    embedding.forward = _panel_rows(head, dtype)
    embedding.weight = nn.Parameter(embedding.weight.new_empty(0), requires_grad=False)


def _panel_rows(head: nn.Module, dtype: torch.dtype):
    """Rows of an Int8Linear's weight from its panels ([panels, quads, 16 columns, 4 inputs] int8 codes,
    [panels, groups, 16] scales): row n is column n % 16 of panel n // 16."""
    k, group = head.in_features, head.group_size or head.in_features

    def forward(ids: torch.Tensor) -> torch.Tensor:
        panel, column = ids // 16, ids % 16
        codes = head.qweight.view(head.qweight.shape[0], -1, 16, 4)[panel, :, column, :]
        codes = codes.reshape(*ids.shape, -1)[..., :k].view(*ids.shape, k // group, group)
        scales = head.scale[panel, :, column].float()
        return (codes.float() * scales[..., None]).view(*ids.shape, k).to(dtype)

    return forward
