package runtime

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/journal"
)

// Steps: a command runs in the sandbox's instance under an id its
// journal (package journal) holds to once.

// ExecSpec is a command to run.
type ExecSpec struct {
	ID   string
	Args []string
	Env  []string // after the sandbox's
	Cwd  string   // default: the sandbox's workdir, then / (a User's home)
	User string   // default: the sandbox's user, then root
	// Stdin is nil for /dev/null. With TTY it is a terminal, the
	// command's controlling one and its stdout and stderr too, and
	// Terminal is its master, whose output Run journals as stdout until
	// the command ends; the caller may write to it (stdin) and closes
	// it once the exec ended (the terminal then hangs up).
	Stdin, Terminal *os.File
	TTY             bool
	// MaxOutput caps the output journaled, both streams together (0:
	// journal.DefaultMaxOutput), lowered to the sandbox's disk bound.
	MaxOutput int64
}

// Result is how an exec ended; Exec a journaled command; ErrInfra marks
// failures of the sandbox or the host (package journal).
type (
	Result = journal.Result
	Exec   = journal.Exec
)

var ErrInfra = journal.ErrInfra

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
	if err := sb.wake(ctx); err != nil {
		return nil, false, err
	}
	sb.mu.Lock()
	c, g, st := sb.c, sb.g, sb.State
	sb.mu.Unlock()
	if st.Paused && st.Hinted { // a hint came between: once more
		if err := sb.wake(ctx); err != nil {
			return nil, false, err
		}
		sb.mu.Lock()
		c, g, st = sb.c, sb.g, sb.State
		sb.mu.Unlock()
	}
	// The journal's outputs together stay within the sandbox's disk
	// bound: what it writes to its disk is bounded so, and so is what
	// its steps write to the host's.
	step := journal.Step{Sandbox: st.Name, ID: spec.ID, Args: spec.Args, Keep: st.Pool == "", MaxOutput: spec.MaxOutput, Bound: cmp.Or(st.Disk, st.DiskBound)}
	return sb.journal().Start(step, func(e *Exec, stdout, stderr *os.File) error {
		if st.Paused {
			return fmt.Errorf("sandbox %s is paused: resume it first (dsec resume): %w", st.Name, ErrPaused)
		}
		if st.Status != Running || c == nil {
			return fmt.Errorf("sandbox %s is %s: start it first: %w", st.Name, st.Status, errdefs.ErrFailedPrecondition)
		}
		select {
		case <-c.Done():
			return fmt.Errorf("sandbox %s: its init died: %w", st.Name, ErrInfra)
		default:
		}
		cwd := spec.Cwd
		if cwd == "" {
			cwd = st.Workdir
		}
		env := mergeEnv(defaultEnv, st.Env, spec.Env)
		user := cmp.Or(spec.User, st.User)
		oomBefore := 0
		if g != nil {
			oomBefore = g.OOMKills()
		}
		maxOutput := e.Limit()
		if maxOutput == 0 {
			maxOutput = -1 // none
		}
		// A terminal's output is the worker's to journal: it holds the
		// master, which the sandbox never gets.
		var term *terminal
		if spec.TTY {
			if spec.Terminal == nil || spec.Stdin == nil {
				return fmt.Errorf("exec %s: a terminal without its master: %w", spec.ID, errdefs.ErrInvalidArgument)
			}
			var err error
			if term, err = recordTerminal(e, spec.Terminal); err != nil {
				return err
			}
			stdout, stderr = spec.Stdin, spec.Stdin
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
			// The call returns when the command ends; the init answers
			// at once if it cannot start it.
			var guestOOM bool
			var truncated int64
			code, err := c.Exec(context.Background(), backend.Cmd{ID: spec.ID, Args: spec.Args, Env: env, Cwd: cwd, TTY: spec.TTY, User: user,
				MakeCwd: spec.Cwd == "" && cwd != "", OOMScore: oomScore(st.Class), OOM: &guestOOM,
				Stdin: spec.Stdin, Stdout: stdout, Stderr: stderr, MaxOutput: maxOutput, Truncated: &truncated,
				Started: func(int) { close(started) }})
			if term != nil {
				truncated += term.end()
			}
			r, ok := sb.resultOf(code, err, g, oomBefore)
			if !ok {
				refused <- err
				return
			}
			r.Truncated = truncated
			r.OOM = r.OOM || guestOOM // a guest's own OOM killer: its own memory, always
			e.Finish(r)
		}()
		select {
		case err := <-refused: // a bad directory, say: the caller's error, not a result
			return fmt.Errorf("exec %s: %v: %w", spec.ID, err, errdefs.ErrInvalidArgument)
		case <-started:
		case <-e.Done(): // not found (127), or the sandbox died
		}
		return nil
	})
}

// resultOf is the result of a command of sb that ended with code and err,
// in the group g that had oomBefore OOM kills when it started; ok is
// false when the init refused to start it (err says why).
func (sb *Sandbox) resultOf(code int, err error, g *cgroup.Group, oomBefore int) (r Result, ok bool) {
	switch {
	case errors.Is(err, backend.ErrDied) && sb.Current().Status == Stopped:
		// A deliberate stop killed it, as docker stop does: its
		// result is that (128+SIGKILL), not a failure of the host.
		code = 128 + 9
	case errors.Is(err, backend.ErrDied):
		r.Err = "the sandbox died under the command" + deathCause(sb.dir, g, oomBefore)
	case err != nil:
		return r, false
	}
	r.ExitCode = code
	if g != nil && code == 128+9 && g.OOMKills() > oomBefore {
		r.OOM = true
		if !g.ReachedLimit() { // not its own limit: the host's bound
			r.Err = "the kernel killed the command for the host's sake: all sandboxes together reached the host's memory bound " +
				"(its memory less admission.host_reserve), not this sandbox's limit; retry the step"
		}
	}
	return r, true
}

// terminal journals what a terminal's master shows as an exec's stdout.
type terminal struct {
	sink *journal.Sink
	pipe *journal.Pipe
}

func recordTerminal(e *Exec, master *os.File) (*terminal, error) {
	out, err := os.OpenFile(e.StdoutPath(), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return nil, err
	}
	t := &terminal{sink: journal.NewSink(e.Limit(), out, nil)}
	if t.pipe, err = journal.Copy(t.sink, 0, master); err != nil {
		t.sink.Close()
		return nil, fmt.Errorf("record the terminal: %w", err)
	}
	return t, nil
}

// end takes what the terminal shows now as the step's last output and
// closes its journal; it returns the bytes the cap cut.
func (t *terminal) end() int64 {
	t.pipe.End()
	t.pipe.Close() // the terminal's life is its master's, which the caller holds
	return t.sink.Close()
}

// journal is the sandbox's journal, in its directory (which its ID
// names for good).
func (sb *Sandbox) journal() *journal.Journal {
	sb.journalOnce.Do(func() {
		sb.steps = journal.Open(filepath.Join(sb.dir, "execs"), filepath.Join(sb.dir, resultsLog), sb.logMade)
	})
	return sb.steps
}

// LookupExec returns the exec with id, running or journaled.
func (sb *Sandbox) LookupExec(id string) (*Exec, error) {
	return sb.journal().Lookup(sb.Current().Name, id)
}

// Terminal allocates a terminal for a command of the sandbox (ExecSpec's
// Terminal and Stdin), as its backend gives one.
func (sb *Sandbox) Terminal() (master, tty *os.File, err error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.c == nil {
		return nil, nil, fmt.Errorf("sandbox %s is %s: start it first: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	}
	t, err := ability[backend.Terminaler](sb, "give a command a terminal")
	if err != nil {
		return nil, nil, err
	}
	if master, tty, err = t.Terminal(); err != nil {
		return nil, nil, fmt.Errorf("sandbox %s: %w", sb.Name, err)
	}
	return master, tty, nil
}

// Signal sends sig to the running exec id (its process group). An exec
// that ended is ErrFailedPrecondition; one never started ErrNotFound.
func (sb *Sandbox) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	e, err := sb.LookupExec(id)
	if err != nil {
		return err
	}
	select {
	case <-e.Done():
		return fmt.Errorf("exec %s in sandbox %s has ended: %w", id, sb.Name, errdefs.ErrFailedPrecondition)
	default:
	}
	if err := sb.wake(ctx); err != nil { // (a hint froze it: signalled, it runs)
		return err
	}
	sb.mu.Lock()
	c, paused := sb.c, sb.Paused
	sb.mu.Unlock()
	if paused {
		return fmt.Errorf("sandbox %s is paused: resume it first (dsec resume): %w", sb.Name, ErrPaused)
	}
	s, ok := c.(backend.Signaler)
	if !ok || c == nil {
		return fmt.Errorf("sandbox %s cannot signal its commands (its backend cannot, or it is not running): %w", sb.Name, errdefs.ErrNotImplemented)
	}
	if err := s.Signal(ctx, id, sig); err != nil {
		if errors.Is(err, backend.ErrUnknownExec) {
			return fmt.Errorf("exec %s in sandbox %s has ended: %w", id, sb.Name, errdefs.ErrFailedPrecondition)
		}
		return fmt.Errorf("signal exec %s in sandbox %s: %w", id, sb.Name, err)
	}
	return nil
}

// ExecCount counts the journaled execs.
func (sb *Sandbox) ExecCount() int { return sb.journal().Count() }

// LastExec is the id of the exec started last in the sandbox ("":
// none) and how many it journaled.
func (sb *Sandbox) LastExec() (id string, n int) { return sb.journal().Last() }

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
