"""Guided decoding (structured outputs): a request's StructuredOutputsParams become a grammar (xgrammar), compiled off
the engine loop and cached; each guided sequence's matcher fills a token bitmask every step, applied to its logits
before sampling, and accepts the sampled token."""
from kvgate.engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
