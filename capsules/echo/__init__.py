"""The echo capsule: replies to each request on ``demo.v1.echo`` with ``{"echo": payload}``.

Try it with the supervisor running: ``astrid bus request demo.v1.echo '{"hi": 1}'``.
"""

from __future__ import annotations

from bus import PayloadTooLarge
from sage.capsule.context import CapsuleContext


async def run(ctx: CapsuleContext) -> None:
    requests = ctx.subscribe("demo.v1.echo")
    ctx.ready()
    async for request in requests:
        try:
            ctx.reply(request, {"echo": request.data()})
        except PayloadTooLarge as exc:
            # a bad request gets an answer that says so; it never crashes the capsule
            ctx.reply(request, {"error": str(exc)})
