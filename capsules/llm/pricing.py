"""A cost estimate per generation, for the audit log (not a bill).

Prices are US dollars per million tokens, by model family prefix (the
longest matching prefix wins), from Anthropic's public price list: input,
output, cache read (0.1 x input) and cache write (1.25 x input, the 5-minute
``ephemeral`` cache).  A model no prefix matches has no estimate (``None``).
"""

from __future__ import annotations

from typing import NamedTuple

from capsules.llm.events import Usage

__all__ = ("PRICES", "Price", "cost_usd")


class Price(NamedTuple):
    input: float
    output: float

    @property
    def cache_read(self) -> float:
        return self.input * 0.1

    @property
    def cache_write(self) -> float:
        return self.input * 1.25


PRICES: dict[str, Price] = {
    "claude-opus-4-5": Price(5.0, 25.0),
    "claude-opus-4": Price(15.0, 75.0),
    "claude-sonnet-4": Price(3.0, 15.0),
    "claude-3-7-sonnet": Price(3.0, 15.0),
    "claude-haiku-4-5": Price(1.0, 5.0),
    "claude-3-5-haiku": Price(0.8, 4.0),
}


def cost_usd(model: str, usage: Usage) -> float | None:
    """The estimated cost of ``usage`` on ``model``, rounded to 1e-6 dollars."""
    matches = [prefix for prefix in PRICES if model.startswith(prefix)]
    if not matches:
        return None
    price = PRICES[max(matches, key=len)]
    dollars = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_input_tokens * price.cache_read
        + usage.cache_creation_input_tokens * price.cache_write
    ) / 1_000_000
    return round(dollars, 6)
