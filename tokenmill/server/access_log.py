"""`--access-log`: one line per HTTP request, written when its response has been sent.

    127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt_tokens=23 completion_tokens=16 1.234s

Token counts appear for generation requests (the handlers record them with `record_usage`);
`-` stands for a status never sent (the client left first). Lines go to the `tokenmill.access`
logger at INFO.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("tokenmill.access")
_USAGE_KEY = "tokenmill.usage"


def record_usage(scope: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    """Called by a handler once it knows its request's token counts."""
    scope.setdefault("state", {})[_USAGE_KEY] = (prompt_tokens, completion_tokens)


class AccessLogMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: int | None = None

        async def observe(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            usage = scope.get("state", {}).get(_USAGE_KEY)
            tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
            logger.info('%s "%s %s" %s%s %.3fs', where, scope["method"], scope["path"],
                        "-" if status is None else status, tokens, time.monotonic() - started)
