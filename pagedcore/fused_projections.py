"""q/k/v and gate/up projections as one matmul each at decode (CPU packed or int4 weights).

A decode row reads every weight once, so a step is bound by memory traffic, and each linear call
pays a fixed ~10 us (Python, the op's dispatch, the thread fork, a cold prefetch stream) beside
streaming its weight: k_proj/v_proj (221 KB of bf16) ran at 44% of the read bandwidth alone. Three
calls become one over the concatenated weight, two become one for gate/up (vLLM's QKVParallelLinear
and MergedColumnParallelLinear). The packed layouts (packed_linear.py, Int4Linear) are panels of 16
output columns, so with widths that are multiples of 16 each member's own packed weight is a slice
of the fused one: the weight is resident once, and the members still run alone on larger batches
(fused there, q/k/v come back strided, which measured slower downstream at batch 64).

Only the lean layers call these (lean_layers.py); they check the members are still the modules
fused here with the forwards they had, so anything that replaces or patches a projection afterwards (a LoRA
layer, a plugin) wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedcore import installs, onednn_linear, packed_linear, quantization, vnni_layout
from pagedcore.kernels import cpu_ext
from pagedcore.quantization import Int4Linear, Int8Linear

# Rows up to which the fused matmul runs: decode batches, where a call's fixed cost is not amortised.
FUSED_ROWS = 8
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_ATTR = "_pagedcore_fused"
PANEL = packed_linear.PANEL


@dataclass
class FusedProjection:
    members: tuple[nn.Module, ...]
    widths: tuple[int, ...]
    run: callable  # x [..., K] -> y [..., sum(widths)]
    # The fused weight as the decode stack takes it (decode_stack.py): (packed, scale_min, bias, out_features,
    # group_size, int8_rows, zero_point), int8_rows -1 for int4 weights that quantize activations at decode
    spec: tuple = ()
    forwards: tuple = ()  # each member's instance forward when fused (None: its class's)
    # The concatenated weight in oneDNN's layout (onednn_linear.py, AMX CPUs): runs from onednn_linear.ROWS rows,
    # in place of the members' own copies (dropped: resident once more, not twice)
    onednn_weight: torch.Tensor | None = None
    # gate/up over packed panels: x -> silu(gate) * up at any row count, the [T, 2 I] product never written
    # (ext.packed_linear_silu_mul; a separate silu pass ran ~5% of a prompt's step)
    silu_mul: callable | None = None

    def __post_init__(self):
        self.forwards = tuple(m.__dict__.get("forward") for m in self.members)

    @property
    def onednn(self) -> bool:
        return self.onednn_weight is not None

    def fuses(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs fused (else each member alone): a few rows on the panels, where
        a call's fixed cost counts; any number through oneDNN or AMX tiles (3 calls of q/k/v measured ~15% slower
        through oneDNN)."""
        if rows <= FUSED_ROWS or (self.spec and vnni_layout.is_packed(self.spec[0])):
            return True
        return self.onednn and onednn_linear.ROWS is not None and rows >= onednn_linear.ROWS

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.run(x).split(self.widths, dim=-1)

    def still_installed_on(self, parent: nn.Module, names: tuple[str, ...]) -> bool:
        """The same modules, each still running the forward it had when fused (a LoRA layer patches the
        forward in place: fused, its product would be skipped)."""
        return all(getattr(parent, n) is m and m.__dict__.get("forward") is f
                   for n, m, f in zip(names, self.members, self.forwards))


def install(model: nn.Module, device: torch.device) -> int:
    """Fuse every q/k/v and gate/up group whose members share one packed kind; returns how many."""
    ext = cpu_ext.load() if device.type == "cpu" else None
    if ext is None:
        return 0
    count = 0
    for module in model.modules():
        for child, names in GROUPS:
            parent = getattr(module, child, None)
            members_present = isinstance(parent, nn.Module) and all(
                isinstance(getattr(parent, n, None), nn.Module) for n in names)
            if members_present and get(parent, names) is None:
                fused = _fuse(ext, [getattr(parent, n) for n in names])
                if fused is not None:
                    parent.__dict__.setdefault(_ATTR, {})[names] = fused
                    installs.record(model, lambda p=parent: p.__dict__.pop(_ATTR, None))
                    count += 1
    return count


def get(parent: nn.Module, names: tuple[str, ...]) -> FusedProjection | None:
    fused = parent.__dict__.get(_ATTR, {}).get(names)
    return fused if fused is not None and fused.still_installed_on(parent, names) else None


def installed(model: nn.Module) -> list[FusedProjection]:
    """Every fused group on `model` (the step profile times them as GEMMs)."""
    return [f for m in model.modules() for f in m.__dict__.get(_ATTR, {}).values()]


def _fuse(ext, members: list[nn.Module]) -> FusedProjection | None:
    widths = tuple(m.out_features for m in members)
    if any(w % PANEL for w in widths) or len({m.in_features for m in members}) != 1:
        return None
    if all(hasattr(m, "_pagedcore_packed") and type(m) is nn.Linear for m in members):
        return _fuse_packed(ext, members, widths)
    if all(type(m) is Int4Linear for m in members):
        return _fuse_int4(ext, members, widths)
    if all(type(m) is Int8Linear for m in members):
        return _fuse_int8(ext, members, widths)
    return None


def _fuse_packed(ext, members: list[nn.Linear], widths: tuple[int, ...]) -> FusedProjection | None:
    if len({m._pagedcore_packed.dtype for m in members}) != 1:
        return None
    packed = torch.cat([m._pagedcore_packed for m in members])
    bias = _cat_bias(members, widths)
    _share_panels(packed, members, widths, lambda m, view: setattr(m, "_pagedcore_packed", view))
    total = sum(widths)
    onednn = None
    if all(getattr(m, "_pagedcore_onednn", None) is not None for m in members):
        onednn = onednn_linear.prepack(torch.cat([m.weight.detach() for m in members]))
        for m in members:
            m._pagedcore_onednn = None

    vnni = vnni_layout.is_packed(packed)

    def run(x: torch.Tensor) -> torch.Tensor:
        if onednn_linear.runs(x, onednn, vnni):
            return onednn_linear.linear(x, onednn, bias)
        return ext.packed_linear(x, packed, total, bias)

    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        if onednn_linear.runs(x, onednn, vnni):
            return ext.silu_and_mul(*onednn_linear.linear(x, onednn, bias).split(widths, dim=-1))
        return ext.packed_linear_silu_mul(x, packed, total, bias)

    gate_up = len(widths) == 2 and widths[0] == widths[1]
    return FusedProjection(tuple(members), widths, run, (packed, None, bias, total, 0, 0, False),
                           onednn_weight=onednn, silu_mul=silu_mul if gate_up else None)


def _fuse_int4(ext, members: list[Int4Linear], widths: tuple[int, ...]) -> FusedProjection | None:
    first = members[0]
    same = all(m.ext is not None and m.input_perm is None and m.group_size == first.group_size
               and m.int8_activations == first.int8_activations
               and m.scales_and_zeros.dtype == first.scales_and_zeros.dtype and m.zero_point == first.zero_point
               for m in members)
    if not same:
        return None
    return _fuse_codes(members, widths, ("packed", "scales_and_zeros"), first.group_size, first.zero_point,
                       lambda x, codes, scales, total, bias, rows: ext.packed_linear_int4(
                           x, codes, scales, total, first.group_size, bias, rows, first.zero_point))


def _fuse_int8(ext, members: list[Int8Linear], widths: tuple[int, ...]) -> FusedProjection | None:
    first = members[0]
    same = all(m.ext is not None and m.group_size == first.group_size and m.scale.dtype == first.scale.dtype
               and m.int8_activations == first.int8_activations for m in members)
    if not same:
        return None
    group = first.group_size or first.in_features
    return _fuse_codes(members, widths, ("qweight", "scale"), group, False,
                       lambda x, codes, scales, total, bias, rows: ext.packed_linear_int8(
                           x, codes, scales, total, group, bias, rows))


def _fuse_codes(members, widths, names: tuple[str, str], group: int, zero_point: bool, op) -> FusedProjection:
    """Quantized members (codes and scale panels in the attributes `names`) as one op over their
    concatenated panels."""
    codes, scales = (torch.cat([getattr(m, name) for m in members]) for name in names)
    bias = _cat_bias(members, widths)

    def share(m, codes_view, scales_view):
        setattr(m, names[0], codes_view)
        setattr(m, names[1], scales_view)

    _share_panels((codes, scales), members, widths, share)
    total, int8_activations = sum(widths), members[0].int8_activations

    def run(x):
        return op(x, codes, scales, total, bias, quantization.INT8_ACTIVATION_ROWS if int8_activations else 0)

    return FusedProjection(tuple(members), widths, run,
                           (codes, scales, bias, total, group, -1 if int8_activations else 0, zero_point))


def _share_panels(fused, members, widths, assign) -> None:
    """Point each member at its panels of the fused weight(s), so the weight is resident once."""
    fused = fused if isinstance(fused, tuple) else (fused,)
    start = 0
    for m, w in zip(members, widths):
        assign(m, *(t.narrow(0, start // PANEL, w // PANEL) for t in fused))
        start += w


def _cat_bias(members, widths) -> torch.Tensor | None:
    if all(m.bias is None for m in members):
        return None
    return torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(w)
                      for m, w in zip(members, widths)])
