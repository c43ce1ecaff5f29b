"""Reading a request body: bytes -> a JSON object of valid Unicode text, or a 400.

Called by the handlers once per HTTP request (rank 0, event-loop thread) before any
endpoint-specific parsing; it knows nothing of aiohttp, so it is tested with plain bytes.
"""

from __future__ import annotations

import json
import re
from typing import Any, List, Optional

from cvllm.server.errors import ApiError


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body; anything but a JSON object of valid Unicode text is a 400.

    Invalid UTF-8 (as OpenAI does) and lone UTF-16 surrogates are refused rather than
    replaced: a replacement would silently change the prompt, and a surrogate cannot be
    encoded for the tokenizer, a log line or a response.
    """
    if not raw:
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"The request body is not valid UTF-8 (at byte {exc.start}).") \
            from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    # After a strict decode only a \uD800-\uDFFF escape can make a surrogate.
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_at(body)
        if where is not None:
            raise ApiError(400, f"'{where}' contains a lone UTF-16 surrogate (an unpaired "
                                f"\\ud800-\\udfff escape); send valid Unicode text.",
                           param=where, code="invalid_unicode")
    return body


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(body: dict) -> Optional[str]:
    """The path (``messages[0].content``) of the first string or key holding a surrogate."""
    stack: List[tuple] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                key_path = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):  # shown escaped: the path is echoed back
                    return key_path.encode("utf-8", "backslashreplace").decode("utf-8")
                stack.append((key_path, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
