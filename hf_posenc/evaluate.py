"""Kept importable for the public contract: ``from hf_posenc.evaluate import perplexity_at_length``.

The evaluation tools live in ``hf_posenc.tools`` (``perplexity`` for the measurement, ``eval_ppl`` for the command).
"""

from .tools.eval_ppl import perplexity_at_length

__all__ = ["perplexity_at_length"]
