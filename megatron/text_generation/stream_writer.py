"""Writes one streaming response (server-sent events) from its own thread, so that the generation, which holds the
server's one-request-at-a-time lock, never waits for a client's socket: a client that stops reading only stalls its
own writer. A write that cannot finish within the timeout (a client that does not read) drops that client: the
remaining events are discarded and the connection is closed when the request ends."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional


class StreamWriter:
    """`put(bytes)` never blocks; `close()` waits for the queued events (each write bounded by `timeout_s`)."""

    def __init__(self, wfile: Any, connection: Any, timeout_s: float, log: Callable[[str], None],
                 client: str = "client") -> None:
        self.wfile = wfile
        self.timeout_s = float(timeout_s)
        self.log = log
        self.client = client
        self.broken = False
        self._queue: queue.SimpleQueue[Optional[bytes]] = queue.SimpleQueue()
        if connection is not None:
            connection.settimeout(self.timeout_s)  # bounds every write (sendall's total time)
        self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        if not self.broken:
            self._queue.put(data)

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self.broken:
                continue
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except TimeoutError:
                self.broken = True
                self.log(f"server: stream to {self.client} dropped: it read nothing for {self.timeout_s:g} s")
            except OSError:  # the client went away
                self.broken = True

    def close(self) -> None:
        """Write what is queued (or drop it once the client is found not reading) and stop the thread."""
        self._queue.put(None)
        self._thread.join()
