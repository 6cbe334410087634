"""Every call asyncrl makes into a private uvicorn API, in one place: the subclass of uvicorn's
h11 protocol under asyncrl's HTTP connection rules (asyncrl/agents/http_guard.py).

Why private: uvicorn has no public hook per connection (its limit_concurrency counts idle
connections too and answers 503 to everyone past it, its keep-alive timer is disarmed by any
byte received, and it has no deadline for a request as a whole nor for an answer nobody reads),
and an ASGI middleware runs only once a request's headers are in: it never sees a connection
that sends nothing.

Checked against uvicorn 0.54.0 (`CHECKED_VERSIONS`). tests/test_compat.py checks that every
name in `PRIVATE_NAMES` and `SOURCE_FACTS` is still there and that the installed uvicorn is the
version checked: after an upgrade, read `h11_protocol` against the new
uvicorn/protocols/http/h11_impl.py, then update `CHECKED_VERSIONS`.
Nothing here imports uvicorn at module level: only the servers need it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

CHECKED_VERSIONS = {"uvicorn": "0.54.0"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed uvicorn.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("uvicorn.protocols.http.h11_impl", "H11Protocol"),
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.handle_events"),
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.on_response_complete"),
]

# What no attribute lookup shows: (module, attribute path, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    # A request's headers are in once handle_events made its cycle, and `headers` are that request's.
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.handle_events", "self.cycle = RequestResponseCycle("),
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.handle_events",
     "self.headers = [(key.lower(), value) for key, value in event.headers]"),
    # A pipelined request is started from on_response_complete: the next one's deadline goes first.
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.on_response_complete", "self.handle_events()"),
    ("uvicorn.protocols.http.h11_impl", "H11Protocol", "self.cycle: RequestResponseCycle = None"),
    # ... and `scope["path"]` its path (the guard's session keys are valid on their paths only).
    ("uvicorn.protocols.http.h11_impl", "H11Protocol.handle_events", '"path": full_path,'),
]


class ConnectionEvents(Protocol):
    """What one connection's rules hear of it, in the order uvicorn's h11 protocol sees it."""

    def opened(self, transport: asyncio.Transport) -> None:
        """The connection is made (uvicorn has set up its side)."""

    def request_headers(self, headers: list[tuple[bytes, bytes]], path: str) -> None:
        """A request's headers are in (names in lower case), for `path`; its body may still be arriving."""

    def response_complete(self) -> None:
        """An answer is sent, before uvicorn starts the next request (pipelined ones included)."""

    def writing_paused(self) -> None:
        """The client reads less than the server writes: the transport's buffer is full."""

    def writing_resumed(self) -> None:
        """The transport's buffer drained again."""

    def lost(self) -> None:
        """The connection is closed, by either side."""


def h11_protocol(events: Callable[[], ConnectionEvents]) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol (for `uvicorn.Config(http=...)`) telling an `events()` of its own per
    connection what happens on it."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithEvents(H11Protocol):
        _seen: object = None  # the request cycle whose headers were reported last

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.events = events()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.events.opened(transport)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.cycle is not self._seen:  # a request's headers are in
                self._seen = self.cycle
                self.events.request_headers(self.headers, self.scope["path"])

        def on_response_complete(self) -> None:
            self.events.response_complete()
            super().on_response_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            self.events.writing_paused()

        def resume_writing(self) -> None:
            super().resume_writing()
            self.events.writing_resumed()

        def connection_lost(self, exc: Exception | None) -> None:
            self.events.lost()
            super().connection_lost(exc)

    return H11WithEvents
