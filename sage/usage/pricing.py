"""A cost estimate per model call, in US dollars: one price table for all of sage.

The session runner's model calls (the ledger, sage/usage/ledger.py) and the completion
provider's generations (capsules/llm) are priced here, so an estimate means the same
wherever it is shown.  It is an estimate, not a bill: the Messages API's invoice is.

Prices are US dollars per million tokens, by model family prefix (the longest
matching prefix wins), from Anthropic's public price list: input, output, cache read
(0.1 x input) and cache write (1.25 x input, the 5-minute ``ephemeral`` cache).  A
model no prefix matches has no estimate (``None``): the ledger then counts the CLI's
own ``total_cost_usd`` for the turn (docs/operations.md, "Budgets and metrics").
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = ("PRICES", "Price", "TokenCounts", "cost_usd", "price_of")


class TokenCounts(Protocol):
    """The four counts of a Messages API ``usage`` (the CLI's, the SDK's, the ledger's)."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cache_read_input_tokens(self) -> int: ...
    @property
    def cache_creation_input_tokens(self) -> int: ...


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


def price_of(model: str) -> Price | None:
    """The price of ``model`` (its longest matching prefix), or None when none matches."""
    matches = [prefix for prefix in PRICES if model.startswith(prefix)]
    return PRICES[max(matches, key=len)] if matches else None


def cost_usd(model: str, usage: TokenCounts) -> float | None:
    """The estimated cost of ``usage`` on ``model``, rounded to 1e-6 dollars."""
    price = price_of(model)
    if price is None:
        return None
    dollars = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_input_tokens * price.cache_read
        + usage.cache_creation_input_tokens * price.cache_write
    ) / 1_000_000
    return round(dollars, 6)
