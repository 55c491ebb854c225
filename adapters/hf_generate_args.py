"""generate()'s arguments -> one engine request plan (SamplingParams and the rows' prompts), or the
reason it cannot be one. Translation only: nothing here touches a model's modules or an engine.

Translated: input_ids + attention_mask (left or right padding: each row's unmasked tokens are its
prompt), a GenerationConfig and/or kwargs merged with `model.generation_config` exactly as
transformers merges them; greedy, sampling (temperature, top_k, top_p, min_p), repetition_penalty,
max_new_tokens / max_length, min_new_tokens / min_length, eos_token_id (int or list), pad_token_id,
stop_strings (with tokenizer=), num_return_sequences, beam search (num_beams, length_penalty,
early_stopping), streamers (batch of one), return_dict_in_generate with output_scores / output_logits,
and pagedcore's own `structured_outputs=` (SamplingParams' constrained decoding; no transformers
counterpart, so a call that cannot run on the engine is an error rather than a fallback).

Anything else raises `Unsupported(reason)`, and the adapter runs transformers' own generate(): logits
processors / stopping criteria / prefix_allowed_tokens_fn / assistants / custom_generate, any other
generation option that changes the result, encoder-decoder models, extra model inputs, sampling with
beams, streamers with more than one row or with beams, output_attentions / hidden states,
output_scores where processors would change them (sampling, repetition_penalty, min length) and
output_logits with beams, and the corner cases where the engine's stopping rules differ (e.g. a stop
string that may begin inside the prompt). The checks that need the engine (its context, its EOS set)
are the adapter's (`hf._admit`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import GenerationMode

from pagedcore.sampling_params import SamplingParams


class Unsupported(Exception):
    """A generate() call the engine cannot run exactly as transformers would; the message says why."""


# generate() arguments the engine has no counterpart for (None or an empty list is fine).
_UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                     "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")
# GenerationConfig fields `translate` reads.
_TRANSLATED = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "stop_strings",
               "do_sample", "num_beams", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
               "length_penalty", "num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate",
               "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation"}
# Fields that cannot change a decoder-only result once the generation mode is greedy, sample or beam
# search (assistant / diverse-beam / contrastive settings only act in their own modes).
_NO_EFFECT = {"use_cache", "cache_config", "max_cache_len", "compile_config", "disable_compile", "prefill_chunk_size",
              "decoder_start_token_id", "transformers_version", "is_assistant", "num_assistant_tokens",
              "num_assistant_tokens_schedule", "assistant_confidence_threshold", "max_matching_ngram_size",
              "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight", "speculation_type",
              "diversity_penalty", "penalty_alpha"}
# Warpers transformers applies only when sampling.
_SAMPLING_ONLY = {"typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}
_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH)


@dataclass
class GeneratePlan:
    """One generate() call, translated."""

    input_ids: torch.Tensor  # [B, W], as given
    prompts: list[list[int]]  # each row's unmasked tokens
    params: SamplingParams
    num_return: int
    beam: bool
    eos: list[int] | None
    pad: int | None  # fills the generated part
    min_tokens: int
    streamer: Any
    tokenizer: Any  # for stop strings
    return_dict: bool
    output_scores: bool
    output_logits: bool
    right_padded: bool


def translate(model, original, args, kwargs) -> GeneratePlan:
    """generate()'s arguments -> a plan for the engine, or Unsupported(reason)."""
    try:
        call = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError as e:
        raise Unsupported(f"arguments not understood ({e})") from None
    extra = dict(call.pop("kwargs", {}))
    for name in _UNSUPPORTED_ARGS:
        value = call.get(name)
        if value is not None and not (isinstance(value, list) and not value):
            raise Unsupported(f"{name} is not supported")
    if call.get("synced_gpus"):
        raise Unsupported("synced_gpus is not supported")
    if model.config.is_encoder_decoder:
        raise Unsupported("encoder-decoder models are not supported")
    if model.training and _has_dropout(model):
        raise Unsupported("the model is in training mode with dropout")
    extra.pop("trust_remote_code", None)
    structured = extra.pop("structured_outputs", None)
    tokenizer = extra.pop("tokenizer", None)
    if extra.pop("assistant_tokenizer", None) is not None:
        raise Unsupported("assistant_tokenizer is not supported")
    user_config = call.get("generation_config")
    gen, model_kwargs = model._prepare_generation_config(user_config, **extra)  # transformers' own merge
    mode = gen.get_generation_mode()
    if mode not in _MODES:
        raise Unsupported(f"generation mode {mode.value!r} is not supported")
    _check_fields(gen)
    beam = mode is GenerationMode.BEAM_SEARCH

    input_ids = call.get("inputs")
    kw_ids = model_kwargs.pop("input_ids", None)
    if input_ids is None:
        input_ids = kw_ids
    elif kw_ids is not None:
        raise Unsupported("both inputs and input_ids given")
    mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("use_cache", None)
    if model_kwargs:
        raise Unsupported(f"model inputs {sorted(model_kwargs)} are not supported")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.shape[1] == 0:
        raise Unsupported("input_ids must be a non-empty [batch, length] tensor of token ids")

    eos = _ids(gen.eos_token_id)
    pad = _ids(gen.pad_token_id)
    pad = pad[0] if pad else (eos[0] if eos else None)
    if eos is not None and any(t < 0 for t in eos):
        raise Unsupported("negative eos_token_id")
    prompts, right_padded = _strip_padding(input_ids, mask, pad, eos)

    width = input_ids.shape[1]
    max_tokens = _max_new_tokens(model, gen, user_config, extra, width)
    if max_tokens < 1:
        raise Unsupported(f"max_length leaves no room after the {width} input tokens")
    if eos is None:
        min_tokens = 0  # transformers' min-length processors need an EOS to suppress
    elif gen.min_new_tokens is not None:
        min_tokens = gen.min_new_tokens
    else:
        min_tokens = max(0, (gen.min_length or 0) - width)
    min_tokens = min(min_tokens, max_tokens)
    num_return = gen.num_return_sequences or 1
    rows = input_ids.shape[0] * num_return

    stop = [gen.stop_strings] if isinstance(gen.stop_strings, str) else list(gen.stop_strings or [])
    if stop:
        if tokenizer is None:
            raise Unsupported("stop_strings need tokenizer=")
        if beam or min_tokens:
            raise Unsupported("stop_strings with beam search or min_new_tokens are not supported")
        if eos is None and rows > 1:
            raise Unsupported("stop_strings without an eos_token_id in a batch")  # transformers does not pad then
        if any(_stop_may_start_in_prompt(tokenizer, p, stop) for p in prompts):
            raise Unsupported("a stop string may begin inside a prompt")

    streamer = call.get("streamer")
    if streamer is not None and (beam or rows > 1):
        raise Unsupported("a streamer with beam search or more than one sequence is not supported")

    return_dict = bool(gen.return_dict_in_generate)
    output_scores = return_dict and bool(gen.output_scores)
    output_logits = return_dict and bool(gen.output_logits)
    penalty = 1.0 if gen.repetition_penalty is None else float(gen.repetition_penalty)
    if beam:
        if penalty != 1.0 or min_tokens:
            raise Unsupported("repetition_penalty or min_new_tokens with beam search are not supported")
        if output_logits:
            raise Unsupported("output_logits with beam search is not supported")
        if structured is not None:
            raise Unsupported("structured_outputs with beam search is not supported")
        params = SamplingParams(use_beam_search=True, best_of=gen.num_beams, n=num_return, max_tokens=max_tokens,
                                length_penalty=float(gen.length_penalty), early_stopping=gen.early_stopping,
                                skip_special_tokens=False)
    else:
        sample = mode is GenerationMode.SAMPLE
        if output_scores and (sample or penalty != 1.0 or min_tokens):
            raise Unsupported("output_scores with sampling, repetition_penalty or min_new_tokens is not supported")
        if sample and not (gen.temperature or 0) > 0:
            raise Unsupported("do_sample with temperature 0")
        # EOS exactly as asked: stop on these ids only, whatever the engine's own EOS set.
        params = SamplingParams(
            n=num_return, temperature=float(gen.temperature) if sample else 0.0,
            top_k=(gen.top_k or 0) if sample else 0, top_p=float(gen.top_p or 1.0) if sample else 1.0,
            min_p=float(gen.min_p or 0.0) if sample else 0.0, repetition_penalty=penalty,
            max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, ignore_eos=True, stop_token_ids=eos or [],
            skip_special_tokens=False, structured_outputs=structured)
    return GeneratePlan(input_ids, prompts, params, num_return, beam, eos, pad, min_tokens, streamer,
                 tokenizer if stop or structured is not None else None, return_dict, output_scores, output_logits, right_padded)



def _check_fields(gen: GenerationConfig) -> None:
    """Any generation option we do not translate must be at its neutral value."""
    defaults = GenerationConfig._get_default_generation_params()
    for name, value in vars(gen).items():
        if name.startswith("_") or name in _TRANSLATED or name in _NO_EFFECT or name not in _known_fields():
            continue
        if name in _SAMPLING_ONLY and not gen.do_sample:
            continue
        neutral = value is None or value is False or (isinstance(value, (list, tuple, dict)) and not value)
        if not neutral and value != defaults.get(name):
            raise Unsupported(f"{name}={value!r} is not supported")
    if gen.cache_implementation not in (None, "dynamic"):
        raise Unsupported(f"cache_implementation={gen.cache_implementation!r} is not supported")


@functools.cache
def _known_fields() -> frozenset[str]:
    return frozenset(vars(GenerationConfig()))


def _ids(value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _strip_padding(input_ids: torch.Tensor, mask, pad: int | None, eos) -> tuple[list[list[int]], bool]:
    """Each row's unmasked tokens (one contiguous run), and whether any row has padding on the right."""
    if mask is None:  # transformers infers the mask from pad tokens when pad is not also an EOS
        infer = pad is not None and bool((input_ids == pad).any()) and (eos is None or pad not in eos)
        mask = input_ids.ne(pad) if infer else torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise Unsupported("attention_mask must have the shape of input_ids")
    prompts, right_padded = [], False
    for row, m in zip(input_ids.tolist(), mask.bool().tolist()):
        idx = [i for i, keep in enumerate(m) if keep]
        if not idx:
            raise Unsupported("a row is all padding")
        if idx[-1] - idx[0] + 1 != len(idx):
            raise Unsupported("an attention_mask with holes inside a row")
        prompts.append(row[idx[0]:idx[-1] + 1])
        right_padded |= idx[-1] < len(row) - 1
    return prompts, right_padded


def _max_new_tokens(model, gen: GenerationConfig, user_config, kwargs: dict, width: int) -> int:
    """transformers' _prepare_generated_length: max_new_tokens wins; an unset max_length means 20 new."""
    if gen.max_new_tokens is not None:
        return gen.max_new_tokens
    unset = kwargs.get("max_length") is None and (user_config is None or user_config.max_length is None) \
        and model.generation_config.max_length is None
    if unset:
        max_length = gen.max_length + width
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None:
            max_length = min(max_length, limit)
        return max_length - width
    return gen.max_length - width


def _stop_may_start_in_prompt(tokenizer, prompt: list[int], stop: list[str]) -> bool:
    """transformers matches stop strings over the whole sequence, the engine over the output only: they
    agree unless the prompt's text ends with the beginning of a stop string."""
    tail = tokenizer.decode(prompt[-max(map(len, stop)):], skip_special_tokens=False)
    return any(tail.endswith(s[:k]) for s in stop for k in range(1, len(s)))


def _has_dropout(model) -> bool:
    if (getattr(model.config.get_text_config(), "attention_dropout", 0) or 0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
