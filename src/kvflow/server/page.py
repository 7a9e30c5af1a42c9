"""The page at `/`: a chat playground and a live view of the engine, from static files in the
package (`server/static/`, no build step, nothing fetched from elsewhere). Its assets live
under `/ui/`. It calls the same `/v1` routes any client calls, and `/v1/engine/snapshot` for
the live view, with the API key the person types when the server has one."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PREFIX = "/ui"


def install_page(app: FastAPI) -> None:
    index = STATIC_DIR / "index.html"

    async def page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.mount(PAGE_PREFIX, StaticFiles(directory=STATIC_DIR), name="ui")
