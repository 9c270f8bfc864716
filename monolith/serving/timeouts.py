"""Header timeouts for uvicorn's h11 protocol: a connection that has not sent a whole
request head within `header_timeout` seconds of opening (or of its previous response) is
closed. uvicorn itself closes idle keep-alive connections, but waits forever on one that
sent part of a request head (half-open connections pile up). The body's own timeout is
the app's (`ServerConfig.body_timeout`, a 408)."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header timeout (for uvicorn.Config(http=...))."""

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request head arrived (or the connection ended)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has as long

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection that sent no complete request head in %g s", header_timeout)
                self.transport.close()

    return TimedH11Protocol
