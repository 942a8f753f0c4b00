"""Simulated hosts for the multi-host mooncake tests: Linux network namespaces on one bridge.

Each host is a namespace ``hs<tag>-<name>`` with one veth, ``eth0``, at ``10.249.49.N/24``
(N = its place in the list, from 1); the other ends meet on a bridge in a namespace of their
own (``hs<tag>-sw``), the switch. Nothing is added to the caller's namespace: no address, no
route, no interface, so no traffic leaves the namespaces the test made. A host's link goes
down and up at its switch port (a pulled cable: the host keeps its address); qdiscs (tbf)
go on the switch port too, shaping what the host receives and, on its ``eth0``, what it sends;
random loss is an iptables rule in the host's namespace (its ``INPUT`` from ``eth0``). This
kernel has neither ``sch_netem`` nor ``sch_fq``, so no delay can be added.

Processes run in a host with ``ip netns exec`` (:meth:`Hosts.popen`); :meth:`Hosts.close`
kills every process started in these namespaces by its process id and deletes the
namespaces (their veths with them). Needs root and ``ip netns``; :func:`require_netns` skips
saying why, or fails where CI is set (as tests/mooncake_master.py does for Mooncake).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest

SUBNET = "10.249.49"
TESTS = os.path.dirname(os.path.abspath(__file__))


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {run.stderr.strip()}")
    return run


def netns_problem() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    name = f"hs{secrets.token_hex(3)}-probe"
    try:
        made = _sh("ip", "netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add fails: {made.stderr.strip()}"
        veth = _sh(
            "ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1",
            check=False,
        )  # fmt: skip
        if veth.returncode != 0:
            return f"veth pairs unavailable: {veth.stderr.strip()}"
        bridge = _sh("ip", "-n", name, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges unavailable: {bridge.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", name, check=False)
    return None


def missing(why: str) -> None:
    """What these tests need is not here: a failure in CI, a skip elsewhere."""
    in_ci = os.environ.get("CI", "").lower() in ("1", "true")
    (pytest.fail if in_ci else pytest.skip)(why)


def require_netns() -> None:
    if problem := netns_problem():
        missing(f"network namespaces: {problem}")


class Hosts:
    """Hosts ``names`` on one switch; ``ip(name)`` is a host's address."""

    def __init__(self, names: list[str], log=print):
        self.tag = secrets.token_hex(2)
        self.names = list(names)
        self.switch = f"hs{self.tag}-sw"
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.log = log
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return f"hs{self.tag}-{name}"

    def ip(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def port(self, name: str) -> str:
        """The host's port on the switch (a veth end in the switch's namespace)."""
        return f"s{self.tag}{name}"[:15]

    def _make(self) -> None:
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        self.made.append(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for name in self.names:
            ns = self.ns(name)
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            port = self.port(name)
            _sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)  # fmt: skip
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")

    # -- processes ---------------------------------------------------------------------
    def popen(self, host: str, argv: list[str], log_path: str, env: dict | None = None):
        """``argv`` in ``host``'s namespace, stdout and stderr to ``log_path``."""
        with open(log_path, "a") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(host), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        self.procs.append(proc)
        return proc

    def python(self, host: str, args: list[str], log_path: str, env: dict | None = None):
        """tests/netns_child.py ``args`` on ``host`` (this interpreter), with tests/ and
        benchmarks/ on its PYTHONPATH (the test helpers it imports by name, as pytest does)."""
        path = [TESTS, os.path.join(os.path.dirname(TESTS), "benchmarks")]
        path += filter(None, [os.environ.get("PYTHONPATH")])
        env = {"MOONCAKE_LOCAL_HOSTNAME": self.ip(host), "PYTHONPATH": os.pathsep.join(path),
               **(env or {})}  # fmt: skip
        child = os.path.join(TESTS, "netns_child.py")
        return self.popen(host, [sys.executable, child, *args], log_path, env)

    def run(self, host: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_port(self, host: str, address: str, timeout: float = 30) -> None:
        """Until ``address`` (host:port) takes a TCP connection from ``host``."""
        h, _, p = address.rpartition(":")
        code = (
            "import socket, sys, time\n"
            f"end = time.monotonic() + {timeout}\n"
            "while True:\n"
            "    try:\n"
            f"        socket.create_connection(({h!r}, {p}), timeout=1).close(); sys.exit(0)\n"
            "    except OSError:\n"
            "        if time.monotonic() > end: sys.exit(1)\n"
            "        time.sleep(0.05)\n"
        )
        if self.run(host, [sys.executable, "-c", code], timeout=timeout + 30).returncode:
            raise RuntimeError(f"{address} does not answer from {host} within {timeout} s")

    @staticmethod
    def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """Signal ``proc`` by its id and wait for it (SIGKILL after ``timeout``)."""
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    # -- faults --------------------------------------------------------------------------
    def fault(self, line: str) -> None:
        """One line in the test's log for each fault."""
        self.log(f"FAULT {time.strftime('%H:%M:%S')} {line}")

    def link(self, host: str, up: bool) -> None:
        state = "up" if up else "down"
        _sh("ip", "-n", self.switch, "link", "set", self.port(host), state)
        self.fault(f"link of {host} ({self.ip(host)}) {state}")

    def shape(self, host: str, *qdisc: str) -> None:
        """A root qdisc on both ends of ``host``'s link (``tbf rate 80mbit ...``): what it
        sends and what it receives."""
        _sh("tc", "-n", self.switch, "qdisc", "add", "dev", self.port(host), "root", *qdisc)
        _sh("tc", "-n", self.ns(host), "qdisc", "add", "dev", "eth0", "root", *qdisc)
        self.fault(f"link of {host} ({self.ip(host)}): {' '.join(qdisc)}")

    def drop(self, host: str, probability: float) -> None:
        """Drop ``probability`` of the packets ``host`` receives on its link, at random
        (iptables' statistic match in its namespace; this kernel has no sch_netem). Every
        host's ``eth0`` first sends one frame per packet (``gso_max_segs 1``: no 64 KB GSO
        batches through the veths), so a packet dropped is one MTU frame, as on a wire."""
        if shutil.which("iptables") is None:  # as _sh runs it: by PATH
            missing("random loss needs iptables: apt-get install iptables")
        for name in self.names:
            _sh("ip", "-n", self.ns(name), "link", "set", "eth0", "gso_max_segs", "1")
        _sh("ip", "netns", "exec", self.ns(host), "iptables", "-A", "INPUT", "-i", "eth0",
            "-m", "statistic", "--mode", "random", "--probability", str(probability),
            "-j", "DROP")  # fmt: skip
        self.fault(f"link of {host} ({self.ip(host)}): {probability:.0%} of its input dropped")

    def dropped(self, host: str) -> int:
        """Packets :meth:`drop` has dropped on ``host`` so far."""
        listing = _sh("ip", "netns", "exec", self.ns(host), "iptables", "-L", "INPUT", "-v",
                      "-n", "-x").stdout  # fmt: skip
        return sum(int(line.split()[0]) for line in listing.splitlines() if " DROP " in line)

    def retransmits(self) -> int:
        """TCP segments sent again, over every host (each namespace counts its own)."""
        total = 0
        for name in self.names:
            snmp = self.run(name, ["cat", "/proc/net/snmp"], timeout=30).stdout.splitlines()
            head, values = [x.split() for x in snmp if x.startswith("Tcp:")][:2]
            total += int(values[head.index("RetransSegs")])
        return total

    # -- cleanup -------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started in these namespaces, by its id; delete them."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(10)
        for ns in self.made:  # any child of theirs still in a namespace
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self.made):
            _sh("ip", "netns", "del", ns, check=False)
        self.made.clear()
