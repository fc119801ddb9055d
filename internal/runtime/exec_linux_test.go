package runtime_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	dsecrt "github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// TestInitDescriptors ("leaky vessels", runc CVE-2024-21626): no
// descriptor of the init reaches a command, neither inherited nor as a
// working directory named /proc/self/fd/N; a command holds its three
// standard streams and nothing else.
func TestInitDescriptors(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(dsecrt.Spec{Name: "fds", Layers: []string{"bb:1"}})
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", sb.Current().Pid))
	if err != nil || len(ents) < 3 {
		t.Fatalf("the init's descriptors: %v %v", ents, err)
	}
	for _, e := range ents {
		spec := dsecrt.ExecSpec{ID: "cwd-" + e.Name(), Cwd: "/proc/self/fd/" + e.Name(), Args: []string{"/bin/sh", "-c", "pwd -P; cat /etc/answer"}}
		x, _, err := sb.Run(context.Background(), spec)
		if err != nil {
			continue // refused: the init's descriptor is no directory of the sandbox
		}
		x.Result(context.Background())
		out, _ := os.ReadFile(x.StdoutPath())
		if !strings.HasSuffix(string(out), "\n42\n") { // in the sandbox's root, wherever its cwd
			t.Errorf("cwd /proc/self/fd/%s: %q", e.Name(), out)
		}
	}
	out, _ := sh(t, sb, "own-fds", "ls /proc/self/fd | sort -n | tr '\\n' ' '")
	if out != "0 1 2 3 " { // 3: ls's own directory
		t.Errorf("a command's descriptors: %q, want 0 1 2 (and ls's 3)", out)
	}
}

// TestWorkdir: a sandbox's working directory that its layers lack is
// made (as docker makes a WORKDIR), where every exec then starts; an
// exec's own missing one is refused with its name (issue 29, item 5); a
// symbolic link to one of the init's descriptors is no way out.
func TestWorkdir(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(dsecrt.Spec{Name: "wd", Layers: []string{"bb:1"}, Workdir: "/work/new/dir"})
	if out, code := sh(t, sb, "pwd", "pwd; ls -ld /work/new/dir | cut -c1-10"); code != 0 || out != "/work/new/dir\ndrwxr-xr-x\n" {
		t.Fatalf("the sandbox's new workdir: %q (exit %d)", out, code)
	}
	_, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: "missing", Cwd: "/missing", Args: []string{"true"}})
	if err == nil || !strings.Contains(err.Error(), "working directory /missing") {
		t.Errorf("an exec's missing workdir: %v", err)
	}
	if _, err := os.Stat(filepath.Join(sb.RootFS(), "missing")); err == nil {
		t.Errorf("an exec's own workdir was made")
	}
	sh(t, sb, "link", "ln -s /proc/self/fd/3 /work/fd3; ln -s /proc/1/cwd /work/initcwd")
	for _, cwd := range []string{"/work/fd3", "/work/initcwd", "/proc/self/fd/3"} {
		x, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: "via-" + filepath.Base(cwd), Cwd: cwd, Args: []string{"/bin/sh", "-c", "pwd -P"}})
		if err == nil {
			x.Result(context.Background())
			out, _ := os.ReadFile(x.StdoutPath())
			t.Errorf("cwd %s was taken: %q", cwd, out)
		}
	}
}

// TestPidsAreTheUsers: --pids N is N processes and threads of the
// sandbox's own; its init's threads are not counted against it (issue
// 29, item 6: --pids 10 could not run two sleeps).
func TestPidsAreTheUsers(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(dsecrt.Spec{Name: "pids", Layers: []string{"bb:1"}, Limits: cgroup.Limits{Pids: 4}})
	if out, code := sh(t, sb, "three", "sleep 1 & sleep 1 & sleep 1 & wait; echo done"); code != 0 || out != "done\n" {
		t.Fatalf("the shell and three sleeps under --pids 4: %q (exit %d)", out, code)
	}
	// The bound holds: N and the init's share, whatever the sandbox
	// starts.
	sh(t, sb, "many", "for i in $(seq 64); do (echo x >> /tmp/n; exec sleep 2) & done 2>/dev/null") // the shell dies at its first refused fork
	time.Sleep(500 * time.Millisecond)
	out, _ := sh(t, sb, "count", "wc -l < /tmp/n")
	if n, err := strconv.Atoi(strings.TrimSpace(out)); err != nil || n < 3 || n >= 4+driver.InitPids {
		t.Fatalf("64 sleeps under --pids 4 (and the init's %d): %q started", driver.InitPids, out)
	}
}

// TestExecCodes: a command that is there but cannot run exits 126 with
// the reason, one that is not there 127, as a shell has them (issue 29,
// item 13: a non-executable file gave only "exec x-...", exit 125).
func TestExecCodes(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(dsecrt.Spec{Name: "codes", Layers: []string{"bb:1"}})
	for i, c := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"/etc/answer"}, 126, "permission denied"},
		{[]string{"/etc"}, 126, "cannot be run"},
		{[]string{"/nope"}, 127, "not found"},
		{[]string{"nope"}, 127, "not found"},
	} {
		e, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: fmt.Sprint("code-", i), Args: c.args})
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		res, err := e.Result(context.Background())
		errb, _ := os.ReadFile(e.StderrPath())
		if err != nil || res.ExitCode != c.code || !strings.Contains(string(errb), c.msg) {
			t.Errorf("%v: exit %d, %q (%v); want %d, %q", c.args, res.ExitCode, errb, err, c.code, c.msg)
		}
	}
}

// TestStopIsNoFailure: a command a deliberate stop kills ends killed
// (137), as docker stop leaves it, not as an infrastructure failure
// (issue 29, items 7 and 13: logs of a stopped sandbox failed).
func TestStopIsNoFailure(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(dsecrt.Spec{Name: "stopped", Layers: []string{"bb:1"}})
	e, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: "run", Args: []string{"/bin/sh", "-c", "echo before; sleep 100"}})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, _ := os.ReadFile(e.StdoutPath()); string(b) == "before\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the command never printed")
		}
	}
	if err := sb.Stop(); err != nil {
		t.Fatal(err)
	}
	res, err := e.Result(context.Background())
	if err != nil || res.ExitCode != 137 || res.Err != "" {
		t.Fatalf("a command under a stop: %+v, %v; want exit 137 and no failure", res, err)
	}
}
