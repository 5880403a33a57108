"""Where a model argument points: a local directory, a default model's name, or a Hugging Face Hub id.

`resolve_model` keeps an existing directory as it is; a name of `nanovllm fetch` (smollm2-135m, ...) is
fetched into nanovllm's cache; anything shaped like `org/name` is a Hub id, downloaded with
huggingface_hub's `snapshot_download` into its cache (or `download_dir`), weights as safetensors plus
config and tokenizer files only. With HF_HUB_OFFLINE=1 the cache alone is looked at.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local HF-format directory of `model`; FileNotFoundError saying why there is none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from nanovllm.models.fetch import MODELS, fetch_model

    if model in MODELS:
        return fetch_model(model)
    if HUB_ID.match(model) and not path.exists():
        return download(model, revision, download_dir)
    raise FileNotFoundError(f"model directory {model!r} does not exist")


def hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def download(repo_id: str, revision: str | None, cache_dir: str | None) -> Path:
    """A snapshot of the Hub repository in the hub cache, downloaded unless it is there (offline: only there)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = hub_offline()
    what = f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                      allow_patterns=ALLOW_PATTERNS, local_files_only=offline))
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as e:
        raise FileNotFoundError(f"{what} is not a local directory, and the Hugging Face Hub refused it: "
                                f"{str(e).splitlines()[0]}") from e
    except errors.LocalEntryNotFoundError as e:
        if offline:
            raise FileNotFoundError(f"{what} is not a local directory, and HF_HUB_OFFLINE is set but the hub cache "
                                    f"{cache} holds no snapshot of it: download it once online, or pass its "
                                    "directory") from e
        raise FileNotFoundError(f"{what} is not a local directory and the Hugging Face Hub cannot be reached "
                                f"({e.__cause__!r}): check the network, or set HF_HUB_OFFLINE=1 with the model "
                                f"in the hub cache {cache}") from e
