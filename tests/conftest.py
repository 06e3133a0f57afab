"""Shared pytest fixtures: the tiny engine model, free TCP ports, the corpus, the vLLM interpreter.

Owns only fixtures that many test modules need; module-specific helpers live with their tests.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cache_root() -> Path:
    """Return where built test artefacts are kept between sessions."""
    env = os.environ.get("CHANDRAD_TEST_CACHE")
    return Path(env) if env else REPO_ROOT / ".tiny-model"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Idefics3 model directory, built once and reused across sessions."""
    return build_tiny_model(_cache_root() / "idefics3")


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function returning a currently free localhost TCP port."""
    return _free_port


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The shared test corpus: `../shared/corpus` beside the checkout, else /work/shared/corpus."""
    for candidate in (REPO_ROOT.parent / "shared" / "corpus", Path("/work/shared/corpus")):
        if (candidate / "MANIFEST.tsv").is_file():
            return candidate
    pytest.fail("test corpus not found: expected ../shared/corpus beside the repository")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter that can run `-m vllm.entrypoints.openai.api_server`."""
    if importlib.util.find_spec("vllm") is None:
        message = f"vllm is not installed for {sys.executable}; run scripts/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Path(sys.executable)
