"""A prompt step runs the last decoder layer's o_proj and MLP on the sampled rows only (ForwardContext.keep_rows,
lean_layers.last_layer): every token's K/V is still written, and the tokens, logprobs and prompt logprobs are the
ones computing every row gives."""

from __future__ import annotations

import pytest
import torch

from api_helpers import assert_pool_whole
from pagedcore import LLM, SamplingParams

PROMPTS = [[5 + i for i in range(n)] for n in (3, 29, 47, 70)]


def _rows_seen(layer) -> list[int]:
    """The row counts the layer's down_proj is called with (a hook: the layer's own forward stays)."""
    seen = []
    layer.mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[-2]))
    return seen


def _llm(model_dir, **settings) -> LLM:
    settings.setdefault("num_kv_blocks", 64)
    settings.setdefault("enable_prefix_caching", False)  # a second run computes its prompts again
    return LLM(str(model_dir), block_size=16, **settings)


def _outputs(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_the_last_layer_runs_only_the_sampled_rows(tiny_model_dir):
    llm = _llm(tiny_model_dir("llama"))
    layers = llm.engine.model.model.layers
    first, last = _rows_seen(layers[0]), _rows_seen(layers[-1])
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert first == [sum(map(len, PROMPTS))]  # one prompt step, every token
    assert last == [len(PROMPTS)]  # its last token each
    assert llm.engine.runner.last_layer is layers[-1]
    assert_pool_whole(llm.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["chunked", "layer_skip", "n2"])
def test_tokens_equal_computing_every_row(tiny_model_dir, dtype, case):
    """Prompt chunks that sample nothing beside decode rows (max_num_batched_tokens 32), speculation by the model's
    own first layers (the draft's last layer keeps rows too; the target's verify rows are several a sequence),
    n = 2 seeded samples: each as computing the last layer on every row gives."""
    settings = {"max_num_batched_tokens": 32} if case == "chunked" else {}
    if case == "layer_skip":
        settings["speculative_config"] = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}
    llm = _llm(tiny_model_dir("llama"), dtype=dtype, **settings)
    runner = llm.engine.runner
    seen = _rows_seen(llm.engine.model.model.layers[-1])
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=3) for _ in PROMPTS]
    if case == "n2":
        params = [SamplingParams(temperature=0.8, n=2, seed=7 + i, max_tokens=8, logprobs=3)
                  for i in range(len(PROMPTS))]
    kept = _outputs(llm, params)
    calls = len(seen)
    runner.last_layer = None  # every row through the last layer
    full = _outputs(llm, params)
    assert calls and sum(seen[:calls]) < sum(seen[calls:])  # the first run's last layer ran fewer rows
    assert kept == full
    assert_pool_whole(llm.engine)


def test_a_replaced_last_layer_mlp_still_gets_every_row(tiny_model_dir):
    """A module swapped into the last layer after start-up (a plugin) makes the layer run its own forward on every
    row; the rows the head needs are then taken from its output, and the tokens stay."""
    llm = _llm(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=6)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    layer, calls = llm.engine.model.model.layers[-1], []

    class Counted(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(x.shape[-2])
            return self.inner(x)

    layer.mlp = Counted(layer.mlp)
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert after == before
    assert calls[0] == sum(map(len, PROMPTS))
