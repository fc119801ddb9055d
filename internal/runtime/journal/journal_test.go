package journal

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// open is the journal of dir, its results log beside it.
func open(dir string) *Journal { return Open(dir, dir+".log", false) }

// started is a start that ends the command at once with code.
func started(code int) func(*Exec, *os.File, *os.File) error {
	return func(e *Exec, stdout, _ *os.File) error {
		stdout.WriteString("out\n")
		e.Finish(Result{ExitCode: code})
		return nil
	}
}

// TestOnce: an id runs once, in this journal and in one opened again on
// its directory (a worker that restarted); a retry asking for another
// command is refused; a start that fails journals nothing, so a retry
// runs; a call's step (Keep false) is answered from memory alone.
func TestOnce(t *testing.T) {
	dir := t.TempDir()
	j := open(dir)
	step := Step{Sandbox: "s", ID: "1", Args: []string{"true"}, Keep: true}
	e, replayed, err := j.Start(step, started(3))
	if err != nil || replayed {
		t.Fatal(err, replayed)
	}
	if r, err := e.Result(context.Background()); err != nil || r.ExitCode != 3 || r.ID != "1" || r.Started.IsZero() || r.Finished.Before(r.Started) {
		t.Fatalf("%+v %v", r, err)
	}
	if b, _ := os.ReadFile(e.StdoutPath()); string(b) != "out\n" {
		t.Fatalf("stdout %q", b)
	}
	again := func(j *Journal, why string) {
		t.Helper()
		e, replayed, err := j.Start(step, func(*Exec, *os.File, *os.File) error { t.Fatalf("%s: ran again", why); return nil })
		if err != nil || !replayed {
			t.Fatalf("%s: %v %v", why, err, replayed)
		}
		if r, _ := e.Result(context.Background()); r.ExitCode != 3 {
			t.Fatalf("%s: %+v", why, r)
		}
	}
	again(j, "in memory")
	again(open(dir), "from the file")
	// A host crash lost result.json (written without waiting for the
	// disk), and the exec's directory with it: the synced log has it.
	if err := os.RemoveAll(filepath.Join(dir, "1")); err != nil {
		t.Fatal(err)
	}
	again(open(dir), "from the log")
	for _, name := range []string{"result.json", "stdout", "stderr"} {
		if _, err := os.Stat(filepath.Join(dir, "1", name)); err != nil {
			t.Errorf("%s not put back from the log: %v", name, err)
		}
	}
	// A line a crash cut short at the log's end is no result.
	f, err := os.OpenFile(dir+".log", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"id":"2","exit_co`)
	f.Close()
	again(open(dir), "beside a cut line")
	if _, err := open(dir).Lookup("s", "2"); !errdefs.IsNotFound(err) {
		t.Errorf("a cut line's exec: %v, want not found", err)
	}
	// The next result after the cut line is whole.
	if _, _, err := open(dir).Start(Step{Sandbox: "s", ID: "9", Args: []string{"true"}, Keep: true}, started(5)); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(filepath.Join(dir, "9"))
	if e, err := open(dir).Lookup("s", "9"); err != nil || e.res.ExitCode != 5 {
		t.Errorf("the result after a cut line: %v %+v", err, e)
	}
	other := step
	other.Args = []string{"false"}
	if _, _, err := open(dir).Start(other, started(0)); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("another command under the id: %v", err)
	}
	if n := j.Count(); n != 2 { // 1 and 9
		t.Fatalf("count %d", n)
	}

	refused := Step{Sandbox: "s", ID: "2", Args: []string{"x"}, Keep: true}
	if _, _, err := j.Start(refused, func(*Exec, *os.File, *os.File) error { return errdefs.ErrInvalidArgument }); !errdefs.IsInvalidArgument(err) {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "2")); !os.IsNotExist(err) {
		t.Fatalf("a refused step left its directory: %v", err)
	}
	if _, replayed, err := j.Start(refused, started(0)); err != nil || replayed {
		t.Fatalf("the retry of a refused step: %v %v", err, replayed)
	}

	call := Step{Sandbox: "s", ID: "3", Args: []string{"true"}}
	if _, _, err := j.Start(call, started(0)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "3", "result.json")); !os.IsNotExist(err) {
		t.Fatalf("a call's result was written: %v", err)
	}
	if _, err := j.Lookup("s", "3"); err != nil {
		t.Fatal(err)
	}
	if _, err := open(dir).Lookup("s", "4"); !errdefs.IsNotFound(err) {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "../x", "-a", string(make([]byte, 200))} {
		if _, _, err := j.Start(Step{ID: bad, Args: []string{"true"}}, started(0)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("id %q: %v", bad, err)
		}
	}
	if _, _, err := j.Start(Step{ID: "5"}, started(0)); !errdefs.IsInvalidArgument(err) {
		t.Errorf("no command: %v", err)
	}
}

// instance is what a restarted worker finds of its sandbox's init: the
// state of each exec id it was asked to run.
type instance struct {
	backend.Instance
	running map[string]bool
	codes   map[string]int
}

func (i instance) Probe(_ context.Context, id string) (bool, backend.Exit, error) {
	code, ok := i.codes[id]
	if !ok {
		return false, backend.Exit{}, backend.ErrUnknownExec
	}
	return i.running[id], backend.Exit{Code: code}, nil
}

func (i instance) Result(_ context.Context, id string) (backend.Exit, error) {
	return backend.Exit{Code: i.codes[id]}, nil
}

// TestRecover: a restarted worker finds the steps a dead one left
// without a result: one the init ran gets its code, one still running
// its code once it ends, one the init never started is forgotten (a
// retry runs it), and with the init gone each is a failure of the host.
func TestRecover(t *testing.T) {
	dir := t.TempDir()
	for _, id := range []string{"ended", "running", "never", "done", "torn"} {
		os.MkdirAll(filepath.Join(dir, id), 0o700)
		os.WriteFile(filepath.Join(dir, id, "stdout"), nil, 0o600)
	}
	os.WriteFile(filepath.Join(dir, "done", "result.json"), []byte(`{"id":"done","exit_code":9}`), 0o600)
	// A result a crash tore (an older dsec's mark written over it): it
	// ended, and is never asked of the init, nor run again.
	os.WriteFile(filepath.Join(dir, "torn", "result.json"), []byte(`{"id":"to`), 0o600)
	j := open(dir)
	j.Recover(instance{running: map[string]bool{"running": true}, codes: map[string]int{"ended": 4, "running": 5}})
	for id, want := range map[string]int{"ended": 4, "running": 5, "done": 9} {
		e, err := j.Lookup("s", id)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := e.Result(context.Background()); err != nil || r.ExitCode != want {
			t.Errorf("%s: %+v %v, want %d", id, r, err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "never")); !os.IsNotExist(err) {
		t.Fatalf("a step never started stays: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "torn")); err != nil {
		t.Fatalf("a step with a torn result went, so that a retry would run it again: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "running", "result.json")); err != nil {
		t.Fatalf("the recovered result was not journaled: %v", err)
	}

	lost := t.TempDir()
	os.MkdirAll(filepath.Join(lost, "x"), 0o700)
	open(lost).Recover(nil)
	e, err := open(lost).Lookup("s", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Result(context.Background()); !errdefs.IsUnavailable(err) {
		t.Fatalf("a step whose sandbox died: %v, want an infrastructure failure", err)
	}
}

// wrote is a start that writes n bytes of output and ends the command.
func wrote(n int) func(*Exec, *os.File, *os.File) error {
	return func(e *Exec, stdout, _ *os.File) error {
		stdout.Write(make([]byte, min(int64(n), e.Limit())))
		e.Finish(Result{})
		return nil
	}
}

// TestBound: a journal with a bound keeps its outputs within it: a
// step's cap is lowered to the bound, and before a step starts the
// outputs of the oldest ended steps are emptied (their results stay,
// marked) until its cap fits; a journal opened again (a worker that
// restarted) counts what is on disk; what running steps wrote counts.
func TestBound(t *testing.T) {
	dir := t.TempDir()
	j := open(dir)
	step := func(j *Journal, id string, n int) *Exec {
		t.Helper()
		e, _, err := j.Start(Step{Sandbox: "s", ID: id, Args: []string{"x"}, Keep: true, MaxOutput: 40, Bound: 100}, wrote(n))
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	total := func() (n int64) {
		for _, p := range must(filepath.Glob(filepath.Join(dir, "*", "std*"))) {
			st, _ := os.Stat(p)
			n += st.Size()
		}
		return n
	}
	dropped := func(j *Journal, id string) bool {
		e, err := j.Lookup("s", id)
		if err != nil {
			t.Fatal(err)
		}
		r, _ := e.Result(context.Background())
		return r.OutputDropped
	}
	for i, n := range []int{30, 30, 30, 50} { // the last writes past its cap
		e := step(j, fmt.Sprint(i), n)
		if e.Limit() != 40 {
			t.Errorf("step %d: cap %d, want 40", i, e.Limit())
		}
		if got := total(); got > 100 {
			t.Fatalf("after step %d the journal holds %d bytes, past its bound 100", i, got)
		}
	}
	// 30+30+30 and a cap of 40 do not fit: step 0's output went.
	if !dropped(j, "0") || dropped(j, "1") || dropped(j, "2") || dropped(j, "3") {
		t.Fatalf("dropped: %v %v %v %v, want only step 0's", dropped(j, "0"), dropped(j, "1"), dropped(j, "2"), dropped(j, "3"))
	}
	if !dropped(open(dir), "0") {
		t.Fatal("the mark of a dropped output is not journaled")
	}
	// A host crash lost step 0's result.json: the log has its mark.
	saved := must(os.ReadFile(filepath.Join(dir, "0", "result.json")))
	os.Remove(filepath.Join(dir, "0", "result.json"))
	if !dropped(open(dir), "0") {
		t.Fatal("the mark of a dropped output is not in the results log")
	}
	os.WriteFile(filepath.Join(dir, "0", "result.json"), saved, 0o600)
	// Opened again, the journal counts 30+30+40 on disk: the next step
	// drops steps 1 and 2.
	again := open(dir)
	if _, replayed, err := again.Start(Step{Sandbox: "s", ID: "1", Args: []string{"x"}, Keep: true, MaxOutput: 40, Bound: 100}, wrote(1)); err != nil || !replayed {
		t.Fatal(err, replayed) // a replay: an ended step, droppable as any
	}
	step(again, "4", 1)
	if !dropped(again, "1") || !dropped(again, "2") || dropped(again, "3") {
		t.Fatal("a journal opened again does not count what is on disk")
	}
	// What a running step wrote counts: the next gets what is left.
	run := func(e *Exec, stdout, _ *os.File) error { // ends later
		stdout.Write(make([]byte, 30))
		return nil
	}
	long, _, err := again.Start(Step{Sandbox: "s", ID: "long", Args: []string{"x"}, Keep: true, MaxOutput: 40, Bound: 100}, run)
	if err != nil {
		t.Fatal(err)
	}
	next, _, err := again.Start(Step{Sandbox: "s", ID: "next", Args: []string{"x"}, Keep: true, MaxOutput: 80, Bound: 100}, run)
	if err != nil {
		t.Fatal(err)
	}
	if next.Limit() != 70 || !dropped(again, "3") || !dropped(again, "4") {
		t.Fatalf("beside a running step's 30 bytes: cap %d, want 70, all ended outputs dropped", next.Limit())
	}
	long.Finish(Result{})
	next.Finish(Result{})
	// Without a bound, only the cap.
	free, _, _ := open(t.TempDir()).Start(Step{ID: "x", Args: []string{"x"}}, run)
	if free.Limit() != DefaultMaxOutput {
		t.Fatalf("no bound: cap %d", free.Limit())
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestHeld: a journal of many steps holds few of them in memory, and
// reads back from the log only the results whose files are lost; a step
// let go of is still answered, never run again.
func TestHeld(t *testing.T) {
	dir := t.TempDir()
	j := open(dir)
	const n = 5 * held
	for i := range n {
		if _, _, err := j.Start(Step{Sandbox: "s", ID: fmt.Sprint(i), Args: []string{"x"}, Keep: true}, started(i%7)); err != nil {
			t.Fatal(err)
		}
	}
	if len(j.execs) > held {
		t.Fatalf("%d steps in memory after %d, want at most %d", len(j.execs), n, held)
	}
	for _, id := range []string{"0", fmt.Sprint(n / 2), fmt.Sprint(n - 1)} {
		e, replayed, err := j.Start(Step{Sandbox: "s", ID: id, Args: []string{"x"}, Keep: true}, func(*Exec, *os.File, *os.File) error {
			t.Fatalf("step %s ran again", id)
			return nil
		})
		if err != nil || !replayed {
			t.Fatal(err, replayed)
		}
		if r, err := e.Result(context.Background()); err != nil || r.ExitCode != must(strconv.Atoi(id))%7 {
			t.Fatalf("step %s: %+v %v", id, r, err)
		}
	}
	// Opened again with every file there, the log is read and none of
	// it kept; with one file lost, that one.
	again := open(dir)
	if _, err := again.Lookup("s", "1"); err != nil {
		t.Fatal(err)
	}
	if len(again.log.results) != 0 {
		t.Fatalf("%d results of the log held, all their files there", len(again.log.results))
	}
	os.RemoveAll(filepath.Join(dir, "3"))
	again = open(dir)
	e, err := again.Lookup("s", "3")
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := e.Result(context.Background()); r.ExitCode != 3 || len(again.log.results) != 1 {
		t.Fatalf("from the log: %+v, %d held", r, len(again.log.results))
	}
}
