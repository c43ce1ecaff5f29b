"""``GET /v1/models``: the model card and model list bodies."""

from __future__ import annotations

from typing import Sequence


def model_card(model_id: str, max_model_len: int, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "cvllm",
            "max_model_len": max_model_len}


def model_list(cards: Sequence[dict]) -> dict:
    return {"object": "list", "data": list(cards)}
