"""The receiving end of sd_notify: a bound AF_UNIX datagram socket, as systemd has for each service."""

from __future__ import annotations

import socket
import threading
import time

from gateway.ops.sdnotify import socket_address


class FakeSystemd:
    """What systemd listens on: a bound datagram socket; records (monotonic time, message)."""

    def __init__(self, notify_socket: str) -> None:
        self.notify_socket = notify_socket
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        address = socket_address(notify_socket)
        assert address is not None
        self.sock.bind(address)
        self.sock.settimeout(0.02)
        self.received: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.received.append((time.monotonic(), data.decode()))

    def messages(self) -> list[str]:
        with self._lock:
            return [m for _, m in self.received]

    def wait_for(self, count: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.messages()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.messages()

    def wait_until_stopping(self, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while "STOPPING=1" not in self.messages() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.messages()

    def clear(self) -> None:
        with self._lock:
            self.received.clear()

    def ping_times(self) -> list[float]:
        with self._lock:
            return [t for t, m in self.received if m == "WATCHDOG=1"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
