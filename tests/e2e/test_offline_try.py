"""The README's offline walk: the real CLI against `make standin`'s model greets Ada
through the greeter capsule and echoes a prompt, with no key and no network."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.echo_model import reply_to
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Standin

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture
async def sage(claude_bin: Path, standin: Standin) -> AsyncIterator[Sage]:
    standin.responder = reply_to
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "greeter"]',
        principal_extra='allowed_tools = ["mcp__sage__greet"]\n',
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-offline-try"}) as running:
        yield running


async def test_the_offline_model_greets_through_the_capsule_and_echoes(sage: Sage) -> None:
    events = await sage.ready("walk")
    await sage.send("walk", "greet Ada with the greet tool")
    text, done = await events.text_until_done(within=60.0)
    assert text == "Hello, Ada!", done
    await sage.send("walk", "hello there")
    text, _ = await events.text_until_done(within=60.0)
    assert text == "echo: hello there"
