"""The served model's own files on this host: a local directory or the Hugging Face cache.

Owns finding one file of ``engine.model`` without downloading anything, and what
chandrad reads from them: the image processor's patch size, from which the number of
image tokens a page costs follows. Nothing here raises for a missing or unreadable
file: that is "unknown" (``None``), and callers keep their conservative default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Where transformers keeps the image processor's settings (4.x, then 5.x's nested form).
_PROCESSOR_FILES = (
    ("preprocessor_config.json", None),
    ("processor_config.json", "image_processor"),
)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub resolves it (``HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def model_file(model: str, filename: str, *, cache_dir: Path | None = None,
               revision: str = "main") -> Path | None:
    """``filename`` of ``model`` (a local directory, or a hub id in the HF cache), or None.

    Reads the cache layout that huggingface_hub writes (``models--org--name/refs/<rev>``
    → ``snapshots/<commit>/<file>``) without importing it: huggingface_hub costs the
    daemon ~20 MB resident. tests/test_model_files.py checks both agree.
    """
    local = Path(model)
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    if model.count("/") != 1 or model.startswith(("/", ".")):
        return None
    repo = (cache_dir or hub_cache_dir()) / ("models--" + model.replace("/", "--"))
    try:
        commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        commit = revision  # a commit hash given as the revision
    path = repo / "snapshots" / commit / filename
    return path if path.is_file() else None


def _image_processor(model: str) -> dict[str, Any] | None:
    for filename, key in _PROCESSOR_FILES:
        path = model_file(model, filename)
        if path is None:
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        section = data.get(key) if key else data
        if isinstance(section, dict):
            return section
    return None


def pixels_per_image_token(model: str) -> int | None:
    """Pixels of the page per image token: ``(patch_size × merge_size)²``.

    Qwen-VL family processors (chandra-ocr-2 is Qwen3.5: 16 px patches merged 2×2, so
    one token per 32×32 px). ``None`` when the model's processor config is not on this
    host or has no patch size (an Idefics3 processor counts tokens per tile instead).
    """
    processor = _image_processor(model)
    if processor is None:
        return None
    patch = processor.get("patch_size")
    merge = processor.get("merge_size", processor.get("spatial_merge_size", 1))
    if isinstance(patch, dict):  # some processors write {"height": 16, "width": 16}
        patch = patch.get("height")
    if not isinstance(patch, int) or not isinstance(merge, int) or patch <= 0 or merge <= 0:
        return None
    return (patch * merge) ** 2
