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
	"strings"
	"sync"
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
	if out, _ := sh(t, sb, "later", "cat /work/state; ps | grep -c '[s]leep 1000'"); out != "kept\n1\n" {
		t.Fatalf("the next step: %q", out)
	}
}

// testExactlyOnce: a step id runs once; a retry gets the recorded
// output and result, also while the first still runs.
func testExactlyOnce(t *testing.T, env *Env) {
	ctx := context.Background()
	sb := create(t, env, "once")
	out1, r1 := sh(t, sb, "step-1", "echo ran >> /count; echo out; echo err >&2; exit 3")
	out2, r2 := sh(t, sb, "step-1", "echo ran >> /count; echo out; echo err >&2; exit 3")
	if out1 != "out\nerr\n" || r1.ExitCode != 3 || r1.Replayed {
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
	if got, _ := sh(t, sb, "after", "cat /work/state; wc -l < /mid; ps | grep -c '[s]leep 1000'"); got != "kept\n1\n1\n" {
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
	out, _ := sh(t, sb, "read", "cat /work/d/f; ls /etc/answer 2>/dev/null || echo gone; ps | grep -c '[s]leep 1000'")
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
	if snap.Entries == 0 || snap.Whiteouts != 1 || snap.Sandbox != sb.Name {
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
