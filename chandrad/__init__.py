"""chandrad: an OCR appliance daemon for the Chandra model.

The package root only carries the version; it does no work at import time.
"""

from __future__ import annotations

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION", "__version__"]
