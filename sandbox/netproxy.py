"""The network allowlist's host side: one proxy per session jail, one route per allowed destination.

Design note. A jail with an allowlist keeps its own network namespace, holding only lo; nothing in
it routes to the host. For each allowed "host:port" the jail's agent listens on a loopback address
inside the jail (the address itself for an IPv4 entry, a 127.77.0.N address that the jail's
/etc/hosts gives the name otherwise) and hands every accepted connection, as a file descriptor, to
this proxy over a unix socket in a folder only the jail's root can open. The proxy connects to
that route's destination, and only to it, from the host, and relays bytes both ways. So the code
can reach exactly the listed destinations: other addresses and ports have no listener in the jail
(connection refused), names other than the listed ones do not resolve (/etc/hosts is the only
source; no DNS server is configured or reachable), and the list lives here, out of the jail's reach.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
import threading

from .policy import parse_destination

JAIL_SOCKET_DIR = "/run/postrain-net"
_CONNECT_TIMEOUT_S = 5.0


class NetworkProxy:
    """Routes of one jail; `close()` ends the listeners and every relayed connection."""

    def __init__(self, network_allow: tuple[str, ...]) -> None:
        self.destinations = [parse_destination(entry) for entry in network_allow]
        self._dir = tempfile.mkdtemp(prefix="postrain-net-")
        self._socket_dir = os.path.join(self._dir, "sock")
        self._etc_dir = os.path.join(self._dir, "etc")
        os.mkdir(self._socket_dir, 0o700)  # the jail's root (host root) only: never the code's uid
        os.mkdir(self._etc_dir, 0o755)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # listeners and relayed sockets; under _lock
        self._closed = False
        self._routes = []
        names = []
        for index, (host, port) in enumerate(self.destinations):
            address = _jail_address(host, index)
            if address != host:
                names.append(f"{address} {host}")
            path = os.path.join(self._socket_dir, f"{index}.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(64)
            self._open.add(listener)
            self._routes.append([address, port, f"{JAIL_SOCKET_DIR}/{index}.sock"])
            threading.Thread(target=self._serve, args=(listener, host, port), daemon=True,
                             name=f"netproxy-{host}:{port}").start()
        _write(os.path.join(self._etc_dir, "hosts"),
               "".join(line + "\n" for line in names) + "127.0.0.1 localhost\n")  # first match wins
        _write(os.path.join(self._etc_dir, "nsswitch.conf"), "hosts: files\n")

    def routes(self) -> list[list]:
        """[jail address, port, jail socket path] per destination (for the jail's agent)."""
        return [list(route) for route in self._routes]

    def nsjail_mounts(self) -> list[str]:
        return ["--bindmount_ro", f"{self._socket_dir}:{JAIL_SOCKET_DIR}",
                "--bindmount_ro", f"{self._etc_dir}/hosts:/etc/hosts",
                "--bindmount_ro", f"{self._etc_dir}/nsswitch.conf:/etc/nsswitch.conf"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _shut(sock)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------ internals
    def _serve(self, listener: socket.socket, host: str, port: int) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                with conn:
                    _, fds, _, _ = socket.recv_fds(conn, 16, 1)
                if not fds:
                    continue
                client = socket.socket(fileno=fds[0])
            except OSError:
                continue
            threading.Thread(target=self._connect, args=(client, host, port), daemon=True).start()

    def _connect(self, client: socket.socket, host: str, port: int) -> None:
        try:
            upstream = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
            upstream.settimeout(None)
        except OSError:
            _shut(client)  # the destination is down: the jail's connection closes
            return
        if not self._track(client, upstream):
            return
        done = threading.Barrier(2, action=lambda: self._untrack(client, upstream))
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(src, dst, done), daemon=True).start()

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                for sock in socks:
                    _shut(sock)
                return False
            self._open.update(socks)
            return True

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)
        for sock in socks:
            _shut(sock)


def _jail_address(host: str, index: int) -> str:
    """The address the jail dials for `host`: an IPv4 literal is itself, a name gets 127.77.0.N."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return f"127.77.0.{index + 1}"


def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier) -> None:
    """Copy src to dst until EOF, then half-close dst; wait for the other direction."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    try:
        done.wait()
    except threading.BrokenBarrierError:
        pass


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
