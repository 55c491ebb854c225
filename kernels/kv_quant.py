"""The quantized KV cache (`EngineConfig.kv_cache_dtype` "int8" / "fp8_e4m3"): layout, allocation,
and the plain-torch quantize / de-quantize every kernel is tested against.

Scales: one per token and KV head (fp16), computed when the token is written: scale = max|row| / qmax
over the row's head_dim values, q = round(x / scale) (int8, clamped to +-127) or x / scale cast to
e4m3 (|x / scale| <= 448). Why per token: a token's scale is exact at write time and never changes, so
no later token can overflow it (a per-(block, head) scale fixed by the block's first token clips the
tokens after it; keeping one per block correct means re-quantizing the block's earlier tokens on every
write). The cost is 2 bytes per head_dim bytes: 3% at head_dim 64, 1.6% at 128. fp16 rather than fp32
scales: fp32 would make int8 KV only 1.88x the blocks of bf16 at head_dim 64 (2 * 64 / (64 + 4)); fp16
gives 1.94x, and its 11-bit mantissa is finer than int8's own step.

Layout: one uint8 tensor per layer and K/V, [num_blocks, block_bytes]; each block is its data
[block_size, Hkv, D] (int8 or float8_e4m3fn) followed by its scales [block_size, Hkv] (fp16). The scales
live inside the block, so everything that moves whole blocks -- swap to and from the CPU pool,
copy-on-write copies, prefix reuse of a cached block -- carries them without knowing about them, and
`bytes_per_block` counts them. Data rows keep the unquantized layout (a block's rows contiguous,
head_dim innermost), so the kernels index them as before, through views with a wider block stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.config import KV_CACHE_DTYPES

QUANTIZED = ("int8", "fp8_e4m3")
SCALE_DTYPE = torch.float16
SCALE_MAX = 65504.0  # fp16's largest finite value
_LAYOUT_ATTR = "_pagedcore_kv_layout"
_VIEWS_ATTR = "_pagedcore_kv_views"


def data_dtype(kv_cache_dtype: str) -> torch.dtype:
    return {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]


def qmax(kv_cache_dtype: str) -> float:
    """The largest magnitude a quantized value takes: a row's max maps onto it."""
    return {"int8": 127.0, "fp8_e4m3": 448.0}[kv_cache_dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device | None = None) -> None:
    """ValueError naming the supported values for an unknown one, or fp8 where the device lacks it."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    # CPU: torch stores float8_e4m3fn and casts it, which is all the CPU paths need.
    if kv_cache_dtype == "fp8_e4m3" and device is not None and device.type == "cuda":
        # Triton's e4m3 (fp8e4nv) converts in hardware from sm_89 (Ada, Hopper) on.
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype 'fp8_e4m3' needs a GPU of compute capability >= 8.9; "
                             f"supported here: auto, int8")


@dataclass(frozen=True)
class KVCacheLayout:
    kv_cache_dtype: str  # "int8" | "fp8_e4m3"
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def data_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim  # 1 byte per value

    @property
    def block_bytes(self) -> int:
        return self.data_bytes + self.block_size * self.num_kv_heads * SCALE_DTYPE.itemsize


def allocate(layout: KVCacheLayout, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """One layer's K (or V) cache: uint8 [num_blocks, block_bytes], its layout attached (torch.empty:
    unwritten slots hold anything; no kernel reads a slot past a sequence's length)."""
    cache = torch.empty((num_blocks, layout.block_bytes), dtype=torch.uint8, device=device)
    setattr(cache, _LAYOUT_ATTR, layout)
    return cache


def layout_of(cache: torch.Tensor) -> KVCacheLayout | None:
    """The layout of a quantized cache made by `allocate`; None for a plain [.., Hkv, D] cache."""
    return getattr(cache, _LAYOUT_ATTR, None)


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [num_blocks, block_size, Hkv, D] int8|float8_e4m3fn, scales [num_blocks, block_size, Hkv] fp16):
    views into the cache (block stride = block_bytes), made once per cache."""
    views = getattr(cache, _VIEWS_ATTR, None)
    if views is None:
        lo = layout_of(cache)
        nb = cache.shape[0]
        data = cache[:, :lo.data_bytes].view(nb, lo.block_size, lo.num_kv_heads, lo.head_dim)
        scales = cache[:, lo.data_bytes:].view(SCALE_DTYPE).view(nb, lo.block_size, lo.num_kv_heads)
        views = (data.view(data_dtype(lo.kv_cache_dtype)), scales)
        setattr(cache, _VIEWS_ATTR, views)
    return views


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in the data dtype, scale [...] fp16), the reference the kernels follow:
    scale = fp16(max|x| / qmax); q = floor(x / scale + 0.5) clamped (int8) or e4m3(x / scale); a zero
    scale (an all-zero row) stores zeros."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax(kv_cache_dtype)).clamp(max=SCALE_MAX).to(SCALE_DTYPE)
    s = scale.float()[..., None]
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    if kv_cache_dtype == "int8":
        q = torch.floor(y + 0.5).clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., D], scale [...] -> q * scale in `dtype` (computed in fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Quantize this step's key/value [T, Hkv, D] into the caches at `slot_mapping` (< 0: skipped), in torch."""
    bs = layout_of(k_cache).block_size
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // bs, slots % bs
    for x, cache in ((key[:slot_mapping.shape[0]][keep], k_cache), (value[:slot_mapping.shape[0]][keep], v_cache)):
        data, scales = split(cache)
        q, s = quantize(x, layout_of(cache).kv_cache_dtype)
        data[blocks, offsets] = q
        scales[blocks, offsets] = s


def gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """De-quantized K (or V) of the slots (blocks[i], offsets[i]): [N, Hkv, D] in `dtype`."""
    data, scales = split(cache)
    return dequantize(data[blocks, offsets], scales[blocks, offsets], dtype)


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole cache de-quantized: [num_blocks, block_size, Hkv, D] (tests, references)."""
    data, scales = split(cache)
    return dequantize(data, scales, dtype)
