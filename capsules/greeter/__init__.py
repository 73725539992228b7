"""The greeter capsule: the smallest tool capsule, written with ``sage.capsule.sdk``.

Its manifest's ``entry`` is this module, so the supervisor serves the
``@tool`` functions below.  ``greet`` answers with text; ``shout`` refuses
an empty text with a :class:`~sage.capsule.sdk.ToolError`, which Claude sees as an
``isError`` result.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from sage.capsule.sdk import ToolError, tool


class GreetArgs(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(description="Who to greet.")]


class ShoutArgs(msgspec.Struct):
    text: Annotated[str, msgspec.Meta(description="What to shout; not empty.")]


@tool("greet")
async def greet(args: GreetArgs) -> str:
    """Greet a person by name."""
    return f"Hello, {args.name}!"


@tool("shout")
async def shout(args: ShoutArgs) -> str:
    """Repeat a text in capitals, with an exclamation mark."""
    if not args.text.strip():
        raise ToolError("there is nothing to shout: text is empty")
    return f"{args.text.upper()}!"
