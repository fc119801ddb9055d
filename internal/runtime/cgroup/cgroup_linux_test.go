package cgroup_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
)

func TestMain(m *testing.M) {
	container.MaybeInit()
	os.Exit(m.Run())
}

func busyboxRoot(t *testing.T) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox-static is missing: make deps installs it")
	}
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "bin"), 0o755)
	b, _ := os.ReadFile(bb)
	os.WriteFile(filepath.Join(root, "bin", "busybox"), b, 0o755)
	out, _ := exec.Command(bb, "--list").Output()
	for _, a := range strings.Fields(string(out)) {
		if a != "busybox" {
			os.Symlink("busybox", filepath.Join(root, "bin", a))
		}
	}
	return root
}

// sandbox runs script in a new sandbox inside a new group.
func sandbox(t *testing.T, l cgroup.Limits, script string) (*cgroup.Group, *container.Process, *bytes.Buffer) {
	t.Helper()
	layertest.RequireRoot(t)
	name := fmt.Sprintf("test-%d-%d", os.Getpid(), time.Now().UnixNano())
	g, err := cgroup.New(name, l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.Kill(); err != nil {
			t.Error(err)
		}
		if err := g.Remove(); err != nil {
			t.Error(err)
		}
	})
	var out bytes.Buffer
	p, err := container.Start(container.Spec{Root: busyboxRoot(t), Args: []string{"/bin/sh", "-c", script},
		Env: []string{"PATH=/bin"}, Stdout: &out, Stderr: &out, Setup: g.Add})
	if err != nil {
		t.Fatal(err)
	}
	return g, p, &out
}

func TestMemoryLimitReportsOOM(t *testing.T) {
	g, p, out := sandbox(t, cgroup.Limits{MemoryBytes: 32 << 20}, `dd if=/dev/zero of=/dev/null bs=256M count=1`)
	code, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if code != 137 && code == 0 {
		t.Fatalf("a 256 MiB buffer under a 32 MiB limit exited %d: %s", code, out)
	}
	if !g.OOMKilled() {
		t.Fatalf("no OOM kill recorded (exit %d): %s", code, out)
	}
}

func TestPidsLimit(t *testing.T) {
	// The shell gives up (exit 2) at the first fork the limit refuses.
	g, p, out := sandbox(t, cgroup.Limits{Pids: 16}, `i=0; while [ $i -lt 40 ]; do sleep 10 & i=$((i+1)); done; wait`)
	most := 0
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			if pids, err := g.Pids(); err == nil {
				most = max(most, len(pids))
			}
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	code, err := p.Wait()
	close(stop)
	<-done
	if err != nil {
		t.Fatal(err)
	}
	if most > 16 || g.PidsLimitHits() == 0 {
		t.Fatalf("pids.max 16: up to %d processes, %d refused forks (exit %d): %s", most, g.PidsLimitHits(), code, out)
	}
}

func TestFreezeThawKill(t *testing.T) {
	g, p, _ := sandbox(t, cgroup.Limits{CPUMilli: 500}, `i=0; while true; do i=$((i+1)); echo $i > /tmp/count; done`)
	time.Sleep(200 * time.Millisecond)
	if err := g.Freeze(); err != nil {
		t.Fatal(err)
	}
	if !g.Frozen() {
		t.Fatal("not frozen")
	}
	pids, err := g.Pids()
	if err != nil || len(pids) == 0 {
		t.Fatalf("pids %v, %v", pids, err)
	}
	// A frozen task is stopped in the freezer: its state says so.
	stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Pid()))
	if f := strings.Fields(string(stat)); len(f) < 3 || (f[2] != "D" && f[2] != "S") {
		t.Fatalf("frozen pid 1 in state %v", f)
	}
	if err := g.Thaw(); err != nil {
		t.Fatal(err)
	}
	if g.Frozen() {
		t.Fatal("still frozen")
	}
	if err := g.Kill(); err != nil {
		t.Fatal(err)
	}
	if code, _ := p.Wait(); code != 137 {
		t.Fatalf("killed sandbox exited %d", code)
	}
	if pids, _ := g.Pids(); len(pids) != 0 {
		t.Fatalf("processes left after kill: %v", pids)
	}
}

func TestBadNames(t *testing.T) {
	for _, n := range []string{"", "a/b", "..", "."} {
		if _, err := cgroup.New(n, cgroup.Limits{}); err == nil {
			t.Errorf("New(%q) succeeded", n)
		}
	}
}
