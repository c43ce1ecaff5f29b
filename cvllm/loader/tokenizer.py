"""The model's tokenizer as a ``transformers`` fast tokenizer with its chat template set.

HF folders load with ``AutoTokenizer``. For a GGUF file, transformers converts the
embedded vocabulary (BPE ``gpt2`` and SentencePiece ``llama`` kinds alike); that re-reads
the whole file and takes seconds, so the converted tokenizer is saved under
``<cvllm cache>/tokenizers/<key>/`` (key: the file's path, size and mtime, and the
transformers version) and later starts load it from there. The engine wraps the result.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from .cache import tokenizers_cache_dir
from .errors import ModelLoadError
from .gguf_config import meta
from .gguf_loader import open_gguf
from .hf_config import read_generation_config, token_ids

logger = logging.getLogger("cvllm.loader")

_DONE_MARK = "cvllm-complete"


def load_tokenizer(source: Any) -> Any:
    """Tokenizer for a ``ModelSource`` (``transformers.PreTrainedTokenizerBase`` subclass)."""
    if source.kind == "hf":
        return _from_folder(source.path)
    if source.tokenizer_path is not None:
        tok = _from_folder(source.tokenizer_path, warn_no_template=False)
    else:
        tok = _from_gguf(source.path)
    # Only re-read the GGUF's metadata (most of a second) when something is missing.
    if not tok.chat_template or tok.eos_token is None or tok.bos_token is None:
        reader = open_gguf(source.path)
        template = meta(reader, "tokenizer.chat_template", None)
        if not tok.chat_template and isinstance(template, str) and template:
            tok.chat_template = template
        _ensure_special_tokens(tok, meta(reader, "tokenizer.ggml.bos_token_id", None),
                               meta(reader, "tokenizer.ggml.eos_token_id", None))
    if not tok.chat_template:
        logger.warning("%s has no chat template; chat requests will fail", source.path)
    return tok


def _from_folder(folder: Path, warn_no_template: bool = True) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types (OSError, ValueError, ...)
        raise ModelLoadError(f"cannot load the tokenizer of {folder}: {e}") from e
    if not tok.is_fast:
        logger.warning("the tokenizer of %s is not a fast tokenizer; detokenizing will be slower",
                       folder)
    if warn_no_template and not tok.chat_template:
        logger.warning("%s has no chat template; chat requests will fail", folder)
    _ensure_folder_special_tokens(tok, folder)
    return tok


def _ensure_folder_special_tokens(tok: Any, folder: Path) -> None:
    gen = read_generation_config(folder)
    eos = token_ids(gen.get("eos_token_id"))
    _ensure_special_tokens(tok, gen.get("bos_token_id"), eos[0] if eos else None)


def _ensure_special_tokens(tok: Any, bos_id: Any, eos_id: Any) -> None:
    """Fill in a missing bos/eos token from the model's ids; the engine's stop logic and
    chat templates (``eos_token`` variable) depend on them."""
    size = len(tok)
    if tok.eos_token is None and isinstance(eos_id, int) and 0 <= eos_id < size:
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    if tok.bos_token is None and isinstance(bos_id, int) and 0 <= bos_id < size:
        tok.bos_token = tok.convert_ids_to_tokens(bos_id)


def tokenizer_cache_key(path: Path) -> str:
    import transformers

    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _from_gguf(path: Path, cache_dir: Optional[Path] = None) -> Any:
    from transformers import AutoTokenizer

    cache = (cache_dir or tokenizers_cache_dir()) / tokenizer_cache_key(path)
    if (cache / _DONE_MARK).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception as e:  # a damaged cache entry: rebuild it below
            logger.warning("ignoring the damaged tokenizer cache %s: %s", cache, e)
    logger.info("converting the tokenizer embedded in %s (cached for next time)", path.name)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF metadata of {path}: "
                             f"{e}") from e
    _save_atomically(tok, cache)
    return tok


def _save_atomically(tok: Any, cache: Path) -> None:
    """Save into a temporary folder and rename it into place: concurrent ranks either see
    a complete entry or none. A failure to cache only costs speed next time."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
    except OSError as e:
        logger.warning("cannot cache the tokenizer in %s: %s", cache.parent, e)
        return
    try:
        tok.save_pretrained(str(tmp))
        (tmp / _DONE_MARK).write_text("ok\n")
        if (cache / _DONE_MARK).is_file():
            return  # another rank won the race
        if cache.exists():
            shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except OSError as e:
        logger.warning("cannot cache the tokenizer in %s: %s", cache, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
