"""The OpenAI-compatible HTTP server (`kvflow serve`): protocol (schemas), serving (logic),
routes and api_server (FastAPI, uvicorn), metrics (Prometheus), args (CLI flags)."""

from __future__ import annotations
