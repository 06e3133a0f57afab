"""The model's own files on this host, and the image-token estimate from its patch size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chandrad import model_files
from chandrad.engine.profile import PROMPT_TOKENS, estimate_prompt_tokens


def _hub_cache(root: Path, repo: str, files: dict[str, str], commit: str = "a" * 40) -> Path:
    """A cache in huggingface_hub's layout, written by huggingface_hub's own code path."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return root


def test_cache_lookup_agrees_with_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import try_to_load_from_cache

    cache = _hub_cache(tmp_path, "datalab-to/chandra-ocr-2",
                       {"preprocessor_config.json": json.dumps({"patch_size": 16,
                                                                "merge_size": 2})})
    for name in ("preprocessor_config.json", "config.json"):
        theirs = try_to_load_from_cache("datalab-to/chandra-ocr-2", name, cache_dir=cache)
        ours = model_files.model_file("datalab-to/chandra-ocr-2", name, cache_dir=cache)
        assert (str(ours) if ours else None) == (theirs if isinstance(theirs, str) else None)


def test_qwen_patch_size_gives_pixels_per_token(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}))
    assert model_files.pixels_per_image_token(str(tmp_path)) == 32 * 32
    assert estimate_prompt_tokens(1024, 2048, 32 * 32) == PROMPT_TOKENS + 2048


def test_transformers5_nested_processor_config(tmp_path: Path) -> None:
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"patch_size": 14, "merge_size": 2}}))
    assert model_files.pixels_per_image_token(str(tmp_path)) == 28 * 28


@pytest.mark.parametrize("model", ["/nonexistent/model", "not-a-repo-id", "org/absent"])
def test_unknown_model_is_none(model: str) -> None:
    assert model_files.pixels_per_image_token(model) is None


def test_tiny_idefics3_has_no_patch_size(tiny_model_dir: Path) -> None:
    """Idefics3 counts tokens per tile: no patch size, the conservative default stays."""
    assert model_files.pixels_per_image_token(str(tiny_model_dir)) is None
