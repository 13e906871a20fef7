"""Who may ask, and how much: the API key and the body limit of a ServerConfig, checked the same
way by ``serve``'s public front (``front.py``) and by the app it relays to (``app.py``); and how
both answer what no route takes."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .config import ServerConfig
from .openai_schema import ApiError, error_body

# A body over the limit is still read (up to this much) before answering 413: closing the
# connection while the client is still sending makes it see a reset instead of the error body.
DRAIN_CAP = 32 << 20


def authorize(request: Request, config: ServerConfig) -> None:
    """ApiError 401 unless the request carries the server's key (when it has one)."""
    if config.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             config.api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def read_body(request: Request, config: ServerConfig) -> bytes:
    """The whole body; ApiError 413 when it is over ``config.max_body_bytes``. Starlette's
    ClientDisconnect passes through (the client left while sending)."""
    limit = config.max_body_bytes
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} "
                            "bytes (--max-body-bytes)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_CAP:
        raise too_big
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > DRAIN_CAP:
            raise too_big
        if size <= limit:
            parts.append(part)
    if size > limit:
        raise too_big
    return b"".join(parts)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and wrong methods, answered in OpenAI's error shape too (its clients parse
    that into their exception's message)."""
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                        status_code=exc.status_code, headers=exc.headers)
