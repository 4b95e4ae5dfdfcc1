"""Who may talk to the server: a Host allow-list and an optional API key.

The Host check stops DNS rebinding: a page on attacker.example whose name is re-pointed at
127.0.0.1 makes the victim's browser send requests here that the browser considers same-origin,
so it may read the answers; those requests carry `Host: attacker.example`. A server that answers
only the names it is reached by (the bound address, `localhost`, the loopback addresses, and
what `--allowed-host` adds) refuses them with a 400 before anything else runs. An IP literal can
not be re-pointed, so a server bound to every interface (0.0.0.0 or ::) takes any IP literal.

The key check is a Bearer token compared in constant time (`hmac.compare_digest`: the time a
wrong key takes does not tell how many of its leading bytes were right), answered with a 401 in
OpenAI's error shape. `GET /health` (for load balancers and the chat page's status line) and
`GET /` (the chat page itself, a static file that holds no secret; its API calls send the key
the user types in) need no key.

Both are pure ASGI middleware, like limits.py: a refusal needs no request object and reads no
body.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Iterable

from .errors import APIError

ALL_HOSTS = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::")
OPEN_PATHS = frozenset({"/health", "/"})  # reachable without the API key (GET or HEAD only)


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The Host names a server bound to `bind_host` answers: the bound address, the loopback
    names, and `extra` (`*` in it allows every Host). Ports are not part of a name: a
    name is allowed with any port."""
    names = [*LOOPBACK_NAMES, bind_host, *extra]
    return tuple(dict.fromkeys(_normal(n) for n in names if n))


def _normal(name: str) -> str:
    """Lower case, no brackets around an IPv6 literal, no trailing dot (`localhost.` is
    `localhost` to a resolver)."""
    name = name.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name.rstrip(".") if name != ALL_HOSTS else name


def host_name(header: str) -> str:
    """The name part of a Host header: `[::1]:8080` -> `::1`, `Example.COM:80` ->
    `example.com`."""
    header = header.strip()
    if header.startswith("["):  # an IPv6 literal, bracketed, maybe with a port
        return _normal(header[:header.find("]") + 1] if "]" in header else header)
    if header.count(":") == 1:
        header = header.rsplit(":", 1)[0]
    return _normal(header)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheckMiddleware:
    """Answers 400 to a request whose Host header names none of `hosts`."""

    def __init__(self, app, hosts: Iterable[str],
                 on_refused: Callable[[str], None] | None = None):
        self.app = app
        self.hosts = frozenset(_normal(h) for h in hosts)
        # a wildcard bind address among the names (allowed_hosts puts it there): any IP literal
        self.any_ip = any(h in WILDCARD_BINDS for h in self.hosts)
        self.on_refused = on_refused  # called with the error code of a refusal

    def allows(self, name: str) -> bool:
        return (ALL_HOSTS in self.hosts or name in self.hosts
                or (self.any_ip and _is_ip(name)))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or ALL_HOSTS in self.hosts:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
        # no Host at all (HTTP/1.0 tools): a browser always sends one, so this is no rebinding
        if header is None or self.allows(host_name(header.decode("latin-1"))):
            return await self.app(scope, receive, send)
        shown = header.decode("latin-1")[:100]
        await refuse(send, APIError(
            400, f"Host {shown!r} is not served here (this server answers "
                 f"{', '.join(sorted(self.hosts))}); start it with --allowed-host "
                 f"{host_name(shown) or 'NAME'} to allow that name", code="invalid_host"),
            self.on_refused)


class ApiKeyMiddleware:
    """Answers 401 to a request without `Authorization: Bearer <key>`, except on OPEN_PATHS."""

    def __init__(self, app, key: str, on_refused: Callable[[str], None] | None = None):
        if not key:
            raise ValueError("the API key is empty")
        self.app = app
        self.key = key.encode("utf-8")
        self.on_refused = on_refused

    def authorized(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest's time depends on the lengths only, never on where the bytes differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope.get("path") in OPEN_PATHS
                                       and scope.get("method") in ("GET", "HEAD")):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.authorized(header):
            return await self.app(scope, receive, send)
        message = ("this server needs an API key: send the header 'Authorization: Bearer KEY'"
                   if header is None else
                   "Incorrect API key provided: the Authorization header's Bearer key is not "
                   "this server's")
        await refuse(send, APIError(401, message, code="invalid_api_key",
                                    headers={"WWW-Authenticate": "Bearer"}), self.on_refused)


async def refuse(send, err: APIError, on_refused: Callable[[str], None] | None) -> None:
    """Answer `err` without reading the request's body; the connection closes after it."""
    if on_refused is not None:
        on_refused(err.code)
    response = err.response()
    response.headers["Connection"] = "close"
    await response({"type": "http"}, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}
