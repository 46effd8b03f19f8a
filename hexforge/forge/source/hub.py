"""A Hugging Face hub id (``ORG/NAME``) as a checkpoint: the files a build reads, through
huggingface_hub's own cache.

    Qwen/Qwen3-0.6B ──snapshot_download(allow_patterns=CHECKPOINT_FILES)──▶
        $HF_HUB_CACHE/models--Qwen--Qwen3-0.6B/snapshots/<commit>/  (an ordinary checkpoint dir)

huggingface_hub decides everything a user already configured for it: the cache (``HF_HOME``,
``HF_HUB_CACHE``), the token, the endpoint, and ``HF_HUB_OFFLINE=1``, under which only the cache
is read. Only what a build reads is fetched: no pickle weights, no GGUF or ONNX copies.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...bundle.errors import CheckpointError

# config, weights, tokenizer, generation defaults, chat template, media processor configs
CHECKPOINT_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
]
# the hub's repo id grammar: an owner and a name of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def is_hub_id(path: str | Path) -> bool:
    """Whether ``path`` names a hub repo: ``ORG/NAME`` and nothing on disk by that name."""
    s = str(path)
    return bool(_HUB_ID.fullmatch(s)) and not s.endswith((".gguf", ".")) and not Path(s).exists()


def hub_checkpoint(repo_id: str, log=None) -> Path:
    """The snapshot dir of ``repo_id`` in the HF cache, downloaded first where it is missing (and
    the hub reachable); any failure is a one-line CheckpointError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        where = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
                 else "the hub cannot be reached")
        raise CheckpointError(
            f"{repo_id} is not a local path, and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) while {where}: "
            f"run `hf download {repo_id}` where the hub is reachable, or give a local "
            "checkpoint dir") from None
    except GatedRepoError:
        raise CheckpointError(f"{repo_id} is gated: accept its license on huggingface.co and log "
                              "in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id} is not a model repository on the hub (a private one "
                              "needs `hf auth login`)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id} has no such revision on the hub") from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"{repo_id}: the hub answered {' '.join(str(e).split())}") from None
    if log:
        log(f"{repo_id}: {snapshot} (the Hugging Face cache)")
    return snapshot
