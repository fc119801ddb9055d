package kubetest

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/testenv"
)

// TestSweep: what a cluster test killed before its cleanups leaves (a
// node's group with a pod's process in it, a shim naming the cluster's
// directory, a mount under that directory, a node's network namespace,
// the bridge, a kernel setting changed and the kubelets' directory) is
// all gone, or put back, after the next test's claim sweeps.
func TestSweep(t *testing.T) {
	testenv.RequireRoot(t, "groups, mounts, namespaces and a bridge")
	Claim(t)
	dir, err := os.MkdirTemp("", "dsk8s-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) }) // (after a failed sweep)
	mnt := filepath.Join(dir, "n1", "rootfs")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	const node = "dsk8s-n1"
	var groups []string
	for _, h := range cgroup.Hierarchies() {
		g := filepath.Join(h, node, "kubepods")
		if err := os.MkdirAll(g, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(g); os.Remove(filepath.Dir(g)) })
		groups = append(groups, g)
	}
	// (Started after their groups are made: their cleanups run first.)
	// A shim: its command line names the cluster's directory.
	shim := exec.Command("sleep", "600")
	shim.Args[0] = filepath.Join(dir, "n1", "containerd-shim")
	// A pod's process, in the node's groups in every hierarchy.
	pod := exec.Command("sleep", "600")
	for _, c := range []*exec.Cmd{shim, pod} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
	}
	in := 0
	for _, g := range groups {
		// (Not where a new group takes no process: v1's cpuset, say.)
		if os.WriteFile(filepath.Join(g, "cgroup.procs"), []byte(strconv.Itoa(pod.Process.Pid)), 0o644) == nil {
			in++
		}
	}
	if in == 0 {
		t.Fatal("the pod's process went into none of the node's groups")
	}
	for _, args := range [][]string{{"netns", "add", node}, {"link", "add", bridge, "type", "bridge"}} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() {
		exec.Command("ip", "netns", "delete", node).Run()
		exec.Command("ip", "link", "delete", bridge).Run()
	})
	// A kernel setting its kubelets changed, and the kubelets' shared
	// directory, which it made (where none was here before this test).
	const setting = "kernel/keys/root_maxkeys"
	b, err := os.ReadFile("/proc/sys/" + setting)
	if err != nil {
		t.Fatal(err)
	}
	was := strings.TrimSpace(string(b))
	t.Cleanup(func() { os.WriteFile("/proc/sys/"+setting, []byte(was), 0o644) })
	n, _ := strconv.Atoi(was)
	if err := os.WriteFile("/proc/sys/"+setting, []byte(strconv.Itoa(n+1)), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = os.Stat(kubeletShared)
	madeShared := os.IsNotExist(err)
	if madeShared {
		if err := os.MkdirAll(filepath.Join(kubeletShared, "device-plugins"), 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(kubeletShared) })
		if err := os.WriteFile(filepath.Join(kubeletShared, "device-plugins", "kubelet_internal_checkpoint"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := json.Marshal(hostState{Sysctls: map[string]string{setting: was + "\n"}, MadeShared: madeShared})
	if err := os.WriteFile(stateFile, st, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(stateFile) })

	sweep()

	for name, c := range map[string]*exec.Cmd{"shim": shim, "pod's process": pod} {
		done := make(chan struct{})
		go func() { c.Wait(); close(done) }()
		select {
		case <-done:
			if ws, ok := c.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
				t.Errorf("the %s ended with %v, not killed", name, c.ProcessState)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("the %s lives on after the sweep", name)
		}
	}
	left := []string{dir, "/run/netns/" + node, "/sys/class/net/" + bridge}
	for _, h := range cgroup.Hierarchies() {
		left = append(left, filepath.Join(h, node))
	}
	for _, p := range left {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s is left after the sweep (%v)", p, err)
		}
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), " "+mnt+" ") {
		t.Errorf("%s is still mounted after the sweep", mnt)
	}
	if b, _ := os.ReadFile("/proc/sys/" + setting); strings.TrimSpace(string(b)) != was {
		t.Errorf("%s is %s after the sweep, want %s as before the dead test", setting, strings.TrimSpace(string(b)), was)
	}
	if _, err := os.Stat(kubeletShared); madeShared && !os.IsNotExist(err) {
		t.Errorf("%s, which the dead test made, is left after the sweep (%v)", kubeletShared, err)
	}
	if _, err := os.Stat(stateFile); !os.IsNotExist(err) {
		t.Errorf("%s is left after the sweep (%v)", stateFile, err)
	}
}
