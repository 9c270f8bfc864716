"""Find a checkpoint: a local directory, or a Hugging Face repo id fetched into (or
found in) the local Hugging Face cache."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

# Everything a checkpoint needs, nothing executable or pickled (*.py, *.bin, *.pt).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
CONFIG_FILE = "config.json"


def resolve_checkpoint(source: str, revision: str | None = None, local_files_only: bool = False) -> Path:
    """The directory holding checkpoint `source`.

    An existing directory is used as it is (it must hold config.json). Anything else
    must be a repo id ("org/name"): it is downloaded with a progress bar, or, when
    `local_files_only` or HF_HUB_OFFLINE is set, looked up in the cache only.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise CheckpointError(f"{path}: not a checkpoint directory (no {CONFIG_FILE})")
        return path.absolute()
    if path.exists():
        raise CheckpointError(f"{path}: is a file; a checkpoint is a directory holding {CONFIG_FILE}")
    _check_repo_id(source)
    offline = local_files_only or _env_true("HF_HUB_OFFLINE")
    snapshot = Path(_snapshot_download(source, revision, offline))
    if not (snapshot / CONFIG_FILE).is_file():
        raise CheckpointError(f"{source} (revision {revision or 'main'}): no {CONFIG_FILE} in the repository")
    return snapshot


def _check_repo_id(source: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") != 1
    try:
        validate_repo_id(source)
    except HFValidationError:
        looks_like_path = True
    if looks_like_path:
        raise CheckpointError(
            f"{source}: neither an existing checkpoint directory nor a Hugging Face repo id (org/name)"
        )


def _snapshot_download(repo_id: str, revision: str | None, offline: bool) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    if not offline and are_progress_bars_disabled() and constants.HF_HUB_DISABLE_PROGRESS_BARS is None:
        enable_progress_bars()  # someone turned them off in code; the user did not ask for that
    name = f"{repo_id} (revision {revision or 'main'})"
    try:
        return snapshot_download(
            repo_id, revision=revision, local_files_only=offline, allow_patterns=ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError as e:
        if offline:
            raise CheckpointError(
                f"{name}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and downloading is "
                "off (HF_HUB_OFFLINE is set or --local-files-only was given). Download it first while "
                f"online (e.g. `hf download {repo_id}`, or run once without HF_HUB_OFFLINE and "
                "--local-files-only), or pass a local checkpoint directory."
            ) from None
        raise CheckpointError(f"{name}: cannot reach the Hugging Face Hub and it is not cached ({e})") from None
    except HfHubHTTPError as e:  # repository or revision not found, gated, server errors
        raise CheckpointError(f"{name}: {type(e).__name__}: {e}") from None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
