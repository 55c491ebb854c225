"""`model.generate()` through pagedcore: one line for a transformers user, translation only.

    from pagedcore.adapters.hf import patch
    patch(model, num_kv_blocks=512)      # engine settings as for LLM(...); weights are shared, not copied
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)   # same call, same tensor

`patch(model)` / `unpatch(model)`, `with patched(model): ...`, and `patch_all()` / `unpatch_all()`
for every model. The engine is made on the first call; the `pagedcore_load_model` hook hands it the
model object itself. Each row of the batch (each of its `num_return_sequences`) is one engine
request, so rows that stop early free their slot at once.

The call's arguments are translated into engine requests (adapters/hf_generate_args.py says which
are); anything else falls back to transformers' own generate() with one `FallbackWarning` naming the
reason, as does a row longer than the engine's context. The result is laid out as transformers lays
it out: the input rows as given, padding included, then the generated tokens (EOS kept),
right-padded with pad_token_id to the longest row.

`unpatch` gives the model back as it was: everything the engine installed on it (attention, lean
layers, fused norms, packed or int4 linears) is recorded while patched and undone (pagedcore/installs.py).

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

A PEFT-wrapped model (`PeftModel`, or transformers' `load_adapter`) runs PEFT's own LoRA layers, so
each call uses the active adapter (or none, under `disable_adapter()`); the prefix cache is salted by
that choice, so switching adapters never reuses KV computed under another. (Serving several adapters
in one batch is the engine's `enable_lora`, README "LoRA adapters".)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import types
import warnings
import weakref
from typing import Any

import torch
from transformers.generation import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput, GenerationMixin

from pagedcore import installs
from pagedcore.adapters.hf_generate_args import GeneratePlan, Unsupported, translate
from pagedcore.hookspecs import hookimpl
from pagedcore.llm_engine import LLMEngine
from pagedcore.outputs import OutputKind
from pagedcore.sampling_params import InvalidRequestError

logger = logging.getLogger("pagedcore")

__all__ = ["patch", "unpatch", "patched", "patch_all", "unpatch_all", "get_engine", "FallbackWarning"]


class FallbackWarning(UserWarning):
    """A generate() call that pagedcore cannot run exactly as transformers would: it ran transformers'."""


_STATE_ATTR = "_pagedcore_hf"
_ORIGINAL_GENERATE = GenerationMixin.generate
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    setattr(model, _STATE_ATTR, _PatchState(original, tokenizer, list(plugins), engine_settings))
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
    state.release(model)
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
            state.release(model)
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
        setattr(self, _STATE_ATTR, _PatchState(types.MethodType(_ORIGINAL_GENERATE, self), g.get("tokenizer"),
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
    def __init__(self, original, tokenizer, plugins: list, settings: dict):
        self.original = original
        self.tokenizer = tokenizer
        self.plugins = plugins
        self.settings = settings
        self.engine: LLMEngine | None = None
        self.engine_attn: str | None = None  # the attention implementation the engine installed
        self.engine_has_tokenizer = False
        self.recorder = _LogitsRecorder()
        self.lock = threading.Lock()
        self.calls = itertools.count()
        self.warned: set[str] = set()

    def engine_for(self, model, tokenizer) -> LLMEngine:
        """The engine, made on first use; remade once with a real tokenizer when stop strings need one."""
        tokenizer = self.tokenizer if self.tokenizer is not None else tokenizer
        if self.engine is None or (tokenizer is not None and not self.engine_has_tokenizer):
            self.release(model)  # a remade engine installs itself on the model as the user gave it
            attn = model.config._attn_implementation
            installs.track(model)
            try:
                plugin = _SharedModel(model, _NoTokenizer() if tokenizer is None else tokenizer, self.recorder)
                settings = {"device": str(model.device), "dtype": _DTYPES.get(model.dtype, "auto"), **self.settings}
                self.engine = LLMEngine(plugins=[plugin, *self.plugins], **settings)
            except BaseException:
                installs.restore(model)
                raise
            self.engine_attn = model.config._attn_implementation
            _set_attn(model, attn)  # calls switch to the engine's attention and back (_engine_attention)
            self.engine_has_tokenizer = tokenizer is not None
        return self.engine

    def release(self, model) -> None:
        """Drop the engine and undo everything it installed on the model."""
        self.engine = None
        installs.restore(model)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message)


def _set_attn(model, implementation: str) -> None:
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


@contextlib.contextmanager
def _engine_attention(model, implementation: str):
    original = model.config._attn_implementation
    _set_attn(model, implementation)
    try:
        yield
    finally:
        _set_attn(model, original)


# ---- generate -----------------------------------------------------------------------------------------
def _generate(model, *args, **kwargs):
    return _dispatch(model, args, kwargs)


def _dispatch(model, args, kwargs):
    state = _state(model)
    if state is None:  # a reference kept from before unpatch()
        return model.generate(*args, **kwargs)
    try:
        plan = translate(model, state.original, args, kwargs)
        with state.lock:
            engine = state.engine_for(model, plan.tokenizer)
            if plan.params.structured_outputs is not None and not state.engine_has_tokenizer:
                raise Unsupported("structured_outputs need a tokenizer: tokenizer= to patch() or generate()")
            prompts = _admit(engine, plan)
            if plan.right_padded:
                state.warn_once("right", "pagedcore: right-padded rows continue from their last real token "
                                "(transformers would continue after the padding, which it warns is incorrect)")
            if plan.beam and plan.output_scores:
                state.warn_once("beam", "pagedcore: beam search returns sequences_scores, but not the per-step "
                                "scores nor beam_indices")
            return _run(model, state, engine, plan, prompts)
    except Unsupported as e:
        if kwargs.get("structured_outputs") is not None:  # transformers has no such thing: no fallback
            raise ValueError(f"pagedcore.adapters.hf: structured_outputs needs the engine, but {e}") from None
        warnings.warn(f"pagedcore.adapters.hf: {e}; running transformers' generate() instead",
                      FallbackWarning, stacklevel=3)
        return state.original(*args, **kwargs)


def _admit(engine: LLMEngine, plan: GeneratePlan) -> list:
    """Checks that need the engine: its context, vocabulary and own EOS set. Returns processed prompts."""
    engine_eos = set(engine.eos_token_ids)
    asked = set(plan.eos or [])
    if plan.beam:
        # Beam search ends on the engine's EOS ids plus stop_token_ids: they must make up the list asked for.
        if not engine_eos <= asked or len(asked) != len(plan.eos or []):
            raise Unsupported(f"beam search with eos_token_id {plan.eos} (the engine's EOS is {sorted(engine_eos)})")
        plan.params.stop_token_ids = [t for t in plan.eos or [] if t not in engine_eos]
    elif plan.min_tokens and not engine_eos <= asked:
        raise Unsupported(f"min_new_tokens with eos_token_id {plan.eos} (the engine's EOS is {sorted(engine_eos)})")
    capacity = engine.max_token_capacity()
    if max(map(len, plan.prompts)) + plan.params.max_tokens > capacity:
        raise Unsupported(f"a row does not fit the engine's context of {capacity} tokens")
    if plan.params.structured_outputs is not None and not engine_eos <= asked:
        raise Unsupported(f"structured_outputs with eos_token_id {plan.eos} (the grammar ends on the engine's EOS "
                          f"{sorted(engine_eos)})")
    try:
        prompts = [engine.process_prompt(p, plan.params) for p in plan.prompts]
    except InvalidRequestError as e:
        raise Unsupported(str(e)) from None
    future = engine.compile_grammar(plan.params)
    if future is not None:
        future.result()  # a bad schema, regex or grammar: InvalidRequestError naming it
    return prompts


def _run(model, state: _PatchState, engine: LLMEngine, plan: GeneratePlan, prompts):
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
        with _engine_attention(model, state.engine_attn):
            salt = _adapter_salt(model)
            for rid, p in zip(rids, prompts):
                engine.add_request(rid, p, output_kind=kind, cache_salt=salt)
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


def _adapter_salt(model) -> str | None:
    """For a PEFT-wrapped model, which adapters its layers apply now (a prefix-cache salt); else None."""
    if getattr(model, "peft_config", None) is None:
        return None
    active = model.active_adapters
    active = active() if callable(active) else active  # transformers' is a method, PeftModel's a property
    disabled = any(getattr(m, "disable_adapters", False) for m in model.modules() if hasattr(m, "lora_A"))
    return "peft:" + ("disabled" if disabled else ",".join(active))


def _outputs(plan: GeneratePlan, rids, tokens, scores, recorded):
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
