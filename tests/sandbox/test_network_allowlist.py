"""The network allowlist in real nsjail: named destinations answer, nothing else is reachable.

Host services are real sockets on this machine; each records what reached it, so "refused" is
checked on both ends: the jail's connection fails, and the service saw nothing. The proxy's own
limits (connection caps, names resolved once and checked) are driven directly, the way the jail's
forwarder hands it connections.
"""
from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time

import psutil
import pytest

from postrain.sandbox import Policy, PolicyError, Sandbox, Status
from postrain.sandbox import netproxy


class Service:
    """A TCP service on the host that answers "<name> got: <first bytes>" and records them."""

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        self.received: list[bytes] = []
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(4096)
                self.received.append(data)
                conn.sendall(f"{self.name} got: ".encode() + data)


class UdpTrap:
    """A UDP port on the host (all addresses) that records any datagram (a DNS exfiltration)."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.received.append(self.sock.recv(4096))
            except OSError:
                return


def host_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for addr in addresses:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return None


PROBE = """
import json, socket, sys
def tcp(host, port, payload=b"hello"):
    try:
        with socket.create_connection((host, port), timeout=1) as c:
            c.sendall(payload)
            return c.recv(4096).decode()
    except OSError as exc:
        return type(exc).__name__
def udp(host, port):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"secret.exfil.example", (host, port))
        return "sent"
    except OSError as exc:
        return type(exc).__name__
def resolve(name):
    try:
        return socket.getaddrinfo(name, 80)[0][4][0]
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({name: eval(expr) for name, expr in json.loads(sys.argv[1] if len(sys.argv) > 1 else input())}))
"""


@pytest.fixture(scope="module")
def services():
    return {"allowed": Service("allowed"), "named": Service("named"), "other": Service("other"),
            "wide": Service("wide", host="0.0.0.0"), "udp": UdpTrap()}


@pytest.fixture(scope="module")
def session(services):
    policy = Policy(wall_time_s=5, memory_mb=256, network_allow=(
        f"127.0.0.1:{services['allowed'].port}", f"localhost:{services['named'].port}"))
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:   # "localhost" may resolve to loopback: said so
            patch.setattr(netproxy, "DEFAULT_OPTIONS", netproxy.ProxyOptions(private_names=("localhost",)))
            sandbox = stack.enter_context(Sandbox(policy, mode="cold", num_spare_sessions=0))
            s = stack.enter_context(sandbox.session())      # its proxy is made here
        yield s


def probe(session, checks: dict[str, str]) -> dict:
    result = session.run_python(PROBE, stdin=json.dumps(list(checks.items())) + "\n")
    assert result.status is Status.OK, result.stderr
    return json.loads(result.stdout)


def test_allowed_destinations_answer(session, services):
    allowed, named = services["allowed"].port, services["named"].port
    out = probe(session, {"literal": f"tcp('127.0.0.1', {allowed})",
                          "name": f"tcp('localhost', {named})"})
    assert out == {"literal": "allowed got: hello", "name": "named got: hello"}
    shell = session.run(f"exec 3<>/dev/tcp/127.0.0.1/{allowed}; printf shell >&3; cat <&3")
    assert shell.stdout == b"allowed got: shell"


def test_everything_else_is_refused(session, services):
    other, wide, udp = services["other"].port, services["wide"].port, services["udp"].port
    checks = {"other_port": f"tcp('127.0.0.1', {other})",
              "allowed_port_on_name_address": f"tcp('127.77.0.2', {services['allowed'].port})",
              "ssh": "tcp('127.0.0.1', 22)", "outside": "tcp('1.1.1.1', 80)",
              "dns_name": "resolve('example.com')", "dns_udp_outside": "udp('8.8.8.8', 53)",
              "udp_host_loopback": f"udp('127.0.0.1', {udp})"}
    address = host_address()
    if address:
        checks.update(host_service=f"tcp({address!r}, {wide})", udp_host=f"udp({address!r}, {udp})")
    out = probe(session, checks)
    refused = {"ConnectionRefusedError", "OSError", "TimeoutError", "socket.gaierror", "gaierror"}
    for name in checks:
        if name.startswith("udp_host_loopback"):
            continue  # the jail's own lo: the datagram goes nowhere (checked on the host below)
        assert out[name] in refused, (name, out[name])
    assert out["dns_name"] == "gaierror"
    assert services["other"].received == [] and services["wide"].received == []
    assert services["udp"].received == []  # no datagram reached the host: no DNS exfiltration


def test_the_allowlist_cannot_be_changed_from_inside(session, services):
    other = services["other"].port
    result = session.run(f"""
        echo "127.0.0.1 evil" >> /etc/hosts 2>/dev/null && echo hosts-written
        ls /run/postrain-net 2>/dev/null && echo sockets-listed
        python3 -c "import socket; s=socket.socket(socket.AF_UNIX); s.connect('/run/postrain-net/0.sock')" 2>/dev/null && echo proxy-reached
        python3 -c "
import socket, struct, fcntl
ifreq = struct.pack('16sH2s4s8s', b'lo:9', socket.AF_INET, b'', socket.inet_aton('10.9.9.9'), b'')
fcntl.ioctl(socket.socket().fileno(), 0x8916, ifreq)" 2>/dev/null && echo address-added
        kill -9 -1 2>/dev/null
        python3 -c "
import socket
l = socket.create_server(('127.0.0.1', {other}))
c = socket.create_connection(('127.0.0.1', {other})); c.sendall(b'x')
print('self-listener', l.accept()[0].recv(1))"
        echo done
    """)
    assert result.stdout == b"self-listener b'x'\ndone\n", result.stderr
    assert services["other"].received == []  # its own listener on lo is not the host's service
    out = probe(session, {"after": f"tcp('127.0.0.1', {services['allowed'].port})"})
    assert out == {"after": "allowed got: hello"}  # the forwarder survived the attempts


def test_no_escape_through_the_allowed_destination(session, services):
    allowed, other = services["allowed"].port, services["other"].port
    connect = f"CONNECT 127.0.0.1:{other} HTTP/1.1\\r\\nHost: 127.0.0.1:{other}\\r\\n\\r\\n"
    out = probe(session, {"connect": f"tcp('127.0.0.1', {allowed}, {connect!r}.encode())"})
    assert out["connect"].startswith("allowed got: CONNECT")   # the allowed service got it verbatim
    assert services["other"].received == []


def test_bad_entries_are_refused():
    for bad in ("127.0.0.1", "host:0", "host:99999", ":80", "a b:80"):
        with pytest.raises(PolicyError, match="network_allow entries must be 'host:port'"):
            Policy(network_allow=(bad,))
    with pytest.raises(PolicyError, match="exclude each other"):
        Policy(network_allow=("127.0.0.1:80",), enable_network=True)


class EchoServer:
    """A TCP echo service on 127.0.0.1 that holds every connection open: one thread for all."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.num_accepted = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(0.1):
                if key.fileobj is self.sock:
                    conn, _ = self.sock.accept()
                    self.num_accepted += 1
                    self._selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    key.fileobj.sendall(data)
                else:
                    self._selector.unregister(key.fileobj)
                    key.fileobj.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()


def through(proxy, index: int) -> socket.socket:
    """A TCP connection through route `index` of `proxy`, handed over as the jail's forwarder does."""
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as handoff:
        handoff.connect(proxy.socket_path(index))
        socket.send_fds(handoff, [b"c"], [theirs.fileno()])
    theirs.close()
    ours.settimeout(10)
    return ours


def outcome(conn: socket.socket) -> str:
    """"echoed" if the destination answered through the proxy, "refused" if it closed the connection."""
    try:
        conn.sendall(b"ping")
        return "echoed" if conn.recv(16) == b"ping" else "refused"
    except (ConnectionResetError, BrokenPipeError):
        return "refused"


def test_the_proxy_caps_connections_per_session_refusing_the_excess(caplog):
    echo = EchoServer()
    num_threads = threading.active_count()
    proxy = netproxy.NetworkProxy((f"127.0.0.1:{echo.port}",))      # the default options
    conns = []
    try:
        with caplog.at_level(logging.WARNING, logger="postrain.sandbox"):
            for _ in range(80):
                conns.append(through(proxy, 0))
            outcomes = [outcome(conn) for conn in conns]
        assert outcomes.count("echoed") == 32, outcomes.count("echoed")
        assert proxy.options.max_connections_per_session == 32
        assert outcomes.count("refused") == 48 and echo.num_accepted == 32
        assert threading.active_count() - num_threads <= 1 + 2 * 32   # the route's + two per connection
        lines = [r.getMessage() for r in caplog.records if "network proxy refused" in r.getMessage()]
        assert lines == ["network proxy refused a connection: 32 open, the cap "
                         "(ProxyOptions.max_connections_per_session)"]     # once per interval
        for conn in conns[:8]:                                  # closed ones free their slots
            conn.close()
        for _ in range(100):
            late = through(proxy, 0)
            if outcome(late) == "echoed":
                break
            late.close()
        else:
            raise AssertionError("no slot came free after 8 connections closed")
        late.close()
    finally:
        for conn in conns:
            conn.close()
        proxy.close()
        echo.close()


def test_the_total_cap_holds_across_sessions():
    echo = EchoServer()
    options = netproxy.ProxyOptions(max_connections_per_session=8, max_connections_total=12)
    proxies = [netproxy.NetworkProxy((f"127.0.0.1:{echo.port}",), options) for _ in range(2)]
    conns = []
    try:
        first = [through(proxies[0], 0) for _ in range(10)]
        got_first = [outcome(conn) for conn in first]
        second = [through(proxies[1], 0) for _ in range(10)]
        got_second = [outcome(conn) for conn in second]
        conns = first + second
        assert got_first.count("echoed") == 8 and got_second.count("echoed") == 4
    finally:
        for conn in conns:
            conn.close()
        for proxy in proxies:
            proxy.close()
        echo.close()


def test_a_name_is_checked_and_pinned_and_an_internal_address_needs_saying_so(caplog):
    echo = EchoServer()
    plain = netproxy.NetworkProxy((f"localhost:{echo.port}", f"127.0.0.1:{echo.port}"))
    answers, asked = ["127.0.0.1"], []

    def resolve(host, port):
        asked.append(host)
        return list(answers)

    try:
        with caplog.at_level(logging.WARNING, logger="postrain.sandbox"):
            assert outcome(through(plain, 0)) == "refused"     # localhost resolves to loopback
        assert outcome(through(plain, 1)) == "echoed"          # the same port, named as 127.0.0.1
        assert echo.num_accepted == 1
        assert "network proxy refused a connection to localhost" in caplog.text
        assert "write the address itself in network_allow" in caplog.text

        rebound = netproxy.NetworkProxy((f"svc.test:{echo.port}",), resolve=resolve)
        for answer in ("127.0.0.1", "169.254.169.254", "10.1.2.3", "192.168.0.1", "fe80::1", "::1",
                       "::ffff:127.0.0.1"):
            answers[:] = [answer]
            assert outcome(through(rebound, 0)) == "refused", answer
        assert echo.num_accepted == 1
        rebound.close()

        internal = netproxy.NetworkProxy((f"svc.test:{echo.port}",), netproxy.ProxyOptions(
            private_names=("svc.test",)), resolve=resolve)
        answers[:] = ["127.0.0.1"]
        asked.clear()
        assert outcome(through(internal, 0)) == "echoed"       # said explicitly: allowed
        answers[:] = ["169.254.169.254"]                        # DNS rebinding after the check
        assert outcome(through(internal, 0)) == "echoed"       # pinned: still the checked address
        assert asked == ["svc.test"] and echo.num_accepted == 3
        internal.close()
    finally:
        plain.close()
        echo.close()


def test_a_relayed_connection_idle_for_the_timeout_is_closed_and_frees_its_slot():
    echo = EchoServer()                                    # it holds every connection open
    proxy = netproxy.NetworkProxy((f"127.0.0.1:{echo.port}",), netproxy.ProxyOptions(
        max_connections_per_session=1, idle_timeout_s=1.0))
    conns = []
    try:
        conns.append(through(proxy, 0))
        for _ in range(15):                                # bytes every 0.1 s: it stays, past 1 s in all
            assert outcome(conns[0]) == "echoed"
            time.sleep(0.1)
        assert conns[0].recv(16) == b""                    # then idle: closed by the proxy
        for _ in range(100):                               # and its slot, the session's one, comes free
            conns.append(through(proxy, 0))
            if outcome(conns[-1]) == "echoed":
                break
        else:
            raise AssertionError("no slot came free after the idle connection closed")
        with pytest.raises(ValueError, match="idle_timeout_s > 0, got 0"):
            netproxy.ProxyOptions(idle_timeout_s=0)
    finally:
        for conn in conns:
            conn.close()
        proxy.close()
        echo.close()
