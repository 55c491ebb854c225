"""pagedcore's extension points: this file is a plugin author's whole contract.

A plugin is any object or module with functions named like the specs below, decorated with
`pagedcore.hookimpl`. Register it through the `pagedcore` entry-point group in your package's
metadata, e.g. in pyproject.toml::

    [project.entry-points.pagedcore]
    myplugin = "mypackage.pagedcore_plugin"

or pass it directly: `LLM(..., plugins=[obj])`. The built-in behaviour is itself a plugin
(`pagedcore.builtin_plugins`); plugins registered later are called first, so a third-party
`firstresult` hook that returns a value overrides the built-in one, and returning None defers.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("pagedcore")
hookimpl = pluggy.HookimplMarker("pagedcore")


@hookspec(firstresult=True)
def pagedcore_load_model(config):
    """Load the model and its tokenizer for an `EngineConfig`.

    Return `(model, tokenizer)`: `model` a transformers causal LM (or anything with the same
    forward signature whose attention layers go through transformers' attention interface),
    already on `config.torch_device()`; or None to let the next plugin try.
    """


@hookspec(firstresult=True)
def pagedcore_attention_backend(name, device):
    """Return an `AttentionBackend` instance for `device` (a torch.device).

    `name` is the user's explicit choice (`EngineConfig.attention_backend`) or None for "the
    best for this device". Return None if you do not provide that backend.
    """


@hookspec
def pagedcore_logits_processors(config):
    """Return a list of batch logits processors for this engine (called once at start).

    Each processor is a callable `(logits, sequences) -> logits`, where `logits` is the
    `[num_rows, vocab]` float tensor about to be sampled and `sequences` the matching list of
    `Sequence` objects (their `params`, `token_ids`, ...). Processors may edit `logits` in place.
    """


@hookspec(firstresult=True)
def pagedcore_scheduling_policy(name):
    """Return the waiting-queue policy called `name` (built in: "fcfs", "priority"): an object with
    `add(waiting_deque, seq)` and `readd_preempted(waiting_deque, seq)`, optionally
    `victim_index(running, first)` (which of `running[first:]` to preempt; default the last) and
    `uses_priority` (whether requests may carry a priority); None if the name is not yours."""


@hookspec(firstresult=True)
def pagedcore_structured_output_backend(name, tokenizer, vocab_size, stop_token_ids):
    """Return the structured-output backend called `name` (`EngineConfig.structured_outputs_backend`;
    built in: "xgrammar", "llguidance"), a `pagedcore.structured_output.backend.StructuredOutputBackend`
    for this tokenizer, `vocab_size` (the logits' width) and the model's stop tokens; None if the name is
    not yours. Called once, on the first constrained request, in a compile thread."""


@hookspec
def pagedcore_request_event(event, request_id, seq_index, info):
    """A request changed state. `event` is one of "added", "scheduled", "preempted", "finished",
    "aborted", "rejected"; `info` a dict of details (e.g. finish_reason, num_preemptions).
    "rejected" (refused input or overload: `request_id` None, `info` has "field", "error" and
    "reason", a `pagedcore.limits.REJECT_REASONS` entry) may come from the caller's thread rather
    than the engine's; "aborted" has "reason" (`ABORT_REASONS`)."""


@hookspec
def pagedcore_step_end(stats):
    """Called after every engine step with an `EngineStats` snapshot (queue lengths, KV blocks,
    tokens this step, preemptions so far): the hook for metrics exporters."""
