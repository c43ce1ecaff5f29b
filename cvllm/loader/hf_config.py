"""Reading a Hugging Face model folder's JSON files: config.json and generation_config.json.

Also the one place that normalises config dialects, so model code reads a single spelling:
transformers 5 writes ``rope_parameters`` where older files have ``rope_theta`` and
``rope_scaling``; after ``normalize_rope`` every config has ``rope_scaling`` (None for plain
RoPE, otherwise a dict with ``rope_type``) and, when the file gives a theta, ``rope_theta``
and ``rope_parameters``. GGUF configs built by ``gguf_config`` go through the same function.
Multimodal configs get their ``text_config`` lifted to the top level (``lift_text_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from .errors import ModelLoadError

# A config or index JSON larger than this is not a config; refuse before reading it all.
MAX_JSON_BYTES = 64 << 20
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_json(path: Path, what: str) -> Dict[str, Any]:
    """Parse a JSON object from ``path``; any problem becomes a ModelLoadError naming it."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelLoadError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if size > MAX_JSON_BYTES:
        raise ModelLoadError(f"{what} {path} is {size} bytes, more than the "
                             f"{MAX_JSON_BYTES} allowed")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_JSON_BYTES + 1))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} must hold a JSON object, not {type(data).__name__}")
    return data


def read_hf_config(folder: Path) -> Dict[str, Any]:
    """config.json of a model folder, rope fields normalised."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    cfg = read_json(path, "model config")
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ModelLoadError(f"{path} has no 'architectures' list naming the model class")
    return normalize_rope(lift_text_config(cfg))


def lift_text_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Multimodal configs (e.g. Gemma3ForConditionalGeneration) keep the language model's
    settings under ``text_config``; cvllm serves only that model, so copy them to the top
    level (in place) where the config has no text settings of its own. Top-level keys
    (``architectures``, ``tie_word_embeddings``) win."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in cfg:
        for key, value in text.items():
            cfg.setdefault(key, value)
    return cfg


def read_generation_config(folder: Optional[Path]) -> Dict[str, Any]:
    """generation_config.json of a model folder, or {} when the folder has none."""
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    return read_json(path, "generation config")


def token_ids(value: Any) -> List[int]:
    """An ``eos_token_id``-style value (int, list of ints or None) as a list of ids."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def merge_ids(*groups: List[int]) -> List[int]:
    """Union of id lists, first-seen order kept (the first eos is the 'main' one)."""
    out: List[int] = []
    for group in groups:
        out.extend(i for i in group if i not in out)
    return out


def sampling_defaults(gen: Dict[str, Any]) -> Dict[str, Any]:
    """The model author's default sampling values from a generation config."""
    out: Dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        v = gen.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[key] = int(v) if key == "top_k" else float(v)
    return out


def normalize_rope(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Give ``cfg`` ``rope_scaling`` and, when the theta is known, ``rope_theta`` and
    ``rope_parameters`` (in place)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and "rope_theta" not in cfg and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
    if scaling is None and isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        # Old configs say "type"; newer ones "rope_type".
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    else:
        scaling = None
    cfg["rope_scaling"] = scaling
    # No default theta here: the model family's own default applies (rule 10).
    if not isinstance(params, dict) and "rope_theta" in cfg:
        rope = scaling or {"rope_type": "default"}
        cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], **rope}
    return cfg
