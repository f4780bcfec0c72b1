"""Running an app under uvicorn on a socket bound first, so that a port in use is a one-line
error and "ready" is said only once clients can connect.

    sock = listen("127.0.0.1", 8000)    # JaxdecError if the address cannot be bound
    run(app, sock)                      # until interrupted
    port = free_port()                  # a port nobody listens on now (for a child server)
"""

from __future__ import annotations

import socket

from jaxdec.errors import JaxdecError


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (connections queue until the server accepts)."""
    if not 0 <= port < 65536:
        raise JaxdecError(f"--port must be in [0, 65535] (got {port})")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise JaxdecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` that is free now (the OS's pick), for a server started next."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run(app, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve `app` on `sock` until interrupted (uvicorn's own handling of SIGINT/SIGTERM)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
