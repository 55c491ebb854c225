"""Speculative decoding (issue 16): proposers (n-gram, draft model, layer skip), exact verification
by rejection sampling, and the cost model that keeps it on only where it pays."""
