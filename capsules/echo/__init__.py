"""The echo capsule: replies to each request on ``demo.v1.echo`` with ``{"echo": payload}``.

Try it with the supervisor running: ``astrid bus request demo.v1.echo '{"hi": 1}'``.
"""

from __future__ import annotations

from sage.capsules import CapsuleContext


async def run(ctx: CapsuleContext) -> None:
    with ctx.subscribe("demo.v1.echo") as requests:
        async for request in requests:
            ctx.reply(request, {"echo": request.data()})
