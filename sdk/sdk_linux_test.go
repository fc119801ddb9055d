package sdk_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// TestMain doubles as a sandbox init and as a worker.
func TestMain(m *testing.M) {
	container.MaybeInit()
	vmm.MaybeRun()   // a microVM's shim
	agent.MaybeRun() // its guest's agent
	runtimetest.MaybeWorker(plainDriver{})
	os.Exit(m.Run())
}

// setup starts a worker on a fresh root with the test layers; cleanup
// kills it, removes every sandbox and checks nothing is left.
func setup(t *testing.T) (*runtimetest.Worker, *sdk.Client) {
	t.Helper()
	return setupWith(t, runtimetest.Config{})
}

// setupWith is setup with a worker configured by cfg.
func setupWith(t testing.TB, cfg runtimetest.Config) (*runtimetest.Worker, *sdk.Client) {
	t.Helper()
	root := t.TempDir()
	runtimetest.Layers(t, root)
	return setupAt(t, root, cfg)
}

// setupAt is setupWith on root, whose layers are built.
func setupAt(t testing.TB, root string, cfg runtimetest.Config) (*runtimetest.Worker, *sdk.Client) {
	t.Helper()
	w := runtimetest.StartWorkerWith(t, root, cfg)
	t.Cleanup(func() {
		w.Kill()
		runtimetest.Clean(root)
		if l := runtimetest.Leftovers(root); len(l) > 0 {
			t.Errorf("left behind: %v", l)
		}
	})
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	return w, c
}

// run runs a shell script and returns its combined output and result.
func run(t *testing.T, sb *sdk.Sandbox, id, script string) (string, api.ExecResult) {
	t.Helper()
	var out bytes.Buffer
	res, err := sb.Exec(context.Background(), sdk.ExecOptions{ID: id, Args: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	return out.String(), res
}

func create(t *testing.T, c *sdk.Client, spec api.SandboxSpec) *sdk.Sandbox {
	t.Helper()
	if spec.Layers == nil {
		spec.Layers = []string{"ws:1", "bb:1"}
	}
	sb, err := c.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func capMask() string {
	var m uint64
	for _, c := range container.KeptCaps {
		m |= 1 << c
	}
	return fmt.Sprintf("%016x", m)
}

func TestIsolationAndState(t *testing.T) {
	_, c := setup(t)
	a := create(t, c, api.SandboxSpec{Name: "a", Memory: 256 << 20})
	b := create(t, c, api.SandboxSpec{Name: "b"})
	checks := []struct{ script, want string }{
		{"cat /work/hello /etc/answer", "from the workspace\n42\n"},
		{"hostname", "a\n"},
		{"ls /sys/class/net", "lo\n"},
		{"ls -d /proc/[0-9]* | wc -l", "count"},                        // the init and this pipeline only
		{"wc -c < /proc/kallsyms; wc -c < /proc/timer_list", "0\n0\n"}, // masked: /dev/null
		{"grep CapEff /proc/self/status | cut -f2", capMask() + "\n"},
		{"grep NoNewPrivs /proc/self/status | cut -f2", "1\n"},
		{"ls /proc/self/fd", "0\n1\n2\n3\n"},
		{"(echo 1 > /proc/sys/kernel/domainname) 2>/dev/null && echo writable || echo ro", "ro\n"},
		{"readlink /proc/1/exe >/dev/null 2>&1; echo $?", "1\n"}, // the init is not dumpable
	}
	for i, ck := range checks {
		out, res := run(t, a, fmt.Sprint("check-", i), ck.script)
		if ck.want == "count" {
			n, _ := strconv.Atoi(strings.TrimSpace(out))
			if n < 3 || n > 5 {
				t.Errorf("%s: %d processes visible, want the init and the pipeline only", ck.script, n)
			}
			continue
		}
		if out != ck.want || res.ExitCode != 0 {
			t.Errorf("%s: got %q (exit %d), want %q", ck.script, out, res.ExitCode, ck.want)
		}
	}
	// State persists across execs and idle time, processes too.
	run(t, a, "s1", "echo kept > /work/state; sleep 1000 &")
	time.Sleep(1500 * time.Millisecond)
	if out, _ := run(t, a, "s2", "cat /work/state; ps | grep -q '[s]leep 1000' && echo alive"); out != "kept\nalive\n" {
		t.Fatalf("after idling: %q", out)
	}
	// The other sandbox sees neither.
	if out, _ := run(t, b, "s1", "cat /work/state 2>&1; ps | grep '[s]leep 1000' || echo none"); !strings.Contains(out, "No such file") || !strings.HasSuffix(out, "none\n") {
		t.Fatalf("sandbox b sees a's state: %q", out)
	}
	info, err := a.Inspect(context.Background())
	if err != nil || info.Status != api.StatusRunning || info.Memory != 256<<20 || info.Execs != len(checks)+2 || info.MemoryBytes <= 0 {
		t.Fatalf("inspect: %+v %v", info, err)
	}
}

// Exec streams, exactly-once steps, files in and out, re-adoption after
// kill -9: the conformance suite (conformance_linux_test.go).

// TestHostileFiles: paths the agent planted never lead the worker out of
// the sandbox.
func TestHostileFiles(t *testing.T) {
	_, c := setup(t)
	sb := create(t, c, api.SandboxSpec{Name: "hostile"})
	host := t.TempDir()
	os.WriteFile(filepath.Join(host, "secret"), []byte("host secret\n"), 0o600)
	run(t, sb, "plant", fmt.Sprintf("ln -s %s/secret /work/link; ln -s %s /work/dir; ln -s ../../../../../../%s /work/rel; mkfifo /work/fifo", host, host, host))
	ctx := context.Background()
	var buf bytes.Buffer
	for _, p := range []string{"/work/link", "/work/rel/secret"} {
		if err := sb.ReadFile(ctx, p, &buf); !errdefs.IsNotFound(err) || buf.Len() > 0 {
			t.Errorf("read %s: %q, %v: a symlink led out of the sandbox", p, buf.String(), err)
		}
	}
	if err := sb.WriteFile(ctx, "/work/dir/planted", strings.NewReader("x"), 0o644); err == nil {
		t.Errorf("write through a symlinked dir succeeded")
	}
	if _, err := os.Stat(filepath.Join(host, "planted")); err == nil {
		t.Fatalf("a write through a planted symlink landed on the host")
	}
	done := make(chan error, 1)
	go func() { done <- sb.ReadFile(ctx, "/work/fifo", &buf) }()
	select {
	case err := <-done:
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("read a fifo: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("reading a fifo the agent made hangs the worker")
	}
	if err := sb.WriteFile(ctx, "work/relative", strings.NewReader("x"), 0o644); !errdefs.IsInvalidArgument(err) {
		t.Errorf("relative path: %v", err)
	}
}

// TestNoHostPaths: nothing a sandbox can read names the host's paths:
// not its init's command line, not its mount table (overlayfs shows its
// layer options as given), for a plain sandbox and a --userns one
// (issue 29, item 13).
func TestNoHostPaths(t *testing.T) {
	w, c := setup(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, userns := range []bool{false, true} {
		sb := create(t, c, api.SandboxSpec{Name: fmt.Sprintf("paths-%v", userns), UserNS: userns})
		out, _ := run(t, sb, "read", "tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/self/mountinfo /proc/1/mountinfo")
		if !strings.HasPrefix(out, "dsec-init \n") || !strings.Contains(out, " / / ") {
			t.Errorf("userns %v: %q: want the init's command line and a mount table", userns, out)
		}
		for _, host := range []string{w.Root, filepath.Dir(self)} {
			if strings.Contains(out, host) {
				t.Errorf("userns %v: the sandbox reads the host path %s:\n%s", userns, host, out)
			}
		}
		// Nothing of the namespace the init was forked from (its binary,
		// the host's /proc and library directories) shows or opens.
		if strings.Contains(out, "/dsec-init") || strings.Contains(out, " /usr ") {
			t.Errorf("userns %v: a mount of the inits' own namespace shows in the sandbox:\n%s", userns, out)
		}
		// A command's stdio: the sandbox's own /dev/null and the pipes
		// its init copies into the journal, never a host file.
		out, _ = run(t, sb, "fds", "for fd in 0 1 2; do readlink /proc/self/fd/$fd; stat -Lc %F /proc/self/fd/$fd; done")
		if !regexp.MustCompile(`^/dev/null\ncharacter special file\n(pipe:\[\d+\]\nfifo\n){2}$`).MatchString(out) {
			t.Errorf("userns %v: a command's stdio: %q, want /dev/null and two pipes", userns, out)
		}
		// Nor can the sandbox's root walk the init's root, cwd or binary.
		out, _ = run(t, sb, "spawner", "for l in root cwd exe; do ls /proc/1/$l/ 2>&1; readlink /proc/1/$l 2>&1; done")
		if got := strings.Count(out, "Permission denied"); got != 3 || strings.Count(out, "\n") != 3 {
			t.Errorf("userns %v: the init's root, cwd and binary from the sandbox: %q, want each refused", userns, out)
		}
	}
}

// TestTerminal: an exec on a terminal gets one of the sandbox's own
// devpts, which ttyname() names, of the size asked for, stdin
// included without -i (as docker's -t), in a --userns sandbox too
// (issue 29, item 13).
func TestTerminal(t *testing.T) {
	_, c := setup(t)
	for _, userns := range []bool{false, true} {
		sb := create(t, c, api.SandboxSpec{Name: fmt.Sprintf("tty-%v", userns), UserNS: userns})
		var out bytes.Buffer
		res, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: []string{"sh", "-c", "tty; stty size; test -t 0 && echo stdin-tty; readlink /proc/self/fd/1"},
			TTY: true, Rows: 33, Cols: 101, Stdout: &out, Stderr: &out})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("userns %v: %v %+v", userns, err, res)
		}
		got := strings.ReplaceAll(out.String(), "\r", "")
		if !regexp.MustCompile(`^/dev/pts/(\d+)\n33 101\nstdin-tty\n/dev/pts/(\d+)\n$`).MatchString(got) {
			t.Errorf("userns %v: %q: want the sandbox's own terminal, 33x101", userns, got)
		}
	}
}

// TestBoundedDefaults: a sandbox that asks for no limits gets the
// worker's defaults (memory, pids), and is stopped by them inside its
// own group, which says so; api.Unlimited opts out; the worker reports
// the bounds in force, the bound on all sandboxes together included
// (issue 36).
func TestBoundedDefaults(t *testing.T) {
	// Not much less memory: the init here is this test binary, built
	// with -race, some 30 MiB resident, and a command runs at the init's
	// oom_score_adj until the init has raised it to 1000, a moment after
	// its exec (longer on a loaded host). A command that reaches the
	// limit within that moment (a fork bomb's first shells) is smaller
	// than such an init under a limit near its size, and the kernel
	// takes the init instead (under 48 MiB, on a loaded host: 3 runs in
	// 20).
	// dsec-init keeps some 3 MiB.
	const mem = 128 << 20
	_, c := setupWith(t, runtimetest.Config{Defaults: worker.Defaults{Memory: mem, Pids: 64}})
	ctx := context.Background()
	v, err := c.Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(v.Backends, []string{"container", "microvm", "vm"}) { // FnCall is a way to use one, not a backend
		t.Errorf("backends %v", v.Backends)
	}
	if l := v.Limits; l == nil || l.DefaultMemory != mem || l.DefaultPids != 64 || l.HostReserve != 1<<30 || l.MemoryBytes <= 0 || l.Pids <= 0 {
		t.Fatalf("version limits: %+v", v.Limits)
	}
	limits := func(sb *sdk.Sandbox) (int64, int64) {
		info, err := sb.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		g, err := cgroup.NewTree("").Open(filepath.Base(info.Cgroup))
		if err != nil {
			t.Fatal(err)
		}
		return g.Limits()
	}
	plain := create(t, c, api.SandboxSpec{Name: "plain"})
	if info, err := plain.Inspect(ctx); err != nil || info.Backend != "container" {
		t.Errorf("the backend a sandbox was made on: %q, %v", info.Backend, err)
	}
	if m, pids := limits(plain); m != mem || pids != 64+driver.InitPids {
		t.Errorf("no limits asked: memory %d, pids %d; want the defaults (128 MiB, 64 + the init's %d)", m, pids, driver.InitPids)
	}
	out, res := run(t, plain, "hog", `x=$(head -c 200000000 /dev/zero | tr '\0' a); echo ${#x}`)
	if res.ExitCode != 137 || !res.OOM {
		t.Errorf("200 MB under the 128 MiB default: %q %+v, want an OOM kill it reports", out, res)
	}
	free := create(t, c, api.SandboxSpec{Name: "free", Memory: api.Unlimited, Pids: api.Unlimited})
	if mem, pids := limits(free); mem != 0 || pids != 0 {
		t.Errorf("api.Unlimited: memory %d, pids %d; want none of its own", mem, pids)
	}
	if _, res := run(t, free, "hog", `x=$(head -c 200000000 /dev/zero | tr '\0' a); echo ${#x}`); res.ExitCode != 0 {
		t.Errorf("200 MB with no limit of its own: %+v", res)
	}
	own := create(t, c, api.SandboxSpec{Name: "own", Memory: 256 << 20, Pids: 100})
	if mem, pids := limits(own); mem != 256<<20 || pids != 100+driver.InitPids {
		t.Errorf("asked 256 MiB and 100 pids: %d, %d", mem, pids)
	}
	// A fork bomb in a sandbox with no --pids: held to the default, while
	// the worker and the other sandboxes answer.
	run(t, plain, "bomb", "bomb() { bomb | bomb & }; bomb 2>/dev/null; sleep 2")
	if _, err := c.Version(ctx); err != nil {
		t.Fatalf("the worker under a fork bomb: %v", err)
	}
	if out, res := run(t, own, "beside", "echo fine"); out != "fine\n" || res.ExitCode != 0 {
		t.Errorf("a sandbox beside a fork bomb: %q %+v", out, res)
	}
	info, _ := plain.Inspect(ctx)
	if g, err := cgroup.NewTree("").Open(filepath.Base(info.Cgroup)); err == nil {
		if pids, _ := g.Pids(); len(pids) > 64+driver.InitPids {
			t.Errorf("the fork bomb has %d processes, over the default of 64", len(pids))
		}
	}
}

// hostMemory is the host's memory (MemTotal), as the worker reads it.
func hostMemory(t *testing.T) int64 {
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// ownParent is a parent group of the test's own, dsec-test-WHAT-PID,
// for the sandboxes of the worker it starts (runtimetest.Config's
// CgroupParent, where runtimetest's cleanup and Leftovers then find
// them).
func ownParent(t *testing.T, what string) string {
	return fmt.Sprintf("dsec-test-%s-%d", what, os.Getpid())
}

// TestPressureFreezesBatch: under memory pressure batch sandboxes give
// way: a latency sandbox holds 200 MiB and a batch one churns a 160 MiB
// file through the page cache, under a 300 MiB bound on both (the
// host's memory less the reserve, in a parent of the test's own); the
// stalls that makes freeze the batch sandbox, never the latency one,
// whose command lives on (issue 36, item 5).
func TestPressureFreezesBatch(t *testing.T) {
	mem, parent := hostMemory(t), ownParent(t, "pressure")
	_, c := setupWith(t, runtimetest.Config{CgroupParent: parent, Reclaim: worker.Reclaim{Pressure: 5},
		Admission: worker.Admission{HostReserve: mem - 300<<20, Primed: -1, Spares: -1}})
	ctx := context.Background()
	lat := create(t, c, api.SandboxSpec{Name: "lat", Memory: api.Unlimited})
	bat := create(t, c, api.SandboxSpec{Name: "bat", Class: api.SchedBatch, Memory: api.Unlimited})
	run(t, bat, "file", "dd if=/dev/urandom of=/big bs=1M count=160 2>/dev/null")
	_, err := lat.Exec(ctx, sdk.ExecOptions{ID: "hold", Detach: true, Args: []string{"sh", "-c", "set -o pipefail; dd if=/dev/zero bs=200M count=1 2>/dev/null | sleep 40"}})
	if err != nil && !errors.Is(err, sdk.ErrRunning) {
		t.Fatal(err)
	}
	if _, err := bat.Exec(ctx, sdk.ExecOptions{ID: "churn", Detach: true, Args: []string{"sh", "-c", "while :; do cat /big > /dev/null; done"}}); err != nil && !errors.Is(err, sdk.ErrRunning) {
		t.Fatal(err)
	}
	frozen := false
	for deadline := time.Now().Add(40 * time.Second); time.Now().Before(deadline) && !frozen; time.Sleep(200 * time.Millisecond) {
		info, err := bat.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		frozen = info.Frozen
		if li, _ := lat.Inspect(ctx); li.Frozen {
			t.Fatal("the latency sandbox was frozen")
		}
	}
	if !frozen {
		t.Fatal("the batch sandbox was never frozen under the pressure")
	}
	// A new step there does not hang until the pressure passes: it is
	// refused at once as busy (or runs, if the sandbox thawed meanwhile).
	t0 := time.Now()
	_, err = bat.Exec(ctx, sdk.ExecOptions{ID: "while-frozen", Args: []string{"true"}})
	if took := time.Since(t0); took > 3*time.Second || err != nil && !(errdefs.IsResourceExhausted(err) && strings.Contains(err.Error(), "memory pressure")) {
		t.Errorf("an exec into the frozen batch sandbox: %v after %v", err, took)
	} else {
		t.Logf("an exec into the frozen batch sandbox: %v after %v", err, took.Round(time.Millisecond))
	}
	if li, _ := lat.Inspect(ctx); li.OOMKills != 0 || li.Frozen {
		t.Errorf("the latency sandbox: %d OOM kills, frozen %v", li.OOMKills, li.Frozen)
	}
}

// TestHostileCopy: copies of trees (dsec cp) resolve inside the
// sandbox's root both ways, whatever the agent planted, and an archive
// from the client never puts a byte outside the directory it names.
func TestHostileCopy(t *testing.T) {
	_, c := setup(t)
	sb := create(t, c, api.SandboxSpec{Name: "hostile-cp"})
	host := t.TempDir()
	os.WriteFile(filepath.Join(host, "secret"), []byte("host secret\n"), 0o600)
	run(t, sb, "plant", fmt.Sprintf("mkdir /work/out; ln -s %s/secret /work/out/link; ln -s %s /work/dir; mkfifo /work/out/fifo; echo mine > /work/out/f", host, host))
	ctx := context.Background()

	// In through a symlink to a host directory: resolved in the
	// sandbox, where that path does not exist.
	_, err := sb.CopyTo(ctx, "/work/dir", tarOf(t, "planted", "x"), false)
	if !errdefs.IsNotFound(err) {
		t.Errorf("copy into a planted link to a host directory: %v", err)
	}
	for _, name := range []string{"../../../../../../" + host + "/planted", "/" + host + "/planted2"} {
		if _, err := sb.CopyTo(ctx, "/work", tarOf(t, name, "x"), false); err == nil {
			t.Errorf("entry %s extracted", name)
		}
	}
	if ents, _ := os.ReadDir(host); len(ents) != 1 {
		t.Fatalf("a copy in landed on the host: %v", ents)
	}

	// Out: links stay links, a fifo does not hang the worker, the host
	// file is never read.
	done := make(chan []string, 1)
	go func() {
		rc, _, err := sb.CopyFrom(ctx, "/work/out", sdk.CopyFromOptions{})
		if err != nil {
			t.Error(err)
			done <- nil
			return
		}
		defer rc.Close()
		var names []string
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err != nil {
				if err != io.EOF {
					t.Error(err)
				}
				break
			}
			b, _ := io.ReadAll(tr)
			if strings.Contains(string(b), "host secret") {
				t.Errorf("%s carried the host's secret", h.Name)
			}
			names = append(names, fmt.Sprintf("%s %c %s", h.Name, h.Typeflag, h.Linkname))
		}
		done <- names
	}()
	select {
	case names := <-done:
		want := []string{"out/ 5 ", "out/f 0 ", "out/fifo 6 ", "out/link 2 " + host + "/secret"}
		if !slices.Equal(names, want) {
			t.Errorf("archive of /work/out: %q, want %q", names, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("copying a tree with a fifo out hangs the worker")
	}
	if _, _, err := sb.CopyFrom(ctx, "/work/dir/secret", sdk.CopyFromOptions{}); !errdefs.IsNotFound(err) {
		t.Errorf("copy out through a planted link: %v", err)
	}
	if _, _, err := sb.CopyFrom(ctx, "/proc/self/environ", sdk.CopyFromOptions{}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("copy out of /proc: %v", err)
	}
}

// TestCopyOwners: a --userns sandbox's copies speak its own ids.
func TestCopyOwners(t *testing.T) {
	_, c := setup(t)
	sb := create(t, c, api.SandboxSpec{Name: "cp-owners", UserNS: true})
	ctx := context.Background()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "kept", Typeflag: tar.TypeReg, Mode: 0o4750, Uid: 5, Gid: 6, Size: 1})
	tw.Write([]byte("k"))
	tw.Close()
	if _, err := sb.CopyTo(ctx, "/work", &buf, true); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.CopyTo(ctx, "/work", tarOf(t, "plain", "p"), false); err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "owners", "stat -c '%u:%g %A %n' /work/kept /work/plain"); out != "5:6 -rwsr-x--- /work/kept\n0:0 -rw-r--r-- /work/plain\n" {
		t.Errorf("in the sandbox: %q", out)
	}
	rc, _, err := sb.CopyFrom(ctx, "/work/kept", sdk.CopyFromOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	h, err := tar.NewReader(rc).Next()
	if err != nil || h.Uid != 5 || h.Gid != 6 || h.Mode != 0o4750 {
		t.Errorf("out: %+v %v, want uid 5, gid 6, mode 4750", h, err)
	}
}

func tarOf(t *testing.T, name, body string) *bytes.Buffer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	io.WriteString(tw, body)
	tw.Close()
	return &buf
}

// TestJournaledNeverStarted: a step the dead worker journaled but never
// handed to the sandbox runs on retry (the rest of a kill -9 is the
// conformance suite's).
func TestJournaledNeverStarted(t *testing.T) {
	w, c := setup(t)
	sb := create(t, c, api.SandboxSpec{Name: "survivor"})
	os.MkdirAll(filepath.Join(w.Root, "sandboxes", runtime.IDOf(w.Root, "survivor"), "execs", "orphan"), 0o700)
	w.Kill()
	runtimetest.StartWorker(t, w.Root)
	if got, res := run(t, sb, "orphan", "echo fresh"); got != "fresh\n" || res.Replayed {
		t.Fatalf("a journaled but never started step: %q %+v", got, res)
	}
}

// TestKilledMidCreate kills the worker at many points of a create: after
// a restart each sandbox either exists and works or left nothing.
func TestKilledMidCreate(t *testing.T) {
	w, _ := setup(t)
	ctx := context.Background()
	made := 0
	defer func() { t.Logf("%d of 12 creates finished before the kill", made) }()
	for i := 0; i < 12; i++ {
		c, err := sdk.New(sdk.Options{Root: w.Root})
		if err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprint("mid-", i)
		go c.Create(ctx, api.SandboxSpec{Name: name, Layers: []string{"ws:1", "bb:1"}})
		time.Sleep(time.Duration(i) * 3 * time.Millisecond)
		w.Kill()
		w = runtimetest.StartWorker(t, w.Root)
		c, _ = sdk.New(sdk.Options{Root: w.Root})
		sb := c.Sandbox(name)
		if info, err := sb.Inspect(ctx); err == nil {
			made++
			if info.Status != api.StatusRunning {
				t.Fatalf("%s after restart: %s", name, info.Status)
			}
			if out, _ := run(t, sb, "x", "cat /etc/answer"); out != "42\n" {
				t.Fatalf("%s after restart: %q", name, out)
			}
			if err := sb.Remove(ctx, true); err != nil {
				t.Fatal(err)
			}
		} else if !errdefs.IsNotFound(err) {
			t.Fatal(err)
		}
		if l := runtimetest.Leftovers(w.Root); len(l) > 0 {
			t.Fatalf("killed %d ms into a create: left %v", i*3, l)
		}
	}
}

func TestLimitsAndErrors(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	// The init is this test binary, built with -race: some 30 MiB
	// resident. Under a limit near that it can outscore, for the OOM
	// killer, what is left of the command once its big shell is killed
	// (where the worker lacks CAP_SYS_RESOURCE, as on CI, and so cannot
	// lower the init's oom_score_adj; see TestOOMScores).
	sb := create(t, c, api.SandboxSpec{Name: "small", Memory: 64 << 20, Pids: 32})
	out, res := run(t, sb, "hog", `x=$(head -c 200000000 /dev/zero | tr '\0' a); echo ${#x}`)
	if res.ExitCode != 137 || !res.OOM {
		t.Fatalf("a 200 MB string under a 64 MiB limit: %q %+v", out, res)
	}
	// The shell dies at its first refused fork; count what started.
	run(t, sb, "forks", "for i in $(seq 64); do (echo x >> /tmp/n; exec sleep 1) & done")
	time.Sleep(1500 * time.Millisecond)
	out, _ = run(t, sb, "count-forks", "wc -l < /tmp/n")
	// 32 of the sandbox's own, and the init's share on top (its
	// threads use some of it).
	if n, err := strconv.Atoi(strings.TrimSpace(out)); err != nil || n == 0 || n >= 32+driver.InitPids {
		t.Fatalf("pids limit 32 (and the init's %d): %q sleeps", driver.InitPids, out)
	}
	if _, res := run(t, sb, "after", "true"); res.ExitCode != 0 {
		t.Fatalf("the sandbox did not survive its OOM: %+v", res)
	}
	var errb bytes.Buffer
	res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"no-such-tool"}, Stderr: &errb})
	if err != nil || res.ExitCode != 127 || !strings.Contains(errb.String(), "not found") {
		t.Fatalf("command not found: %+v %q %v", res, errb.String(), err)
	}
	for _, tc := range []struct {
		what string
		err  error
		is   func(error) bool
	}{
		{"unknown sandbox", c.Sandbox("nope").Remove(ctx, true), errdefs.IsNotFound},
		{"exec in unknown sandbox", execErr(c.Sandbox("nope")), errdefs.IsNotFound},
		{"duplicate name", createErr(c, api.SandboxSpec{Name: "small", Layers: []string{"bb:1"}}), errdefs.IsAlreadyExists},
		{"unknown layer", createErr(c, api.SandboxSpec{Name: "x", Layers: []string{"missing:1"}}), errdefs.IsNotFound},
		{"unknown backend", createErr(c, api.SandboxSpec{Name: "y", Backend: "warp", Layers: []string{"bb:1"}}), errdefs.IsInvalidArgument},
		{"bad name", createErr(c, api.SandboxSpec{Name: "../z", Layers: []string{"bb:1"}}), errdefs.IsInvalidArgument},
		{"rm running", sb.Remove(ctx, false), errdefs.IsFailedPrecondition},
		{"bad exec id", execIDErr(sb, "a/../b"), errdefs.IsInvalidArgument},
	} {
		if !tc.is(tc.err) {
			t.Errorf("%s: %v", tc.what, tc.err)
		}
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := execErr(sb); !errdefs.IsFailedPrecondition(err) || sdk.IsInfra(err) {
		t.Fatalf("exec in a stopped sandbox: %v", err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, sb, "restarted", "ps | grep '[s]leep' || echo no-processes; echo ok"); out != "no-processes\nok\n" {
		t.Fatalf("after stop and start: %q", out)
	}
	// The init dies under a command: an infrastructure failure, and the
	// sandbox is dead.
	errc := make(chan error, 1)
	go func() { errc <- execErr(sb, "sh", "-c", "touch /up; exec sleep 5") }()
	backendtest.WaitFile(t, sb, "/up")
	info, _ := sb.Inspect(ctx)
	syscallKill(t, info.Pid)
	if err := <-errc; !sdk.IsInfra(err) {
		t.Fatalf("the init died under the command: %v", err)
	}
	if info, _ := sb.Inspect(ctx); info.Status != api.StatusDead {
		t.Fatalf("status after the init died: %s", info.Status)
	}
	if err := execErr(sb); !sdk.IsInfra(err) && !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("exec in a dead sandbox: %v", err)
	}
}

func execErr(sb *sdk.Sandbox, args ...string) error {
	if len(args) == 0 {
		args = []string{"true"}
	}
	_, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: args})
	return err
}

func execIDErr(sb *sdk.Sandbox, id string) error {
	_, err := sb.Exec(context.Background(), sdk.ExecOptions{ID: id, Args: []string{"true"}})
	return err
}

func createErr(c *sdk.Client, spec api.SandboxSpec) error {
	_, err := c.Create(context.Background(), spec)
	return err
}

func syscallKill(t *testing.T, pid int) {
	t.Helper()
	p, err := os.FindProcess(pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
}

// TestNoLeaks: 100 create, exec, rm cycles leave no mount, cgroup,
// process or file behind.
func TestNoLeaks(t *testing.T) {
	w, c := setup(t)
	ctx := context.Background()
	for i := 0; i < 100; i++ {
		sb := create(t, c, api.SandboxSpec{Memory: 64 << 20})
		if _, res := run(t, sb, "x", "echo $$ > /tmp/pid; sleep 100 &"); res.ExitCode != 0 {
			t.Fatalf("cycle %d: %+v", i, res)
		}
		if err := sb.Remove(ctx, true); err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
	}
	if l := runtimetest.Leftovers(w.Root); len(l) > 0 {
		t.Fatalf("after 100 cycles: %v", l)
	}
	// A spare or a primed sandbox being made is a child for a moment (an
	// init taken from the spares before the primed state names it): once
	// they settle, no other child may be left.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		kids := w.Children()
		if len(kids) == 0 && len(w.Spares()) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 100 cycles the worker has children (zombies or leaked inits): %v", kids)
		}
	}
	if list, err := c.List(ctx); err != nil || len(list) != 0 {
		t.Fatalf("ps after 100 cycles: %v %v", list, err)
	}
}
