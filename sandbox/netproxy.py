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

What the proxy does not trust:
- The host's resolver: a name is resolved on its route's first connection, checked, and the
  address checked is pinned for the proxy's life (no second lookup that DNS rebinding could
  answer otherwise). A name that resolves only to addresses that are not globally routable
  (loopback, link-local 169.254/16 and fe80::/10 (cloud metadata), private, shared, reserved)
  is refused, unless the entry is itself an IP literal or `ProxyOptions.private_names` names
  it: reaching an internal address must be written down as such.
- The jail's appetite: each relayed connection costs two host threads and an upstream socket,
  so connections are capped per proxy (one session) and in total (every proxy of this
  process); the excess is reset at once (the jail sees ECONNRESET) and logged, at most one line
  per cause per `warning_interval_s`. Threads: at most 1 per route + 2 per open connection.
- The jail's idleness: a relayed connection that moves no byte either way for `idle_timeout_s`
  is shut down at both ends, so connections left open hold no slot for longer than that.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Callable, cast

from .policy import HOST_ROOT_UID, parse_destination

log = logging.getLogger("postrain.sandbox")

JAIL_SOCKET_DIR = "/run/postrain-net"


@dataclasses.dataclass(frozen=True)
class ProxyOptions:
    """Limits of the allowlist proxy (see the module's note); all have defaults."""

    max_connections_per_session: int = 32   # relayed connections one session may hold open at once
    max_connections_total: int = 256        # relayed connections all sessions of this process may hold
    connect_timeout_s: float = 5.0          # to reach the destination; then the jail's connection closes
    idle_timeout_s: float = 300.0           # a relayed connection moving no byte either way this long closes
    private_names: tuple[str, ...] = ()     # names allowed to resolve to loopback/private/link-local
    warning_interval_s: float = 10.0        # at most one refusal line per cause this often

    def __post_init__(self) -> None:
        if not 0 < self.max_connections_per_session <= self.max_connections_total:
            raise ValueError(f"ProxyOptions needs 0 < max_connections_per_session <= max_connections_total, "
                             f"got {self.max_connections_per_session} and {self.max_connections_total}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"ProxyOptions needs idle_timeout_s > 0, got {self.idle_timeout_s}")


DEFAULT_OPTIONS = ProxyOptions()


def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (the host's resolver), in its order."""
    # an IPv4 or IPv6 sockaddr (the only families a host name resolves to) starts with the address string
    return [cast(str, info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


class _Slots:
    """A count of open connections under a cap (shared by every proxy: the total)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.num_open = 0   # under lock; 0 <= num_open


_TOTAL = _Slots()


class NetworkProxy:
    """Routes of one jail; `close()` ends the listeners and every relayed connection.
    `options`: DEFAULT_OPTIONS when None; `resolve`: host, port -> addresses (resolve_host)."""

    def __init__(self, network_allow: tuple[str, ...], options: ProxyOptions | None = None,
                 resolve: Callable[[str, int], list[str]] = resolve_host) -> None:
        self.options = options or DEFAULT_OPTIONS
        self.num_refused = 0
        self._resolve = resolve
        self._pinned: dict[int, str] = {}     # route index -> the address checked; under _resolve_lock
        self._resolve_lock = threading.Lock()
        self._num_open = 0                    # relayed connections of this proxy; under _TOTAL.lock
        self._last_warning: dict[str, list] = {}   # cause -> [time, suppressed]; under _TOTAL.lock
        self.destinations = [parse_destination(entry) for entry in network_allow]
        self._dir = tempfile.mkdtemp(prefix="postrain-net-")
        self._socket_dir = os.path.join(self._dir, "sock")
        self._etc_dir = os.path.join(self._dir, "etc")
        os.mkdir(self._socket_dir, 0o700)  # the jail's root only (its host uid): never the code's uid
        jail_root = HOST_ROOT_UID if os.geteuid() == 0 else None   # not root: the jail root is ours
        if jail_root is not None:
            os.chown(self._socket_dir, jail_root, jail_root)
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
            if jail_root is not None:
                os.chown(path, jail_root, jail_root)
            listener.listen(64)
            self._open.add(listener)
            self._routes.append([address, port, f"{JAIL_SOCKET_DIR}/{index}.sock"])
            threading.Thread(target=self._serve, args=(listener, index), daemon=True,
                             name=f"netproxy-{host}:{port}").start()
        _write(os.path.join(self._etc_dir, "hosts"),
               "".join(line + "\n" for line in names) + "127.0.0.1 localhost\n")  # first match wins
        _write(os.path.join(self._etc_dir, "nsswitch.conf"), "hosts: files\n")

    def socket_path(self, index: int) -> str:
        """The host's path of route `index`'s unix socket (the jail sees it under JAIL_SOCKET_DIR)."""
        return os.path.join(self._socket_dir, f"{index}.sock")

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
    def _serve(self, listener: socket.socket, index: int) -> None:
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
            if self._take_slot():
                threading.Thread(target=self._connect, args=(client, index), daemon=True).start()
            else:
                _reset(client)

    def _take_slot(self) -> bool:
        """A slot for one more relayed connection, if under both caps (else logged, False)."""
        opts = self.options
        with _TOTAL.lock:
            if self._num_open >= opts.max_connections_per_session:
                cap, num_open = "max_connections_per_session", self._num_open
            elif _TOTAL.num_open >= opts.max_connections_total:
                cap, num_open = "max_connections_total", _TOTAL.num_open
            else:
                self._num_open += 1
                _TOTAL.num_open += 1
                return True
            self.num_refused += 1
            self._warn(cap, "network proxy refused a connection: %d open, the cap (ProxyOptions.%s)",
                       num_open, cap)
            return False

    def _give_slot(self) -> None:
        with _TOTAL.lock:
            self._num_open -= 1
            _TOTAL.num_open -= 1

    def _warn(self, key: str, msg: str, *args) -> None:
        """At most one line per `key` per options.warning_interval_s (under _TOTAL.lock)."""
        now = time.monotonic()
        entry = self._last_warning.setdefault(key, [-float("inf"), 0])
        if now - entry[0] < self.options.warning_interval_s:
            entry[1] += 1
            return
        if entry[1]:
            msg += f" (and {entry[1]} more in the last {self.options.warning_interval_s:g} s, not logged)"
        entry[:] = [now, 0]
        log.warning(msg, *args)

    def _address(self, index: int) -> str | None:
        """The address route `index` connects to: resolved once, checked, pinned; None if refused."""
        host, port = self.destinations[index]
        with self._resolve_lock:
            if index in self._pinned:
                return self._pinned[index]
            if _is_ip(host):
                self._pinned[index] = host          # written down as an address: explicit
                return host
            try:
                addresses = self._resolve(host, port)
            except OSError:
                addresses = []
            explicit = host in self.options.private_names
            for address in addresses:
                if explicit or _is_global(address):
                    self._pinned[index] = address
                    return address
        with _TOTAL.lock:
            self.num_refused += 1
            self._warn(f"resolve {host}", "network proxy refused a connection to %s:%d: it resolves to %s, "
                       "no globally routable address; to allow an internal one, write the address itself "
                       "in network_allow (or name it in ProxyOptions.private_names)", host, port,
                       addresses or "nothing")
        return None

    def _connect(self, client: socket.socket, index: int) -> None:
        try:
            address = self._address(index)
            if address is None:
                _reset(client)
                self._give_slot()
                return
            port = self.destinations[index][1]
            try:
                upstream = socket.create_connection((address, port), timeout=self.options.connect_timeout_s)
                upstream.settimeout(None)
            except OSError:
                _shut(client)  # the destination is down: the jail's connection closes
                self._give_slot()
                return
        except BaseException:
            _shut(client)
            self._give_slot()
            raise
        if not self._track(client, upstream):
            self._give_slot()
            return
        def release() -> None:  # once both pumps are done
            self._untrack(client, upstream)
            self._give_slot()

        done = threading.Barrier(2, action=release)
        last_moved = [time.monotonic()]      # when a byte last moved, either way (both pumps write it)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(src, dst, done, last_moved, self.options.idle_timeout_s),
                             daemon=True).start()

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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_global(address: str) -> bool:
    """Whether `address` is globally routable (not loopback, link-local, private, shared, reserved)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global


def _reset(sock: socket.socket) -> None:
    """Close `sock` with a reset (SO_LINGER 0): its peer sees ECONNRESET, not a clean end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier, last_moved: list[float],
          idle_timeout_s: float) -> None:
    """Copy src to dst until EOF, then half-close dst; wait for the other direction. Once no byte
    has moved either way for idle_timeout_s (`last_moved[0]`, shared with the other direction),
    shut both sockets down: the other direction ends too."""
    poller = select.poll()
    poller.register(src, select.POLLIN)
    try:
        while True:
            left_s = last_moved[0] + idle_timeout_s - time.monotonic()
            if left_s <= 0:
                for sock in (src, dst):
                    sock.shutdown(socket.SHUT_RDWR)
                break
            if not poller.poll(int(left_s * 1000) + 1):
                continue
            data = src.recv(1 << 16)
            if not data:
                break
            last_moved[0] = time.monotonic()
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
