package cgroup_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
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

func busyboxRoot(t *testing.T) string { return layertest.BusyboxRoot(t, t.TempDir()) }

type result struct {
	code int
	err  error
}

// sandbox runs script in a new sandbox inside a new group; the result
// arrives on the channel.
func sandbox(t *testing.T, l cgroup.Limits, script string) (*cgroup.Group, *container.Sandbox, <-chan result, *os.File) {
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
	var initErr bytes.Buffer
	sb, err := container.Create(container.Spec{Root: busyboxRoot(t), Stderr: &initErr, Setup: g.Add,
		Socket: filepath.Join(t.TempDir(), "init.sock")})
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	t.Cleanup(func() { sb.Destroy() })
	out, _ := os.CreateTemp(t.TempDir(), "out")
	t.Cleanup(func() { out.Close() })
	ch := make(chan result, 1)
	go func() {
		code, err := sb.Exec(context.Background(), container.Cmd{ID: "test", Args: []string{"/bin/sh", "-c", script}, Env: []string{"PATH=/bin"}, Stdout: out, Stderr: out})
		ch <- result{code, err}
	}()
	return g, sb, ch, out
}

func output(f *os.File) string {
	b, _ := os.ReadFile(f.Name())
	return string(b)
}

func TestMemoryLimitReportsOOM(t *testing.T) {
	g, sb, ch, out := sandbox(t, cgroup.Limits{MemoryBytes: 32 << 20}, `dd if=/dev/zero of=/dev/null bs=256M count=1`)
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.code != 137 {
		t.Fatalf("a 256 MiB buffer under a 32 MiB limit exited %d: %s", r.code, output(out))
	}
	if g.OOMKills() == 0 {
		t.Fatalf("no OOM kill recorded: %s", output(out))
	}
	// The sandbox survived its command's OOM.
	if code, err := sb.Exec(context.Background(), container.Cmd{ID: "after", Args: []string{"true"}}); err != nil || code != 0 {
		t.Fatalf("sandbox after an OOM: %d %v", code, err)
	}
}

func TestPidsLimit(t *testing.T) {
	// The shell gives up (exit 2) at the first fork the limit refuses.
	g, _, ch, out := sandbox(t, cgroup.Limits{Pids: 16}, `i=0; while [ $i -lt 40 ]; do sleep 10 & i=$((i+1)); done; wait`)
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
	r := <-ch
	close(stop)
	<-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if most > 16 || g.PidsLimitHits() == 0 {
		t.Fatalf("pids.max 16: up to %d processes, %d refused forks (exit %d): %s", most, g.PidsLimitHits(), r.code, output(out))
	}
}

func TestFreezeThawKill(t *testing.T) {
	g, sb, ch, _ := sandbox(t, cgroup.Limits{CPUMilli: 500}, `i=0; while true; do i=$((i+1)); echo $i > /tmp/count; done`)
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
	stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", sb.Pid()))
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
	if r := <-ch; r.err == nil {
		t.Fatalf("a killed sandbox's exec returned %d, want ErrSandboxDied", r.code)
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
