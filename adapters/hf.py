"""`model.generate()` through pagedcore: one line for a transformers user, translation only.

    from pagedcore.adapters.hf import patch
    patch(model, num_kv_blocks=512)      # engine settings as for LLM(...); weights are shared, not copied
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)   # same call, same tensor

`patch(model)` / `unpatch(model)`, `with patched(model): ...`, and `patch_all()` / `unpatch_all()`
for every model. The engine is made on the first call; the `pagedcore_load_model` hook hands it the
model object itself. Each row of the batch (each of its `num_return_sequences`) is one engine
request, so rows that stop early free their slot at once.

Translated: input_ids + attention_mask (left or right padding: each row's unmasked tokens are its
prompt), a GenerationConfig and/or kwargs merged with `model.generation_config` exactly as
transformers merges them; greedy, sampling (temperature, top_k, top_p, min_p), repetition_penalty,
max_new_tokens / max_length, min_new_tokens / min_length, eos_token_id (int or list), pad_token_id,
stop_strings (with tokenizer=), num_return_sequences, beam search (num_beams, length_penalty,
early_stopping), streamers (batch of one), return_dict_in_generate with output_scores / output_logits.
The result is laid out as transformers lays it out: the input rows as given, padding included, then
the generated tokens (EOS kept), right-padded with pad_token_id to the longest row.

Anything else falls back to transformers' own generate() with one `FallbackWarning` naming the
reason: logits processors / stopping criteria / prefix_allowed_tokens_fn / assistants / custom_generate,
any other generation option that changes the result, encoder-decoder models, extra model inputs,
sampling with beams, streamers with more than one row or with beams, output_attentions / hidden
states, output_scores where processors would change them (sampling, repetition_penalty, min length)
and output_logits with beams, a row longer than the engine's context, and the corner cases where the
engine's stopping rules differ (e.g. a stop string that may begin inside the prompt).

The engine renders each output's text, which generate() never returns: it gets the tokenizer passed
to patch() or, when stop_strings need one, to generate(tokenizer=...) (the engine is then remade once);
otherwise a stand-in that renders nothing. No tokenizer is loaded behind the user's back.

Known differences, by design:
  * Right padding: transformers continues after the pads with wrong positions (it warns that its
    results are incorrect); pagedcore continues each row's real tokens, which is what transformers
    gives for the same rows left-padded.
  * `scores` / `logits` rows of sequences that already finished hold zeros for the later steps
    (transformers fills them with logits computed on padding). `past_key_values` is None.
  * Beam search returns `sequences_scores` but not the per-step `scores` nor `beam_indices`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import threading
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import (GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput, GenerationMixin,
                                     GenerationMode)

from pagedcore import packed_linear
from pagedcore.attention import hf_glue
from pagedcore.hookspecs import hookimpl
from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind
from pagedcore.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger("pagedcore")

__all__ = ["patch", "unpatch", "patched", "patch_all", "unpatch_all", "get_engine", "FallbackWarning"]


class FallbackWarning(UserWarning):
    """A generate() call that pagedcore cannot run exactly as transformers would: it ran transformers'."""


class _Unsupported(Exception):
    pass


_STATE_ATTR = "_pagedcore_hf"
_ORIGINAL_GENERATE = GenerationMixin.generate
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# generate() arguments the engine has no counterpart for (None or an empty list is fine).
_UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                     "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")
# GenerationConfig fields translated below.
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


# ---- public API ---------------------------------------------------------------------------------
def patch(model, tokenizer=None, plugins=(), **engine_settings):
    """Make `model.generate` run through a pagedcore engine (made on the first call). `tokenizer` is
    only needed for stop_strings (a generate(tokenizer=...) call supplies it too); `plugins` and
    `engine_settings` go to LLMEngine. Returns the model."""
    if _state(model) is not None:
        unpatch(model)
    original = model.generate
    if getattr(original, "__func__", None) is _generate_all:  # patch_all() is on: fall back to transformers'
        original = types.MethodType(_ORIGINAL_GENERATE, model)
    setattr(model, _STATE_ATTR, _PatchState(model, original, tokenizer, list(plugins), engine_settings))
    wrapper = functools.update_wrapper(functools.partial(_generate, model), original)
    model.generate = wrapper
    return model


def unpatch(model):
    """Restore transformers' generate (and the attention implementation) and drop the engine."""
    state = _state(model)
    if state is None:
        return model
    if getattr(model.__dict__.get("generate"), "func", None) is _generate:
        del model.generate
    delattr(model, _STATE_ATTR)
    state.close(model)
    _GLOBAL_MODELS.discard(model)
    return model


@contextlib.contextmanager
def patched(model, tokenizer=None, plugins=(), **engine_settings):
    """`with patched(model): model.generate(...)` runs through pagedcore inside the block only."""
    patch(model, tokenizer, plugins, **engine_settings)
    try:
        yield model
    finally:
        unpatch(model)


_GLOBAL_SETTINGS: dict[str, Any] = {}
_GLOBAL_MODELS: weakref.WeakSet = weakref.WeakSet()


def patch_all(tokenizer=None, plugins=(), **engine_settings) -> None:
    """Every transformers model's generate() runs through pagedcore (an engine per model, made on its
    first call), until unpatch_all(). Models patched one by one keep their own settings."""
    _GLOBAL_SETTINGS.clear()
    _GLOBAL_SETTINGS.update(tokenizer=tokenizer, plugins=list(plugins), settings=dict(engine_settings))
    GenerationMixin.generate = _generate_all


def unpatch_all() -> None:
    GenerationMixin.generate = _ORIGINAL_GENERATE
    for model in list(_GLOBAL_MODELS):
        state = _state(model)
        if state is not None and "generate" not in model.__dict__:
            delattr(model, _STATE_ATTR)
            state.close(model)
    _GLOBAL_MODELS.clear()
    _GLOBAL_SETTINGS.clear()


def get_engine(model) -> LLMEngine | None:
    """The engine behind a patched model (None before its first generate call)."""
    state = _state(model)
    return None if state is None else state.engine


@functools.wraps(_ORIGINAL_GENERATE)
def _generate_all(self, *args, **kwargs):
    if _state(self) is None:
        g = _GLOBAL_SETTINGS
        setattr(self, _STATE_ATTR, _PatchState(self, types.MethodType(_ORIGINAL_GENERATE, self), g.get("tokenizer"),
                                               g.get("plugins", []), g.get("settings", {})))
        _GLOBAL_MODELS.add(self)
    return _dispatch(self, args, kwargs)


def _state(model) -> _PatchState | None:
    return model.__dict__.get(_STATE_ATTR)


# ---- the engine behind one model ------------------------------------------------------------------
class _NoTokenizer:
    """What the engine gets when generate() has no tokenizer: the engine renders each output's text,
    which generate() never returns, so this renders nothing and adds no EOS of its own."""

    eos_token_id = None

    def decode(self, token_ids, **kwargs) -> str:
        return ""


class _LogitsRecorder:
    """An engine logits processor keeping the raw next-token logits of the requests being watched."""

    def __init__(self):
        self.watched: dict[str, dict[int, list[torch.Tensor]]] = {}

    def __call__(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        if self.watched:
            for i, seq in enumerate(seqs):
                rows = self.watched.get(seq.request_id)
                if rows is not None:
                    rows.setdefault(seq.index, []).append(logits[i].to(torch.float32, copy=True))
        return logits


class _SharedModel:
    """The plugin that hands the engine the already-loaded model (same object, same weights)."""

    def __init__(self, model, tokenizer, recorder: _LogitsRecorder):
        self.model, self.tokenizer, self.recorder = model, tokenizer, recorder

    @hookimpl
    def pagedcore_load_model(self, config):
        return self.model, self.tokenizer

    @hookimpl
    def pagedcore_logits_processors(self, config):
        return [self.recorder]


class _PatchState:
    def __init__(self, model, original, tokenizer, plugins: list, settings: dict):
        self.original = original
        self.tokenizer = tokenizer
        self.plugins = plugins
        self.settings = settings
        self.original_attn = model.config._attn_implementation
        self.engine: LLMEngine | None = None
        self.engine_has_tokenizer = False
        self.recorder = _LogitsRecorder()
        self.lock = threading.Lock()
        self.calls = itertools.count()
        self.warned: set[str] = set()

    def engine_for(self, model, tokenizer) -> LLMEngine:
        """The engine, made on first use; remade once with a real tokenizer when stop strings need one."""
        tokenizer = self.tokenizer if self.tokenizer is not None else tokenizer
        if self.engine is None or (tokenizer is not None and not self.engine_has_tokenizer):
            attn = model.config._attn_implementation
            self.engine = None
            try:
                plugin = _SharedModel(model, _NoTokenizer() if tokenizer is None else tokenizer, self.recorder)
                settings = {"device": str(model.device), "dtype": _DTYPES.get(model.dtype, "auto"), **self.settings}
                self.engine = LLMEngine(plugins=[plugin, *self.plugins], **settings)
            finally:
                _set_attn(model, attn)  # the engine installed its attention; calls switch to it and back
            self.engine_has_tokenizer = tokenizer is not None
        return self.engine

    def close(self, model) -> None:
        self.engine = None
        _set_attn(model, self.original_attn)
        packed_linear.restore(model)  # the packed copies of the user's weights go with the engine

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message)


def _set_attn(model, implementation: str) -> None:
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


@contextlib.contextmanager
def _paged_attention(model):
    original = model.config._attn_implementation
    _set_attn(model, hf_glue.ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        _set_attn(model, original)


# ---- generate -----------------------------------------------------------------------------------------
@dataclass
class _Plan:
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


def _generate(model, *args, **kwargs):
    return _dispatch(model, args, kwargs)


def _dispatch(model, args, kwargs):
    state = _state(model)
    if state is None:  # a reference kept from before unpatch()
        return model.generate(*args, **kwargs)
    try:
        plan = _translate(model, state.original, args, kwargs)
        with state.lock:
            engine = state.engine_for(model, plan.tokenizer)
            prompts = _admit(engine, plan)
            if plan.right_padded:
                state.warn_once("right", "pagedcore: right-padded rows continue from their last real token "
                                "(transformers would continue after the padding, which it warns is incorrect)")
            if plan.beam and plan.output_scores:
                state.warn_once("beam", "pagedcore: beam search returns sequences_scores, but not the per-step "
                                "scores nor beam_indices")
            return _run(model, state, engine, plan, prompts)
    except _Unsupported as e:
        warnings.warn(f"pagedcore.adapters.hf: {e}; running transformers' generate() instead",
                      FallbackWarning, stacklevel=3)
        return state.original(*args, **kwargs)


def _translate(model, original, args, kwargs) -> _Plan:
    """generate()'s arguments -> a plan for the engine, or _Unsupported(reason)."""
    try:
        call = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError as e:
        raise _Unsupported(f"arguments not understood ({e})") from None
    extra = dict(call.pop("kwargs", {}))
    for name in _UNSUPPORTED_ARGS:
        value = call.get(name)
        if value is not None and not (isinstance(value, list) and not value):
            raise _Unsupported(f"{name} is not supported")
    if call.get("synced_gpus"):
        raise _Unsupported("synced_gpus is not supported")
    if model.config.is_encoder_decoder:
        raise _Unsupported("encoder-decoder models are not supported")
    if model.training and _has_dropout(model):
        raise _Unsupported("the model is in training mode with dropout")
    extra.pop("trust_remote_code", None)
    tokenizer = extra.pop("tokenizer", None)
    if extra.pop("assistant_tokenizer", None) is not None:
        raise _Unsupported("assistant_tokenizer is not supported")
    user_config = call.get("generation_config")
    gen, model_kwargs = model._prepare_generation_config(user_config, **extra)  # transformers' own merge
    mode = gen.get_generation_mode()
    if mode not in _MODES:
        raise _Unsupported(f"generation mode {mode.value!r} is not supported")
    _check_fields(gen)
    beam = mode is GenerationMode.BEAM_SEARCH

    input_ids = call.get("inputs")
    kw_ids = model_kwargs.pop("input_ids", None)
    if input_ids is None:
        input_ids = kw_ids
    elif kw_ids is not None:
        raise _Unsupported("both inputs and input_ids given")
    mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("use_cache", None)
    if model_kwargs:
        raise _Unsupported(f"model inputs {sorted(model_kwargs)} are not supported")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.shape[1] == 0:
        raise _Unsupported("input_ids must be a non-empty [batch, length] tensor of token ids")

    eos = _ids(gen.eos_token_id)
    pad = _ids(gen.pad_token_id)
    pad = pad[0] if pad else (eos[0] if eos else None)
    if eos is not None and any(t < 0 for t in eos):
        raise _Unsupported("negative eos_token_id")
    prompts, right_padded = _strip_padding(input_ids, mask, pad, eos)

    width = input_ids.shape[1]
    max_tokens = _max_new_tokens(model, gen, user_config, extra, width)
    if max_tokens < 1:
        raise _Unsupported(f"max_length leaves no room after the {width} input tokens")
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
            raise _Unsupported("stop_strings need tokenizer=")
        if beam or min_tokens:
            raise _Unsupported("stop_strings with beam search or min_new_tokens are not supported")
        if eos is None and rows > 1:
            raise _Unsupported("stop_strings without an eos_token_id in a batch")  # transformers does not pad then
        if any(_stop_may_start_in_prompt(tokenizer, p, stop) for p in prompts):
            raise _Unsupported("a stop string may begin inside a prompt")

    streamer = call.get("streamer")
    if streamer is not None and (beam or rows > 1):
        raise _Unsupported("a streamer with beam search or more than one sequence is not supported")

    return_dict = bool(gen.return_dict_in_generate)
    output_scores = return_dict and bool(gen.output_scores)
    output_logits = return_dict and bool(gen.output_logits)
    penalty = 1.0 if gen.repetition_penalty is None else float(gen.repetition_penalty)
    if beam:
        if penalty != 1.0 or min_tokens:
            raise _Unsupported("repetition_penalty or min_new_tokens with beam search are not supported")
        if output_logits:
            raise _Unsupported("output_logits with beam search is not supported")
        params = SamplingParams(use_beam_search=True, best_of=gen.num_beams, n=num_return, max_tokens=max_tokens,
                                length_penalty=float(gen.length_penalty), early_stopping=gen.early_stopping,
                                skip_special_tokens=False)
    else:
        sample = mode is GenerationMode.SAMPLE
        if output_scores and (sample or penalty != 1.0 or min_tokens):
            raise _Unsupported("output_scores with sampling, repetition_penalty or min_new_tokens is not supported")
        if sample and not (gen.temperature or 0) > 0:
            raise _Unsupported("do_sample with temperature 0")
        # EOS exactly as asked: stop on these ids only, whatever the engine's own EOS set.
        params = SamplingParams(
            n=num_return, temperature=float(gen.temperature) if sample else 0.0,
            top_k=(gen.top_k or 0) if sample else 0, top_p=float(gen.top_p or 1.0) if sample else 1.0,
            min_p=float(gen.min_p or 0.0) if sample else 0.0, repetition_penalty=penalty,
            max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, ignore_eos=True, stop_token_ids=eos or [],
            skip_special_tokens=False)
    return _Plan(input_ids, prompts, params, num_return, beam, eos, pad, min_tokens, streamer,
                 tokenizer if stop else None, return_dict, output_scores, output_logits, right_padded)


def _admit(engine: LLMEngine, plan: _Plan) -> list:
    """Checks that need the engine: its context, vocabulary and own EOS set. Returns processed prompts."""
    engine_eos = set(engine.eos_token_ids)
    asked = set(plan.eos or [])
    if plan.beam:
        # Beam search ends on the engine's EOS ids plus stop_token_ids: they must make up the list asked for.
        if not engine_eos <= asked or len(asked) != len(plan.eos or []):
            raise _Unsupported(f"beam search with eos_token_id {plan.eos} (the engine's EOS is {sorted(engine_eos)})")
        plan.params.stop_token_ids = [t for t in plan.eos or [] if t not in engine_eos]
    elif plan.min_tokens and not engine_eos <= asked:
        raise _Unsupported(f"min_new_tokens with eos_token_id {plan.eos} (the engine's EOS is {sorted(engine_eos)})")
    capacity = engine.max_token_capacity()
    if max(map(len, plan.prompts)) + plan.params.max_tokens > capacity:
        raise _Unsupported(f"a row does not fit the engine's context of {capacity} tokens")
    try:
        return [engine.process_prompt(p, plan.params) for p in plan.prompts]
    except InvalidRequestError as e:
        raise _Unsupported(str(e)) from None


def _run(model, state: _PatchState, engine: LLMEngine, plan: _Plan, prompts):
    call = next(state.calls)
    rids = [f"hf-{call}-{i}" for i in range(len(prompts))]
    streamer = plan.streamer
    kind = OutputKind.DELTA if streamer is not None else OutputKind.FINAL_ONLY
    tokens: dict[str, list[list[int]]] = {}
    scores: dict[str, float] = {}
    watch = not plan.beam and (plan.output_scores or plan.output_logits)
    if watch:
        state.recorder.watched.update({rid: {} for rid in rids})
    try:
        with _paged_attention(model):
            for rid, p in zip(rids, prompts):
                engine.add_request(rid, p, output_kind=kind)
            if streamer is not None:
                streamer.put(plan.input_ids.cpu())
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if streamer is not None:
                        for t in out.outputs[0].token_ids:
                            streamer.put(torch.tensor([t]))
                        tokens.setdefault(out.request_id, [[]])[0].extend(out.outputs[0].token_ids)
                    elif out.finished:
                        tokens[out.request_id] = [list(c.token_ids) for c in out.outputs]
                        scores.update({f"{out.request_id}/{c.index}": c.score for c in out.outputs})
    except BaseException:
        engine.abort_request(rids)
        raise
    finally:
        recorded = [state.recorder.watched.pop(rid, {}) for rid in rids] if watch else None
    if streamer is not None:
        streamer.end()
    return _outputs(plan, rids, tokens, scores, recorded)


def _outputs(plan: _Plan, rids, tokens, scores, recorded):
    """Engine results -> the tensor (or ModelOutput) transformers' generate returns."""
    device = plan.input_ids.device
    generated = [seq for rid in rids for seq in tokens[rid]]
    width = max(map(len, generated))
    if plan.beam:
        # transformers' beam fill: `pad_token_id or eos_token_id[0]`, -1 without an EOS
        fill = (plan.pad or plan.eos[0]) if plan.eos else -1
    else:
        fill = 0 if plan.pad is None else plan.pad
    new = torch.full((len(generated), width), fill, dtype=plan.input_ids.dtype)
    for i, seq in enumerate(generated):
        new[i, :len(seq)] = torch.tensor(seq, dtype=plan.input_ids.dtype)
    sequences = torch.cat([plan.input_ids.repeat_interleave(plan.num_return, 0), new.to(device)], dim=1)
    if not plan.return_dict:
        return sequences
    if plan.beam:
        seq_scores = torch.tensor([scores[f"{rid}/{j}"] for rid in rids for j in range(plan.num_return)],
                                  dtype=torch.float32, device=device) if plan.output_scores else None
        return GenerateBeamDecoderOnlyOutput(sequences=sequences, sequences_scores=seq_scores)
    steps = None
    if recorded is not None:
        rows = [rec.get(j, []) for rec in recorded for j in range(plan.num_return)]
        vocab = next(r[0].shape[0] for r in rows if r)
        zeros = torch.zeros(vocab)
        steps = tuple(torch.stack([r[t].cpu() if t < len(r) else zeros for r in rows]).to(device)
                      for t in range(width))
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=steps if plan.output_scores else None,
                                     logits=steps if plan.output_logits else None)


# ---- translation helpers ------------------------------------------------------------------------------
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
            raise _Unsupported(f"{name}={value!r} is not supported")
    if gen.cache_implementation not in (None, "dynamic"):
        raise _Unsupported(f"cache_implementation={gen.cache_implementation!r} is not supported")


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
        raise _Unsupported("attention_mask must have the shape of input_ids")
    prompts, right_padded = [], False
    for row, m in zip(input_ids.tolist(), mask.bool().tolist()):
        idx = [i for i, keep in enumerate(m) if keep]
        if not idx:
            raise _Unsupported("a row is all padding")
        if idx[-1] - idx[0] + 1 != len(idx):
            raise _Unsupported("an attention_mask with holes inside a row")
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
