"""Kept importable for the public contract: ``from hf_posenc.evaluate import perplexity_at_length``.

The evaluation tools live in ``hf_posenc.tools``: ``perplexity`` (the measurement) and ``eval_ppl`` (the command).
"""

from .tools.perplexity import perplexity_at_length

__all__ = ["perplexity_at_length"]
