"""The built-in implementations, registered as a plugin like any other."""

from __future__ import annotations

from pagedcore.hookspecs import hookimpl


@hookimpl(trylast=True)
def pagedcore_load_model(config):
    from pagedcore.model_loader import load_model_and_tokenizer

    device = config.torch_device()
    return load_model_and_tokenizer(config.model, config.torch_dtype(device), device, config.tokenizer,
                                    config.quantization)


@hookimpl(trylast=True)
def pagedcore_attention_backend(name, device):
    if name in (None, "triton") and device.type == "cuda" or name == "triton":
        from pagedcore.kernels.triton_attention_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name in (None, "torch"):
        from pagedcore.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    return None


@hookimpl(trylast=True)
def pagedcore_scheduling_policy(name):
    from pagedcore.scheduling_policies import POLICIES

    return POLICIES[name]() if name in POLICIES else None


@hookimpl(trylast=True)
def pagedcore_structured_output_backend(name, tokenizer, vocab_size, stop_token_ids):
    if name == "xgrammar":
        from pagedcore.structured_output.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        from pagedcore.structured_output.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    return None
