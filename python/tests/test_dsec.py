"""The Python SDK against a real worker: started here with the dsec on PATH
(cmd/dsec's python.txtar runs these tests with it, as root, on a root that
holds the layer bb:1), on its unix socket and on TCP with TLS and tokens."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dsec  # noqa: E402

ROOT = os.environ["DSEC_ROOT"]
BASE = ["bb:1"]


def dsec_cli(*args, env=None):
    e = dict(os.environ, DSEC_HOST="")
    e.update(env or {})
    return subprocess.run(["dsec", *args], check=True, capture_output=True, text=True, env=e).stdout.strip()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Worker:
    """dsec daemon on ROOT, serving TCP with TLS on a loopback port."""

    def __init__(self, certs):
        self.certs = certs
        self.port = free_port()
        self.proc = None

    @property
    def host(self):
        return "tcp://127.0.0.1:%d" % self.port

    def start(self):
        log = open(os.path.join(ROOT, "..", "python-worker.log"), "ab")
        self.proc = subprocess.Popen(["dsec", "daemon", "--listen", self.host,
                                      "--tls-cert", os.path.join(self.certs, "server.pem"),
                                      "--tls-key", os.path.join(self.certs, "server-key.pem")],
                                     stdout=log, stderr=log, env=dict(os.environ, DSEC_HOST=""))
        deadline = time.time() + 20
        while time.time() < deadline:
            try:  # the socket is made once the worker serves (TCP accepts before)
                dsec.Client(host="", root=ROOT).version()
                return
            except dsec.InfraError:
                if self.proc.poll() is not None:
                    raise RuntimeError("the worker exited: see python-worker.log")
                time.sleep(0.02)
        raise RuntimeError("the worker does not listen after 20 s")

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            dsec_cli("daemon", "stop")
            self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    certs = str(tmp_path_factory.mktemp("certs") / "tls")
    dsec_cli("daemon", "certs", certs, "--name", "127.0.0.1")
    w = Worker(certs)
    w.start()
    yield w
    # Whatever a test left is removed, through the admin's socket.
    c = dsec.Client(host="", root=ROOT)
    for s in c.sandboxes():
        c.sandbox(s.name).remove(force=True)
    w.stop()


def token(scope="sandboxes", ttl=None, allow=None):
    args = ["token", "create", "--scope", scope]
    if ttl:
        args += ["--ttl", ttl]
    if allow:
        args += ["--allow", allow]
    return dsec_cli(*args)


def remote(worker, tok, aio=False):
    cls = dsec.aio.Client if aio else dsec.Client
    return cls(host=worker.host, token=tok, tls_ca=os.path.join(worker.certs, "ca.pem"))


def test_local_socket(worker):
    c = dsec.Client(host="", root=ROOT)
    sb = c.create(BASE, name="local-1")
    try:
        r = sb.exec(["sh", "-c", "echo out; echo err >&2; exit 4"], id="s1")
        assert (r.exit_code, r.stdout, r.stderr, r.replayed) == (4, "out\n", "err\n", False)
        with pytest.raises(dsec.CommandFailed):
            r.check()
        assert sb.inspect().status == "running"
    finally:
        sb.remove(force=True)


def test_output_truncated(worker):
    c = dsec.Client(host="", root=ROOT)
    sb = c.create(BASE, name="bounded-1", disk=16 << 20)
    try:
        r = sb.exec(["head", "-c", str(17 << 20), "/dev/zero"], id="flood")
        assert r.exit_code == 0 and len(r.stdout_bytes) == 16 << 20
        assert r.output_truncated and r.output_truncated_bytes == 1 << 20 and not r.output_dropped
        sb.exec(["true"])  # the flood's 16 MiB and the next cap do not fit: dropped
        again = sb.exec(["head", "-c", str(17 << 20), "/dev/zero"], id="flood")
        assert again.replayed and again.output_dropped and again.output_truncated and again.stdout_bytes == b""
    finally:
        sb.remove(force=True)


def test_remote_rollout(worker):
    c = remote(worker, token())
    sb = c.create(BASE, name="remote-1", env={"STEP": "x"})
    r = sb.exec(["sh", "-c", 'echo "$STEP"; echo ran >> /ran; exit 3'], id="step-1")
    assert (r.exit_code, r.stdout) == (3, "x\n")
    again = remote(worker, c.target.token).sandbox("remote-1").exec(["sh", "-c", 'echo "$STEP"; echo ran >> /ran; exit 3'], id="step-1")
    assert again.replayed and again.exit_code == 3 and again.stdout == "x\n"
    with pytest.raises(dsec.Conflict):
        sb.exec(["true"], id="step-1")  # another command under the id
    assert sb.exec(["cat"], stdin=b"in\n").stdout == "in\n"
    assert sb.exec(["sh", "-c", "pwd"], workdir="/tmp").stdout == "/tmp\n"
    sb.write_file("/data", b"\x00bytes")
    assert sb.read_file("/data") == b"\x00bytes"
    pieces = sb.exec_stream(["sh", "-c", "echo a; sleep 0.1; echo b >&2"])
    got = [(p.stream, p.data) for p in pieces]
    assert got == [("stdout", b"a\n"), ("stderr", b"b\n")] and pieces.result.exit_code == 0
    assert sb.logs("step-1").exit_code == 3
    sb.stop()
    with pytest.raises(dsec.WrongState):
        sb.exec(["true"])
    sb.start()
    assert sb.read_file("/data") == b"\x00bytes"
    snap = sb.pack_diff("remote-1:1")
    assert snap.name == "remote-1:1" and snap.sandbox == "remote-1" and snap.memory is None
    with pytest.raises(dsec.NotImplementedByWorker):
        sb.pack_diff("remote-1:2", memory=True)  # a container keeps no memory in a snapshot
    with pytest.raises(dsec.NotImplementedByWorker):
        sb.evict()
    with pytest.raises(dsec.NotImplementedByWorker, match="cannot show a screen"):
        sb.screenshot()  # a full VM's only
    with pytest.raises(dsec.NotImplementedByWorker):
        sb.type_text("x")
    with pytest.raises(dsec.NotImplementedByWorker, match="no screen to serve over VNC"):
        sb.vnc()
    with pytest.raises(dsec.InvalidArgument, match="one of text, key"):
        sb.input(text="a", key="b")
    sb.pause()
    assert sb.inspect().status == "paused"
    sb.resume()
    assert sb.exec(["cat", "/data"]).stdout_bytes == b"\x00bytes"
    branches = c.branch(snap.name, 3)
    assert len(branches) == 3
    assert [b.exec(["cat", "/data"]).stdout_bytes for b in branches] == [b"\x00bytes"] * 3
    assert {s.name for s in c.sandboxes()} == {"remote-1"} | {b.name for b in branches}
    assert [s["name"] for s in c.snapshots()] == ["remote-1:1"]
    assert c.snapshot("remote-1:1")["name"] == "remote-1:1"
    with pytest.raises(dsec.NotFound):
        c.snapshot("remote-1:9")
    for b in branches:
        b.remove(force=True)
    sb.remove(force=True)
    c.remove_snapshot("remote-1:1")
    with pytest.raises(dsec.NotFound):
        sb.inspect()


def test_grade(worker, tmp_path):
    grader = tmp_path / "grader" / "opt" / "grader"
    grader.mkdir(parents=True)
    (grader / "grade").write_text('test "$(cat /work/answer)" = 42 && ! test -e /work/tests/hacked && echo \'{"ok": true}\' > "$DSEC_GRADE_RESULT"\n')
    dsec_cli("layer", "build", str(tmp_path / "grader"), "--kind", "toolkit", "-t", "pygrader:1")
    c = remote(worker, token())
    sb = c.create(BASE, name="graded-1")
    try:
        sb.exec(["sh", "-c", "mkdir -p /work/tests && echo 42 > /work/answer && touch /work/tests/hacked"])
        g = sb.grade(["pygrader:1"], ["sh", "/opt/grader/grade"], carry=["/work/**", "!/work/tests/**"], id="g-1")
        assert g.passed and g.result == {"ok": True} and g.carried["paths"] >= 1
        assert [p["path"] for p in g.tamper["paths"] if p["group"] == "tests"] == ["/work/tests/hacked"]
        again = sb.grade(["pygrader:1"], ["sh", "/opt/grader/grade"], carry=["/work/**", "!/work/tests/**"], id="g-1")
        assert again.raw == g.raw  # the same id: the same answer
        with pytest.raises(dsec.Conflict):
            sb.grade(["pygrader:1"], ["true"], carry=["/work/**"], id="g-1")  # the same id, another grade
        failed = sb.grade(["pygrader:1"], ["sh", "/opt/grader/grade"], carry=["/work/**"])  # the hack carried: the grader sees it
        assert not failed.passed and failed.result is None
        with pytest.raises(dsec.InvalidArgument):
            sb.grade(["pygrader:1"], ["true"], carry=["work"])

        async def graded():
            a = remote(worker, c.target.token, aio=True)
            return await a.sandbox("graded-1").grade(["pygrader:1"], ["sh", "/opt/grader/grade"], carry=["/work/**", "!/work/tests/**"])
        assert asyncio.run(graded()).passed
    finally:
        sb.remove(force=True)


def test_fork_lease(worker):
    c = remote(worker, token())
    sb = c.create(BASE, name="forked-1")
    try:
        sb.exec(["sh", "-c", "echo 5 > /state"])
        g = sb.fork(2, ttl=600)
        assert len(g["members"]) == 2 and g["lease"] and g["snapshot"] == "fork-forked-1:1"
        first, second = (m["name"] for m in g["members"])
        assert c.sandbox(first).exec(["cat", "/state"], id="look").stdout == "5\n"
        assert c.group(g["id"])["members"][0]["last_exec"] == "look"
        assert [lease["id"] for lease in c.leases()] == [g["lease"]]
        c.renew_lease(g["lease"], 900)
        assert c.keep(g["id"], first)["sandboxes"] == [second]
        assert c.groups() == []
        released = c.remove_lease(g["lease"])
        assert released["sandboxes"] == [first] and released["snapshots"] == [g["snapshot"]]
        assert c.leases() == [] and c.snapshots() == []
        with pytest.raises(dsec.NotFound):
            c.renew_lease(g["lease"], 60)

        async def aio_fork():
            a = remote(worker, c.target.token, aio=True)
            lease = await a.create_lease(600)
            grp = await a.sandbox("forked-1").fork(1, lease=lease["id"])
            assert (await a.group(grp["id"]))["lease"] == lease["id"]
            return await a.remove_lease(lease["id"])
        assert len(asyncio.run(aio_fork())["sandboxes"]) == 1
    finally:
        sb.remove(force=True)


def test_idle_hint(worker):
    c = remote(worker, token())
    sb = c.create(BASE, name="idle-1")
    try:
        assert not sb.idle(0.1)["frozen"]  # too short a wait: nothing done
        rep = sb.idle(60)
        assert rep["frozen"] and rep["memory_after"] <= rep["memory_before"]
        info = sb.inspect()
        assert info.status == "running" and info.raw.get("hinted")
        assert sb.exec(["echo", "next turn"]).stdout == "next turn\n"  # resumed first
        assert not sb.inspect().raw.get("hinted")
    finally:
        sb.remove(force=True)


def test_apply_policy(worker):
    """A policy applied live: its network rules hold at once, for the
    sandbox's running processes too; reset is passed on; a policy the
    worker does not know or cannot read is refused, the old one kept."""
    def nat(cidr):
        return {"apiVersion": "dsec/v1", "kind": "Policy", "network": {"mode": "nat", "egress": [{"to": cidr, "ports": [80]}]}}

    def denied(sb, addr):
        out = sb.exec(["sh", "-c", "nc -w 1 %s 80 </dev/null 2>&1; true" % addr]).stdout
        return "not permitted" in out.lower()

    with pytest.raises(dsec.PermissionDenied):  # a token not allowed its own policies
        remote(worker, token()).create(BASE, name="pol-0", policy=nat("192.0.2.0/24"))
    c = remote(worker, token(allow="policy"))
    sb = c.create(BASE, name="pol-1", policy=nat("192.0.2.0/24"))
    try:
        assert denied(sb, "198.51.100.1") and not denied(sb, "192.0.2.1")
        report = sb.apply_policy(nat("198.51.100.0/24"))
        assert isinstance(report, dsec.PolicyReport) and any("network" in n for n in report.now), report
        assert not denied(sb, "198.51.100.1") and denied(sb, "192.0.2.1")
        with pytest.raises(dsec.NotFound):
            sb.apply_policy("no-such-policy")
        with pytest.raises(dsec.InvalidArgument):
            sb.apply_policy(nat("**"))
        assert not denied(sb, "198.51.100.1")

        async def aio():
            async with remote(worker, c.target.token, aio=True) as ac:
                return await ac.sandbox("pol-1").apply_policy(nat("192.0.2.0/24"), reset=True)
        assert any("network" in n for n in asyncio.run(aio()).now)
        assert denied(sb, "198.51.100.1") and not denied(sb, "192.0.2.1")
    finally:
        sb.remove(force=True)


def test_long_step(worker):
    """A step longer than the client's own timeout is waited for; one past
    exec's timeout raises TimeoutError and runs on: the same id later gets
    its result."""
    tok = token()
    c = dsec.Client(host=worker.host, token=tok, tls_ca=os.path.join(worker.certs, "ca.pem"), timeout=0.5)
    sb = c.create(BASE, name="long-1")
    try:
        assert sb.exec(["sh", "-c", "sleep 1; echo late"]).stdout == "late\n"
        with pytest.raises(TimeoutError):
            sb.exec(["sh", "-c", "sleep 1; echo later"], id="t1", timeout=0.2)
        assert sb.exec(["sh", "-c", "sleep 1; echo later"], id="t1").stdout == "later\n"
        assert [p.data for p in sb.exec_stream(["sh", "-c", "sleep 1; echo s"])] == [b"s\n"]

        async def aio():
            async with dsec.aio.Client(host=worker.host, token=tok, tls_ca=os.path.join(worker.certs, "ca.pem"), timeout=0.5) as ac:
                return (await ac.sandbox("long-1").exec(["sh", "-c", "sleep 1; echo a"])).stdout
        assert asyncio.run(aio()) == "a\n"
    finally:
        sb.remove(force=True)


def test_call(worker):
    """A call runs one command in a sandbox made for it, discarded after."""
    c = remote(worker, token())
    r = c.call(None, ["sh", "-c", "echo called; exit 5"], spec={"layers": BASE})
    assert (r.exit_code, r.stdout) == (5, "called\n") and r.sandbox
    assert c.sandboxes() == []
    dsec_cli("pool", "resize", "py-pool", "1", "--base", BASE[0])  # pools are the admin's
    try:
        first = c.call("py-pool", ["sh", "-c", "echo one > /tmp/state; hostname"])
        second = c.call("py-pool", ["sh", "-c", "cat /tmp/state 2>/dev/null || echo fresh"])
        assert first.exit_code == 0 and second.stdout == "fresh\n" and first.sandbox != second.sandbox
    finally:
        dsec_cli("pool", "rm", "py-pool")


def test_tokens(worker):
    mine = remote(worker, token())
    other = remote(worker, token())
    sb = mine.create(BASE, name="tok-1")
    try:
        with pytest.raises(dsec.NotFound):
            other.sandbox("tok-1").inspect()
        with pytest.raises(dsec.NotFound):
            other.sandbox("tok-1").exec(["true"])
        assert other.sandboxes() == []
        with pytest.raises(dsec.Conflict):
            other.create(BASE, name="tok-1")  # names are one namespace
        for bad in ["dsec_" + "0" * 40, "nonsense"]:
            with pytest.raises(dsec.Unauthorized):
                remote(worker, bad).sandboxes()
        expired = token(ttl="1s")
        time.sleep(1.2)
        with pytest.raises(dsec.Unauthorized):
            remote(worker, expired).sandboxes()
        with pytest.raises(dsec.Unauthorized):
            dsec.Client(host=worker.host, token="")
    finally:
        sb.remove(force=True)


def test_client_killed_mid_step(worker, tmp_path):
    """A client that goes away mid-step leaves it running and journaled; a
    new client asking with the same id gets the recorded result, and the
    step ran once."""
    tok = token()
    c = remote(worker, tok)
    sb = c.create(BASE, name="kill-client")
    try:
        script = ("import sys; sys.path.insert(0, %r); import dsec\n"
                  "c = dsec.Client(host=%r, token=%r, tls_ca=%r)\n"
                  "c.sandbox('kill-client').exec(['sh', '-c', 'echo start >> /log; sleep 1; echo done'], id='long')\n"
                  % (os.path.join(os.path.dirname(__file__), ".."), worker.host, tok, os.path.join(worker.certs, "ca.pem")))
        p = subprocess.Popen([sys.executable, "-c", script])
        wait_file(sb, "/log")
        p.kill()
        p.wait()
        r = remote(worker, tok).sandbox("kill-client").exec(["sh", "-c", "echo start >> /log; sleep 1; echo done"], id="long")
        assert r.exit_code == 0 and r.stdout == "done\n" and r.replayed
        assert sb.read_file("/log") == b"start\n"
    finally:
        sb.remove(force=True)


def test_worker_killed_mid_step(worker):
    """kill -9 of the worker mid-step: the client sees an InfraError; once a
    worker serves again, the same id gets the step's result, run once."""
    tok = token()
    c = remote(worker, tok)
    sb = c.create(BASE, name="kill-worker")
    errs = []

    def step():
        try:
            sb.exec(["sh", "-c", "echo start >> /log; sleep 1; echo done"], id="long")
        except dsec.InfraError as e:
            errs.append(e)

    t = threading.Thread(target=step)
    t.start()
    wait_file(sb, "/log")
    worker.kill9()
    t.join(30)
    assert len(errs) == 1, "the client did not see the worker die"
    worker.start()
    r = None
    for _ in range(100):  # a new client, as a trainer's retry
        try:
            r = remote(worker, tok).sandbox("kill-worker").exec(["sh", "-c", "echo start >> /log; sleep 1; echo done"], id="long")
            break
        except dsec.InfraError:
            time.sleep(0.1)
    assert r is not None and r.exit_code == 0 and r.stdout == "done\n"
    assert sb.read_file("/log") == b"start\n"
    sb.remove(force=True)


def test_asyncio_256_concurrent(worker):
    tok = token()

    async def main():
        async with remote(worker, tok, aio=True) as c:
            sb = await c.create(BASE, name="aio-1")
            try:
                rs = await asyncio.gather(*(sb.exec(["sh", "-c", "echo %d" % i], id="s%d" % i) for i in range(256)))
                assert [r.stdout for r in rs] == ["%d\n" % i for i in range(256)]
                again = await sb.exec(["sh", "-c", "echo 7"], id="s7")
                assert again.replayed and again.stdout == "7\n"
                pieces = [p async for p in sb.exec_stream(["sh", "-c", "echo a; echo b >&2; exit 2"])]
                assert isinstance(pieces[-1], dsec.ExecResult) and pieces[-1].exit_code == 2
                await sb.write_file("/f", "text")
                assert await sb.read_file("/f") == b"text"
                snap = await sb.pack_diff("aio-1:1")
                bs = await c.branch(snap.name, 2)
                assert [(await b.exec(["cat", "/f"])).stdout for b in bs] == ["text", "text"]
                for b in bs:
                    await b.remove(force=True)
                await c.remove_snapshot("aio-1:1")
                with pytest.raises(dsec.NotFound):
                    await c.sandbox("none").inspect()
            finally:
                await sb.remove(force=True)

    asyncio.run(main())


def wait_file(sb, p, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            sb.read_file(p)
            return
        except dsec.NotFound:
            time.sleep(0.02)
    raise AssertionError("no %s in %s after %ds" % (p, sb.name, timeout))


def test_batch(worker):
    c = remote(worker, token())
    taken = c.create(BASE, name="pb-1")
    try:
        got = c.batch(4, BASE, name="pb", memory=64 << 20)
        assert isinstance(got[1], dsec.Conflict)
        made = [sb for sb in got if isinstance(sb, dsec.Sandbox)]
        assert [sb.name for sb in made] == ["pb-0", "pb-2", "pb-3"]
        assert [sb.exec(["echo", sb.name]).stdout for sb in made] == ["pb-0\n", "pb-2\n", "pb-3\n"]
        for sb in made:
            sb.remove(force=True)
        with pytest.raises(dsec.InvalidArgument):
            c.batch(0, BASE)

        async def main():
            async with remote(worker, token(), aio=True) as a:
                bs = await a.batch(2, BASE, memory=64 << 20)
                assert all(isinstance(b, dsec.aio.Sandbox) for b in bs) and bs[0].name != bs[1].name
                for b in bs:
                    await b.remove(force=True)

        asyncio.run(main())
    finally:
        taken.remove(force=True)
