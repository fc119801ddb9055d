// Package backendtest is the conformance suite for backends: what every
// kind of sandbox must do, checked through the worker's API as a user
// (and a trainer's SDK) sees it, as containerd's snapshotter suite and
// restic's backend suite hold each implementation to one contract.
//
// The suite drives a real worker through package sdk rather than the
// backend's Go interface: what users rely on (a step that runs exactly
// once across a worker killed with -9, files kept across a stop) is a
// property of the worker and the backend together, and the interface
// between them may change while the contract may not. A backend passes
// when its Factory's workers pass Run.
//
//	func TestConformance(t *testing.T) { backendtest.Run(t, factory) }
package backendtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// Env is a worker under test, on a root of its own.
type Env struct {
	// Backend is the name sandboxes ask for (api.SandboxSpec.Backend).
	Backend string
	// Layers make a sandbox: topmost first, over a base holding
	// busybox (sh and its applets), /etc/answer ("42\n"), and an empty
	// /work.
	Layers []string
	// Client talks to the worker.
	Client *sdk.Client
	// Restart kills the worker with SIGKILL, then starts another on the
	// same root and returns a client of it. Sandboxes must live on.
	Restart func(t *testing.T) *sdk.Client
	// Leftovers lists what of removed sandboxes the host still holds
	// (mounts, groups, devices, processes, directories): nothing, once
	// every sandbox is removed, while the worker runs on.
	Leftovers func() []string
	// Root is the worker's root: where the suite looks at what the host
	// holds of a sandbox's journal.
	Root string
	// BlockDiff: the backend's snapshots are block diffs of a disk (a
	// full VM's), which count no files: PackDiff holds them to bytes
	// packed, not to files and whiteouts.
	BlockDiff bool
}

// Factory makes a fresh Env for one test, on a fresh root; its cleanup
// (t.Cleanup) stops the worker and removes the root.
type Factory func(t *testing.T) *Env

// Run runs the suite: each test on an Env of its own.
func Run(t *testing.T, f Factory) {
	for _, tc := range []struct {
		name string
		fn   func(*testing.T, *Env)
	}{
		{"Backend", testBackend},
		{"Exec", testExec},
		{"ExactlyOnce", testExactlyOnce},
		{"Reattach", testReattach},
		{"StopStart", testStopStart},
		{"Files", testFiles},
		{"PackDiff", testPackDiff},
		{"Call", testCall},
		{"Journal", testJournal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := f(t)
			defer removeAll(t, env) // while the worker runs: before the factory's cleanup
			tc.fn(t, env)
		})
	}
}

// removeAll removes every sandbox through the API, then asks the host
// what is left of them.
func removeAll(t *testing.T, env *Env) {
	ctx := context.Background()
	list, err := env.Client.List(ctx)
	if err != nil {
		t.Errorf("list: %v", err)
		return
	}
	for _, s := range list {
		if err := env.Client.Sandbox(s.Name).Remove(ctx, true); err != nil {
			t.Errorf("remove %s: %v", s.Name, err)
		}
	}
	if l := env.Leftovers(); len(l) > 0 {
		t.Errorf("every sandbox removed, the host still holds: %v", l)
	}
}

func create(t *testing.T, env *Env, name string) *sdk.Sandbox {
	t.Helper()
	sb, err := env.Client.Create(context.Background(), api.SandboxSpec{Name: name, Backend: env.Backend, Layers: env.Layers})
	if err != nil {
		t.Fatalf("create %s on backend %s: %v", name, env.Backend, err)
	}
	return sb
}

// sh runs script under id and returns its output, stdout then stderr
// as they came, and its result.
func sh(t *testing.T, sb *sdk.Sandbox, id, script string) (string, api.ExecResult) {
	t.Helper()
	var out bytes.Buffer
	res, err := sb.Exec(context.Background(), sdk.ExecOptions{ID: id, Args: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err != nil {
		t.Fatalf("exec %q in %s: %v", script, sb.Name, err)
	}
	return out.String(), res
}

// WaitFile waits for p to exist in sb (a command got that far), for up
// to 30 s.
func WaitFile(t *testing.T, sb *sdk.Sandbox, p string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if sb.ReadFile(context.Background(), p, io.Discard) == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s in sandbox %s after 30 s", p, sb.Name)
		}
	}
}

// testBackend: a sandbox records the backend it asked for, and a name
// the worker does not run is refused as the caller's error.
func testBackend(t *testing.T, env *Env) {
	ctx := context.Background()
	v, err := env.Client.Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, b := range v.Backends {
		found = found || b == env.Backend
	}
	if !found {
		t.Fatalf("the worker lists backends %v, not %s", v.Backends, env.Backend)
	}
	sb := create(t, env, "which")
	info, err := sb.Inspect(ctx)
	if err != nil || info.Backend != env.Backend || info.Status != api.StatusRunning {
		t.Fatalf("inspect: %+v %v, want backend %s, running", info, err, env.Backend)
	}
	_, err = env.Client.Create(ctx, api.SandboxSpec{Name: "nowhere", Backend: "no-such-backend", Layers: env.Layers})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), env.Backend) {
		t.Fatalf("create on an unknown backend: %v, want invalid argument naming %s", err, env.Backend)
	}
}

// testExec: streams kept apart, stdin, environment and directory, exit
// codes of every kind.
func testExec(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "exec")
	var stdout, stderr bytes.Buffer
	res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", `echo "out $X $(pwd)"; echo err >&2; cat; exit 3`},
		Env: []string{"X=given"}, Cwd: "/etc", Stdin: strings.NewReader("from stdin\n"), Stdout: &stdout, Stderr: &stderr})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("exec: %+v %v, want exit 3", res, err)
	}
	if stdout.String() != "out given /etc\nfrom stdin\n" || stderr.String() != "err\n" {
		t.Fatalf("stdout %q, stderr %q", stdout.String(), stderr.String())
	}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"true"}, 0},
		{[]string{"sh", "-c", "kill -9 $$"}, 137},
		{[]string{"no-such-command"}, 127},
		{[]string{"/etc/answer"}, 126}, // not executable
	} {
		res, err := sb.Exec(ctx, sdk.ExecOptions{Args: c.args})
		if err != nil || res.ExitCode != c.code {
			t.Errorf("%v: %+v %v, want exit %d", c.args, res, err, c.code)
		}
	}
	// Output larger than any buffer on the way arrives whole.
	out, res := sh(t, sb, "big", "head -c 3000000 /dev/zero | tr '\\0' x")
	if res.ExitCode != 0 || len(out) != 3000000 || strings.Trim(out, "x") != "" {
		t.Fatalf("3 MB of output: %d bytes, exit %d", len(out), res.ExitCode)
	}
	// State lasts across steps: files and processes.
	sh(t, sb, "bg", "echo kept > /work/state; sleep 1000 >/dev/null 2>&1 &")
	if out, _ := sh(t, sb, "later", "cat /work/state; "+countProcs("sleep 1000")); out != "kept\n1\n" {
		t.Fatalf("the next step: %q", out)
	}
}

// countProcs is a shell command that prints how many processes run
// cmdline (its words joined by spaces), from /proc: a base need not
// have ps.
func countProcs(cmdline string) string {
	return `(for p in /proc/[0-9]*; do tr '\0' ' ' < $p/cmdline; echo; done) 2>/dev/null | grep -c '^` + cmdline + ` $'`
}

// testExactlyOnce: a step id runs once; a retry gets the recorded
// output and result, also while the first still runs.
func testExactlyOnce(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "once")
	// Each stream on its own: which of two pipes a command wrote at once
	// is copied first is the copier's to choose.
	step := func() (string, api.ExecResult) {
		var stdout, stderr bytes.Buffer
		res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "step-1", Args: []string{"sh", "-c", "echo ran >> /count; echo out; echo err >&2; exit 3"},
			Stdout: &stdout, Stderr: &stderr})
		if err != nil {
			t.Fatalf("step-1: %v", err)
		}
		return stdout.String() + "|" + stderr.String(), res
	}
	out1, r1 := step()
	out2, r2 := step()
	if out1 != "out\n|err\n" || r1.ExitCode != 3 || r1.Replayed {
		t.Fatalf("first: %q %+v", out1, r1)
	}
	if out2 != out1 || r2.ExitCode != 3 || !r2.Replayed || !r2.Finished.Equal(r1.Finished) {
		t.Fatalf("replay: %q %+v", out2, r2)
	}
	// A retry asking for another command under the id is refused, not
	// answered with the first one's result.
	if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "step-1", Args: []string{"rm", "-rf", "/work"}}); !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "a retry must ask for the same command") {
		t.Fatalf("a replay of step-1 with another command: %v", err)
	}
	// A retry while the command still runs waits for the same result.
	var wg sync.WaitGroup
	results := make([]api.ExecResult, 2)
	for i := range results {
		wg.Go(func() {
			if i == 1 { // once the first runs
				WaitFile(t, sb, "/slow-started")
			}
			_, results[i] = sh(t, sb, "slow", "touch /slow-started; sleep 0.6; echo ran >> /count; exit 4")
		})
	}
	wg.Wait()
	if results[0].ExitCode != 4 || results[1].ExitCode != 4 || !results[1].Replayed {
		t.Fatalf("concurrent same id: %+v", results)
	}
	if out, _ := sh(t, sb, "count", "wc -l < /count"); out != "2\n" {
		t.Fatalf("commands ran %s times, want 2 (one per id)", out)
	}
	var buf bytes.Buffer
	res, err := sb.Logs(ctx, "step-1", false, &buf, &buf)
	if err != nil || res.ExitCode != 3 || buf.String() != "out\nerr\n" {
		t.Fatalf("logs: %q %+v %v", buf.String(), res, err)
	}
	// A detached step's output and result are collected later.
	if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "detached", Args: []string{"sh", "-c", "sleep 0.2; echo late; exit 5"}, Detach: true}); err != nil {
		t.Fatal(err)
	}
	buf.Reset()
	if res, err := sb.Logs(ctx, "detached", true, &buf, &buf); err != nil || res.ExitCode != 5 || buf.String() != "late\n" {
		t.Fatalf("logs of a detached step: %q %+v %v", buf.String(), res, err)
	}
}

// testReattach: a worker killed with -9 mid-step leaves the sandbox,
// its files, its processes and the step running; the next worker has
// the step's result, and runs a step the dead one journaled but never
// started.
func testReattach(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "survivor")
	sh(t, sb, "before", "echo kept > /work/state; sleep 1000 >/dev/null 2>&1 &")
	errc := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, sdk.ExecOptions{ID: "mid", Args: []string{"sh", "-c", "touch /mid-started; sleep 1; echo finished; echo ran >> /mid; exit 7"}})
		errc <- err
	}()
	WaitFile(t, sb, "/mid-started")
	c := env.Restart(t)
	if err := <-errc; !sdk.IsInfra(err) {
		t.Fatalf("the client of a killed worker: %v, want an infrastructure error", err)
	}
	sb = c.Sandbox(sb.Name)
	var out bytes.Buffer
	res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "mid", Args: []string{"sh", "-c", "touch /mid-started; sleep 1; echo finished; echo ran >> /mid; exit 7"}, Stdout: &out})
	if err != nil || res.ExitCode != 7 || !res.Replayed || out.String() != "finished\n" {
		t.Fatalf("retry after the worker's restart: %q %+v %v", out.String(), res, err)
	}
	if got, _ := sh(t, sb, "after", "cat /work/state; wc -l < /mid; "+countProcs("sleep 1000")); got != "kept\n1\n1\n" {
		t.Fatalf("after re-adoption (state, runs of the step, background processes): %q", got)
	}
	if info, err := sb.Inspect(ctx); err != nil || info.Status != api.StatusRunning || info.Backend != env.Backend {
		t.Fatalf("inspect after re-adoption: %+v %v", info, err)
	}
	// Killed again, before a step reached the sandbox: the retry runs it.
	c = env.Restart(t)
	sb = c.Sandbox(sb.Name)
	if got, res := sh(t, sb, "fresh", "echo fresh"); got != "fresh\n" || res.Replayed {
		t.Fatalf("a step after the second restart: %q %+v", got, res)
	}
}

// testStopStart: stopping ends every process and keeps every file;
// starting again runs on the same files.
func testStopStart(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "pause")
	// Only the sleep is left running: the files are written when the
	// step ends, however slow the sandbox (a guest under TCG).
	const write = "mkdir -p /work/d && echo kept > /work/d/f && rm /etc/answer && { sleep 1000 >/dev/null 2>&1 & }"
	sh(t, sb, "write", write)
	sh(t, sb, "sync", "sync")
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := sb.Inspect(ctx); err != nil || info.Status != api.StatusStopped {
		t.Fatalf("inspect after stop: %+v %v", info, err)
	}
	if _, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("exec in a stopped sandbox: %v, want failed precondition", err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	out, _ := sh(t, sb, "read", "cat /work/d/f; ls /etc/answer 2>/dev/null || echo gone; "+countProcs("sleep 1000"))
	if out != "kept\ngone\n0\n" {
		t.Fatalf("after stop and start (a file written, one removed, processes): %q", out)
	}
	// Steps stay journaled across the restart.
	if _, res := sh(t, sb, "write", write); !res.Replayed {
		t.Fatalf("a step of before the stop ran again: %+v", res)
	}
}

// testFiles: files in and out, their mode, and what a missing one says.
func testFiles(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "files")
	if err := sb.WriteFile(ctx, "/work/in.txt", strings.NewReader("payload\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, _ := sh(t, sb, "stat-in", "cat /work/in.txt; stat -c %a /work/in.txt"); out != "payload\n600\n" {
		t.Fatalf("file in: %q", out)
	}
	sh(t, sb, "make", "printf 'made\\n' > /work/out.txt; chmod 640 /work/out.txt")
	var buf bytes.Buffer
	if err := sb.ReadFile(ctx, "/work/out.txt", &buf); err != nil || buf.String() != "made\n" {
		t.Fatalf("file out: %q %v", buf.String(), err)
	}
	st, err := sb.Stat(ctx, "/work/out.txt", false)
	if err != nil || st.Size != 5 || st.Mode.Perm() != 0o640 {
		t.Fatalf("stat: %+v %v", st, err)
	}
	if err := sb.ReadFile(ctx, "/work/none", io.Discard); !errdefs.IsNotFound(err) {
		t.Fatalf("reading a missing file: %v, want not found", err)
	}
	// The layers' files are there to read, too.
	buf.Reset()
	if err := sb.ReadFile(ctx, "/etc/answer", &buf); err != nil || buf.String() != "42\n" {
		t.Fatalf("a layer's file: %q %v", buf.String(), err)
	}
}

// testPackDiff: a pack-diff holds what the sandbox wrote, and branches
// started from it see it and diverge.
func testPackDiff(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "source")
	sh(t, sb, "write", "echo step-1 > /work/progress; rm /etc/answer")
	snap, err := sb.PackDiff(ctx, api.PackRequest{Tag: "conf:1"})
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case snap.Sandbox != sb.Name || snap.Name != "conf:1":
		t.Fatalf("pack-diff: %+v, of sandbox %s", snap, sb.Name)
	case env.BlockDiff && (snap.Bytes <= 0 || snap.Size != snap.Bytes):
		t.Fatalf("pack-diff: %+v, want a block diff's bytes", snap)
	case !env.BlockDiff && (snap.Entries == 0 || snap.Whiteouts != 1):
		t.Fatalf("pack-diff: %+v, want the file written and one whiteout", snap)
	}
	branches, err := env.Client.Branch(ctx, api.BranchRequest{Snapshot: snap.Name, N: 2, Spec: api.SandboxSpec{Backend: env.Backend}})
	if err != nil || len(branches) != 2 {
		t.Fatalf("branch: %v %v", branches, err)
	}
	for i, b := range branches {
		if out, _ := sh(t, b, "see", "cat /work/progress; ls /etc/answer 2>/dev/null || echo gone"); out != "step-1\ngone\n" {
			t.Fatalf("branch %s: %q", b.Name, out)
		}
		sh(t, b, "diverge", fmt.Sprintf("echo branch-%d > /work/progress", i))
	}
	for i, b := range branches {
		if out, _ := sh(t, b, "check", "cat /work/progress"); out != fmt.Sprintf("branch-%d\n", i) {
			t.Fatalf("branch %s after both wrote: %q", b.Name, out)
		}
	}
	if out, _ := sh(t, sb, "check", "cat /work/progress"); out != "step-1\n" {
		t.Fatalf("the source after its branches wrote: %q", out)
	}
	if info, err := branches[0].Inspect(ctx); err != nil || info.Backend != env.Backend {
		t.Fatalf("a branch's backend: %+v %v", info, err)
	}
}

// testCall: a one-off call (dsec run --rm) runs in a sandbox that is
// gone when it answers.
func testCall(t *testing.T, env *Env) {
	ctx := context.Background()
	var out bytes.Buffer
	res, err := env.Client.Call(ctx, sdk.CallOptions{Run: true, Spec: &api.SandboxSpec{Backend: env.Backend, Layers: env.Layers},
		ExecOptions: sdk.ExecOptions{Args: []string{"sh", "-c", "cat /etc/answer; exit 9"}, Stdout: &out}})
	if err != nil || res.ExitCode != 9 || out.String() != "42\n" {
		t.Fatalf("call: %q %+v %v", out.String(), res, err)
	}
	// Removed after the answer, not before: gone from the list, then
	// from the host, soon.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		list, err := env.Client.ListAll(ctx)
		if err != nil {
			t.Fatal(err)
		}
		left := env.Leftovers()
		if len(list) == 0 && len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after the call answered, its sandbox is still listed (%+v) or held (%v)", list, left)
		}
	}
}

// blocks is what a file allocates, in 512-byte blocks.
func blocks(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return int64(st.Blocks)
	}
	return 0
}

// counter counts what is written to it.
type counter struct{ n int64 }

func (c *counter) Write(b []byte) (int, error) { c.n += int64(len(b)); return len(b), nil }

// testJournal: a command's output reaches the sandbox's journal through
// pipes that a process out of the sandbox's reach copies: the command's
// descriptors show no host file, so it can neither grow the journal's
// files on the host nor rewrite them; its output is kept up to the cap
// (the sandbox's disk bound here, 16 MiB), the rest read and dropped
// (the command never sees SIGPIPE) and counted in the result; what a
// process it left writes after it ended is never journaled, though it
// runs on; the journal's outputs stay within the disk bound, the oldest
// dropped and said so; and a step the worker was killed under is
// journaled whole, up to its exit, by the next worker.
func testJournal(t *testing.T, env *Env) {
	ctx := context.Background()
	sb, err := env.Client.Create(ctx, api.SandboxSpec{Name: "journal", Backend: env.Backend, Layers: env.Layers, Disk: journalBound})
	if err != nil {
		t.Fatal(err)
	}
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// What the host holds of the journal's outputs: their sizes and what
	// they allocate.
	held := func() (size, alloc int64) {
		files, _ := filepath.Glob(filepath.Join(env.Root, "sandboxes", info.ID, "execs", "*", "std*"))
		for _, p := range files {
			var st os.FileInfo
			if st, err = os.Stat(p); err == nil {
				size += st.Size()
				alloc += blocks(st) * 512
			}
		}
		return size, alloc
	}

	journalDescriptors(t, env, sb)
	journalFlood(t, sb, held)
	journalLeftover(t, sb, held)
	journalAcrossRestart(t, env, sb)
}

// journalBound is the journal's sandbox's disk bound, which bounds its
// journal's outputs too.
const journalBound = 16 << 20

// journalDescriptors: the descriptors a command gets are pipes (stdin
// without one: the sandbox's own /dev/null, or a pipe of a guest's),
// never a host path.
func journalDescriptors(t *testing.T, env *Env, sb *sdk.Sandbox) {
	ctx := context.Background()
	out, _ := sh(t, sb, "fds", "for fd in 0 1 2; do readlink /proc/self/fd/$fd; done")
	if !regexp.MustCompile(`^(/dev/null|pipe:\[\d+\])\npipe:\[\d+\]\npipe:\[\d+\]\n$`).MatchString(out) {
		t.Errorf("a command's descriptors: %q, want /dev/null (or a pipe) and two pipes", out)
	}
	var buf bytes.Buffer
	if _, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "readlink /proc/self/fd/0; ls -l /proc/self/fd/ /proc/$$/fd/"},
		Stdin: strings.NewReader(""), Stdout: &buf, Stderr: &buf}); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^pipe:\[\d+\]\n`).MatchString(buf.String()) || strings.Contains(buf.String(), env.Root) {
		t.Errorf("a command with stdin: %q, want pipes and no host path", buf.String())
	}
}

// journalFlood: a command's stdout cannot be grown, cut or rewritten as
// a file, and its output past the bound is read and counted, not kept;
// held is what the host holds of the journal.
func journalFlood(t *testing.T, sb *sdk.Sandbox, held func() (size, alloc int64)) {
	ctx := context.Background()
	// Its stdout cannot be grown, cut or rewritten as a file.
	out, res := sh(t, sb, "grow", "fallocate -l 256M /proc/self/fd/1 2>/dev/null && echo fallocate; "+
		"truncate -s 256M /proc/self/fd/1 2>/dev/null && echo truncate; "+
		// (coreutils' dd fills a seek it cannot make with zeros: output,
		// not a file grown, and 256M one-byte writes under TCG)
		"dd --version 2>&1 | grep -q coreutils || { dd if=/dev/zero of=/proc/self/fd/1 bs=1 count=1 seek=256M conv=notrunc 2>/dev/null && echo seek; }; "+
		"echo done")
	if out != "done\n" || res.ExitCode != 0 {
		t.Errorf("growing stdout: %q, want every attempt refused", out)
	}
	if size, alloc := held(); size > 1<<20 || alloc > 1<<20 {
		t.Fatalf("after the attempts to grow stdout the host holds %d bytes of journal (%d allocated)", size, alloc)
	}

	// 64 MiB of output with a 16 MiB disk: 16 MiB kept, the rest read
	// and counted; the command ends well.
	var c counter
	res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "flood", Args: []string{"sh", "-c", "head -c 67108864 /dev/zero"}, Stdout: &c, Stderr: &c})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("64 MiB of output: %+v %v, want exit 0 (no SIGPIPE)", res, err)
	}
	if c.n > journalBound || !res.OutputTruncated || res.OutputTruncatedBytes != 64<<20-c.n {
		t.Fatalf("64 MiB of output, a 16 MiB disk: %d bytes streamed, result %+v, want at most 16 MiB and the rest counted", c.n, res)
	}
	if size, alloc := held(); size > journalBound || alloc > journalBound+1<<20 {
		t.Fatalf("the host holds %d bytes of journal (%d allocated), past the sandbox's disk bound", size, alloc)
	}
	var again counter
	if replay, err := sb.Logs(ctx, "flood", false, &again, &again); err != nil || again.n != c.n || replay.OutputTruncatedBytes != res.OutputTruncatedBytes {
		t.Fatalf("the flood's replay: %d bytes, %+v %v", again.n, replay, err)
	}
}

// journalLeftover: what a process a step left writes after the step
// ended is never journaled, and the flood's output is dropped to keep
// the journal within the bound; held is what the host holds of it.
func journalLeftover(t *testing.T, sb *sdk.Sandbox, held func() (size, alloc int64)) {
	// A process the step left writes on after it ended, to its stdout
	// and through /proc/self/fd: the step's output stays what it was,
	// and the process runs on, never blocked or killed by SIGPIPE.
	const forge = `echo honest; ( sleep 0.5; echo reward=1; echo reward=1 > /proc/self/fd/1; echo reward=1 >> /proc/self/fd/2; ` +
		`head -c 1048576 /dev/zero; touch /wrote; exec sleep 1000 ) & exit 0`
	ctx := context.Background()
	out, res := sh(t, sb, "forge", forge)
	if out != "honest\n" || res.ExitCode != 0 {
		t.Fatalf("the step: %q %+v", out, res)
	}
	WaitFile(t, sb, "/wrote")
	var buf bytes.Buffer
	for _, replay := range []func(w io.Writer) (api.ExecResult, error){
		func(w io.Writer) (api.ExecResult, error) {
			return sb.Exec(ctx, sdk.ExecOptions{ID: "forge", Args: []string{"sh", "-c", forge}, Stdout: w, Stderr: w})
		},
		func(w io.Writer) (api.ExecResult, error) { return sb.Logs(ctx, "forge", false, w, w) },
	} {
		buf.Reset()
		if res, err := replay(&buf); err != nil || buf.String() != "honest\n" || res.ExitCode != 0 || res.OutputTruncated {
			t.Errorf("the step's replay after its leftover wrote: %q %+v %v, want its own output", buf.String(), res, err)
		}
	}
	if out, _ := sh(t, sb, "alive", countProcs("sleep 1000")); out != "1\n" {
		t.Errorf("the process the step left: %q running, want 1", out)
	}
	// The flood's 16 MiB and any cap do not fit the bound beside the
	// steps since: its output was dropped, its result kept.
	buf.Reset()
	if replay, err := sb.Logs(ctx, "flood", false, &buf, &buf); err != nil || buf.Len() != 0 || !replay.OutputDropped || replay.ExitCode != 0 {
		t.Errorf("the flood's replay later: %d bytes, %+v %v, want its output dropped, its result kept", buf.Len(), replay, err)
	}
	if size, _ := held(); size > journalBound {
		t.Errorf("the host holds %d bytes of journal, past the bound", size)
	}
}

// journalAcrossRestart: the worker killed mid-step, the command writing
// on, the next worker's replay has all of it, up to its exit.
func journalAcrossRestart(t *testing.T, env *Env, sb *sdk.Sandbox) {
	const mid = `for i in 1 2 3 4 5 6 7 8; do echo line $i; [ $i = 1 ] && touch /mid-started; sleep 0.2; done; echo end >&2; exit 3`
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, sdk.ExecOptions{ID: "mid", Args: []string{"sh", "-c", mid}})
		errc <- err
	}()
	WaitFile(t, sb, "/mid-started")
	sb = env.Restart(t).Sandbox(sb.Name)
	<-errc
	out, res := sh(t, sb, "mid", mid)
	if want := "line 1\nline 2\nline 3\nline 4\nline 5\nline 6\nline 7\nline 8\nend\n"; out != want || res.ExitCode != 3 || !res.Replayed {
		t.Errorf("a step across the worker's restart: %q %+v, want all its output and exit 3", out, res)
	}
}
