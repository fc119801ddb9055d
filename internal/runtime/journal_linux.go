package runtime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
)

// The exec journal: every exec runs under an id, in
// <sandbox>/execs/<id>/ with its output (stdout, stderr: the files the
// command writes to, passed to the init as descriptors, so the output
// survives the worker) and, once it ended, result.json. An id runs at
// most once per sandbox: asking again returns the journaled result, or
// waits for it.

// ExecSpec is a command to run.
type ExecSpec struct {
	ID   string
	Args []string
	Env  []string // after the sandbox's
	Cwd  string   // default: the sandbox's workdir, then /
	// Stdin is nil for /dev/null. Stdout and Stderr, when set, replace
	// the journal's output files (a terminal: the caller records it).
	Stdin, Stdout, Stderr *os.File
	TTY                   bool // Stdin is a terminal to make the controlling one
}

// Result is how an exec ended. Err, when set, is an infrastructure
// failure: the sandbox died under the command (a stop is no failure:
// the command's result is then 137, killed).
type Result struct {
	ID       string `json:"id"`
	ExitCode int    `json:"exit_code"`
	OOM      bool   `json:"oom,omitempty"`
	// Args is the command the id ran, so that a replay asking for
	// another is refused, not answered with this one's result.
	Args     []string  `json:"args,omitempty"`
	Err      string    `json:"error,omitempty"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
}

// ErrInfra marks failures of the sandbox or the host, not of a command:
// a trainer retries these elsewhere instead of scoring them.
var ErrInfra = fmt.Errorf("sandbox infrastructure failure: %w", errdefs.ErrUnavailable)

// Exec is a journaled command, running or ended.
type Exec struct {
	ID   string
	dir  string
	done chan struct{}
	res  Result
	// journal: the result is written before it is told. Not in a call's
	// sandbox (State.Pool): it runs one command, and goes before the
	// worker does (a worker that starts removes those of one that died),
	// so the exec in memory is all a replay finds, and its answer
	// waits for no file.
	journal bool
}

// StdoutPath and StderrPath are the journaled output files.
func (e *Exec) StdoutPath() string { return filepath.Join(e.dir, "stdout") }
func (e *Exec) StderrPath() string { return filepath.Join(e.dir, "stderr") }

// Done is closed when the command has ended and its result is journaled.
func (e *Exec) Done() <-chan struct{} { return e.done }

// Result waits for the command to end.
func (e *Exec) Result(ctx context.Context) (Result, error) {
	select {
	case <-e.done:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	if e.res.Err != "" {
		return e.res, fmt.Errorf("exec %s: %s: %w", e.ID, e.res.Err, ErrInfra)
	}
	return e.res, nil
}

var execIDRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.:@-]{0,127}$`) })

// defaultEnv is what every exec starts from.
var defaultEnv = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"}

// mergeEnv lays the lists over each other, later ones winning per name.
func mergeEnv(lists ...[]string) []string {
	idx := map[string]int{}
	var out []string
	for _, l := range lists {
		for _, kv := range l {
			k, _, _ := strings.Cut(kv, "=")
			if i, ok := idx[k]; ok {
				out[i] = kv
				continue
			}
			idx[k] = len(out)
			out = append(out, kv)
		}
	}
	return out
}

// Run starts spec under its id and returns the journaled exec. If the
// id ran before (in this worker's life or an earlier one) it returns
// that exec instead, with replayed set: the command does not run again.
func (sb *Sandbox) Run(ctx context.Context, spec ExecSpec) (e *Exec, replayed bool, err error) {
	if !execIDRE().MatchString(spec.ID) {
		return nil, false, fmt.Errorf("bad exec id %q: use up to 128 letters, digits and '_.:@-': %w", spec.ID, errdefs.ErrInvalidArgument)
	}
	if len(spec.Args) == 0 {
		return nil, false, fmt.Errorf("exec: no command: %w", errdefs.ErrInvalidArgument)
	}
	sb.execMu.Lock()
	defer sb.execMu.Unlock()
	replay := func(e *Exec) (*Exec, bool, error) {
		if len(e.res.Args) > 0 && !slices.Equal(e.res.Args, spec.Args) {
			return nil, false, fmt.Errorf("exec id %s ran %q in sandbox %s already, and this asks for %q: a retry must ask for the same command; give another --id for another: %w",
				spec.ID, strings.Join(e.res.Args, " "), sb.Name, strings.Join(spec.Args, " "), errdefs.ErrAlreadyExists)
		}
		return e, true, nil
	}
	if e := sb.execs[spec.ID]; e != nil {
		return replay(e)
	}
	dir := filepath.Join(sb.dir, "execs", spec.ID)
	if e, err := loadExec(dir, spec.ID); err == nil {
		sb.remember(e)
		return replay(e)
	}
	sb.mu.Lock()
	c, g, st := sb.c, sb.g, sb.State
	sb.mu.Unlock()
	if st.Status != Running || c == nil {
		return nil, false, fmt.Errorf("sandbox %s is %s: start it first: %w", sb.Name, st.Status, errdefs.ErrFailedPrecondition)
	}
	select {
	case <-c.Done():
		return nil, false, fmt.Errorf("sandbox %s: its init died: %w", sb.Name, ErrInfra)
	default:
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, false, err
	}
	stdout, stderr := spec.Stdout, spec.Stderr
	for _, f := range []struct {
		name string
		out  **os.File
	}{{"stdout", &stdout}, {"stderr", &stderr}} {
		jf, err := os.OpenFile(filepath.Join(dir, f.name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			os.RemoveAll(dir)
			return nil, false, err
		}
		// Sent with the request, the kernel holds them from then on.
		defer jf.Close()
		if *f.out == nil {
			*f.out = jf
		}
	}
	cwd := spec.Cwd
	if cwd == "" {
		cwd = st.Workdir
	}
	env := mergeEnv(defaultEnv, st.Env, spec.Env)
	e = &Exec{ID: spec.ID, dir: dir, done: make(chan struct{}), journal: st.Pool == ""}
	e.res.ID, e.res.Started, e.res.Args = spec.ID, time.Now().UTC(), spec.Args
	oomBefore := 0
	if g != nil {
		oomBefore = g.OOMKills()
	}
	started := make(chan struct{})
	refused := make(chan error, 1)
	sb.touch()
	sb.running.Add(1)
	go func() {
		defer func() {
			sb.running.Add(-1)
			sb.touch()
		}()
		// The call returns when the command ends; the init answers at
		// once if it cannot start it.
		code, err := c.Exec(context.Background(), backend.Cmd{ID: spec.ID, Args: spec.Args, Env: env, Cwd: cwd, TTY: spec.TTY,
			MakeCwd: spec.Cwd == "" && cwd != "", OOMScore: oomScore(st.Class),
			Stdin: spec.Stdin, Stdout: stdout, Stderr: stderr, Started: func(int) { close(started) }})
		switch {
		case errors.Is(err, backend.ErrDied) && sb.Snapshot().Status == Stopped:
			// A deliberate stop killed it, as docker stop does: its
			// result is that (128+SIGKILL), not a failure of the host.
			code = 128 + 9
		case errors.Is(err, backend.ErrDied):
			e.res.Err = "the sandbox died under the command" + deathCause(sb.dir, g, oomBefore)
		case err != nil:
			refused <- err
			return
		}
		e.res.ExitCode = code
		if g != nil && code == 128+9 && g.OOMKills() > oomBefore {
			e.res.OOM = true
			if !g.ReachedLimit() { // not its own limit: the host's bound
				e.res.Err = "the kernel killed the command for the host's sake: all sandboxes together reached the host's memory bound " +
					"(its memory less admission.host_reserve), not this sandbox's limit; retry the step"
			}
		}
		e.finish()
	}()
	select {
	case err := <-refused: // a bad directory, say: the caller's error, not a result
		os.RemoveAll(dir)
		return nil, false, fmt.Errorf("exec %s: %v: %w", spec.ID, err, errdefs.ErrInvalidArgument)
	case <-started:
	case <-e.done: // not found (127), or the sandbox died
	}
	sb.remember(e)
	return e, false, nil
}

// finish journals the result and wakes the waiters. A worker killed
// before the rename leaves no result: the next asks the init.
func (e *Exec) finish() {
	e.res.Finished = time.Now().UTC()
	if e.journal {
		// The result is what a retry after a host crash finds instead
		// of running the step again; its output is not synced (two more
		// fsyncs per exec), so a crash may cut what a replay prints.
		b, _ := json.Marshal(e.res)
		if err := durable.WriteFile(filepath.Join(e.dir, "result.json"), b, 0o600); err != nil {
			e.res.Err = "journal the result: " + err.Error()
		}
	}
	close(e.done)
}

func (sb *Sandbox) remember(e *Exec) {
	if sb.execs == nil {
		sb.execs = map[string]*Exec{}
	}
	sb.execs[e.ID] = e
}

func loadExec(dir, id string) (*Exec, error) {
	b, err := os.ReadFile(filepath.Join(dir, "result.json"))
	if err != nil {
		return nil, err
	}
	e := &Exec{ID: id, dir: dir, done: make(chan struct{})}
	if err := json.Unmarshal(b, &e.res); err != nil {
		return nil, err
	}
	close(e.done)
	return e, nil
}

// LookupExec returns the exec with id, running or journaled.
func (sb *Sandbox) LookupExec(id string) (*Exec, error) {
	if !execIDRE().MatchString(id) {
		return nil, fmt.Errorf("bad exec id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	sb.execMu.Lock()
	defer sb.execMu.Unlock()
	if e := sb.execs[id]; e != nil {
		return e, nil
	}
	e, err := loadExec(filepath.Join(sb.dir, "execs", id), id)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s has no exec %s: %w", sb.Name, id, errdefs.ErrNotFound)
	}
	return e, nil
}

// ExecCount counts the journaled execs.
func (sb *Sandbox) ExecCount() int {
	ents, _ := os.ReadDir(filepath.Join(sb.dir, "execs"))
	return len(ents)
}

// recoverExecs collects the results of the execs an earlier worker left
// running: the init still has them. One the init never started (that
// worker died between journaling and asking) is forgotten, so that a
// retry runs it.
func (sb *Sandbox) recoverExecs() {
	ents, _ := os.ReadDir(filepath.Join(sb.dir, "execs"))
	for _, ent := range ents {
		dir := filepath.Join(sb.dir, "execs", ent.Name())
		if _, err := os.Stat(filepath.Join(dir, "result.json")); err == nil {
			continue
		}
		e := &Exec{ID: ent.Name(), dir: dir, done: make(chan struct{}), journal: true}
		e.res.ID = e.ID
		if st, err := os.Stat(filepath.Join(dir, "stdout")); err == nil {
			e.res.Started = st.ModTime().UTC()
		}
		if sb.c == nil {
			e.res.Err = "the sandbox died under the command (found on worker restart)"
			e.finish()
			continue
		}
		running, code, err := sb.c.Probe(context.Background(), e.ID)
		if errors.Is(err, backend.ErrUnknownExec) {
			os.RemoveAll(dir)
			continue
		}
		sb.remember(e)
		if !running { // it ended while no worker was there
			e.res.ExitCode = code
			if err != nil {
				e.res.Err = "the sandbox died under the command"
			}
			e.finish()
			continue
		}
		go func(c backend.Instance) { // still running: wait on it
			code, err := c.Result(context.Background(), e.ID)
			if err != nil {
				e.res.Err = "the sandbox died under the command"
			}
			e.res.ExitCode = code
			e.finish()
		}(sb.c)
	}
}

// Commands' oom_score_adj by class: when all sandboxes together reach
// the host's bound, the kernel kills a batch command before a latency
// one (a task's badness is its resident pages plus adj thousandths of
// the limit's, so 500 more is half the host's bound), and the init of
// either last.
const (
	latencyOOMScore = 500
	batchOOMScore   = 1000
)

func oomScore(class string) int {
	if class == api.SchedBatch {
		return batchOOMScore
	}
	return latencyOOMScore
}

// deathCause says why a sandbox's init died, as far as the host can
// tell: the OOM killer in its group since oomBefore, or the first line
// of a failure report the init wrote to init.log (its own error, or the
// Go runtime's fatal error, say when the sandbox's pids left it no
// thread). "" when neither says.
func deathCause(dir string, g *cgroup.Group, oomBefore int) string {
	var why []string
	if g != nil && g.OOMKills() > oomBefore {
		why = append(why, "the OOM killer took processes of its group, its init perhaps: give the sandbox more memory (--memory)")
	}
	if l := initFailure(filepath.Join(dir, "init.log")); l != "" {
		why = append(why, "its init: "+l)
	}
	if len(why) == 0 {
		return ""
	}
	return " (" + strings.Join(why, "; ") + ")"
}

// initFailure is the last line of a failure report (the init's own
// error, a Go panic or fatal error) in the init's log at p, from its
// last MiB (a fatal error dumps every goroutine after its line).
func initFailure(p string) string {
	f, err := os.Open(p)
	if err != nil {
		return ""
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	off := int64(0)
	if fi, err := f.Stat(); err == nil && fi.Size() > int64(len(buf)) {
		off = fi.Size() - int64(len(buf))
	}
	n, _ := f.ReadAt(buf, off)
	lines := strings.Split(string(buf[:n]), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		for _, p := range []string{"dsec init: ", "fatal error: ", "panic: ", "runtime: "} {
			if strings.HasPrefix(lines[i], p) {
				return strings.ToValidUTF8(lines[i][:min(len(lines[i]), 200)], "")
			}
		}
	}
	return ""
}
