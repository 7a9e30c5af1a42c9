"""Request fields kvflow does not know (a typo, another server's extension): each name logged
once per server as a warning, in vLLM's words, or with `--strict-request-fields` refused with a
400 that names them. Only a request body's own fields count; the fields of its parts (a message,
`stream_options`) are not checked."""

from __future__ import annotations

import logging

from kvflow.server.errors import ServingError
from kvflow.server.protocol import UNSUPPORTED_FIELDS, RequestModel

logger = logging.getLogger("kvflow.server")


class UnknownFields:
    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._logged: set[str] = set()

    def check(self, req: RequestModel) -> None:
        """Raises ServingError (400) in strict mode if `req` has unknown fields; otherwise
        logs those not logged before. vLLM's refused fields (`UNSUPPORTED_FIELDS`) are known:
        set, they get a 400 of their own."""
        names = sorted(set(req.model_extra or {}).difference(UNSUPPORTED_FIELDS))
        if not names:
            return
        if self.strict:
            listed = ", ".join(f"`{name}`" for name in names)
            raise ServingError(
                f"Unknown request fields: {listed} (refused under --strict-request-fields).",
                param=names[0],
            )
        new = [name for name in names if name not in self._logged]
        if new:
            self._logged.update(new)
            logger.warning(
                "The following fields were present in the request but ignored: %s", set(new)
            )
