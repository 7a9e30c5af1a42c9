"""`kvflow serve`'s address, taken before anything slow: the port is bound before the heavy
imports and the model load, so a busy port ends the command within a second, naming host:port.
The socket listens only once the server can answer (uvicorn starts it), so a client that
connects during start-up is refused rather than kept waiting. Standard library only."""

from __future__ import annotations

import argparse
import errno
import socket
import sys


def bind_or_exit(args: argparse.Namespace) -> socket.socket:
    """The entry points' first step: a TCP socket bound to `args.host`:`args.port`, not
    listening yet, or for an API server that the --api-server-count supervisor started, the
    supervisor's socket it inherited (`--listen-fd`). If the address cannot be had, exits with
    status 1 and one line on stderr naming host:port.

    The protocol is named: asyncio sets TCP_NODELAY only on the connections of a socket whose
    `proto` says TCP, and without it Nagle holds a response's last bytes back (an SSE chunk
    waits for an ACK; a 413's body, sent just before the connection closes, is lost to the
    reset). SO_REUSEADDR, as uvicorn sets it: a restart does not wait for the last run's
    connections in TIME_WAIT, while a port that another socket listens on stays refused."""
    if args.listen_fd is not None:
        return socket.socket(fileno=args.listen_fd)  # family, type and protocol read from it
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
