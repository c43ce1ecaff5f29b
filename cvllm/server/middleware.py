"""aiohttp middlewares: OpenAI-shaped errors everywhere, and API-key authentication.

Installed by ``build_app`` on rank 0. ``error_middleware`` is outermost, so anything a
route or the auth check raises (ApiError, aiohttp's 404/405/413, or a bug) becomes a JSON
``{"error": {...}}`` answer and the server keeps serving.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Awaitable, Callable, Optional

from aiohttp import web

from cvllm.server.errors import ApiError, error_body

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Load balancers probe /health and Prometheus scrapes /metrics without credentials (as in
# vLLM); neither reveals prompts or outputs.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})

_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "invalid_request_error"}


def json_dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _ascii_dumps(obj: object) -> str:
    # Error messages may quote what a client sent; ASCII escapes can never fail to encode.
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def error_response(status: int, body: dict, headers: Optional[dict] = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers, dumps=_ascii_dumps)


def _http_exception_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status == 404:
        message = f"Not found: {request.method} {request.path}"
    elif exc.status == 405:
        message = f"Method {request.method} is not allowed on {request.path}"
    else:
        message = exc.text or exc.reason
    kind = _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500
                                 else "server_error")
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return error_response(exc.status, error_body(message, kind), headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.body())
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through untouched
            raise
        return _http_exception_response(request, exc)
    except ConnectionResetError:
        raise  # the client is gone; there is nobody to answer
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, error_body("Internal server error; see the server log.",
                                              "server_error"))


def auth_middleware(api_key: str):
    """Require ``Authorization: Bearer <api_key>`` on every path but PUBLIC_PATHS."""
    expected = api_key.encode("utf-8")

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in PUBLIC_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # compare_digest: the time taken must not reveal how much of the key matched.
            # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way.
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode("utf-8", "surrogateescape"), expected):
                raise ApiError(401, "Invalid or missing API key; send 'Authorization: "
                                    "Bearer <key>'.", type="authentication_error",
                               code="invalid_api_key")
        return await handler(request)

    return check_api_key
