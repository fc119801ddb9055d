"""A rollout loop against a dsec worker: create a sandbox, take ten steps
with ids (one retried: its recorded result comes back, the step does not run
again), snapshot step 10, branch it three ways, remove everything.

    DSEC_HOST=tcp://worker:7443 DSEC_TLS_CA=ca.pem DSEC_TOKEN=dsec_... python3 rollout.py bb:1
"""

import sys
import time

sys.path.insert(0, __file__.rsplit("/examples/", 1)[0])
import dsec  # noqa: E402


def main(layers):
    c = dsec.Client()
    name = "py-rollout-%d" % (time.time() * 1000 % 100000)
    sb = c.create(layers, name=name)
    print("created", sb.name, "on", c.target.where)
    try:
        for step in range(1, 11):
            r = sb.exec(["sh", "-c", "echo step %d >> /work.log; wc -l < /work.log" % step], id="step-%d" % step)
            print("step %2d: exit %d, %s lines" % (step, r.exit_code, r.stdout.strip()))
        r = sb.exec(["sh", "-c", "echo step 10 >> /work.log; wc -l < /work.log"], id="step-10")
        print("step 10 again: replayed=%s, %s lines (it did not run twice)" % (r.replayed, r.stdout.strip()))
        snap = sb.pack_diff("%s:10" % name)
        print("snapshot", snap.name, "%d bytes" % snap.size)
        branches = c.branch(snap.name, 3)
        for i, b in enumerate(branches):
            r = b.exec(["sh", "-c", "echo branch %d >> /work.log; tail -1 /work.log; wc -l < /work.log" % i], id="b-1")
            print("branch", b.name, "->", " / ".join(r.stdout.split("\n")[:2]))
        for b in branches:
            b.remove(force=True)
        c.remove_snapshot(snap.name)
    finally:
        sb.remove(force=True)
    print("removed")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bb:1"])
