"""The ``learned_profiles`` table: the engine profile that proved stable, per key.

The key (``engine/learned``) names everything that changes which profile works: model,
vLLM version, GPU name and count. Profiles belong to the host whose GPUs proved them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from chandrad.store.database import SqlDatabase


class ProfileTable:
    """Learned engine profiles by key."""

    def __init__(self, db: SqlDatabase) -> None:
        self._db = db

    def save(self, key: str, profile: dict[str, Any]) -> None:
        """Store the profile that proved stable for ``key`` (model, vLLM, GPU name, count)."""
        with self._db.tx() as c:
            c.execute(
                "INSERT INTO learned_profiles (key, profile_json, saved_at) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET profile_json = excluded.profile_json, "
                "saved_at = excluded.saved_at",
                (key, json.dumps(profile, sort_keys=True), time.time()),
            )

    def load(self, key: str) -> dict[str, Any] | None:
        """The learned profile for ``key``, or ``None``."""
        row = self._db.conn.execute(
            "SELECT profile_json FROM learned_profiles WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        data = json.loads(row[0])
        return data if isinstance(data, dict) else None

    def saved_at(self, key: str) -> float | None:
        """Wall-clock time the learned profile for ``key`` was last saved, or ``None``."""
        row = self._db.conn.execute(
            "SELECT saved_at FROM learned_profiles WHERE key = ?", (key,)).fetchone()
        return None if row is None else float(row[0])
