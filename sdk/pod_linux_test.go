package sdk_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestWorkerAsPod: a worker run as a Kubernetes DaemonSet's pod runs
// it, short of the cluster: in a mount namespace of its own over a root
// that is a shared mount (a hostPath with Bidirectional propagation,
// its mounts reaching the host's namespace), and in a pod's group in
// every cgroup hierarchy. Its sandboxes start (pivot_root into a root
// cloned from a shared mount), outlive its container's restart (kill
// -9, its mount namespace gone: the next worker, in a new one, takes
// them back) and its pod's deletion (every process left in any
// hierarchy of the pod's groups killed, as the kubelet does: none of
// the sandbox's is there), and a worker of the next pod serves them.
func TestWorkerAsPod(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	runtimetest.Layers(t, root)
	if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) }) // (after the workers' cleanups)
	if err := unix.Mount("", root, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	pod, next := "dsec-test-pod-"+randHex(8), "dsec-test-pod-"+randHex(8)
	t.Cleanup(func() {
		for _, p := range []string{pod, next} {
			if err := runtimetest.KillPod(p); err != nil {
				t.Errorf("the pod's groups: %v", err)
			}
		}
	})
	// The pod is pinned to CPU 0 (a CPU manager's static policy): its
	// sandboxes leave its groups, not its pinning.
	pinned := filepath.Join(cgroup.Root, "cpuset", pod)
	if err := os.Mkdir(pinned, 0o755); err != nil {
		t.Fatal(err)
	}
	for f, v := range map[string]string{"cpuset.cpus": "0", "cpuset.mems": "0"} {
		if err := os.WriteFile(filepath.Join(pinned, f), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	w, c := setupAt(t, root, runtimetest.Config{MountNS: true, Pod: pod})
	sb := create(t, c, api.SandboxSpec{Name: "inpod"})
	if out, _ := run(t, sb, "cpus", "grep Cpus_allowed_list /proc/self/status"); !strings.HasSuffix(out, "\t0\n") {
		t.Errorf("the sandbox of a pod pinned to CPU 0 runs on %q", out)
	}
	if out, res := run(t, sb, "start", "echo kept > /state; sleep 1000 >/dev/null 2>&1 & echo $! > /sleeper"); res.ExitCode != 0 {
		t.Fatalf("start: %q %+v", out, res)
	}
	alive := func(c *sdk.Client, when string) {
		t.Helper()
		out, res := run(t, c.Sandbox("inpod"), "", "cat /state; kill -0 $(cat /sleeper) && echo alive")
		if res.ExitCode != 0 || out != "kept\nalive\n" {
			t.Errorf("%s: %q %+v", when, out, res)
		}
	}

	// The container restarts: its worker killed, its mount namespace
	// gone; the next one, in a new one, takes the sandbox back.
	w.Crash()
	runtimetest.StartWorkerWith(t, root, runtimetest.Config{MountNS: true, Pod: pod})
	alive(c, "after the worker's container restarted")

	// The pod is deleted: every process left in its groups is killed.
	if err := runtimetest.KillPod(pod); err != nil {
		t.Fatalf("the pod's groups held a sandbox's process, or would not go: %v", err)
	}
	w3 := runtimetest.StartWorkerWith(t, root, runtimetest.Config{MountNS: true, Pod: next})
	alive(c, "after its pod was deleted, from the next pod's worker")
	if err := sb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	w3.Kill() // (the cleanup then finds nothing left of the sandbox)
}
