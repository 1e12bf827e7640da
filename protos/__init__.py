"""The contracts: generated from the .proto files beside this one by `make protos`, and the few
conventions of the wire that are not messages, shared by the server and the clients (the lowest
package both import): the retry hint's key, the token's variable, what counts as loopback, the version."""

# Trailing metadata key of a transient refusal (RESOURCE_EXHAUSTED: a full queue, a wait beyond the
# queue limit or the deadline): milliseconds after which to retry. Clients decide on it and the
# status code, never on the message's words.
RETRY_AFTER_KEY = "scoremap-retry-after-ms"

# The environment variable holding the bearer token, for the server and the command lines alike (kept
# off the command line, where `ps` shows it).
TOKEN_ENV = "SCOREMAP_TOKEN"
LOOPBACK = "127.0.0.1"  # where servers bind and clients look unless told otherwise


def version() -> str:
    """The version of the installed `scoremap` distribution, for every command's --version."""
    from importlib import metadata

    try:
        return metadata.version("scoremap")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def is_loopback(address: str, *, resolve: bool = False) -> bool:
    """Whether `address` (HOST, HOST:PORT or [V6]:PORT) is on this machine only.

    `resolve=False` (a client about to send a token in clear text): only a literal loopback address or
    `localhost` counts, since a name's resolution can change under it. `resolve=True` (a server choosing
    what to bind): a name counts when every address it resolves to is loopback."""
    import ipaddress
    import socket

    host = address
    if address.startswith("["):
        host = address[1:].partition("]")[0]
    elif address.count(":") == 1:
        host = address.rsplit(":", 1)[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not resolve:
        return host == "localhost"
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
