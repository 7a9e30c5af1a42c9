"""The scale-out tests reuse the server test helpers (tests/server/serverproc.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))
