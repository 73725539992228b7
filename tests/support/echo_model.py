"""A model to try sage with, offline: the Messages API stand-in with a tiny policy.

``make standin`` (``python -m tests.support.echo_model --port 8765``) serves it on
127.0.0.1 until Ctrl-C.  Point sessions at it with ``[claude] env`` (README, "Trying it
without an API key") and the README's walk runs without a key or a network:

- a prompt that asks to greet someone, in a request that offers a tool whose name ends
  in ``greet`` (the built-in greeter capsule's ``mcp__sage__greet``), gets a call of that
  tool for the name after "greet" (``Ada`` when there is none);
- a request that carries tool results gets their text back;
- anything else gets ``echo: <the prompt>``.

It is not a model: it never reads more than the last user message.  The tests use the
same :class:`~tests.support.standin.Standin` with scripted replies; this module only adds
:func:`reply_to` (pure, tested without I/O) and a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
from typing import Any

from tests.support.standin import Recorded, Reply, Standin, Text, ToolUse

__all__ = ("prompt_of", "reply_to")

_GREET = re.compile(r"\bgreet\b(?:\s+([A-Za-z][\w-]*))?", re.IGNORECASE)
_NOT_A_NAME = frozenset({"with", "the", "using", "someone", "by", "via"})


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]


def prompt_of(request: Recorded) -> str:
    """The last user message's own text: its text blocks without the CLI's
    ``<system-reminder>`` blocks."""
    message = request.last_user_message or {}
    texts = [t for t in _texts(message.get("content")) if not t.startswith("<system-reminder>")]
    return "\n".join(texts).strip()


def reply_to(request: Recorded) -> Reply:
    """What the offline model answers ``request`` (see the module docstring)."""
    results = request.tool_results()
    if results:
        said = [t for block in results for t in _texts(block.get("content"))]
        return Text("\n".join(said) or "(the tool said nothing)")
    prompt = prompt_of(request)
    greeters = [name for name in request.live_tool_names if name.endswith("greet")]
    found = _GREET.search(prompt)
    if found and greeters:
        name = found.group(1) or ""
        if not name or name.lower() in _NOT_A_NAME:
            name = "Ada"
        return ToolUse(greeters[0], {"name": name})
    return Text(f"echo: {prompt}")


async def _serve(port: int) -> None:
    standin = Standin(responder=reply_to)
    await standin.start(port=port)
    print(standin.url, flush=True)
    print(
        "sessions reach it with, in your config:\n"
        "  [claude]\n"
        f'  env = {{ ANTHROPIC_BASE_URL = "{standin.url}", '
        'CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC = "1" }\n'
        "(any API key of 8 characters or more will do; Ctrl-C stops it)",
        file=sys.stderr,
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await standin.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.echo_model",
        description="Serve an offline stand-in for the Messages API on 127.0.0.1: it echoes "
        "prompts and calls a *greet tool when asked to greet someone. Prints its URL.",
    )
    parser.add_argument(
        "--port", type=int, default=8765, help="port on 127.0.0.1 (0: any free one)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: not a port (0-65535)")
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(_serve(args.port))
        except OSError as exc:
            print(f"echo_model: cannot listen on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
