"""The served model's own files on this host: a local directory or the Hugging Face cache.

Owns finding one file of ``engine.model`` without downloading anything, and what
chandrad reads from them: the image processor's patch size, from which the number of
image tokens a page costs follows, and for the memory plan (``engine/planner.py``) the
``config.json``, the image processor's settings and the weights' bytes by dtype (from the
safetensors headers only). Nothing here raises for a missing or unreadable
file: that is "unknown" (``None``), and callers keep their conservative default.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chandrad.engine import planner

#: Where transformers keeps the image processor's settings (4.x, then 5.x's nested form).
_PROCESSOR_FILES = (
    ("preprocessor_config.json", None),
    ("processor_config.json", "image_processor"),
)


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache, as huggingface_hub resolves it from ``env`` (default:
    this process's): ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
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


def is_available(model: str, *, cache_dir: Path | None = None) -> bool:
    """Whether the engine can load ``model`` without the network: a local directory, or a
    hub id whose snapshot in the HF cache has its ``config.json`` and every weight shard
    its index names."""
    if Path(model).is_dir():
        return True
    config = model_file(model, "config.json", cache_dir=cache_dir)
    if config is None:
        return False
    index = config.with_name("model.safetensors.index.json")
    if not index.is_file():
        return any(config.parent.glob("*.safetensors")) or any(config.parent.glob("*.bin"))
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    return all((config.parent / shard).is_file() for shard in shards)


def model_config(model: str, *, cache_dir: Path | None = None) -> dict[str, Any] | None:
    """``model``'s ``config.json``, or None when it is not on this host or unreadable."""
    path = model_file(model, "config.json", cache_dir=cache_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


#: A safetensors header larger than this is not one (the format's own limit is 100 MB).
_MAX_HEADER = 100_000_000


def weight_bytes(model: str, *, cache_dir: Path | None = None) -> dict[str, int] | None:
    """Bytes of ``model``'s weights by safetensors dtype (``{"BF16": n, ...}``), read from each
    shard's header only (8-byte length, then JSON with each tensor's ``data_offsets``).
    None when a shard is missing or not safetensors."""
    config = model_file(model, "config.json", cache_dir=cache_dir)
    if config is None:
        return None
    index = config.with_name("model.safetensors.index.json")
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                .values()))
        else:
            shards = sorted(p.name for p in config.parent.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    if not shards:
        return None
    totals: dict[str, int] = {}
    for shard in shards:
        try:
            with (config.parent / shard).open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                if length > _MAX_HEADER:
                    return None
                header = json.loads(fh.read(length))
        except (OSError, ValueError, struct.error):
            return None
        for name, tensor in header.items():
            if name != "__metadata__" and isinstance(tensor, dict):
                start, end = tensor["data_offsets"]
                totals[tensor["dtype"]] = totals.get(tensor["dtype"], 0) + end - start
    return totals


def image_processor(model: str) -> dict[str, Any] | None:
    """The image processor's settings of ``model`` (transformers 4.x or 5.x file), or None."""
    return _image_processor(model)


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


def planner_shape(model: str, max_pixels: int | None = None, *,
                  cache_dir: Path | None = None) -> planner.ModelShape | None:
    """``model``'s shape for the memory plan (config, processor, weight bytes), or None when
    its config or weights are not on this host. ``max_pixels``: the engine's
    ``mm_processor_kwargs`` bound, when it narrows the processor's."""
    config = model_config(model, cache_dir=cache_dir)
    weights = weight_bytes(model, cache_dir=cache_dir)
    if config is None or weights is None:
        return None
    return planner.model_shape(config, sum(weights.values()), _image_processor(model),
                               max_pixels)
