"""The asyncio client: the same methods as dsec.Client, as coroutines, over
asyncio streams (the worker's unix socket, or TCP with TLS). Idle
connections are kept for the next request; an exec always carries an id
(one is made if none is given), so that a request sent again never runs the
command twice. Many requests may run at once on one client: each takes a
connection of its own.

    async with dsec.aio.Client() as c:
        sb = await c.create(["bb:1"])
        res = await sb.exec(["sh", "-c", "echo hi"], id="step-1")
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _wire
from ._wire import DsecError, Env, ExecResult, Grade, InfraError, Output, PolicyReport, SandboxInfo, Snapshot, Target

_Conn = Tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Response:
    """An answer being read: its status, headers and body, chunked or not."""

    def __init__(self, conn: _Conn, status: int, headers: Dict[str, str]) -> None:
        self.reader, self.writer = conn
        self.status, self.headers = status, headers
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.left = int(headers.get("content-length", "-1")) if not self.chunked else -1
        if status in (204, 304) or 100 <= status < 200:  # no body, whatever the headers say
            self.chunked, self.left = False, 0
        self.keep = headers.get("connection", "").lower() != "close"
        self.done = self.left == 0
        self._chunk = 0
        self._buf = b""

    def getheader(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    async def _piece(self) -> bytes:
        """The next piece of the body (b"" at its end)."""
        if self.done:
            return b""
        r = self.reader
        if self.chunked:
            if self._chunk == 0:
                size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()).strip():  # trailers
                        pass
                    self.done = True
                    return b""
                self._chunk = size
            data = await r.read(min(self._chunk, 1 << 16))
            if not data:
                raise ConnectionError("the answer ended mid-chunk")
            self._chunk -= len(data)
            if self._chunk == 0:
                await r.readexactly(2)  # CRLF
            return data
        if self.left < 0:  # to the connection's end
            data = await r.read(1 << 16)
            if not data:
                self.done, self.keep = True, False
            return data
        data = await r.read(min(self.left, 1 << 16))
        if not data:
            raise ConnectionError("the answer ended early")
        self.left -= len(data)
        self.done = self.left == 0
        return data

    async def read(self) -> bytes:
        out = [self._buf]
        self._buf = b""
        while True:
            p = await self._piece()
            if not p:
                return b"".join(out)
            out.append(p)

    async def readline(self) -> bytes:
        while b"\n" not in self._buf:
            p = await self._piece()
            if not p:
                line, self._buf = self._buf, b""
                return line
            self._buf += p
        line, _, self._buf = self._buf.partition(b"\n")
        return line + b"\n"


class Client:
    """An asyncio client of one worker; the same settings as dsec.Client."""

    def __init__(self, host: Optional[str] = None, token: Optional[str] = None, tls_ca: Optional[str] = None,
                 root: Optional[str] = None, client_cert: Optional[str] = None, client_key: Optional[str] = None,
                 timeout: float = 60.0, max_idle: int = 64) -> None:
        self.target: Target = _wire.target(host, token, tls_ca, root, client_cert, client_key)
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: List[_Conn] = []

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for _, w in idle:
            w.close()
        for _, w in idle:
            try:
                await w.wait_closed()
            except OSError:
                pass

    # -- transport -------------------------------------------------------

    async def _connect(self) -> _Conn:
        t = self.target
        try:
            if t.socket:
                return await asyncio.wait_for(asyncio.open_unix_connection(t.socket), self.timeout)
            return await asyncio.wait_for(asyncio.open_connection(t.host, t.port, ssl=t.ssl, limit=1 << 20), self.timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise InfraError("no answer from the dsec worker at %s (%s): is it running? (dsec daemon)" % (t.where, e)) from e

    async def _send(self, method: str, path: str, body: bytes = b"", json_body: bool = True) -> _Response:
        """Make a request and return its answer (status < 300); over an idle
        connection the worker had closed, once more over a new one."""
        for attempt in (0, 1):
            fresh = not self._idle
            conn = await self._connect() if fresh else self._idle.pop()
            r, w = conn
            h = _wire.headers(self.target, body, json_body)
            head = "%s %s HTTP/1.1\r\n%s\r\n" % (method, path, "".join("%s: %s\r\n" % kv for kv in h.items()))
            try:
                w.write(head.encode() + body)
                await w.drain()
                line = await asyncio.wait_for(r.readline(), self.timeout)
                if not line:
                    raise ConnectionError("the worker closed the connection")
                status = int(line.split()[1])
                headers: Dict[str, str] = {}
                while True:
                    hl = await r.readline()
                    if hl in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = hl.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
            except (ConnectionError, OSError, IndexError, ValueError) as e:
                w.close()
                if fresh or attempt:
                    raise InfraError("no answer from the dsec worker at %s (%s): is it running? (dsec daemon); "
                                     "a retried exec with the same id never runs twice" % (self.target.where, e)) from e
                continue
            resp = _Response(conn, status, headers)
            if status >= 300:
                data = await resp.read()
                self._release(resp)
                raise _wire.error_of(status, data, self.target.where if self.target.host else "")
            return resp
        raise AssertionError("unreachable")

    def _release(self, resp: _Response) -> None:
        """Keep resp's connection for the next request if it may serve one."""
        if resp.done and resp.keep and len(self._idle) < self.max_idle:
            self._idle.append((resp.reader, resp.writer))
        else:
            resp.writer.close()

    async def _body(self, method: str, path: str, body: bytes = b"", json_body: bool = True) -> bytes:
        resp = await self._send(method, path, body, json_body)
        try:
            data = await resp.read()
        except BaseException:
            resp.writer.close()
            raise
        self._release(resp)
        return data

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        raw = await self._body(method, path, b"" if body is None else json.dumps(body).encode())
        return json.loads(raw) if raw else None

    async def _stream(self, method: str, path: str, id: str, body: bytes) -> AsyncIterator[Union[Output, ExecResult]]:
        """An exec's answer: its Output pieces as they come, then its ExecResult."""
        resp = await self._send(method, path, body, json_body=False)
        f = _wire.Frames(id)
        try:
            while not f.done:
                line = await resp.readline()
                if not line:
                    break
                for out in f.line(line):
                    yield out
            await resp.read()
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            resp.writer.close()
            raise InfraError("exec %s: the worker went away (%s): retry with the same id" % (id, e)) from e
        except BaseException:
            resp.writer.close()  # the answer is not read to its end
            raise
        self._release(resp)
        yield f.finish()

    async def _frames(self, method: str, path: str, id: str, body: bytes, timeout: Optional[float]) -> ExecResult:
        async def run() -> ExecResult:
            last: Union[Output, ExecResult, None] = None
            async for last in self._stream(method, path, id, body):
                pass
            assert isinstance(last, ExecResult)
            return last

        if timeout is None:
            return await run()
        try:
            return await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError as e:
            raise TimeoutError("exec %s: no result after %gs; it runs on: ask again with the same id" % (id, timeout)) from e

    # -- the API ---------------------------------------------------------

    async def version(self) -> Dict[str, Any]:
        return await self._json("GET", _wire.path("/version"))

    async def create(self, layers: Sequence[str] = (), name: Optional[str] = None, cpu: Optional[float] = None,
                     memory: Optional[int] = None, env: Env = None, workdir: Optional[str] = None,
                     policy: Union[str, Mapping[str, Any], None] = None, backend: Optional[str] = None,
                     image: Optional[str] = None, **spec: Any) -> "Sandbox":
        """See dsec.Client.create."""
        if "class_" in spec:
            spec["class"] = spec.pop("class_")
        d = await self._json("POST", _wire.path("/sandboxes"),
                             _wire.spec(layers, name, cpu, memory, env, workdir, policy, backend, image=image, **spec))
        return Sandbox(self, d["name"])

    async def batch(self, count: int, layers: Sequence[str] = (), name: Optional[str] = None,
                    **spec: Any) -> List[Union["Sandbox", DsecError]]:
        """See dsec.Client.batch."""
        if "class_" in spec:
            spec["class"] = spec.pop("class_")
        body = json.dumps({"spec": _wire.spec(layers, name, **spec), "count": count}).encode()
        raw = await self._body("POST", _wire.path("/batches"), body)
        return [x if isinstance(x, DsecError) else Sandbox(self, x) for x in _wire.batch_items(raw, count)]

    def sandbox(self, name: str) -> "Sandbox":
        return Sandbox(self, name)

    async def sandboxes(self) -> List[SandboxInfo]:
        return [SandboxInfo.of(d) for d in await self._json("GET", _wire.path("/sandboxes")) or []]

    async def branch(self, snapshot: str, n: int, name_prefix: Optional[str] = None, **spec: Any) -> List["Sandbox"]:
        req: Dict[str, Any] = {"snapshot": snapshot, "n": n}
        if name_prefix:
            req["name_prefix"] = name_prefix
        if spec:
            req["spec"] = _wire.spec(**spec)
        return [Sandbox(self, d["name"]) for d in await self._json("POST", _wire.path("/branches"), req)]

    async def groups(self) -> List[Dict[str, Any]]:
        """The fork groups this client may see, each member's state and last exec."""
        return (await self._json("GET", _wire.path("/groups"))) or []

    async def group(self, id: str) -> Dict[str, Any]:
        return await self._json("GET", _wire.path("/groups/" + _wire.quote(id, safe="")))

    async def remove_group(self, id: str) -> Dict[str, Any]:
        """Remove a group's members, and its snapshot unless something else stands on it."""
        return await self._json("DELETE", _wire.path("/groups/" + _wire.quote(id, safe="")))

    async def keep(self, group: str, member: str) -> Dict[str, Any]:
        """Keep one member of a fork group (the next step's parent) and remove the others."""
        return await self._json("POST", _wire.path("/groups/" + _wire.quote(group, safe="") + "/keep"), {"member": member})

    async def create_lease(self, ttl: int) -> Dict[str, Any]:
        """A lease of ttl seconds, for forks to name (Sandbox.fork(lease=...))."""
        return await self._json("POST", _wire.path("/leases"), {"ttl": int(ttl)})

    async def leases(self) -> List[Dict[str, Any]]:
        return (await self._json("GET", _wire.path("/leases"))) or []

    async def renew_lease(self, id: str, ttl: int) -> Dict[str, Any]:
        """Make the lease expire ttl seconds from now."""
        return await self._json("POST", _wire.path("/leases/" + _wire.quote(id, safe="") + "/renew"), {"ttl": int(ttl)})

    async def remove_lease(self, id: str) -> Dict[str, Any]:
        """End the lease now: what it holds is removed, its snapshots untagged unless something else stands on them."""
        return await self._json("DELETE", _wire.path("/leases/" + _wire.quote(id, safe="")))

    async def snapshots(self) -> List[Dict[str, Any]]:
        return await self._json("GET", _wire.path("/snapshots")) or []

    async def snapshot(self, name: str) -> Dict[str, Any]:
        for n in await self._json("GET", _wire.path("/snapshots", name=name)) or []:
            if n.get("name") == name:  # an older worker lists them all
                return n
        raise _wire.NotFound("no snapshot " + name, 404)

    async def remove_snapshot(self, ref: str, force: bool = False) -> None:
        await self._body("DELETE", _wire.path("/snapshots/" + ref, force="1" if force else None))

    async def call(self, pool: Optional[str], args: Sequence[str], id: Optional[str] = None,
                   stdin: Union[bytes, str, None] = None, env: Env = None, workdir: Optional[str] = None,
                   spec: Optional[Mapping[str, Any]] = None, timeout: Optional[float] = None) -> ExecResult:
        id, body = _wire.exec_body(args, id, stdin, env, workdir, pool=pool, spec=dict(spec) if spec else None)
        return await self._frames("POST", _wire.path("/calls"), id, body, timeout)


class Sandbox:
    """A handle on a sandbox, by name; see dsec.Sandbox."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name

    def __repr__(self) -> str:
        return "aio.Sandbox(%r)" % self.name

    async def inspect(self) -> SandboxInfo:
        return SandboxInfo.of(await self.client._json("GET", _wire.sandbox_path(self.name)))

    async def exec(self, args: Sequence[str], id: Optional[str] = None, stdin: Union[bytes, str, None] = None,
                   timeout: Optional[float] = None, env: Env = None, workdir: Optional[str] = None) -> ExecResult:
        """See dsec.Sandbox.exec."""
        id, body = _wire.exec_body(args, id, stdin, env, workdir)
        return await self.client._frames("POST", _wire.sandbox_path(self.name, "/exec"), id, body, timeout)

    async def exec_stream(self, args: Sequence[str], id: Optional[str] = None, stdin: Union[bytes, str, None] = None,
                          env: Env = None, workdir: Optional[str] = None) -> AsyncIterator[Union[Output, ExecResult]]:
        """exec, its output as it comes: Output pieces, then the ExecResult."""
        id, body = _wire.exec_body(args, id, stdin, env, workdir)
        async for x in self.client._stream("POST", _wire.sandbox_path(self.name, "/exec"), id, body):
            yield x

    async def logs(self, id: str) -> ExecResult:
        return await self.client._frames("GET", _wire.sandbox_path(self.name, "/execs/" + id, follow="1"), id, b"", None)

    async def write_file(self, path: str, data: Union[bytes, str], mode: int = 0o644) -> None:
        b = data.encode() if isinstance(data, str) else bytes(data)
        await self.client._body("PUT", _wire.sandbox_path(self.name, "/files", path=path, mode="%o" % mode), b, json_body=False)

    async def screenshot(self) -> Tuple[bytes, Dict[str, int]]:
        """A full VM's screen; see Sandbox.screenshot of dsec.Client."""
        resp = await self.client._send("GET", _wire.sandbox_path(self.name, "/screen"))
        try:
            png = await resp.read()
        except BaseException:
            resp.writer.close()
            raise
        self.client._release(resp)
        return png, _wire.screen_info(resp)

    async def input(self, **action: Any) -> None:
        """One action on a full VM's keyboard or mouse; see Sandbox.input of dsec.Client."""
        await self.client._json("POST", _wire.sandbox_path(self.name, "/input"), action)

    async def read_file(self, path: str) -> bytes:
        return await self.client._body("GET", _wire.sandbox_path(self.name, "/files", path=path))

    async def vnc(self) -> Dict[str, str]:
        """A VNC grant to a full VM's screen; see Sandbox.vnc of dsec.Client."""
        return await self.client._json("POST", _wire.sandbox_path(self.name, "/vnc"))

    async def revoke_vnc(self) -> None:
        """End the sandbox's VNC grant; see Sandbox.revoke_vnc of dsec.Client."""
        await self.client._body("DELETE", _wire.sandbox_path(self.name, "/vnc"))

    async def pack_diff(self, tag: str, memory: bool = False) -> Snapshot:
        req: Dict[str, Any] = {"tag": tag}
        if memory:
            req["memory"] = True
        return Snapshot.of(await self.client._json("POST", _wire.sandbox_path(self.name, "/snapshots"), req))

    async def grade(self, grader: Sequence[str], args: Sequence[str], carry: Optional[Sequence[str]] = None, id: Optional[str] = None,
                    env: Env = None, cwd: Optional[str] = None, user: Optional[str] = None, timeout: Optional[int] = None,
                    result: Optional[str] = None) -> Grade:
        """Grade the sandbox in a fresh one; see Sandbox.grade of dsec.Client."""
        return Grade.of(await self.client._json("POST", _wire.sandbox_path(self.name, "/grade"),
                                                _wire.grade_request(grader, args, carry, id, env, cwd, user, timeout, result)))

    async def fork(self, n: int, ttl: Optional[int] = None, lease: Optional[str] = None, tag: Optional[str] = None,
             name_prefix: Optional[str] = None, memory: bool = False) -> Dict[str, Any]:
        """Snapshot the sandbox and start n sandboxes on it, in one call: a
        fork group (its "id", "snapshot" and "members"), held by a new lease
        of ttl seconds, or the lease named, or (neither) until it is removed."""
        req: Dict[str, Any] = {"n": n}
        for k, v in (("ttl", ttl), ("lease", lease), ("tag", tag), ("name_prefix", name_prefix), ("memory", memory)):
            if v:
                req[k] = v
        return await self.client._json("POST", _wire.sandbox_path(self.name, "/fork"), req)

    async def apply_policy(self, policy: Union[str, Mapping[str, Any]], reset: bool = False) -> PolicyReport:
        """Apply a policy to the running sandbox: a stored policy's name or a
        policy document (a dict, as dsec policy show prints it). Its network
        rules hold for every process at once; reset: connections the new
        policy no longer allows are ended too (by default they live on)."""
        return PolicyReport.of(await self.client._json("POST", _wire.sandbox_path(self.name, "/policy"),
                                                       _wire.policy_request(policy, reset)))

    async def idle(self, expected: float) -> Dict[str, Any]:
        """Hint that the sandbox will wait about expected seconds (for the
        model's next turn): the worker freezes one expected to wait long
        enough and gives its memory back to the host; the next exec resumes
        it first. Answers {"frozen", "memory_before", "memory_after"}."""
        return await self.client._json("POST", _wire.sandbox_path(self.name, "/idle"), {"expected_seconds": float(expected)})

    async def pause(self) -> None:
        await self.client._json("POST", _wire.sandbox_path(self.name, "/pause"))

    async def resume(self) -> None:
        await self.client._json("POST", _wire.sandbox_path(self.name, "/resume"))

    async def evict(self) -> None:
        await self.client._json("POST", _wire.sandbox_path(self.name, "/evict"))

    async def stop(self) -> None:
        await self.client._json("POST", _wire.sandbox_path(self.name, "/stop"))

    async def start(self) -> None:
        await self.client._json("POST", _wire.sandbox_path(self.name, "/start"))

    async def remove(self, force: bool = False) -> None:
        await self.client._body("DELETE", _wire.sandbox_path(self.name, force="1" if force else None))
