"""The synchronous client: http.client over the worker's unix socket, or TCP
with TLS. Connections are kept per thread and made again when the worker
closed one; an exec always carries an id (one is made if none is given), so
that a request sent again never runs the command twice."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _wire
from ._wire import (DsecError, Env, ExecResult, Grade, InfraError, Output, PolicyReport, SandboxInfo, Snapshot, Target)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("dsec", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


def _settimeout(resp: http.client.HTTPResponse, t: Optional[float]) -> None:
    """Set the timeout of the socket resp is read from, if it is still open."""
    sock = getattr(resp, "dsec_sock", None)
    if sock is not None and sock.fileno() != -1:
        sock.settimeout(t)


class Client:
    """A client of one worker.

    host: ``tcp://HOST:PORT`` (default ``DSEC_HOST``; none: the local worker's
    socket under ``root``, default ``DSEC_ROOT`` or /var/lib/dsec); token
    (default ``DSEC_TOKEN``); tls_ca: the CA file the worker's certificate is
    checked against (default ``DSEC_TLS_CA``); client_cert and client_key for a
    worker that asks for a client certificate."""

    def __init__(self, host: Optional[str] = None, token: Optional[str] = None, tls_ca: Optional[str] = None,
                 root: Optional[str] = None, client_cert: Optional[str] = None, client_key: Optional[str] = None,
                 timeout: float = 60.0) -> None:
        self.target: Target = _wire.target(host, token, tls_ca, root, client_cert, client_key)
        self.timeout = timeout
        self._local = threading.local()

    # -- transport -------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        t = self.target
        if t.socket:
            return _UnixConnection(t.socket, self.timeout)
        if t.ssl is not None:
            return http.client.HTTPSConnection(t.host, t.port, timeout=self.timeout, context=t.ssl)
        return http.client.HTTPConnection(t.host, t.port, timeout=self.timeout)

    def _send(self, method: str, path: str, body: bytes = b"", json_body: bool = True) -> http.client.HTTPResponse:
        """Make a request and return its answer (status < 300), over this
        thread's connection; one the worker had closed is made again once."""
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            fresh = conn is None
            if fresh:
                conn = self._local.conn = self._connect()
            try:
                conn.request(method, path, body=body, headers=_wire.headers(self.target, body, json_body))
                sock = conn.sock  # the answer's, also once conn lets go of it ("Connection: close")
                resp = conn.getresponse()
                resp.dsec_sock = sock  # type: ignore[attr-defined]
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest, BrokenPipeError) as e:
                self._drop()
                if fresh or attempt:
                    raise InfraError("no answer from the dsec worker at %s (%s): is it running? (dsec daemon); "
                                     "a retried exec with the same id never runs twice" % (self.target.where, e)) from e
                continue
            except OSError as e:
                self._drop()
                raise InfraError("no answer from the dsec worker at %s (%s): is it running? (dsec daemon)"
                                 % (self.target.where, e)) from e
            if resp.status >= 300:
                data = resp.read()
                raise _wire.error_of(resp.status, data, self.target.where if self.target.host else "")
            return resp
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data = b"" if body is None else json.dumps(body).encode()
        resp = self._send(method, path, data)
        raw = resp.read()
        return json.loads(raw) if raw else None

    def close(self) -> None:
        """Close this thread's connection."""
        self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the API ---------------------------------------------------------

    def version(self) -> Dict[str, Any]:
        """Who the worker is: its version, API, pid, backends, limits, features."""
        return self._json("GET", _wire.path("/version"))

    def create(self, layers: Sequence[str] = (), name: Optional[str] = None, cpu: Optional[float] = None,
               memory: Optional[int] = None, env: Env = None, workdir: Optional[str] = None,
               policy: Union[str, Mapping[str, Any], None] = None, backend: Optional[str] = None,
               image: Optional[str] = None, **spec: Any) -> "Sandbox":
        """Create and start a sandbox on layers (topmost first: toolkit,
        workspace, base), or on a container image (image="python:3.12",
        pulled on first use; pull="never" uses only what the store holds,
        pull="always" resolves its tag again) with any layers over it. memory
        in bytes; policy a stored policy's name or a policy document; spec:
        any other api.SandboxSpec field (pids, disk, class_, hostname, user,
        userns, snapshot, pull)."""
        if "class_" in spec:
            spec["class"] = spec.pop("class_")
        d = self._json("POST", _wire.path("/sandboxes"),
                       _wire.spec(layers, name, cpu, memory, env, workdir, policy, backend, image=image, **spec))
        return Sandbox(self, d["name"])

    def batch(self, count: int, layers: Sequence[str] = (), name: Optional[str] = None,
              **spec: Any) -> List[Union["Sandbox", DsecError]]:
        """Create count sandboxes of one spec in one request (a rollout's
        burst; through a gateway, spread over its workers), named NAME-0 ...
        (none: generated). In index order: each Sandbox, or the error it was
        not made for. spec: what create takes."""
        if "class_" in spec:
            spec["class"] = spec.pop("class_")
        body = json.dumps({"spec": _wire.spec(layers, name, **spec), "count": count}).encode()
        raw = self._send("POST", _wire.path("/batches"), body).read()
        return [x if isinstance(x, DsecError) else Sandbox(self, x) for x in _wire.batch_items(raw, count)]

    def sandbox(self, name: str) -> "Sandbox":
        """A handle on an existing sandbox."""
        return Sandbox(self, name)

    def sandboxes(self) -> List[SandboxInfo]:
        """Every sandbox this client may see, oldest first."""
        return [SandboxInfo.of(d) for d in self._json("GET", _wire.path("/sandboxes")) or []]

    def branch(self, snapshot: str, n: int, name_prefix: Optional[str] = None, **spec: Any) -> List["Sandbox"]:
        """Start n sandboxes on one snapshot (NAME:STEP), each on its own
        copy of the files; all or none are made."""
        req: Dict[str, Any] = {"snapshot": snapshot, "n": n}
        if name_prefix:
            req["name_prefix"] = name_prefix
        if spec:
            req["spec"] = _wire.spec(**spec)
        return [Sandbox(self, d["name"]) for d in self._json("POST", _wire.path("/branches"), req)]

    def groups(self) -> List[Dict[str, Any]]:
        """The fork groups this client may see, each member's state and last exec."""
        return (self._json("GET", _wire.path("/groups"))) or []

    def group(self, id: str) -> Dict[str, Any]:
        return self._json("GET", _wire.path("/groups/" + _wire.quote(id, safe="")))

    def remove_group(self, id: str) -> Dict[str, Any]:
        """Remove a group's members, and its snapshot unless something else stands on it."""
        return self._json("DELETE", _wire.path("/groups/" + _wire.quote(id, safe="")))

    def keep(self, group: str, member: str) -> Dict[str, Any]:
        """Keep one member of a fork group (the next step's parent) and remove the others."""
        return self._json("POST", _wire.path("/groups/" + _wire.quote(group, safe="") + "/keep"), {"member": member})

    def create_lease(self, ttl: int) -> Dict[str, Any]:
        """A lease of ttl seconds, for forks to name (Sandbox.fork(lease=...))."""
        return self._json("POST", _wire.path("/leases"), {"ttl": int(ttl)})

    def leases(self) -> List[Dict[str, Any]]:
        return (self._json("GET", _wire.path("/leases"))) or []

    def renew_lease(self, id: str, ttl: int) -> Dict[str, Any]:
        """Make the lease expire ttl seconds from now."""
        return self._json("POST", _wire.path("/leases/" + _wire.quote(id, safe="") + "/renew"), {"ttl": int(ttl)})

    def remove_lease(self, id: str) -> Dict[str, Any]:
        """End the lease now: what it holds is removed, its snapshots untagged unless something else stands on them."""
        return self._json("DELETE", _wire.path("/leases/" + _wire.quote(id, safe="")))

    def snapshots(self) -> List[Dict[str, Any]]:
        """The snapshots this client may see, with their lineage."""
        return self._json("GET", _wire.path("/snapshots")) or []

    def snapshot(self, name: str) -> Dict[str, Any]:
        """The snapshot named name (NAME:STEP) with its lineage; NotFound if there is none this client sees."""
        for n in self._json("GET", _wire.path("/snapshots", name=name)) or []:
            if n.get("name") == name:  # an older worker lists them all
                return n
        raise _wire.NotFound("no snapshot " + name, 404)

    def remove_snapshot(self, ref: str, force: bool = False) -> None:
        self._send("DELETE", _wire.path("/snapshots/" + ref, force="1" if force else None)).read()

    def call(self, pool: Optional[str], args: Sequence[str], id: Optional[str] = None, stdin: Union[bytes, str, None] = None,
             env: Env = None, workdir: Optional[str] = None, spec: Optional[Mapping[str, Any]] = None,
             timeout: Optional[float] = None) -> ExecResult:
        """Run one command in a fresh warm sandbox of the FnCall pool (or of
        the pool whose template is spec), discarded after the call."""
        id, body = _wire.exec_body(args, id, stdin, env, workdir, pool=pool, spec=dict(spec) if spec else None)
        return self._frames("POST", _wire.path("/calls"), id, body, timeout, None)

    # -- execs -----------------------------------------------------------

    def _frames(self, method: str, path: str, id: str, body: bytes, timeout: Optional[float],
                each: Optional[Any]) -> ExecResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        resp = self._send(method, path, body, json_body=False)
        f = _wire.Frames(id)
        try:
            _settimeout(resp, None)  # a command takes what it takes, but for timeout
            while not f.done:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("exec %s: no result after %gs; it runs on: ask again with the same id" % (id, timeout))
                    _settimeout(resp, left)
                try:
                    line = resp.readline()
                except socket.timeout as e:
                    raise TimeoutError("exec %s: no result after %gs; it runs on: ask again with the same id" % (id, timeout)) from e
                except (ConnectionError, http.client.IncompleteRead) as e:
                    raise InfraError("exec %s: the worker went away (%s): retry with the same id" % (id, e)) from e
                if not line:
                    break
                for out in f.line(line):
                    if each is not None:
                        each(out)
            resp.read()
        except BaseException:
            self._drop()  # the answer is not read to its end
            raise
        finally:
            _settimeout(resp, self.timeout)
        return f.finish()


class Sandbox:
    """A handle on a sandbox, by name."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name

    def __repr__(self) -> str:
        return "Sandbox(%r)" % self.name

    def inspect(self) -> SandboxInfo:
        return SandboxInfo.of(self.client._json("GET", _wire.sandbox_path(self.name)))

    def exec(self, args: Sequence[str], id: Optional[str] = None, stdin: Union[bytes, str, None] = None,
             timeout: Optional[float] = None, env: Env = None, workdir: Optional[str] = None) -> ExecResult:
        """Run a command and wait for it: its exit code and output. A command
        that fails is a result (never an exception); InfraError means the
        sandbox or worker failed: ask again with the same id, and it runs at
        most once. timeout: seconds to wait (TimeoutError; the command runs
        on, and the same id later gets its result)."""
        id, body = _wire.exec_body(args, id, stdin, env, workdir)
        return self.client._frames("POST", _wire.sandbox_path(self.name, "/exec"), id, body, timeout, None)

    def exec_stream(self, args: Sequence[str], id: Optional[str] = None, stdin: Union[bytes, str, None] = None,
                    timeout: Optional[float] = None, env: Env = None, workdir: Optional[str] = None) -> "ExecStream":
        """exec, its output as it comes: iterate for Output pieces, then read
        .result. timeout: seconds without output before TimeoutError."""
        return ExecStream(self, args, id, stdin, timeout, env, workdir)

    def logs(self, id: str) -> ExecResult:
        """The recorded output and result of the exec id (waits for a running one)."""
        return self.client._frames("GET", _wire.sandbox_path(self.name, "/execs/" + id, follow="1"), id, b"", None, None)

    def write_file(self, path: str, data: Union[bytes, str], mode: int = 0o644) -> None:
        """Write a file (atomically: its directory must exist)."""
        b = data.encode() if isinstance(data, str) else bytes(data)
        self.client._send("PUT", _wire.sandbox_path(self.name, "/files", path=path, mode="%o" % mode), b, json_body=False).read()

    def read_file(self, path: str) -> bytes:
        return self.client._send("GET", _wire.sandbox_path(self.name, "/files", path=path)).read()

    def screenshot(self) -> Tuple[bytes, Dict[str, int]]:
        """The screen of a full VM (backend vm) as PNG bytes, and its
        {"width", "height", "seq"} (seq: the sandbox's count of screenshots).
        Another backend has no screen: NotImplementedByWorker."""
        resp = self.client._send("GET", _wire.sandbox_path(self.name, "/screen"))
        png = resp.read()
        return png, _wire.screen_info(resp)

    def input(self, **action: Any) -> None:
        """One action on a full VM's keyboard or mouse: text="...",
        key="ctrl+alt+t", move={"x", "y"}, click={"x", "y", "button",
        "double"}, drag={"from": {...}, "to": {...}} or scroll=N."""
        self.client._json("POST", _wire.sandbox_path(self.name, "/input"), action)

    def type_text(self, text: str) -> None:
        """Type text (ASCII) on a full VM's keyboard."""
        self.input(text=text)

    def press(self, key: str) -> None:
        """Press a key by name ("Return", "ctrl+alt+t") on a full VM."""
        self.input(key=key)

    def click(self, x: int, y: int, button: str = "left", double: bool = False) -> None:
        """Click at pixel (x, y) of a full VM's screen."""
        self.input(click={"x": x, "y": y, "button": button, "double": double})

    def vnc(self) -> Dict[str, str]:
        """Grant a token to a full VM's screen over VNC, ending the grant
        before: {"sandbox", "path", "token"}; the WebSocket at path (RFB in
        binary messages, as noVNC speaks it) opens with ?token= alone.
        Another backend has no screen: NotImplementedByWorker."""
        return self.client._json("POST", _wire.sandbox_path(self.name, "/vnc"))

    def revoke_vnc(self) -> None:
        """End the sandbox's VNC grant and the connections it opened."""
        self.client._send("DELETE", _wire.sandbox_path(self.name, "/vnc")).read()

    def pack_diff(self, tag: str, memory: bool = False) -> Snapshot:
        """Snapshot what the sandbox changed as a layer tagged NAME:STEP;
        memory: a microVM's guest whole too, its processes and memory, which
        its branches continue (another backend: NotImplementedByWorker)."""
        req: Dict[str, Any] = {"tag": tag}
        if memory:
            req["memory"] = True
        return Snapshot.of(self.client._json("POST", _wire.sandbox_path(self.name, "/snapshots"), req))

    def grade(self, grader: Sequence[str], args: Sequence[str], carry: Optional[Sequence[str]] = None, id: Optional[str] = None,
              env: Env = None, cwd: Optional[str] = None, user: Optional[str] = None, timeout: Optional[int] = None,
              result: Optional[str] = None) -> Grade:
        """Grade the sandbox in a fresh one: the grader's layers (grader,
        topmost first) over what the carry rules (carry, else the policy's
        grading.carry: absolute globs, "!" to exclude) take of its changes
        over its own pristine layers, with no network and none of its
        processes; args run there, $DSEC_GRADE_RESULT the path of the JSON
        result it may write. The answer has the exit code, output, result
        and a tamper report of what the grade left out. A retry with the
        same id answers what the first answered; the sandbox runs on."""
        return Grade.of(self.client._json("POST", _wire.sandbox_path(self.name, "/grade"),
                                          _wire.grade_request(grader, args, carry, id, env, cwd, user, timeout, result)))

    def fork(self, n: int, ttl: Optional[int] = None, lease: Optional[str] = None, tag: Optional[str] = None,
             name_prefix: Optional[str] = None, memory: bool = False) -> Dict[str, Any]:
        """Snapshot the sandbox and start n sandboxes on it, in one call: a
        fork group (its "id", "snapshot" and "members"), held by a new lease
        of ttl seconds, or the lease named, or (neither) until it is removed."""
        req: Dict[str, Any] = {"n": n}
        for k, v in (("ttl", ttl), ("lease", lease), ("tag", tag), ("name_prefix", name_prefix), ("memory", memory)):
            if v:
                req[k] = v
        return self.client._json("POST", _wire.sandbox_path(self.name, "/fork"), req)

    def apply_policy(self, policy: Union[str, Mapping[str, Any]], reset: bool = False) -> PolicyReport:
        """Apply a policy to the running sandbox: a stored policy's name or a
        policy document (a dict, as dsec policy show prints it). Its network
        rules hold for every process at once; reset: connections the new
        policy no longer allows are ended too (by default they live on)."""
        return PolicyReport.of(self.client._json("POST", _wire.sandbox_path(self.name, "/policy"),
                                                 _wire.policy_request(policy, reset)))

    def idle(self, expected: float) -> Dict[str, Any]:
        """Hint that the sandbox will wait about expected seconds (for the
        model's next turn): the worker freezes one expected to wait long
        enough and gives its memory back to the host; the next exec resumes
        it first. Answers {"frozen", "memory_before", "memory_after"}."""
        return self.client._json("POST", _wire.sandbox_path(self.name, "/idle"), {"expected_seconds": float(expected)})

    def pause(self) -> None:
        """Freeze the sandbox's processes where they are, their memory kept."""
        self.client._json("POST", _wire.sandbox_path(self.name, "/pause"))

    def resume(self) -> None:
        """Let a paused sandbox run on (an evicted microVM restored first)."""
        self.client._json("POST", _wire.sandbox_path(self.name, "/resume"))

    def evict(self) -> None:
        """Pause a microVM and save its guest to the worker's disk, its
        memory given back to the host; resume restores it."""
        self.client._json("POST", _wire.sandbox_path(self.name, "/evict"))

    def stop(self) -> None:
        self.client._json("POST", _wire.sandbox_path(self.name, "/stop"))

    def start(self) -> None:
        self.client._json("POST", _wire.sandbox_path(self.name, "/start"))

    def remove(self, force: bool = False) -> None:
        self.client._send("DELETE", _wire.sandbox_path(self.name, force="1" if force else None)).read()


class ExecStream:
    """A running exec's output, piece by piece; .result once it ended."""

    def __init__(self, sb: Sandbox, args: Sequence[str], id: Optional[str], stdin: Union[bytes, str, None],
                 timeout: Optional[float], env: Env, workdir: Optional[str]) -> None:
        self.id, self._body = _wire.exec_body(args, id, stdin, env, workdir)
        self._sb, self._timeout = sb, timeout
        self.result: Optional[ExecResult] = None

    def __iter__(self) -> Iterator[Output]:
        c = self._sb.client
        resp = c._send("POST", _wire.sandbox_path(self._sb.name, "/exec"), self._body, json_body=False)
        f = _wire.Frames(self.id)
        try:
            _settimeout(resp, self._timeout)  # between pieces of output (None: none)
            while not f.done:
                try:
                    line = resp.readline()
                except socket.timeout as e:
                    raise TimeoutError("exec %s: no output for %gs; it runs on: ask again with the same id"
                                       % (self.id, self._timeout)) from e
                if not line:
                    break
                yield from f.line(line)
            resp.read()
            _settimeout(resp, c.timeout)
        except BaseException:
            c._drop()  # the answer is not read to its end
            raise
        self.result = f.finish()
