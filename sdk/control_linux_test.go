package sdk_test

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestPauseResume: a paused sandbox's processes stop where they are and
// go on from there when it resumes (the same process, its count kept);
// it runs no exec meanwhile, stays paused across a worker restart, and
// stops and is removed as any.
func TestPauseResume(t *testing.T) {
	w, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{})
	if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "count", Detach: true,
		Args: []string{"sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.05; done"}}); err != nil {
		t.Fatal(err)
	}
	read := func() string {
		var b bytes.Buffer
		sb.ReadFile(ctx, "/tmp/n", &b) // "" until the loop first wrote it
		return strings.TrimSpace(b.String())
	}
	backendtestWait(t, func() bool { return atoi(read()) > 3 })
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	d, _ := sb.Inspect(ctx)
	if d.Status != api.StatusPaused || !d.Frozen {
		t.Fatalf("paused: status %s, frozen %v", d.Status, d.Frozen)
	}
	if err := sb.Pause(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("pause twice: %v", err)
	}
	if err := execErr(sb, "true"); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "paused") {
		t.Fatalf("exec while paused: %v", err)
	}
	at := read()
	// A new worker leaves it paused.
	w.Kill()
	w = runtimetest.StartWorker(t, w.Root)
	time.Sleep(300 * time.Millisecond)
	if got := read(); got != at {
		t.Fatalf("a paused sandbox ran on: %s -> %s", at, got)
	}
	if d, _ := sb.Inspect(ctx); d.Status != api.StatusPaused {
		t.Fatalf("after a worker restart: %s", d.Status)
	}
	if err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	backendtestWait(t, func() bool { return read() != at })
	if n, m := atoi(at), atoi(read()); m < n || m > n+40 {
		t.Fatalf("resumed from %d to %d: not where it was", n, m)
	}
	if err := sb.Resume(ctx); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("resume a running sandbox: %v", err)
	}
	// Paused, then stopped and removed: nothing of it left (setup checks).
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if d, _ := sb.Inspect(ctx); d.Status != api.StatusStopped {
		t.Fatalf("stopped while paused: %s", d.Status)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "", "echo up"); out != "up\n" {
		t.Fatalf("started again: %q", out)
	}
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
}

func atoi(s string) int {
	n := 0
	for _, r := range s {
		n = n*10 + int(r-'0')
	}
	return n
}

// backendtestWait polls cond for up to 10 s.
func backendtestWait(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
	}
}

// TestSignal: a signal reaches the exec's whole process group (a shell's
// children too), its result says so, and an ended or unknown exec is
// told apart.
func TestSignal(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{})
	if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "tree", Detach: true,
		Args: []string{"sh", "-c", "sleep 300 & sleep 301 & wait"}}); err != nil {
		t.Fatal(err)
	}
	backendtestWait(t, func() bool { out, _ := run(t, sb, "", "ps"); return strings.Contains(out, "sleep 301") })
	if err := sb.Signal(ctx, "tree", syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	res, err := sb.Logs(ctx, "tree", true, nil, nil)
	if err != nil || res.ExitCode != 128+int(syscall.SIGTERM) {
		t.Fatalf("signalled: %+v %v", res, err)
	}
	if out, _ := run(t, sb, "", "ps"); strings.Contains(out, "sleep 30") {
		t.Fatalf("the group's other processes run on:\n%s", out)
	}
	if err := sb.Signal(ctx, "tree", 0); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("signal an ended exec: %v", err)
	}
	if err := sb.Signal(ctx, "nosuch", 0); !errdefs.IsNotFound(err) {
		t.Fatalf("signal an unknown exec: %v", err)
	}
	if err := sb.Signal(ctx, "tree", 99); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("a bad signal: %v", err)
	}
}

// TestFileOps: list, mkdir, rename and remove inside a sandbox's tree,
// never outside it (a planted link is removed, not followed).
func TestFileOps(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{})
	if _, err := sb.MakeDir(ctx, "/t/a/b", true); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.MakeDir(ctx, "/t/a/b", true); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("mkdir twice: %v", err)
	}
	if _, err := sb.MakeDir(ctx, "/none/x", false); !errdefs.IsNotFound(err) {
		t.Fatalf("mkdir without parents: %v", err)
	}
	run(t, sb, "", "echo x > /t/a/f; ln -s /etc /t/a/l; mkdir -p /t/a/b/c")
	ents, err := sb.ListDir(ctx, "/t/a", 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Path+":"+e.Mode.Type().String())
	}
	slices.Sort(names)
	if want := []string{"/t/a/b:d---------", "/t/a/f:----------", "/t/a/l:L---------"}; !slices.Equal(names, want) {
		t.Fatalf("list: %v, want %v", names, want)
	}
	if ents, _ := sb.ListDir(ctx, "/t", 3); len(ents) != 5 {
		t.Fatalf("list 3 deep: %d entries", len(ents))
	}
	if _, err := sb.ListDir(ctx, "/t/a/f", 0); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("list a file: %v", err)
	}
	if st, err := sb.Rename(ctx, "/t/a/f", "/t/g"); err != nil || st.Name != "g" || st.Size != 2 {
		t.Fatalf("rename: %+v %v", st, err)
	}
	if err := sb.RemovePath(ctx, "/t/a", false); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("remove a full directory without recursive: %v", err)
	}
	if err := sb.RemovePath(ctx, "/t/a", true); err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "", "ls /t; ls -d /etc"); out != "g\n/etc\n" {
		t.Fatalf("after the removal: %q", out)
	}
	for _, bad := range []string{"", "rel", "/"} {
		if err := sb.RemovePath(ctx, bad, true); !errdefs.IsInvalidArgument(err) {
			t.Errorf("remove %q: %v", bad, err)
		}
	}
	if err := sb.RemovePath(ctx, "/proc/self", true); err == nil || errors.Is(err, context.Canceled) {
		t.Fatalf("remove in /proc: %v", err)
	}
}

// TestExecUser: a command runs as a user of the sandbox's own
// /etc/passwd (by name, with its groups, home and HOME), as a uid, or
// either with a group (a gid or a name of its /etc/group); an unknown
// name is refused; a hostile /etc/passwd (a fifo)
// cannot stall the init.
func TestExecUser(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{})
	run(t, sb, "", "echo 'agent:x:1000:1000::/home/agent:/bin/sh' >> /etc/passwd; echo 'tools:x:2000:root,agent' >> /etc/group; mkdir -p /home/agent")
	as := func(user string) (string, error) {
		var out bytes.Buffer
		_, err := sb.Exec(ctx, sdk.ExecOptions{User: user, Stdout: &out, Stderr: &out,
			Args: []string{"sh", "-c", `echo $(id -u):$(id -g) $(id -G) $HOME $USER $(pwd)`}})
		return out.String(), err
	}
	for user, want := range map[string]string{
		"agent":   "1000:1000 1000 2000 /home/agent agent /home/agent\n",
		"1000":    "1000:1000 1000 2000 /home/agent agent /home/agent\n",
		"4242:77": "4242:77 77 / 4242 /\n",
		// a group by name, as an image's config may give it
		"agent:tools": "1000:2000 2000 /home/agent agent /home/agent\n",
		"1000:tools":  "1000:2000 2000 /home/agent agent /home/agent\n",
		"":            "0:0 0 /root /\n", // root's environment is the sandbox's own: no USER
	} {
		if got, err := as(user); err != nil || got != want {
			t.Errorf("as %q: %q %v, want %q", user, got, err, want)
		}
	}
	if _, err := as("nosuch"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no user") {
		t.Errorf("an unknown user: %v", err)
	}
	if _, err := as("agent:nosuch"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), `no group "nosuch"`) {
		t.Errorf("an unknown group: %v", err)
	}
	run(t, sb, "", "rm /etc/passwd; mkfifo /etc/passwd")
	done := make(chan error, 1)
	go func() { _, err := as("agent"); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("a user looked up in a fifo")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a fifo for /etc/passwd stalls the init")
	}
	var out bytes.Buffer // (id would read the fifo itself)
	if _, err := sb.Exec(ctx, sdk.ExecOptions{User: "1000", Stdout: &out, Args: []string{"sh", "-c", "grep ^Uid /proc/self/status"}}); err != nil ||
		!strings.HasPrefix(out.String(), "Uid:\t1000\t") {
		t.Errorf("a uid without a passwd entry: %q %v", out.String(), err)
	}
}
