"""Which model to serve: the ``--w`` / ``--f`` / ``--m`` flags resolved to files on disk.

``resolve_model_source`` is called by the CLI on every rank (the Hub and the default-model
cache tolerate concurrent callers) and returns a ``ModelSource``, the boundary object every
other loader function takes. Flags follow candle-vllm:

- ``--w FOLDER``: a Hugging Face folder (config.json + *.safetensors), or a folder that holds
  exactly one .gguf file;
- ``--f FILE.gguf``: a GGUF file; with ``--w`` the file may be named relative to that folder,
  and the folder's tokenizer / generation config are used in place of the GGUF's own;
- ``--m ORG/NAME``: a Hub model id, downloaded (or found in the HF cache); with ``--f`` the
  named GGUF file of that repository;
- nothing: the default model (SmolLM2-135M-Instruct GGUF).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Union

from .default_model import default_model_path
from .errors import ModelLoadError

logger = logging.getLogger("cvllm.loader")

PathLike = Union[str, Path]
# Enough to serve a model; skips duplicate *.bin / *.pth / *.gguf weights in HF repos.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken",
                "merges.txt", "vocab.txt"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location."""

    kind: str
    """``hf`` (``path`` is a folder) or ``gguf`` (``path`` is a .gguf file)."""
    path: Path
    tokenizer_path: Optional[Path] = None
    """For ``gguf``: an HF folder whose tokenizer and generation config override the
    GGUF's embedded ones (``--w`` next to ``--f``); None to use the GGUF's."""

    def __post_init__(self) -> None:
        if self.kind not in ("hf", "gguf"):
            raise ValueError(f"ModelSource.kind must be 'hf' or 'gguf', got {self.kind!r}")
        object.__setattr__(self, "path", Path(self.path))
        if self.tokenizer_path is not None:
            object.__setattr__(self, "tokenizer_path", Path(self.tokenizer_path))

    @property
    def name(self) -> str:
        """A short display name: the folder name or the GGUF file's stem."""
        return self.path.name if self.kind == "hf" else self.path.stem


def resolve_model_source(weight_path: Optional[PathLike] = None,
                         weight_file: Optional[PathLike] = None,
                         model_id: Optional[str] = None) -> ModelSource:
    """Turn the model flags into a ``ModelSource``; raise ModelLoadError if they can't be."""
    if model_id:
        if weight_path:
            raise ModelLoadError("give either --m (a Hub model id) or --w (a local folder), "
                                 "not both")
        if weight_file:
            if Path(weight_file).expanduser().is_file():
                raise ModelLoadError(f"--f {weight_file} is a local file; drop --m to serve it, "
                                     "or give --f as a file name inside the --m repository")
            return ModelSource("gguf", _hub_file(model_id, str(weight_file)))
        return _folder_source(_hub_snapshot(model_id))
    if weight_file:
        return _file_source(Path(weight_file).expanduser(),
                            Path(weight_path).expanduser() if weight_path else None)
    if weight_path:
        p = Path(weight_path).expanduser()
        return _file_source(p, None) if p.is_file() else _folder_source(p)
    return ModelSource("gguf", default_model_path())


def _file_source(file: Path, folder: Optional[Path]) -> ModelSource:
    if folder is not None and not folder.is_dir():
        raise ModelLoadError(f"--w {folder} is not a folder")
    if folder is not None and not file.is_absolute() and (folder / file).is_file():
        file = folder / file  # candle-vllm style: --w folder --f name-in-folder.gguf
    if not file.is_file():
        raise ModelLoadError(f"model file {file} does not exist")
    if file.suffix.lower() != ".gguf":
        raise ModelLoadError(f"--f expects a .gguf file, got {file}; "
                             "pass a Hugging Face folder with --w instead")
    tok = folder if folder is not None and _has_tokenizer(folder) else None
    if folder is not None and tok is None:
        logger.warning("--w %s has no tokenizer files; using the tokenizer inside %s",
                       folder, file.name)
    return ModelSource("gguf", file, tok)


def _folder_source(folder: Path) -> ModelSource:
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder")
    has_config = (folder / "config.json").is_file()
    ggufs = sorted(folder.glob("*.gguf"))
    if has_config and (any(folder.glob("*.safetensors")) or not ggufs):
        return ModelSource("hf", folder)
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], folder if _has_tokenizer(folder) else None)
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs[:6])
        raise ModelLoadError(f"{folder} holds several GGUF files ({names}); choose one with --f")
    raise ModelLoadError(f"{folder} has no config.json and no .gguf file; "
                         "it is not a Hugging Face model folder")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in TOKENIZER_FILES)


def _hub_snapshot(model_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(_hub_call(model_id, partial(snapshot_download, model_id,
                                            allow_patterns=HUB_PATTERNS)))


def _hub_file(model_id: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(_hub_call(model_id, partial(hf_hub_download, model_id, filename), filename))


def _hub_call(model_id: str, fetch: Callable[[], str], filename: Optional[str] = None) -> str:
    """Run a Hub download, turning the hub's exceptions into messages a user can act on."""
    from huggingface_hub import errors as hub

    what = f"{filename} from {model_id}" if filename else model_id
    logger.info("fetching %s from the Hugging Face Hub (or its local cache)", what)
    try:
        return fetch()
    except hub.LocalEntryNotFoundError as e:
        raise ModelLoadError(f"cannot download {what}: offline and not in the Hugging Face cache "
                             f"({str(e).splitlines()[0]})") from e
    except hub.GatedRepoError as e:
        raise ModelLoadError(f"cannot download {model_id}: the repository is gated; accept its "
                             "license on huggingface.co and set HF_TOKEN") from e
    except hub.RepositoryNotFoundError as e:
        raise ModelLoadError(f"cannot download {model_id}: no such model on the Hugging Face Hub "
                             "(or it is private: set HF_TOKEN)") from e
    except hub.RevisionNotFoundError as e:
        raise ModelLoadError(f"cannot download {model_id}: revision not found") from e
    except hub.EntryNotFoundError as e:
        raise ModelLoadError(f"cannot download {what}: no such file in the repository") from e
    except (hub.HfHubHTTPError, hub.HFValidationError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot download {what}: {e}") from e
