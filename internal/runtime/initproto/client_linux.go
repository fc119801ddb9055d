package initproto

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/journal"
)

// Conn is a connection to a running sandbox's init: pid 1 of the
// namespaces, which reaps every process, keeps the sandbox alive while
// idle and starts the processes Exec asks for. The init listens on a unix
// socket on the host, so the sandbox outlives the worker that created
// it: a restarted worker Attaches again.
type Conn struct {
	pid    int
	pidfd  int           // the init's, from Attach; -1 when closed
	cmd    *exec.Cmd     // set when this process created the sandbox
	exited chan struct{} // closed once cmd is reaped
	conn   *net.UnixConn
	users  bool // the init runs commands as other users (hello.Users)
	// journal: the init writes the journal's files (hello.Journal)
	journal bool

	mu   sync.Mutex
	wait map[string]chan Reply
	dead chan struct{}
	err  error
}

// Attach connects to the init of a running sandbox, whose host pid is
// pid: how a restarted worker takes its sandboxes back.
func Attach(socket string, pid int) (*Conn, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	return Greet(c, pid)
}

// Greet waits for the init's greeting on c, a new connection to it.
func Greet(c *net.UnixConn, pid int) (*Conn, error) {
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil || n == 0 { // the init greets once it is ready
		c.Close()
		return nil, fmt.Errorf("%w: init did not answer", ErrSandboxDied)
	}
	var h Hello
	json.Unmarshal(buf[:n], &h)
	return NewConn(c, pid, h), nil
}

// NewConn is the connection c to an init, whose host pid is pid, that
// greeted it with h.
func NewConn(c *net.UnixConn, pid int, h Hello) *Conn {
	s := &Conn{pid: pid, conn: c, wait: map[string]chan Reply{}, dead: make(chan struct{}), pidfd: -1, users: h.Users, journal: h.Journal}
	// Only the init holds the listener, so the init is alive now and pid
	// is still its own: a pidfd keeps Destroy from ever signalling
	// another process that reuses the pid after the init's death.
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		s.pidfd = fd
	}
	go s.readReplies()
	return s
}

// Spawned says that this process started the init as cmd, reaped once
// exited is closed: Destroy then kills it and waits.
func (s *Conn) Spawned(cmd *exec.Cmd, exited chan struct{}) { s.cmd, s.exited = cmd, exited }

// Done is closed when the connection to the init is lost: the init died
// (or Close was called).
func (s *Conn) Done() <-chan struct{} { return s.dead }

// Pid is the init's pid on the host.
func (s *Conn) Pid() int { return s.pid }

func (s *Conn) readReplies() {
	buf := make([]byte, 64<<10)
	for {
		n, err := s.conn.Read(buf)
		if err != nil || n == 0 {
			s.mu.Lock()
			s.err = errors.New("connection to the sandbox init lost")
			// Dead before any waiter wakes: a caller told its command's
			// sandbox died must find it dead when it looks.
			close(s.dead)
			for _, ch := range s.wait {
				close(ch)
			}
			s.wait = map[string]chan Reply{}
			s.mu.Unlock()
			return
		}
		var rep Reply
		if json.Unmarshal(buf[:n], &rep) != nil {
			continue
		}
		s.mu.Lock()
		ch := s.wait[rep.ID]
		if rep.Last() {
			delete(s.wait, rep.ID)
		}
		s.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// ErrSandboxDied says the sandbox's init is gone (or the connection to
// it): an infrastructure failure, not the command's.
var ErrSandboxDied = backend.ErrDied

// ErrUnknownExec says the init never started a command under the id
// Result asked for (or forgot it: it keeps the last 4096).
var ErrUnknownExec = backend.ErrUnknownExec

// A Conn is an Instance: what every init answers (a container's
// adds what its host side does, a microVM's what its shim does).
var (
	_ backend.Instance   = (*Conn)(nil)
	_ backend.Restricter = (*Conn)(nil)
	_ backend.Signaler   = (*Conn)(nil)
)

// Exec runs cmd in the sandbox and returns its exit code (128+N for a
// signal, 127 for a command not found).
func (s *Conn) Exec(ctx context.Context, cmd Cmd) (int, error) {
	if len(cmd.Args) == 0 {
		return -1, errors.New("exec: no command")
	}
	if cmd.User != "" && !s.users {
		return -1, fmt.Errorf("this sandbox's init, an older dsec's, cannot run a command as user %q (it would run it as root): stop and start the sandbox to give it a current init", cmd.User)
	}
	if !s.journal && !cmd.TTY { // a terminal's master is journaled by the caller
		return s.execCopied(ctx, cmd)
	}
	return s.exec(ctx, cmd)
}

// exec sends cmd's request with its descriptors and waits for its end.
func (s *Conn) exec(ctx context.Context, cmd Cmd) (int, error) {
	req := Request{Op: OpExec, ID: cmd.ID, Args: cmd.Args, Env: cmd.Env, Cwd: cmd.Cwd, TTY: cmd.TTY, MakeCwd: cmd.MakeCwd, OOMScore: cmd.OOMScore,
		User: cmd.User, MaxOutput: cmd.MaxOutput}
	var files []int
	if cmd.Stdin == nil {
		req.NullStdin = true
	} else {
		files = append(files, int(cmd.Stdin.Fd()))
	}
	for _, f := range []*os.File{cmd.Stdout, cmd.Stderr} {
		if f == nil {
			null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			if err != nil {
				return -1, err
			}
			defer null.Close()
			f = null
		}
		files = append(files, int(f.Fd()))
	}
	r, err := s.Do(ctx, req, unix.UnixRights(files...), cmd.Started)
	if err != nil {
		return -1, err
	}
	if cmd.OOM != nil {
		*cmd.OOM = r.OOM
	}
	if cmd.Truncated != nil {
		*cmd.Truncated = r.Truncated
	}
	return *r.Exit, nil
}

// execCopied runs cmd in a sandbox whose init, an older dsec's, hands a
// command the descriptors it gets: it gets pipes, which the worker
// copies into the journal, within the cap, until the command's end. Its
// output then lives no longer than this worker: a worker that dies
// meanwhile leaves the command writing to a pipe nobody reads (stop and
// start the sandbox to give it a current init).
func (s *Conn) execCopied(ctx context.Context, cmd Cmd) (int, error) {
	var outs [2]*os.File
	for i, f := range []*os.File{cmd.Stdout, cmd.Stderr} {
		if f == nil {
			continue
		}
		d, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		outs[i] = os.NewFile(uintptr(d), f.Name())
	}
	sink := journal.NewSink(journal.Cap(cmd.MaxOutput), outs[0], outs[1])
	defer sink.Close()
	c := cmd
	if c.Stdin == nil { // an older init takes three descriptors
		null, err := os.Open(os.DevNull)
		if err != nil {
			return -1, err
		}
		defer null.Close()
		c.Stdin = null
	}
	var pipes []*journal.Pipe
	for i, to := range []**os.File{&c.Stdout, &c.Stderr} {
		r, w, err := journal.Pipes()
		if err != nil {
			return -1, err
		}
		p, err := journal.CopyPipe(sink, i, r)
		if err != nil {
			w.Close()
			return -1, err
		}
		defer p.Close()
		defer w.Close()
		pipes, *to = append(pipes, p), w
	}
	code, err := s.exec(ctx, c)
	for _, p := range pipes {
		p.End()
	}
	if t := sink.Close(); cmd.Truncated != nil {
		*cmd.Truncated = t
	}
	return code, err
}

// Result waits for the end of an earlier Exec with id, also one a
// previous connection started: what a worker that restarted mid-step
// asks before running anything again.
func (s *Conn) Result(ctx context.Context, id string) (backend.Exit, error) {
	rep, err := s.Do(ctx, Request{Op: OpResult, ID: id}, nil, nil)
	if err != nil {
		return backend.Exit{Code: -1}, err
	}
	return backend.Exit{Code: *rep.Exit, Truncated: rep.Truncated}, nil
}

// Probe says whether the command under id still runs; if it ended, how.
// ErrUnknownExec: the init never started it.
func (s *Conn) Probe(ctx context.Context, id string) (running bool, x backend.Exit, err error) {
	rep, err := s.Do(ctx, Request{Op: OpProbe, ID: id}, nil, nil)
	switch {
	case errors.Is(err, errRunning):
		return true, backend.Exit{Code: -1}, nil
	case err != nil:
		return false, backend.Exit{Code: -1}, err
	}
	return false, backend.Exit{Code: *rep.Exit, Truncated: rep.Truncated}, nil
}

var errRunning = errors.New("running")

// Restrict makes every command the sandbox starts from now on run under
// r too (on top of what they did: seccomp filters and Landlock domains
// only stack). Commands already running keep what they had.
func (s *Conn) Restrict(ctx context.Context, r Restrictions) error {
	_, err := s.call(ctx, Request{Op: OpRestrict, ID: fmt.Sprintf("#restrict-%d", RestrictSeq.Add(1)), Restrict: &r}, nil, nil)
	return err
}

var RestrictSeq atomic.Int64

// Signal sends sig to the process group of the command under id (a
// no-op once it ended). ErrUnknownExec: the init never started it.
func (s *Conn) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	_, err := s.call(ctx, Request{Op: OpSignal, ID: fmt.Sprintf("#signal-%d", RestrictSeq.Add(1)), Exec: id, Signal: int(sig)}, nil, nil)
	return err
}

func (s *Conn) call(ctx context.Context, r Request, oob []byte, started func(pid int)) (int, error) {
	rep, err := s.Do(ctx, r, oob, started)
	if err != nil {
		return -1, err
	}
	return *rep.Exit, nil
}

// Do sends r and returns its last reply: one with an exit code, or an
// error.
func (s *Conn) Do(ctx context.Context, r Request, oob []byte, started func(pid int)) (Reply, error) {
	ch := make(chan Reply, 2)
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return Reply{}, fmt.Errorf("%w: %v", ErrSandboxDied, s.err)
	}
	if _, busy := s.wait[r.ID]; busy {
		s.mu.Unlock()
		return Reply{}, fmt.Errorf("exec %s is already being waited for", r.ID)
	}
	s.wait[r.ID] = ch
	s.mu.Unlock()
	b, _ := json.Marshal(r)
	if _, _, err := s.conn.WriteMsgUnix(b, oob, nil); err != nil {
		return Reply{}, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	for {
		select {
		case rep, ok := <-ch:
			if !ok {
				return Reply{}, ErrSandboxDied
			}
			if rep.Unknown {
				return rep, fmt.Errorf("%w: %s", ErrUnknownExec, r.ID)
			}
			if rep.Error != "" {
				return rep, errors.New(rep.Error)
			}
			if rep.Exit != nil {
				return rep, nil
			}
			if r.Op == OpProbe { // rep.Running, or Pid -1 from an earlier init
				return rep, errRunning
			}
			if rep.Pid > 0 && started != nil {
				started(rep.Pid)
			}
		case <-ctx.Done():
			s.mu.Lock()
			delete(s.wait, r.ID)
			s.mu.Unlock()
			return Reply{}, ctx.Err()
		}
	}
}

// Close drops the connection; the sandbox runs on.
func (s *Conn) Close() error {
	s.closePidfd()
	err := s.conn.Close()
	<-s.dead
	return err
}

// Destroy kills every process of the sandbox: its pid 1 gone, the kernel
// kills the rest of the namespace.
func (s *Conn) Destroy() error {
	if s.cmd != nil {
		s.cmd.Process.Kill()
		<-s.exited
	} else if s.pidfd >= 0 {
		unix.PidfdSendSignal(s.pidfd, unix.SIGKILL, nil, 0)
	}
	s.closePidfd()
	s.conn.Close()
	<-s.dead
	return nil
}

// SignalInit sends the init (a microVM's shim) sig.
func (s *Conn) SignalInit(sig syscall.Signal) error {
	if s.cmd != nil {
		return s.cmd.Process.Signal(sig)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pidfd < 0 {
		return os.ErrProcessDone
	}
	return unix.PidfdSendSignal(s.pidfd, sig, nil, 0)
}

func (s *Conn) closePidfd() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pidfd >= 0 {
		unix.Close(s.pidfd)
		s.pidfd = -1
	}
}
