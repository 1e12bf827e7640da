"""Who may reach a server: its bind address, TLS and bearer token, checked before anything loads.

The rules of every edge (the gRPC service, and any other face over the same pipeline): beyond
loopback, refuse what fails open unless the operator says the network is theirs alone; a token that would be empty refuses to start rather than turn authentication off; a port
in use is refused at once. Each raises `StartRefused`, one line for the user (exit status 2).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Mapping

from protos import TOKEN_ENV, is_loopback

__all__ = ["StartRefused", "check_exposure", "check_port_free", "read_tls", "read_token", "token_problem"]

LOG = logging.getLogger("scoremap.serve")


class StartRefused(Exception):
    """Why the server will not start, in one line for the user (exit status 2)."""


def read_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The bearer token from `--token-file` or `$SCOREMAP_TOKEN`; None when neither is given.

    An empty, blank or unreadable source refuses to start rather than turning authentication off.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise StartRefused(f"--token-file {token_file}: cannot read it ({reason}); give a readable file "
                               "holding the token, or leave the flag out to serve without one") from error
        source = f"--token-file {token_file}"
    elif TOKEN_ENV in environ:
        token = environ[TOKEN_ENV].strip()
        source = f"${TOKEN_ENV}"
    else:
        return None
    if problem := token_problem(token):
        raise StartRefused(f"{source}: the token {problem}; put one word of printable ASCII in it, or remove it "
                           f"({'the flag' if token_file else 'unset the variable'}) to serve without one")
    return token


def token_problem(token: str) -> str | None:
    """Why `token` cannot be the bearer token (None: it can): an empty one would turn authentication off."""
    if not token:
        return "is empty: that would turn authentication off"
    if not token.isascii() or any(char.isspace() or not char.isprintable() for char in token):
        return (f"holds {len(token)} characters with spaces, line breaks or non-ASCII ones: a token is one word "
                "of printable ASCII (it travels in an HTTP/2 header)")
    return None


def read_tls(cert_path: str | None, key_path: str | None) -> tuple[bytes, bytes] | None:
    """(certificate chain PEM, private key PEM) from `--tls-cert`/`--tls-key`; None when not given."""
    if not cert_path:
        return None
    try:
        with open(cert_path, "rb") as cert, open(key_path, "rb") as key:
            return cert.read(), key.read()
    except OSError as error:
        raise StartRefused(f"--tls-cert/--tls-key: cannot read {error.filename} ({error.strerror})") from error


def check_exposure(host: str, *, tls: bool, token: bool, insecure: bool) -> None:
    """Beyond loopback, refuse what fails open unless --insecure says the network is yours alone: no TLS and no token (anyone may call), or a token without TLS (it travels in clear text,
    to be read and replayed; the clients refuse to send one that way). TLS without a token only warns:
    it hides the traffic but lets any client in."""
    if is_loopback(host, resolve=True):
        return
    if not tls:
        problem = ("the bearer token would travel in clear text, to be read and replayed" if token else
                   "with neither TLS nor a token anyone who can reach it may use it")
        if not insecure:
            raise StartRefused(
                f"--host {host} reaches beyond this machine, and {problem}: give --tls-cert/--tls-key "
                f"(and --token-file or ${TOKEN_ENV}), or --insecure if the network is yours alone"
            )
        LOG.warning("INSECURE: serving on %s without TLS (--insecure): %s", host, problem)
    elif not token:
        LOG.warning("serving on %s with TLS but no token: any client that reaches it may call (add --token-file)", host)


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse at once (before models load) when `port` is taken; port 0 always has a free one."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise StartRefused(f"--host {host}: cannot resolve it ({error.strerror})") from error
    for family, kind, protocol, _name, address in infos:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue  # e.g. no IPv6 here: gRPC binds what it can, and says so if nothing
                raise StartRefused(f"{flag} {port}: {host}:{port} is in use; stop what holds it or choose another "
                                   f"({flag} 0 picks a free one)") from error
