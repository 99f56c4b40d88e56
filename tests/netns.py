"""Local "nodes" for multi-node tests: Linux network namespaces joined by a veth pair, each with its own address.

Every launcher of a test runs inside one namespace (`ip netns exec`), so msrun, its scheduler and
the workers see only that node's address, as on separate machines; the filesystem stays shared,
as a cluster's shared filesystem is. Names carry the test process's PID so parallel runs never collide.
"""

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts


@dataclass
class Node:
    name: str      # the namespace
    address: str   # its address on the link between the nodes
    hostname: str  # resolves to `address` inside every namespace of the fixture (/etc/netns/NS/hosts)

    def command(self, argv: list) -> list:
        """argv run inside this node's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def create_nodes(count: int = 2, prefix: str = None) -> list:
    """`count` namespaces, each with a veth pair to a bridge in the first one; removed again if anything fails."""
    prefix = prefix or f"mn{os.getpid()}"
    nodes = [Node(f"{prefix}n{i}", f"10.231.0.{i + 1}", f"node{i + 1:02d}") for i in range(count)]
    hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in nodes)
    try:
        for node in nodes:
            _checked("netns", "add", node.name)
            _checked("-n", node.name, "link", "set", "lo", "up")
            os.makedirs(os.path.join(NETNS_ETC, node.name), exist_ok=True)
            with open(os.path.join(NETNS_ETC, node.name, "hosts"), "w", encoding="utf-8") as f:
                f.write(hosts)
        _checked("-n", nodes[0].name, "link", "add", "br0", "type", "bridge")
        _checked("-n", nodes[0].name, "link", "set", "br0", "up")
        for i, node in enumerate(nodes):
            outer, inner = f"{prefix}b{i}", f"{prefix}e{i}"
            _checked("link", "add", outer, "type", "veth", "peer", "name", inner)
            _checked("link", "set", outer, "netns", nodes[0].name)
            _checked("link", "set", inner, "netns", node.name)
            _checked("-n", nodes[0].name, "link", "set", outer, "master", "br0", "up")
            _checked("-n", node.name, "addr", "add", f"{node.address}/24", "dev", inner)
            _checked("-n", node.name, "link", "set", inner, "up")
    except BaseException:
        for i in range(count):  # a veth pair still in this namespace (made, not yet moved)
            _ip("link", "del", f"{prefix}b{i}")
        remove_nodes(nodes)
        raise
    return nodes


def remove_nodes(nodes: list) -> None:
    """Delete the namespaces (their veth ends and bridge go with them) and their hosts files."""
    for node in nodes:
        _ip("netns", "del", node.name)
        shutil.rmtree(os.path.join(NETNS_ETC, node.name), ignore_errors=True)
    try:
        os.rmdir(NETNS_ETC)  # only when empty: another run may be using it
    except OSError:
        pass


def _checked(*args) -> None:
    result = _ip(*args)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def why_no_namespaces() -> str:
    """Why this machine cannot give tests network namespaces, or '' when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"mn{os.getpid()}probe"
    result = _ip("netns", "add", probe)
    if result.returncode:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    _ip("netns", "del", probe)
    return ""


@pytest.fixture(scope="module")
def netns_nodes():
    """Two namespaces with their own addresses (10.231.0.1, .2; hostnames node01, node02), removed afterwards."""
    reason = why_no_namespaces()
    if reason:
        pytest.skip(reason)
    nodes = create_nodes(2)
    try:
        yield nodes
    finally:
        remove_nodes(nodes)
