"""What the sync and asyncio clients share: settings, the API's errors and
types, and how requests and exec frames are written and read.

The wire format is package api of the Go code: HTTP/1.1 and JSON under /v1,
errors as a status and {"class", "message"}, an exec's answer as one JSON
frame per line.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import ssl
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote, urlencode

API = "/v1"
SOCKET = "dsec.sock"

Env = Union[Mapping[str, str], Sequence[str], None]


class DsecError(Exception):
    """An error the worker (or reaching it) gave. ``cls`` is the API's error
    class, ``status`` the HTTP status (0: no answer)."""

    cls = "internal"

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidArgument(DsecError, ValueError):
    """The request is wrong: fix it (a bad name, spec, path or id)."""

    cls = "invalid"


class NotFound(DsecError, LookupError):
    """No such sandbox, snapshot, exec or file (or another token's)."""

    cls = "not_found"


class Conflict(DsecError):
    """The name is taken, or an exec id ran another command."""

    cls = "exists"


class WrongState(Conflict):
    """The sandbox is in the wrong state: stopped, say, for an exec."""

    cls = "state"


class InfraError(DsecError):
    """The sandbox, the worker or the host failed, not the command: retry the
    step, with the same id, here or elsewhere; it never runs twice."""

    cls = "infra"


class Busy(DsecError):
    """The host is at capacity: retry later."""

    cls = "busy"


class LimitExceeded(DsecError):
    """Over a bound (a snapshot's size, entries or depth)."""

    cls = "limit"


class Unauthorized(DsecError, PermissionError):
    """No valid token: give one (DSEC_TOKEN; dsec token create on the worker's host)."""

    cls = "unauthorized"


class PermissionDenied(DsecError, PermissionError):
    """Not allowed: a registry refused the credentials, or the token's scope
    does not cover it."""

    cls = "denied"


class NotImplementedByWorker(DsecError, NotImplementedError):
    """The worker, its backend or its host cannot do this."""

    cls = "not_implemented"


class DataLoss(DsecError):
    """State on the worker's disk is damaged."""

    cls = "data_loss"


class CommandFailed(DsecError):
    """A command exited non-zero. Never raised by ``exec`` (a failing command is
    a result): ``ExecResult.check()`` raises it for those who want that."""

    cls = "command"

    def __init__(self, result: "ExecResult") -> None:
        super().__init__("command %s exited %d" % (result.id, result.exit_code))
        self.result = result


_CLASSES = {c.cls: c for c in (InvalidArgument, NotFound, Conflict, WrongState, InfraError, Busy, LimitExceeded,
                               Unauthorized, PermissionDenied, NotImplementedByWorker, DataLoss)}
_STATUS = {400: "invalid", 401: "unauthorized", 403: "denied", 404: "not_found", 409: "exists", 412: "state",
           413: "limit", 429: "busy", 501: "not_implemented", 503: "infra"}


def error_of(status: int, body: bytes, where: str = "") -> DsecError:
    """The exception an error answer is."""
    cls, message = "", ""
    try:
        e = json.loads(body or b"{}")
        cls, message = e.get("class", ""), e.get("message", "")
    except (ValueError, AttributeError):
        pass
    cls = cls or _STATUS.get(status, "internal")
    message = message or "HTTP %d" % status
    if cls == "unauthorized" and where:
        message = ("the worker at %s refused the token: give a valid one in DSEC_TOKEN "
                   "(dsec token ls on the worker's host lists them): %s" % (where, message))
    return _CLASSES.get(cls, DsecError)(message, status)


def error_frame(e: Mapping[str, Any]) -> DsecError:
    return _CLASSES.get(e.get("class", ""), DsecError)(e.get("message", "exec failed"), 0)


def batch_items(raw: bytes, count: int) -> List[Union[str, DsecError]]:
    """A batch's answer (api.BatchItem lines), in index order: each
    sandbox's name, or the error it was not made for."""
    out: List[Union[str, DsecError, None]] = [None] * count
    for line in raw.splitlines():
        if not line.strip():
            continue
        it = json.loads(line)
        i = it.get("index", -1)
        if 0 <= i < count:
            out[i] = error_frame(it["error"]) if it.get("error") else it["sandbox"]["name"]
    return [x if x is not None else InfraError("the batch's answer ended before its sandbox %d" % i, 0)
            for i, x in enumerate(out)]


@dataclass
class ExecResult:
    """How a command ended, and what it wrote (stdout and stderr as text, the
    bytes in stdout_bytes and stderr_bytes). ``replayed``: the id ran before
    and this is its recorded result; the command did not run again.
    ``output_truncated``: the command wrote more than the exec's cap (the
    worker's exec.max_output, lowered to the sandbox's disk bound), stdout and
    stderr together; the journal kept the first bytes and dropped
    ``output_truncated_bytes`` more. ``output_dropped``: the journal emptied
    this exec's output later, to stay within the sandbox's disk bound."""

    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    id: str = ""
    replayed: bool = False
    oom: bool = False
    sandbox: str = ""  # for a call: where it ran
    output_truncated: bool = False
    output_truncated_bytes: int = 0
    output_dropped: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> "ExecResult":
        """Raise CommandFailed if the command exited non-zero."""
        if self.exit_code != 0:
            raise CommandFailed(self)
        return self


@dataclass
class Output:
    """A piece of a running command's output: stream is "stdout" or "stderr"."""

    stream: str
    data: bytes


@dataclass
class Snapshot:
    """A snapshot pack-diff made (api.Snapshot)."""

    name: str
    digest: str = ""
    size: int = 0
    parent: str = ""
    layers: List[str] = field(default_factory=list)
    sandbox: str = ""
    incremental: bool = False
    memory: Optional[Dict[str, Any]] = None  # a memory snapshot's guest (api.SnapshotMemory)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> "Snapshot":
        return cls(name=d.get("name", ""), digest=d.get("digest", ""), size=d.get("size", 0), parent=d.get("parent", ""),
                   layers=list(d.get("layers") or []), sandbox=d.get("sandbox", ""), incremental=d.get("incremental", False),
                   memory=d.get("memory"), raw=dict(d))


@dataclass
class Grade:
    """A grade's answer (api.Grade): the grader's exit code, output and JSON
    result, what was carried, and the tamper report of what was not."""

    id: str
    sandbox: str = ""
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    result: Any = None  # the JSON the grader wrote, decoded; None: it wrote none
    result_error: str = ""
    timed_out: bool = False
    carried: Dict[str, Any] = field(default_factory=dict)  # digest, paths, bytes
    tamper: Dict[str, Any] = field(default_factory=dict)  # processes, groups, paths (api.TamperReport)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> "Grade":
        return cls(id=d.get("id", ""), sandbox=d.get("sandbox", ""), exit_code=d.get("exit_code", 0), stdout=d.get("stdout", ""),
                   stderr=d.get("stderr", ""), result=d.get("result"), result_error=d.get("result_error", ""),
                   timed_out=d.get("timed_out", False), carried=dict(d.get("carried") or {}), tamper=dict(d.get("tamper") or {}),
                   raw=dict(d))


def grade_request(grader: Sequence[str], args: Sequence[str], carry: Optional[Sequence[str]], id: Optional[str], env: "Env",
                  cwd: Optional[str], user: Optional[str], timeout: Optional[int], result: Optional[str]) -> Dict[str, Any]:
    """An api.GradeRequest; a fresh id when none is given, so that a retry
    of the same call is the same grade."""
    if isinstance(grader, str):
        grader = [grader]
    req: Dict[str, Any] = {"id": id or "grade-" + os.urandom(8).hex(), "grader": list(grader), "args": list(args)}
    if carry:
        req["carry"] = list(carry)
    if env is not None:
        req["env"] = env_list(env)
    for k, v in (("cwd", cwd), ("user", user), ("timeout", timeout), ("result", result)):
        if v:
            req[k] = v
    return req


@dataclass
class PolicyReport:
    """What applying a policy to a running sandbox did (api.PolicyReport)."""

    now: List[str] = field(default_factory=list)  # in force for every process at once
    new_processes: List[str] = field(default_factory=list)  # for processes started from now on
    unchanged: List[str] = field(default_factory=list)  # what a live policy cannot loosen

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> "PolicyReport":
        return cls(now=list(d.get("now") or []), new_processes=list(d.get("new_processes") or []),
                   unchanged=list(d.get("unchanged") or []))


def policy_request(policy: Union[str, Mapping[str, Any]], reset: bool) -> Dict[str, Any]:
    """An api.PolicyRequest: policy a stored policy's name or a document."""
    req: Dict[str, Any] = {"name": policy} if isinstance(policy, str) else {"policy": dict(policy)}
    if reset:
        req["reset"] = True
    return req


@dataclass
class SandboxInfo:
    """A sandbox as the worker describes it (api.Sandbox); raw holds every field."""

    name: str
    status: str = ""
    id: str = ""
    layers: List[str] = field(default_factory=list)
    pid: int = 0
    node: str = ""  # the worker that holds it, when a gateway answers (dsec gateway)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        return cls(name=d.get("name", ""), status=d.get("status", ""), id=d.get("id", ""),
                   layers=list(d.get("layers") or []), pid=d.get("pid", 0), node=d.get("node", ""), raw=dict(d))


def default_root() -> str:
    if os.environ.get("DSEC_ROOT"):
        return os.environ["DSEC_ROOT"]
    if os.geteuid() == 0:
        return "/var/lib/dsec"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(data, "dsec")


@dataclass
class Target:
    """Where the worker is: a unix socket, or TCP (with TLS or not)."""

    socket: str = ""
    host: str = ""
    port: int = 0
    token: str = ""
    ssl: Optional[ssl.SSLContext] = None

    @property
    def where(self) -> str:
        return "tcp://%s:%d" % (self.host, self.port) if self.host else self.socket


def target(host: Optional[str], token: Optional[str], tls_ca: Optional[str], root: Optional[str],
           client_cert: Optional[str] = None, client_key: Optional[str] = None) -> Target:
    """Resolve the settings: arguments, else DSEC_HOST, DSEC_TOKEN, DSEC_TLS_CA,
    DSEC_CLIENT_CERT and DSEC_CLIENT_KEY, else the local worker's socket. TLS
    is used with a CA or a client certificate, and off loopback."""
    host = host if host is not None else os.environ.get("DSEC_HOST", "")
    if not host:
        return Target(socket=os.path.join(root or default_root(), SOCKET))
    if not host.startswith("tcp://"):
        raise InvalidArgument("bad host %r: give tcp://HOST:PORT" % host)
    hostport = host[len("tcp://"):]
    name, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument("bad host %r: give tcp://HOST:PORT" % host)
    name = name.strip("[]")
    token = token if token is not None else os.environ.get("DSEC_TOKEN", "")
    if not token:
        raise Unauthorized("the worker at %s takes a token: give one in DSEC_TOKEN (dsec token create makes one on "
                           "the worker's host)" % host)
    tls_ca = tls_ca if tls_ca is not None else os.environ.get("DSEC_TLS_CA", "")
    client_cert = client_cert if client_cert is not None else os.environ.get("DSEC_CLIENT_CERT", "")
    client_key = client_key if client_key is not None else os.environ.get("DSEC_CLIENT_KEY", "")
    ctx = None
    if tls_ca or client_cert or not _loopback(name):
        ctx = ssl.create_default_context(cafile=tls_ca or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_cert:
            ctx.load_cert_chain(client_cert, client_key or None)
    return Target(host=name, port=int(port), token=token, ssl=ctx)


def _loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def headers(t: Target, body: bytes, json_body: bool = True) -> Dict[str, str]:
    h = {"Host": t.host or "dsec", "Content-Length": str(len(body))}
    if json_body and body:
        h["Content-Type"] = "application/json"
    if t.token:
        h["Authorization"] = "Bearer " + t.token
    return h


def path(p: str, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v is not None and v is not False}
    return API + p + ("?" + urlencode(q) if q else "")


def sandbox_path(name: str, p: str = "", **query: Any) -> str:
    return path("/sandboxes/" + quote(name, safe="") + p, **query)


def env_list(env: Env) -> Optional[List[str]]:
    if env is None:
        return None
    if isinstance(env, Mapping):
        return ["%s=%s" % kv for kv in env.items()]
    return list(env)


def spec(layers: Optional[Sequence[str]] = None, name: Optional[str] = None, cpu: Optional[float] = None,
         memory: Optional[int] = None, env: Env = None, workdir: Optional[str] = None,
         policy: Union[str, Mapping[str, Any], None] = None, backend: Optional[str] = None,
         snapshot: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """An api.SandboxSpec. policy: a stored policy's name, or a policy document
    (a dict, as dsec policy show prints it)."""
    s: Dict[str, Any] = {"layers": list(layers or [])}
    for k, v in (("name", name), ("cpu", cpu), ("memory", memory), ("env", env_list(env)), ("workdir", workdir),
                 ("backend", backend), ("snapshot", snapshot)):
        if v is not None:
            s[k] = v
    if isinstance(policy, str):
        s["policy_name"] = policy
    elif policy is not None:
        s["policy"] = dict(policy)
    s.update({k: v for k, v in extra.items() if v is not None})
    return s


def exec_body(args: Sequence[str], id: Optional[str], stdin: Union[bytes, str, None], env: Env,
              workdir: Optional[str], **extra: Any) -> Tuple[str, bytes]:
    """The exec's id (a new one if none is given, so that a retry of this very
    request never runs the command twice) and its request body."""
    if isinstance(args, (str, bytes)):
        raise InvalidArgument("args is a list of strings (the command and its arguments), not one string: "
                              "give [\"sh\", \"-c\", %r] for a shell line" % (args,))
    id = id or "py-" + secrets.token_hex(8)
    req: Dict[str, Any] = {"id": id, "args": list(args)}
    e = env_list(env)
    if e:
        req["env"] = e
    if workdir:
        req["cwd"] = workdir
    data = b""
    if stdin is not None:
        req["stdin"] = True
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    req.update({k: v for k, v in extra.items() if v is not None})
    return id, json.dumps(req).encode() + b"\n" + data


class Frames:
    """Reads an exec's frames: feed it each line, and it says what they hold."""

    def __init__(self, id: str) -> None:
        self.result = ExecResult(exit_code=-1, id=id)
        self.done = False

    def line(self, line: bytes) -> Iterable[Output]:
        line = line.strip()
        if not line:
            return ()
        f = json.loads(line)
        out: List[Output] = []
        if f.get("call"):
            self.result.sandbox = f["call"].get("sandbox", "")
        if f.get("id"):
            self.result.id = f["id"]
        for stream in ("stdout", "stderr"):
            if f.get(stream):
                data = base64.b64decode(f[stream])
                out.append(Output(stream, data))
                if stream == "stdout":
                    self.result.stdout_bytes += data
                else:
                    self.result.stderr_bytes += data
        if f.get("error"):
            self.done = True
            raise error_frame(f["error"])
        if f.get("result"):
            r = f["result"]
            self.result.exit_code = r.get("exit_code", -1)
            self.result.replayed = bool(r.get("replayed"))
            self.result.oom = bool(r.get("oom"))
            self.result.output_truncated = bool(r.get("output_truncated"))
            self.result.output_truncated_bytes = int(r.get("output_truncated_bytes") or 0)
            self.result.output_dropped = bool(r.get("output_dropped"))
            self.result.id = r.get("id") or self.result.id
            self.done = True
        return out

    def finish(self) -> ExecResult:
        if not self.done:
            raise InfraError("the worker's answer to exec %s ended before its result: retry with the same id" % self.result.id)
        return self.result


def screen_info(resp: Any) -> Dict[str, int]:
    """A screenshot's size and count, from its answer's headers."""
    def num(h: str) -> int:
        try:
            return int(resp.getheader(h) or 0)
        except ValueError:
            return 0
    return {"width": num("X-Dsec-Screen-Width"), "height": num("X-Dsec-Screen-Height"), "seq": num("X-Dsec-Screen-Seq")}
