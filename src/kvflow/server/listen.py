"""`kvflow serve`'s address, taken before anything slow: the port is bound before the heavy
imports and the model load, so a busy port ends the command within a second, naming host:port.
The socket listens only once the server can answer (uvicorn starts it), so a client that
connects during start-up is refused rather than kept waiting. Standard library only."""

from __future__ import annotations

import argparse
import errno
import socket
import sys


def bind_or_exit(args: argparse.Namespace) -> socket.socket | None:
    """The entry points' first step: a TCP socket bound to `args.host`:`args.port`, not
    listening yet; None for an API server that the --api-server-count supervisor started (it
    serves the supervisor's socket). If the address cannot be had, exits with status 1 and one
    line on stderr naming host:port.

    SO_REUSEADDR, as uvicorn sets it: a restart does not wait for the last run's connections in
    TIME_WAIT, while a port that another socket listens on stays refused."""
    if args.listen_fd is not None:
        return None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        busy = " (another server is there: choose another --port)"
        reason = f"{exc.strerror or exc}{busy if exc.errno == errno.EADDRINUSE else ''}"
        print(
            f"kvflow serve: error: cannot listen on {args.host}:{args.port}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    return sock
