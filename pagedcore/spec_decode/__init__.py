"""Speculative decoding (issue 16): proposers (n-gram, draft model, layer skip), exact verification
by rejection sampling, and the cost model that keeps it on only where it pays."""

import logging

logger = logging.getLogger("pagedcore")


def make_spec_decoder(config, logits_processors: list, engine):
    """The engine's SpecDecoder, or None: speculation off (no speculative_config, or logits processor
    plugins registered). Its modules load only when it is on."""
    if config.speculative_config is None:
        return None
    from pagedcore.spec_decode.config import SpeculativeConfig
    from pagedcore.spec_decode.spec_decoder import SpecDecoder

    if logits_processors:
        # Processors see one row per sequence and its tokens; verification rows are not that.
        logger.warning("speculative decoding off: logits processor plugins are registered")
        return None
    return SpecDecoder(SpeculativeConfig.from_dict(config.speculative_config), engine)
