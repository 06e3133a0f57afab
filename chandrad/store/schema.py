"""The SQLite schema: its migrations by version, and running them at open.

The schema of record is ``MIGRATIONS``: version N is reached by running ``MIGRATIONS[N - 1]``
in one transaction, and ``schema_version`` holds the version reached. A database newer
than this chandrad is refused, never downgraded.
"""

from __future__ import annotations

import sqlite3

from chandrad.errors import InternalError
from chandrad.store.database import Database

#: Schema migrations by version; version N is reached by running MIGRATIONS[N - 1].
#: Append only: never edit a released step, add a new one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        watch_index INTEGER NOT NULL,
        input_root TEXT NOT NULL,
        path TEXT NOT NULL,
        abs_path TEXT NOT NULL,
        size INTEGER NOT NULL,
        mtime REAL NOT NULL,
        sha256 TEXT NOT NULL,
        state TEXT NOT NULL,
        pages_total INTEGER,
        attempts INTEGER NOT NULL DEFAULT 0,
        error_code TEXT,
        error_message TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        output_dir TEXT,
        final_path TEXT
    );
    CREATE INDEX jobs_by_state ON jobs (state, id);
    CREATE INDEX jobs_by_path ON jobs (abs_path, state);
    CREATE INDEX jobs_by_hash ON jobs (sha256, state);
    CREATE TABLE pages (
        job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        page_index INTEGER NOT NULL,
        state TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        releases INTEGER NOT NULL DEFAULT 0,
        width INTEGER,
        height INTEGER,
        result_json TEXT,
        error TEXT,
        seconds REAL,
        started_at REAL,
        finished_at REAL,
        PRIMARY KEY (job_id, page_index)
    ) WITHOUT ROWID;
    CREATE INDEX pages_by_state ON pages (state);
    CREATE INDEX pages_done_at ON pages (finished_at) WHERE state = 'done';
    CREATE TABLE learned_profiles (
        key TEXT PRIMARY KEY,
        profile_json TEXT NOT NULL,
        saved_at REAL NOT NULL
    );
    """,
    # 2: jobs find their watch by input folder; list the folders with work quickly.
    """
    CREATE INDEX jobs_by_root ON jobs (input_root, state);
    """,
    # 3: paths as exact bytes (BLOB), so names that are not valid UTF-8 fit.
    """
    UPDATE jobs SET input_root = CAST(input_root AS BLOB), path = CAST(path AS BLOB),
        abs_path = CAST(abs_path AS BLOB), output_dir = CAST(output_dir AS BLOB),
        final_path = CAST(final_path AS BLOB)
    """,
    # 4: jobs and pages per state kept by triggers, so counts() (the status line, every
    # main-loop tick) and page_counts() (every metrics scrape) read a handful of rows
    # instead of an index scan over every job and page ever accepted (a 10,000-file backlog).
    """
    CREATE TABLE job_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO job_counts (state, n) SELECT state, COUNT(*) FROM jobs GROUP BY state;
    CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs BEGIN
        INSERT INTO job_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
    END;
    CREATE TRIGGER job_counts_update AFTER UPDATE OF state ON jobs
    WHEN OLD.state IS NOT NEW.state BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
        INSERT INTO job_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TABLE page_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO page_counts (state, n) SELECT state, COUNT(*) FROM pages GROUP BY state;
    CREATE TRIGGER page_counts_insert AFTER INSERT ON pages BEGIN
        INSERT INTO page_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    CREATE TRIGGER page_counts_delete AFTER DELETE ON pages BEGIN
        UPDATE page_counts SET n = n - 1 WHERE state = OLD.state;
    END;
    CREATE TRIGGER page_counts_update AFTER UPDATE OF state ON pages
    WHEN OLD.state IS NOT NEW.state BEGIN
        UPDATE page_counts SET n = n - 1 WHERE state = OLD.state;
        INSERT INTO page_counts (state, n) VALUES (NEW.state, 1)
            ON CONFLICT (state) DO UPDATE SET n = n + 1;
    END;
    """,
    # 5: pages by state and finish time in one index, so pages_done_since() (the pages/min
    # of every status call and metrics scrape) is answered from the index alone. With the
    # partial index on finished_at SQLite still read each done page's row to check its
    # state, and a row holds the page's result (its crops too) in overflow pages: 26 ms
    # of daemon CPU per status call after 182 pages, growing with history.
    """
    DROP INDEX IF EXISTS pages_by_state;
    DROP INDEX IF EXISTS pages_done_at;
    CREATE INDEX pages_by_state ON pages (state, finished_at);
    """,
    # 6: the HTTP job API: who submitted a job (its token's name), the outputs it asked
    # for and its webhook URL; the webhook outbox, filled by a trigger in the transaction
    # that ends an API job with a callback (done, partial, failed), so a kill -9 between
    # the job's end and the delivery loses no webhook.
    """
    CREATE TABLE api_jobs (
        job_id INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
        owner TEXT NOT NULL,
        outputs TEXT NOT NULL,
        callback_url TEXT
    );
    CREATE INDEX api_jobs_by_owner ON api_jobs (owner, job_id);
    CREATE TABLE webhook_outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        next_at REAL NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        body TEXT,
        delivered_at REAL,
        given_up_at REAL,
        last_error TEXT
    );
    CREATE INDEX webhook_outbox_due ON webhook_outbox (next_at)
        WHERE delivered_at IS NULL AND given_up_at IS NULL;
    CREATE TRIGGER webhook_on_finish AFTER UPDATE OF state ON jobs
    WHEN NEW.state IN ('done', 'partial', 'failed') AND OLD.state IS NOT NEW.state
        AND EXISTS (SELECT 1 FROM api_jobs a WHERE a.job_id = NEW.id
                    AND a.callback_url IS NOT NULL) BEGIN
        INSERT INTO webhook_outbox (job_id, state, created_at, next_at) VALUES (
            NEW.id, NEW.state, (julianday('now') - 2440587.5) * 86400.0,
            (julianday('now') - 2440587.5) * 86400.0);
    END;
    """,
)


def migrate(db: Database) -> None:
    """Bring ``db`` to the newest schema, one transaction per version.

    Raises InternalError when the database is newer than this chandrad.
    """
    with db.tx() as c:
        c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = c.execute("SELECT version FROM schema_version").fetchone()
        if row is None:
            c.execute("INSERT INTO schema_version (version) VALUES (0)")
    version = schema_version(db.conn)
    if version > len(MIGRATIONS):
        raise InternalError(
            f"{db.path} has schema version {version}, newer than this chandrad "
            f"understands ({len(MIGRATIONS)}); refusing to downgrade it",
            path=str(db.path),
        )
    for target in range(version + 1, len(MIGRATIONS) + 1):
        with db.tx() as c:
            for statement in statements(MIGRATIONS[target - 1]):
                c.execute(statement)
            c.execute("UPDATE schema_version SET version = ?", (target,))


def schema_version(conn: sqlite3.Connection) -> int:
    """The schema version stored in the database."""
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    return int(row[0])


def statements(script: str) -> list[str]:
    """Split a migration script into statements (ours contain no ``;`` in literals); a
    trigger's ``BEGIN … END;`` body is kept whole (``sqlite3.complete_statement``)."""
    out: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending.strip())
            pending = ""
    if pending.strip(" \n;"):
        out.append(pending.strip())
    return out
