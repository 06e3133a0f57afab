"""The HTTP job API (``[api]``): uploads as jobs, their state, results, cancel, and signed
webhooks from a durable outbox; served by uvicorn inside the daemon's event loop."""

from chandrad.api.server import ApiServer

__all__ = ["ApiServer"]
