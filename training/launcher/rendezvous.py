"""Multi-node rendezvous: every node's launcher checks in with node 0's launcher before msrun starts anywhere.

msrun alone gives poor answers on several nodes: a node that never comes leaves the others
waiting for `cluster_time_out` (600 s), two nodes on one address fail with a bind error of a
second scheduler, and a node running another recipe or other code trains anyway. So node 0's
launcher listens on master_port + 1 (RENDEZVOUS_PORT_OFFSET) and every other node's launcher connects:

  node k -> 0  hello     its node rank, the resolved recipe and a hash of every source file
  0 -> node k  welcome   (or refused, naming the recipe keys / files / versions that differ)
  0 -> node k  prepared  node 0 holds the run directory and has prepared it (resume, dataset)
  node k -> 0  ready     node k checked that it sees that run directory (shared filesystem) and the data
  0 -> node k  start     every node is ready: each starts its msrun

The connection then stays open as a node heartbeat (every NODE_BEAT_SECONDS, with the phases of
the node's ranks): a node whose launcher dies (its connection closes) or falls silent for
NODE_TIMEOUT_SECONDS is named by the others, which stop their part of the job. Messages are JSON lines.
"""

import hashlib
import importlib
import json
import os
import platform
import queue
import socket
import threading
import time
import uuid
from importlib import metadata
from typing import Callable, Optional

from ascend_llm_recipes.common.errors import LaunchError

RENDEZVOUS_PORT_OFFSET = 1
DEFAULT_RENDEZVOUS_TIMEOUT = 600  # --rendezvous-timeout: how long a node waits for the others to come
NODE_BEAT_SECONDS = 2
NODE_TIMEOUT_SECONDS = 30          # a node silent this long (its connection still open) is lost
# A node started before node 0 listens retries its connection this often (a refused connection costs nothing;
# a longer pause only delays the start of every node).
CONNECT_RETRY_SECONDS = 0.2
RENDEZVOUS_FILE = "rendezvous.json"  # RUN_DIR: written by node 0; the other nodes read it back (shared filesystem)
PACKAGES = ("common", "models", "data", "training")


def resolve(host: str) -> str:
    """The IPv4 address of `host` (an address or a name), as msrun resolves it."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as err:
        raise LaunchError(f"--master-addr {host}: cannot be resolved on this node ({err.strerror or err})",
                          hint="give node 0's IP address, or a host name every node resolves") from None


def is_local_address(address: str) -> bool:
    """True when this machine has `address` (it can listen on it)."""
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def check_node_address(nodes: int, node_rank: int, master_addr: str, master_port: int) -> str:
    """master_addr must be node 0's own address on node 0 and another machine's elsewhere; returns its IPv4 address.

    msrun starts a scheduler on every node that has master_addr: two nodes on one address fail
    with a bind error of the second scheduler, long after launch.
    """
    address = resolve(master_addr)
    local = is_local_address(address)
    shown = master_addr if address == master_addr else f"{master_addr} ({address})"
    if node_rank == 0 and not local:
        raise LaunchError(f"--master-addr {shown} is not an address of this machine, but this is "
                          "node 0, which runs msrun's scheduler and the rendezvous there",
                          hint="on node 0 give its own address (`hostname -I` lists them); the other nodes give the "
                               "same address")
    if node_rank > 0 and local:
        raise LaunchError(f"--master-addr {shown} is an address of this machine, but this is node "
                          f"{node_rank}: two nodes on one address cannot work (msrun would start a second scheduler "
                          f"on port {master_port} here, which cannot bind)",
                          hint="give node 0's address and start node 0 on its own machine; to run several workers "
                               "on one machine use one node (--nodes 1) with hardware.devices_per_node workers")
    return address


def code_hashes() -> dict:
    """{path: sha256} of the package's source files and the worker script: which code every rank runs."""
    files = {}
    for package in PACKAGES:
        root = os.path.realpath(importlib.import_module(f"ascend_llm_recipes.{package}").__path__[0])
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if name.endswith((".py", ".yaml")):
                    path = os.path.join(folder, name)
                    files[os.path.join(package, os.path.relpath(path, root))] = path
        if package == "training":  # the worker script lives beside the package folders (launch.WORKER_SCRIPT)
            files["scripts/train.py"] = os.path.join(os.path.dirname(root), "scripts", "train.py")
    hashes = {}
    for key, path in sorted(files.items()):
        try:
            with open(path, "rb") as f:
                hashes[key] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            hashes[key] = None
    return hashes


def fingerprint(recipe) -> dict:
    """What must be equal on every node: the resolved recipe, the code, the framework versions."""
    versions = {"python": platform.python_version()}
    for name in ("mindspore", "mindformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"recipe": recipe.to_dict(), "code": code_hashes(), "versions": versions}


def differences(mine: dict, theirs: dict, here: str = "here", there: str = "there") -> list:
    """What differs between two nodes' fingerprints, each item naming the recipe key, file or package."""
    found = [f"recipe key {key}: {a!r} on {here}, {b!r} on {there}"
             for key, a, b in _diff(mine["recipe"], theirs["recipe"])]
    files = sorted(k for k in set(mine["code"]) | set(theirs["code"]) if mine["code"].get(k) != theirs["code"].get(k))
    if files:
        more = ", ..." if len(files) > 5 else ""
        found.append(f"code: {len(files)} source file(s) differ ({', '.join(files[:5])}{more})")
    found += [f"{name} {mine['versions'].get(name)} on {here}, {theirs['versions'].get(name)} on {there}"
              for name in sorted(set(mine["versions"]) | set(theirs["versions"]))
              if mine["versions"].get(name) != theirs["versions"].get(name)]
    return found


def _diff(a, b, prefix: str = "") -> list:
    """(dotted key, a value, b value) where two nested recipe dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b), key=str)
                for d in _diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{prefix}.{i}")]
    return [] if a == b else [(prefix, a, b)]


def describe_phases(phases: dict, now: float = None) -> str:
    """'rank 1 in phase 'step 4' (2 s before)' for each rank of a node's last heartbeat."""
    now = time.time() if now is None else now
    if not phases:
        return "its ranks had not started"
    return ", ".join(f"rank {rank} in phase '{beat['phase']}' ({now - beat['time']:.0f} s before)" if beat
                     else f"rank {rank} not started" for rank, beat in sorted(phases.items(), key=lambda x: int(x[0])))


class Link:
    """One TCP connection between node 0's launcher and another node's: JSON lines, heartbeats both ways."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.messages = queue.Queue()
        self.last_seen = time.time()
        self.phases = {}     # the peer's ranks' last heartbeats, from its beats
        self.ranks = []      # the peer's ranks
        self.ended = None    # the peer's "end" message
        self.closed = False  # the connection closed (or broke)
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        sock.settimeout(None)
        threading.Thread(target=self._read, name=f"link-{peer}", daemon=True).start()

    def send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    self.last_seen = time.time()
                    if message["type"] == "beat":
                        self.phases = message["phases"]
                    elif message["type"] == "end":
                        self.ended = message
                    else:
                        self.messages.put(message)
        except (OSError, ValueError):
            pass
        self.closed = True
        self.messages.put({"type": "closed"})

    def start_beating(self, phases: Callable[[], dict]) -> None:
        def beat():
            while not self._stop.wait(NODE_BEAT_SECONDS):
                self.send({"type": "beat", "phases": phases()})
        threading.Thread(target=beat, name=f"beat-{self.peer}", daemon=True).start()

    def problem(self) -> str:
        """Why the peer counts as lost ('' while it is alive, or after it ended well)."""
        if self.ended is not None:
            return "" if self.ended["ok"] else f"{self.peer} stopped: {self.ended['reason']}"
        if self.closed:
            return f"{self.peer} is gone (its launcher's connection closed); {describe_phases(self.phases)}"
        silent = time.time() - self.last_seen
        if silent > NODE_TIMEOUT_SECONDS:
            return f"{self.peer} is gone (no heartbeat for {silent:.0f} s); {describe_phases(self.phases)}"
        return ""

    def receive(self, deadline: float = None) -> dict:
        """The next message other than a heartbeat: {'type': 'closed'} once the peer is lost, None at the deadline."""
        while True:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.time())
            if wait <= 0:
                return None
            try:
                return self.messages.get(timeout=wait)
            except queue.Empty:
                if self.problem():
                    return {"type": "closed"}

    def end(self, ok: bool, reason: str = "") -> None:
        self._stop.set()
        self.send({"type": "end", "ok": ok, "reason": reason})
        self.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


EXIT_MEANINGS = {1: "a rank failed", 2: "a check failed", 3: "a rank stalled",
                 4: "it was stopped (Ctrl-C or SIGTERM)", 5: "it was stopped hard", 6: "it lost another node"}


def exit_reason(node_rank: int, code: int) -> str:
    meaning = EXIT_MEANINGS.get(code, "see its output")
    return f"node {node_rank}'s launcher ended with exit code {code} ({meaning})"


class NodeGroup:
    """The other nodes, seen from this node's launcher during one launch: rendezvous, then heartbeats."""

    def __init__(self, cluster, timeout: float):
        self.cluster = cluster
        self.timeout = timeout
        self.links = {}  # node rank -> Link
        # Set by the launcher once its run directory is known: {rank: last heartbeat} of the given ranks.
        self.heartbeats = lambda ranks: {}
        self.failure = ""  # set by the launcher: how this node's part failed (which rank, how, in which phase)

    def phases(self) -> dict:
        """This node's ranks' last heartbeats, sent to the other nodes."""
        return self.heartbeats(self.cluster.ranks)

    @property
    def address(self) -> str:
        return f"{self.cluster.master_addr}:{self.cluster.master_port + RENDEZVOUS_PORT_OFFSET}"

    def problem(self) -> str:
        """The first lost node, or ''."""
        for link in self.links.values():  # the shared run directory may hold fresher heartbeats than the last beat
            for rank, beat in self.heartbeats(link.ranks).items():
                old = link.phases.get(str(rank))
                if beat and (not old or beat["time"] > old["time"]):
                    link.phases[str(rank)] = beat
        return next((p for p in (link.problem() for _, link in sorted(self.links.items())) if p), "")

    def scheduler_unneeded(self) -> bool:
        """No other node needs msrun's scheduler any more (it runs on node 0): every other node said its part
        ended well, so its workers have exited (and unregistered). Always true on the other nodes."""
        if self.cluster.node_rank != 0:
            return True
        return all(link.ended is not None and link.ended["ok"] for link in self.links.values())

    def end(self, code: int, ok: bool) -> None:
        """Tell the other nodes how this launch ended (`ok` False stops their part), then close."""
        reason = exit_reason(self.cluster.node_rank, code) + (f": {self.failure}" if self.failure else "")
        for link in self.links.values():
            link.end(ok, reason)
        self.links = {}

    def abort(self, reason: str) -> None:
        for link in self.links.values():
            link.end(False, reason)
        self.links = {}


class NodeZero(NodeGroup):
    """Node 0's side: listen, check each node's hello, tell them when to start."""

    def __init__(self, cluster, mine: dict, timeout: float, join_command: Callable[[int], str]):
        super().__init__(cluster, timeout)
        self.mine = mine
        self.join_command = join_command
        self.refusals = []
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = cluster.master_port + RENDEZVOUS_PORT_OFFSET
        try:
            self._server.bind((resolve(cluster.master_addr), port))
        except OSError as err:
            self._server.close()
            raise LaunchError(f"node 0 cannot listen for the other nodes on {self.address} "
                              f"({err.strerror or err}): another launch (a second node 0?) or another program uses "
                              f"port {port}",
                              hint=f"see who holds it with `ss -ltnp 'sport = :{port}'`; give each job its own "
                                   "--master-port (the rendezvous uses the next port too)") from None
        self._server.listen(16)
        threading.Thread(target=self._accept, name="rendezvous", daemon=True).start()
        missing = list(range(1, cluster.nodes))
        print(f"[launch] node 0 of {cluster.nodes}: waiting up to {timeout:.0f} s (--rendezvous-timeout) for node(s) "
              f"{', '.join(map(str, missing))} at {self.address}; on each of them run:\n"
              + "\n".join(f"  {join_command(k)}" for k in missing), flush=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, (host, _) = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, host), daemon=True).start()

    def _greet(self, sock: socket.socket, host: str) -> None:
        link = Link(sock, f"a node at {host}")
        hello = link.receive(time.time() + 30)
        if not hello or hello.get("type") != "hello":
            link.close()
            return
        rank = hello["node_rank"]
        link.peer = f"node {rank} ({host}, ranks {', '.join(map(str, hello['ranks']))})"
        link.ranks = hello["ranks"]
        problems = []
        with self._lock:
            if hello["nodes"] != self.cluster.nodes:
                problems.append(f"it was started with --nodes {hello['nodes']}, node 0 with --nodes "
                                f"{self.cluster.nodes}")
            elif rank in self.links:
                problems.append(f"node {rank} has joined already (from {self.links[rank].peer})")
            problems += differences(self.mine, hello["fingerprint"], "node 0", f"node {rank}")
            if problems:
                reason = (f"node {rank} ({host}) does not match node 0 ({self.cluster.master_addr}):\n"
                          + "\n".join(f"  - {p}" for p in problems))
                self.refusals.append(reason)
                link.send({"type": "refused", "reason": reason})
                link.close()
                return
            self.links[rank] = link
        link.send({"type": "welcome"})
        link.start_beating(self.phases)
        print(f"[launch] {link.peer} joined", flush=True)

    def _wait(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.time() + self.timeout
        while not done():
            with self._lock:
                if self.refusals:
                    raise LaunchError(self.refusals[0], hint="start every node with the same recipe, the same "
                                                             "--set overrides and the same code and versions")
                lost = self.problem()
            if lost:
                raise LaunchError(f"{lost}, before training started")
            if time.time() > deadline:
                missing = [k for k in range(1, self.cluster.nodes) if k not in self.links]
                if missing:
                    commands = "\n".join(f"  {self.join_command(k)}" for k in missing)
                    raise LaunchError(f"node(s) {', '.join(map(str, missing))} did not join within "
                                      f"{self.timeout:.0f} s (--rendezvous-timeout); nothing was started",
                                      hint=f"start them with:\n{commands}\n  and check that they reach {self.address} "
                                           "(firewall, the same --master-addr and --master-port on every node)")
                raise LaunchError(f"node(s) did not become {what} within {self.timeout:.0f} s (--rendezvous-timeout)")
            time.sleep(0.2)

    def wait_joined(self) -> None:
        """Wait until every other node joined (and matched), at most the rendezvous timeout."""
        self._wait("joined", lambda: len(self.links) == self.cluster.nodes - 1)
        self._server.close()

    def start(self, run_dir: str, nothing_to_do: str = "") -> None:
        """Tell the nodes that node 0 prepared `run_dir`, wait until each is ready, start them all."""
        from ascend_llm_recipes.training.checkpoint import write_atomic
        token = uuid.uuid4().hex
        write_atomic(os.path.join(run_dir, RENDEZVOUS_FILE),
                     json.dumps({"token": token, "master": self.address, "time": time.time()}) + "\n")
        for link in self.links.values():
            link.send({"type": "prepared", "token": token, "nothing_to_do": nothing_to_do})
        if nothing_to_do:
            return
        ready = set()

        def all_ready():
            for rank, link in self.links.items():
                while rank not in ready and not link.messages.empty():
                    message = link.messages.get()
                    if message["type"] == "ready":
                        ready.add(rank)
                    elif message["type"] == "failed":
                        link.ended = {"ok": False, "reason": message["reason"]}
            return len(ready) == len(self.links)
        self._wait("ready", all_ready)
        for link in self.links.values():
            link.send({"type": "start"})

    def close(self) -> None:
        self._server.close()


class NodeK(NodeGroup):
    """Another node's side: join node 0, pass its checks, wait for the word to start."""

    def __init__(self, cluster, mine: dict, timeout: float):
        super().__init__(cluster, timeout)
        port = cluster.master_port + RENDEZVOUS_PORT_OFFSET
        deadline, said = time.time() + timeout, False
        while True:
            try:
                sock = socket.create_connection((cluster.master_addr, port), timeout=5)
                break
            except OSError as err:
                if time.time() > deadline:
                    raise LaunchError(f"node 0 did not answer at {self.address} within {timeout:.0f} s "
                                      f"(--rendezvous-timeout; last: {err.strerror or err}); nothing was started",
                                      hint="start node 0 (--node-rank 0) with the same command, and check that this "
                                           "node reaches it (firewall, the same --master-addr and --master-port on "
                                           "every node)") from None
                if not said:
                    print(f"[launch] node {cluster.node_rank} of {cluster.nodes}: waiting up to {timeout:.0f} s "
                          f"(--rendezvous-timeout) for node 0 at {self.address}", flush=True)
                    said = True
                time.sleep(CONNECT_RETRY_SECONDS)
        link = Link(sock, f"node 0 ({cluster.master_addr})")
        link.ranks = list(range(cluster.local_workers))
        link.send({"type": "hello", "node_rank": cluster.node_rank, "nodes": cluster.nodes,
                   "ranks": list(cluster.ranks), "host": platform.node(), "fingerprint": mine})
        answer = link.receive(time.time() + timeout)
        if not answer or answer["type"] != "welcome":
            link.close()
            reason = (answer or {}).get("reason") or "node 0 closed the connection without an answer"
            raise LaunchError(f"refused by node 0 at {self.address}: {reason}",
                              hint="start every node with the same recipe, the same --set overrides and the same "
                                   "code and versions")
        self.links[0] = link
        link.start_beating(self.phases)
        print(f"[launch] node {cluster.node_rank} joined node 0 at {self.address}; waiting for it to prepare the "
              "run directory", flush=True)

    def prepared(self, run_dir: str) -> str:
        """Wait until node 0 prepared the run directory, and check that this node sees it; returns nothing_to_do."""
        link = self.links[0]
        message = link.receive()
        if message["type"] != "prepared":
            raise LaunchError(f"{link.problem() or 'node 0 closed the connection'}; nothing was started here")
        path = os.path.join(run_dir, RENDEZVOUS_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                seen = json.load(f).get("token")
        except (OSError, ValueError):
            seen = None
        if seen != message["token"]:
            raise LaunchError(f"output_dir {run_dir} on this node is not the run directory node 0 prepared ({path} "
                              f"{'is missing' if seen is None else 'was written by another launch'}): every node "
                              "must see the same run directory",
                              hint="put output_dir (and the datasets) on a filesystem shared by all nodes, at the "
                                   "same path")
        return message["nothing_to_do"]

    def start(self) -> None:
        """Say this node is ready, then wait for node 0's word to start."""
        link = self.links[0]
        link.send({"type": "ready"})
        message = link.receive()
        if message["type"] != "start":
            raise LaunchError(f"{link.problem() or 'node 0 closed the connection'}; nothing was started here")

    def abort(self, reason: str) -> None:
        for link in self.links.values():
            link.send({"type": "failed", "reason": reason})
        super().abort(reason)


def open_rendezvous(cluster, recipe, timeout: float, join_command: Callable[[int], str]) -> Optional[NodeGroup]:
    """Node 0 starts listening, any other node joins it; None on a single node."""
    if cluster.nodes == 1:
        return None
    mine = fingerprint(recipe)
    if cluster.node_rank == 0:
        return NodeZero(cluster, mine, timeout, join_command)
    return NodeK(cluster, mine, timeout)


def report_lost(lost: str, cluster, run_dir: str) -> str:
    """What the launcher says when another node was lost during training."""
    return (f"[launch] {lost}\n[launch] stopped this node's part of the job (node {cluster.node_rank}, ranks "
            f"{cluster.ranks.start}-{cluster.ranks.stop - 1}); no process of it is left on this node; rerun the "
            f"command on every node to resume {run_dir} from its newest valid checkpoint")
