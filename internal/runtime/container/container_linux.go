package container

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Sandbox is a connection to a running sandbox's init: pid 1 of the
// namespaces, which reaps every process, keeps the sandbox alive while
// idle and starts the processes Exec asks for. The init listens on a unix
// socket on the host, so the sandbox outlives the worker that created
// it: a restarted worker Attaches again.
type Sandbox struct {
	pid    int
	pidfd  int           // the init's, from Attach; -1 when closed
	cmd    *exec.Cmd     // set when this process created the sandbox
	exited chan struct{} // closed once cmd is reaped
	conn   *net.UnixConn

	mu   sync.Mutex
	wait map[string]chan execReply
	dead chan struct{}
	err  error
}

// request is what the worker sends the init: start a process (its stdio
// travels along as SCM_RIGHTS), or the result of an earlier one.
type request struct {
	Op   string   `json:"op"` // exec, result, probe or restrict
	ID   string   `json:"id"`
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	TTY  bool     `json:"tty,omitempty"`
	// MakeCwd: create Cwd if it is missing.
	MakeCwd bool `json:"make_cwd,omitempty"`
	// OOMScore: the command's oom_score_adj (0: 1000).
	OOMScore int `json:"oom_score,omitempty"`
	// Restrict: what commands started from now on run under, on top
	// of what they did.
	Restrict *Restrictions `json:"restrict,omitempty"`
}

type execReply struct {
	ID      string `json:"id"`
	Pid     int    `json:"pid,omitempty"`
	Exit    *int   `json:"exit,omitempty"`
	Error   string `json:"error,omitempty"`
	Unknown bool   `json:"unknown,omitempty"` // Result of an id the init never started
}

// Spare is a sandbox init started ahead of need: its namespaces made, its
// runtime up, out of every host mount (it waits on an empty tmpfs root),
// nothing of a sandbox yet. Claim makes it one; Discard kills it.
// Starting the re-executed binary is most of what starting a sandbox
// costs, so a worker keeps spares and a create only hands one its root.
type Spare struct {
	cmd    *exec.Cmd
	ctl    *os.File // our end of the socket pair the init waits on
	exited chan struct{}
}

// Prestart starts a spare init and waits until it is ready. setup, if not
// nil, runs with its host pid first (the place to put it in its cgroup).
// With ids the init gets a user namespace of its own mapped to them; the
// root it is then claimed with must show the sandbox's files through
// mounts idmapped into that namespace (UserNamespace).
func Prestart(setup func(pid int) error, ids *IDMap) (*Spare, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "spare"), os.NewFile(uintptr(fds[1]), "spare")
	// The binary as the spawner's namespace has it (spawn_linux.go),
	// where the namespace's root may search the way to it (a 0700 build
	// or test directory on the host would stop it).
	cmd := exec.Command(spawnInit)
	cmd.Args = []string{InitName} // its /proc/PID/cmdline names no host path
	cmd.Env = []string{initEnv + "=1"}
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWUTS | syscall.CLONE_NEWIPC | syscall.CLONE_NEWNET,
		Setsid:     true,
	}
	if ids != nil {
		cmd.Env = append(cmd.Env, usernsEnv+"=1")
		m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(ids.Host), Size: int(ids.Size)}}
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings, cmd.SysProcAttr.GidMappings = m, m
		cmd.SysProcAttr.GidMappingsEnableSetgroups = true
		// Root of the namespace (not the host's root, which it does not
		// map): the exec then gives it the namespace's capabilities.
		cmd.SysProcAttr.Credential = &syscall.Credential{}
	}
	if serr := spawn(func() { err = cmd.Start() }); serr != nil {
		err = serr
	}
	theirs.Close()
	if err != nil {
		ours.Close()
		return nil, fmt.Errorf("start sandbox init: %w", err)
	}
	protectInit(cmd.Process.Pid)
	sp := &Spare{cmd: cmd, ctl: ours, exited: make(chan struct{})}
	// Reap the init whenever it exits, whether or not this process still
	// holds a connection: a long-lived worker must not collect zombies.
	go func() { cmd.Wait(); close(sp.exited) }()
	if setup != nil {
		if err := setup(cmd.Process.Pid); err != nil {
			sp.Discard()
			return nil, err
		}
	}
	if n, err := ours.Read(make([]byte, 16)); err != nil || n == 0 {
		<-sp.exited // its end closes when it exits
		ours.Close()
		return nil, fmt.Errorf("sandbox init exited before it was ready (exit %d)", cmd.ProcessState.ExitCode())
	}
	return sp, nil
}

// InitBinaryEnv names the variable that picks the program sandbox inits run.
const InitBinaryEnv = "DSEC_INIT"

// InitName is the sandbox init's own binary (cmd/dsec-init).
const InitName = "dsec-init"

// InitBinary is the program sandbox inits run, found once per process:
// $DSEC_INIT if set, else dsec-init next to this executable, else this
// executable (any binary that calls MaybeInit first serves). dsec-init is
// this package alone, static: it starts in a third of the time the
// complete dsec does (no other package's initialisers, a quarter of the
// pages to fault in) and keeps less memory per sandbox for as long as the
// sandbox lives.
var InitBinary = sync.OnceValues(lookupInitBinary)

func lookupInitBinary() (string, error) {
	if p := os.Getenv(InitBinaryEnv); p != "" {
		if !filepath.IsAbs(p) || !executable(p) {
			return "", fmt.Errorf("%s=%s: give the absolute path of an executable dsec-init (or unset it)", InitBinaryEnv, p)
		}
		return p, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	if p := filepath.Join(filepath.Dir(self), InitName); p != self && executable(p) {
		return p, nil
	}
	return self, nil
}

func executable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// UserNamespace opens the spare's user namespace (O_CLOEXEC): what the
// mounts of its root are idmapped into.
func (sp *Spare) UserNamespace() (int, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", sp.cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the sandbox init's user namespace: %w", err)
	}
	return fd, nil
}

// Pid is the spare's pid on the host.
func (sp *Spare) Pid() int { return sp.cmd.Process.Pid }

// Alive reports whether the spare still waits for a sandbox.
func (sp *Spare) Alive() bool {
	select {
	case <-sp.exited:
		return false
	default:
		return true
	}
}

// Discard kills a spare that was not claimed.
func (sp *Spare) Discard() {
	sp.ctl.Close()
	sp.cmd.Process.Kill()
	<-sp.exited
}

// Claim makes the spare the sandbox spec describes (spec.Setup is not
// run: the spare is where Prestart's setup put it). The spare is used
// up either way; on an error it is gone.
func (sp *Spare) Claim(spec Spec) (_ *Sandbox, err error) {
	defer func() {
		if err != nil {
			sp.Discard()
			os.Remove(spec.Socket)
		}
	}()
	if spec.Socket == "" {
		return nil, errors.New("container: no control socket path")
	}
	os.Remove(spec.Socket)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: spec.Socket, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	l.SetUnlinkOnClose(false)
	lf, err := l.File()
	l.Close()
	if err != nil {
		return nil, err
	}
	// Only the init may hold the listener: if it dies, a connection
	// waiting for its greeting must see the socket go.
	defer lf.Close()
	// The root travels as a detached copy of its mount, which the init
	// attaches in its own namespace: it never shared the host's mounts.
	tree, err := unix.OpenTree(unix.AT_FDCWD, spec.Root, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return nil, fmt.Errorf("clone the sandbox root %s: %w", spec.Root, err)
	}
	defer unix.Close(tree)
	logf, done, err := logFile(spec.Stderr)
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(spec)
	if err != nil {
		logf.Close()
		return nil, err
	}
	err = unix.Sendmsg(int(sp.ctl.Fd()), b, unix.UnixRights(int(lf.Fd()), tree, int(logf.Fd())), nil, 0)
	logf.Close()
	if err != nil {
		return nil, fmt.Errorf("%w: the spare init is gone: %v", ErrSandboxDied, err)
	}
	// The pair is the first worker's connection: no dial, no accept.
	fc, err := net.FileConn(sp.ctl)
	if err != nil {
		return nil, err
	}
	sb, err := greet(fc.(*net.UnixConn), sp.cmd.Process.Pid)
	if err != nil {
		<-sp.exited
		<-done
		return nil, fmt.Errorf("sandbox init failed (exit %d): see its stderr", sp.cmd.ProcessState.ExitCode())
	}
	sp.ctl.Close()
	sb.cmd, sb.exited = sp.cmd, sp.exited
	return sb, nil
}

// logFile is a file whose writes reach w: w itself when it is one, else a
// pipe copied into w until done closes; /dev/null without w.
func logFile(w io.Writer) (_ *os.File, done chan struct{}, err error) {
	done = make(chan struct{})
	if f, ok := w.(*os.File); ok {
		close(done)
		g, err := dupFile(f)
		return g, done, err
	}
	if w == nil {
		close(done)
		f, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		return f, done, err
	}
	r, pw, err := os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	go func() { io.Copy(w, r); r.Close(); close(done) }()
	return pw, done, nil
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// Create starts a sandbox's init on spec.Root, listening on spec.Socket:
// a spare started and claimed at once.
func Create(spec Spec) (*Sandbox, error) {
	sp, err := Prestart(spec.Setup, nil)
	if err != nil {
		return nil, err
	}
	return sp.Claim(spec)
}

// Attach connects to the init of a running sandbox, whose host pid is
// pid: how a restarted worker takes its sandboxes back.
func Attach(socket string, pid int) (*Sandbox, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	return greet(c, pid)
}

// greet waits for the init's greeting on c, a new connection to it.
func greet(c *net.UnixConn, pid int) (*Sandbox, error) {
	buf := make([]byte, 4096)
	if n, err := c.Read(buf); err != nil || n == 0 { // the init greets once it is ready
		c.Close()
		return nil, fmt.Errorf("%w: init did not answer", ErrSandboxDied)
	}
	s := &Sandbox{pid: pid, conn: c, wait: map[string]chan execReply{}, dead: make(chan struct{}), pidfd: -1}
	// Only the init holds the listener, so the init is alive now and pid
	// is still its own: a pidfd keeps Destroy from ever signalling
	// another process that reuses the pid after the init's death.
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		s.pidfd = fd
	}
	go s.readReplies()
	return s, nil
}

// Done is closed when the connection to the init is lost: the init died
// (or Close was called).
func (s *Sandbox) Done() <-chan struct{} { return s.dead }

// Pid is the init's pid on the host.
func (s *Sandbox) Pid() int { return s.pid }

func (s *Sandbox) readReplies() {
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
			s.wait = map[string]chan execReply{}
			s.mu.Unlock()
			return
		}
		var rep execReply
		if json.Unmarshal(buf[:n], &rep) != nil {
			continue
		}
		s.mu.Lock()
		ch := s.wait[rep.ID]
		if rep.Exit != nil || rep.Error != "" || rep.Pid == -1 {
			delete(s.wait, rep.ID)
		}
		s.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// ErrSandboxDied says the sandbox's init is gone or unreachable: an
// infrastructure failure, not the command's.
var ErrSandboxDied = errors.New("sandbox died")

// ErrUnknownExec says the init never started a command under the id
// Result asked for (or forgot it: it keeps the last 4096).
var ErrUnknownExec = errors.New("no such exec in the sandbox")

// Exec runs cmd in the sandbox and returns its exit code (128+N for a
// signal, 127 for a command not found).
func (s *Sandbox) Exec(ctx context.Context, cmd Cmd) (int, error) {
	if len(cmd.Args) == 0 {
		return -1, errors.New("exec: no command")
	}
	var files []int
	for _, f := range []*os.File{cmd.Stdin, cmd.Stdout, cmd.Stderr} {
		if f == nil {
			null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
			if err != nil {
				return -1, err
			}
			defer null.Close()
			f = null
		}
		files = append(files, int(f.Fd()))
	}
	return s.call(ctx, request{Op: "exec", ID: cmd.ID, Args: cmd.Args, Env: cmd.Env, Cwd: cmd.Cwd, TTY: cmd.TTY, MakeCwd: cmd.MakeCwd, OOMScore: cmd.OOMScore}, unix.UnixRights(files...), cmd.Started)
}

// Result waits for the exit code of an earlier Exec with id, also one a
// previous connection started: what a worker that restarted mid-step
// asks before running anything again.
func (s *Sandbox) Result(ctx context.Context, id string) (int, error) {
	return s.call(ctx, request{Op: "result", ID: id}, nil, nil)
}

// Probe says whether the command under id still runs; if it ended, its
// exit code. ErrUnknownExec: the init never started it.
func (s *Sandbox) Probe(ctx context.Context, id string) (running bool, code int, err error) {
	code, err = s.call(ctx, request{Op: "probe", ID: id}, nil, nil)
	if errors.Is(err, errRunning) {
		return true, -1, nil
	}
	return false, code, err
}

var errRunning = errors.New("running")

// Restrict makes every command the sandbox starts from now on run under
// r too (on top of what they did: seccomp filters and Landlock domains
// only stack). Commands already running keep what they had.
func (s *Sandbox) Restrict(ctx context.Context, r Restrictions) error {
	_, err := s.call(ctx, request{Op: "restrict", ID: fmt.Sprintf("#restrict-%d", restrictSeq.Add(1)), Restrict: &r}, nil, nil)
	return err
}

var restrictSeq atomic.Int64

func (s *Sandbox) call(ctx context.Context, r request, oob []byte, started func(pid int)) (int, error) {
	ch := make(chan execReply, 2)
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return -1, fmt.Errorf("%w: %v", ErrSandboxDied, s.err)
	}
	if _, busy := s.wait[r.ID]; busy {
		s.mu.Unlock()
		return -1, fmt.Errorf("exec %s is already being waited for", r.ID)
	}
	s.wait[r.ID] = ch
	s.mu.Unlock()
	b, _ := json.Marshal(r)
	if _, _, err := s.conn.WriteMsgUnix(b, oob, nil); err != nil {
		return -1, fmt.Errorf("%w: %v", ErrSandboxDied, err)
	}
	for {
		select {
		case rep, ok := <-ch:
			if !ok {
				return -1, ErrSandboxDied
			}
			if rep.Unknown {
				return -1, fmt.Errorf("%w: %s", ErrUnknownExec, r.ID)
			}
			if rep.Error != "" {
				return -1, errors.New(rep.Error)
			}
			if rep.Exit != nil {
				return *rep.Exit, nil
			}
			if r.Op == "probe" {
				return -1, errRunning
			}
			if rep.Pid > 0 && started != nil {
				started(rep.Pid)
			}
		case <-ctx.Done():
			s.mu.Lock()
			delete(s.wait, r.ID)
			s.mu.Unlock()
			return -1, ctx.Err()
		}
	}
}

// Close drops the connection; the sandbox runs on.
func (s *Sandbox) Close() error {
	s.closePidfd()
	err := s.conn.Close()
	<-s.dead
	return err
}

// Destroy kills every process of the sandbox: its pid 1 gone, the kernel
// kills the rest of the namespace.
func (s *Sandbox) Destroy() error {
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

func (s *Sandbox) closePidfd() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pidfd >= 0 {
		unix.Close(s.pidfd)
		s.pidfd = -1
	}
}

// MaybeInit runs the sandbox init and never returns if this process was
// started as one; otherwise it returns at once.
func MaybeInit() {
	if os.Getenv(initEnv) != "1" {
		return
	}
	// Capabilities and no_new_privs are per thread: the init drops them
	// on this thread and forks every command from it.
	runtime.LockOSThread()
	err := initSandbox()
	fmt.Fprintf(os.Stderr, "dsec init: %v\n", err)
	os.Exit(127)
}

// maxResults bounds the exit codes the init keeps for Result.
const maxResults = 4096

type job struct {
	id   string
	conn *net.UnixConn // who hears the exit; nil once it went away
}

// initSandbox waits, as a spare, for its sandbox; then sets the root up,
// serves requests and reaps.
func initSandbox() error {
	spareThreads(initThreads)
	// Out of the host's mounts before anything: a spare may wait long,
	// and must pin none of them meanwhile.
	if err := leaveHostMounts(os.Getenv(usernsEnv) == "1"); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	// The bounding set limits only what commands exec into: dropped
	// while the spare waits, off the claim's path; the init keeps its
	// own capabilities for the claim's mounts.
	if err := dropBounding(); err != nil {
		return err
	}
	if _, err := unix.Write(3, []byte("ready")); err != nil {
		return err
	}
	// A spec is a few KiB; the largest, a seccomp program of
	// BPF_MAXINSNS instructions, under 64 KiB as JSON.
	buf, oob := make([]byte, 256<<10), make([]byte, unix.CmsgSpace(3*4))
	n, oobn, _, _, err := unix.Recvmsg(3, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil || n == 0 { // discarded: the worker closed its end
		os.Exit(0)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
		fds, _ = unix.ParseUnixRights(&msgs[0])
	}
	if len(fds) != 3 {
		return fmt.Errorf("the sandbox came with %d descriptors, not 3", len(fds))
	}
	listener, tree, logfd := fds[0], fds[1], fds[2]
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(logfd, fd, 0); err != nil {
			return err
		}
	}
	unix.Close(logfd)
	var spec Spec
	if err := json.Unmarshal(buf[:n], &spec); err != nil {
		return fmt.Errorf("read spec: %w", err)
	}
	l, err := net.FileListener(os.NewFile(uintptr(listener), "ctl"))
	if err != nil {
		return err
	}
	ul := l.(*net.UnixListener)
	fc, err := net.FileConn(os.NewFile(3, "claim"))
	if err != nil {
		return err
	}
	first := fc.(*net.UnixConn)
	if err := setupRoot(tree); err != nil {
		return err
	}
	if spec.Hostname != "" {
		if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	// Both are inherited by every command forked from this thread.
	if spec.Idle {
		if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
			return fmt.Errorf("SCHED_IDLE: %w", err)
		}
		if err := coreSchedule(); err != nil {
			return err
		}
	}
	if spec.MergeMemory {
		if err := unix.Prctl(unix.PR_SET_MEMORY_MERGE, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("let KSM merge the sandbox's memory: %w", err)
		}
	}
	// Nothing the worker, the host or the init holds reaches a command:
	// commands get exactly the three descriptors of their request.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return err
	}
	if err := dropPrivileges(); err != nil {
		return err
	}
	// On this thread, which forks every command: they inherit it.
	if err := spec.Restrictions.apply(); err != nil {
		return err
	}
	// Its other threads still hold the host's capabilities: no process
	// of the sandbox may ptrace the init or read its /proc entries.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("make the init undumpable: %w", err)
	}
	// The worker that claimed the init hears it is ready from this
	// thread, before anything else: no goroutine needs to be scheduled
	// first. Its first request waits in the socket meanwhile.
	greeting := []byte(`{"ready":true}`)
	first.Write(greeting)
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	type incoming struct {
		req   request
		files []*os.File
		conn  *net.UnixConn
	}
	in := make(chan incoming)
	gone := make(chan *net.UnixConn)
	serve := func(c *net.UnixConn) {
		buf, oob := make([]byte, 64<<10), make([]byte, unix.CmsgSpace(3*4))
		for {
			n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
			if err != nil || n == 0 {
				gone <- c
				return
			}
			var r incoming
			if json.Unmarshal(buf[:n], &r.req) != nil {
				continue
			}
			r.conn = c
			if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
				if fds, err := unix.ParseUnixRights(&msgs[0]); err == nil {
					for _, fd := range fds {
						r.files = append(r.files, os.NewFile(uintptr(fd), "stdio"))
					}
				}
			}
			in <- r
		}
	}
	// The worker that claimed the init, then later ones, one after
	// another or at once.
	go serve(first)
	go func() {
		for {
			c, err := ul.AcceptUnix()
			if err != nil {
				continue
			}
			c.Write(greeting)
			go serve(c)
		}
	}()
	running := map[int]*job{} // pid -> job
	byID := map[string]*job{}
	done := map[string]int{}
	var doneOrder []string
	reply := func(c *net.UnixConn, r execReply) {
		if c != nil {
			b, _ := json.Marshal(r)
			c.Write(b)
		}
	}
	for {
		select {
		case r := <-in:
			switch r.req.Op {
			case "result", "probe":
				if code, ok := done[r.req.ID]; ok {
					reply(r.conn, execReply{ID: r.req.ID, Exit: &code})
				} else if j := byID[r.req.ID]; j != nil && r.req.Op == "probe" {
					reply(r.conn, execReply{ID: r.req.ID, Pid: -1})
				} else if j != nil {
					j.conn = r.conn // the exit goes to whoever asks last
				} else {
					reply(r.conn, execReply{ID: r.req.ID, Unknown: true, Error: "no process " + r.req.ID + " in this sandbox"})
				}
			case "restrict":
				if err := r.req.Restrict.apply(); err != nil {
					reply(r.conn, execReply{ID: r.req.ID, Error: err.Error()})
				} else {
					zero := 0
					reply(r.conn, execReply{ID: r.req.ID, Exit: &zero})
				}
			case "exec":
				_, seen := done[r.req.ID]
				if seen || byID[r.req.ID] != nil {
					reply(r.conn, execReply{ID: r.req.ID, Error: "exec id " + r.req.ID + " was used already"})
					break
				}
				pid, err := start(r.req, r.files)
				var nf *notFound
				var ce *cannotExec
				switch {
				case errors.As(err, &nf), errors.As(err, &ce):
					// Like a shell: a message on the command's stderr, 127
					// for a command not found, 126 for one that cannot run.
					fmt.Fprintf(r.files[2], "%v\n", err)
					code := 127
					if ce != nil {
						code = 126
					}
					done[r.req.ID] = code
					doneOrder = append(doneOrder, r.req.ID)
					reply(r.conn, execReply{ID: r.req.ID, Exit: &code})
				case err != nil:
					reply(r.conn, execReply{ID: r.req.ID, Error: err.Error()})
				default:
					j := &job{id: r.req.ID, conn: r.conn}
					running[pid], byID[r.req.ID] = j, j
					reply(r.conn, execReply{ID: r.req.ID, Pid: pid})
				}
			}
			for _, f := range r.files {
				f.Close()
			}
		case c := <-gone:
			c.Close()
			for _, j := range byID {
				if j.conn == c {
					j.conn = nil
				}
			}
		case <-sigs:
		}
		// Reap everything: tracked processes report their status,
		// orphans that reparented to us just go away.
		for {
			var ws unix.WaitStatus
			pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
			j, ok := running[pid]
			if !ok {
				continue
			}
			delete(running, pid)
			delete(byID, j.id)
			code := ws.ExitStatus()
			if ws.Signaled() {
				code = 128 + int(ws.Signal())
			}
			done[j.id] = code
			doneOrder = append(doneOrder, j.id)
			if len(doneOrder) > maxResults {
				delete(done, doneOrder[0])
				doneOrder = doneOrder[1:]
			}
			reply(j.conn, execReply{ID: j.id, Exit: &code})
		}
	}
}

// initThreads is how many idle threads an init keeps for the runtime.
const initThreads = 4

// spareThreads makes n threads that the Go runtime then keeps idle. An
// init's threads count against its sandbox's pids.max, which commands
// may fill: a runtime that then needs a thread (one is blocked in a
// fork, say) cannot create it and aborts, and the sandbox dies with its
// init. Made now, before any limit, the runtime finds idle ones (they
// take four of the sandbox's pids.max, as the init's other threads do).
func spareThreads(n int) {
	var locked, exit sync.WaitGroup
	locked.Add(n)
	exit.Add(1)
	var done sync.WaitGroup
	for range n {
		done.Go(func() {
			runtime.LockOSThread() // one thread each while they wait
			locked.Done()
			exit.Wait()
			runtime.UnlockOSThread() // unlocked, it stays, idle
		})
	}
	locked.Wait()
	exit.Done()
	done.Wait()
}

// CoreScheduling reports whether the kernel has core scheduling and the
// CPUs have SMT siblings for it to keep apart.
func CoreScheduling() bool {
	// Reading the calling thread's cookie fails with EINVAL without
	// CONFIG_SCHED_CORE, ENODEV without SMT.
	var cookie uint64
	err := unix.Prctl(unix.PR_SCHED_CORE, 0 /* PR_SCHED_CORE_GET */, 0, 0 /* PIDTYPE_PID */, uintptr(unsafe.Pointer(&cookie)))
	return err == nil
}

// coreSchedule gives the calling thread (and so every command forked
// from it) a core-scheduling cookie of its own where the kernel has core
// scheduling: the sandbox's batch work then never runs on the SMT
// sibling of another sandbox's task, so it cannot slow a latency step
// sharing the core (or read its state through the core's caches).
// Without it (CONFIG_SCHED_CORE unset, as on these VMs, or no SMT)
// there is nothing to do.
func coreSchedule() error {
	if !CoreScheduling() {
		return nil
	}
	if err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_CREATE, 0, 0 /* PIDTYPE_PID */, 0); err != nil {
		return fmt.Errorf("core scheduling cookie: %w", err)
	}
	return nil
}

// start starts a request's command from the init's thread, so it
// inherits the dropped capabilities and no_new_privs.
func start(r request, stdio []*os.File) (int, error) {
	if len(stdio) != 3 || len(r.Args) == 0 {
		return 0, errors.New("bad exec request")
	}
	path := r.Args[0]
	if !strings.Contains(path, "/") {
		p, err := lookPath(path, envPath(r.Env))
		if err != nil {
			return 0, err
		}
		path = p
	}
	cwd := r.Cwd
	if cwd == "" {
		cwd = "/"
	}
	if r.MakeCwd {
		os.MkdirAll(cwd, 0o755) // in the sandbox's root: the init has pivoted into it
	}
	// The directory is opened here, never through a magic link (a
	// /proc/self/fd/N, or a symbolic link to one, would name one of the
	// init's descriptors: runc's CVE-2024-21626), and the command starts
	// in exactly it: its descriptor, which the child holds until exec.
	dir, err := unix.Openat2(unix.AT_FDCWD, cwd, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return 0, fmt.Errorf("working directory %s: %v: give a directory of the sandbox (or create it first)", cwd, err)
	}
	defer unix.Close(dir)
	pid, err := syscall.ForkExec(path, r.Args, &syscall.ProcAttr{
		Dir:   fmt.Sprintf("/proc/self/fd/%d", dir),
		Env:   r.Env,
		Files: []uintptr{stdio[0].Fd(), stdio[1].Fd(), stdio[2].Fd()},
		// A terminal's command leads its session with stdin as its
		// controlling terminal, as a login shell does.
		Sys: &syscall.SysProcAttr{Setsid: true, Setctty: r.TTY, Ctty: 0},
	})
	switch {
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.ENOEXEC), errors.Is(err, syscall.EISDIR):
		return 0, &cannotExec{path, err}
	case errors.Is(err, syscall.ENOENT):
		return 0, &notFound{path}
	case errors.Is(err, syscall.EAGAIN):
		return 0, fmt.Errorf("cannot start %s: the sandbox is at its limit of processes and threads (pids): wait for some to end, or raise the limit (a policy's resources.pids)", path)
	}
	if err == nil {
		// A command that runs the sandbox out of memory is what the OOM
		// killer must take, never the init, whose death ends the
		// sandbox. Raising a score needs no privilege (lowering the
		// init's would need CAP_SYS_RESOURCE, which hosts may withhold).
		score := r.OOMScore
		if score == 0 {
			score = 1000
		}
		os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte(strconv.Itoa(score)), 0)
	}
	return pid, err
}

// initOOMScore is the sandbox init's oom_score_adj where the worker may
// lower it: the last process of its group the OOM killer takes. The
// commands it starts get 1000, which alone does not always do: a task's
// badness is its resident pages (mapped file pages too) plus adj times
// the limit's pages/1000, rounded down, so an init whose pages come near
// its limit outscores what is left of a command the killer has just
// taken, and the sandbox dies. dsec-init keeps some 3 MiB resident
// (limits start at 4 MiB); a test binary built with -race, serving as
// the init, keeps 30. Not -1000: an init alone over its limit must stay
// killable, or the group would stall.
const initOOMScore = -999

// protectInit lowers the init's oom_score_adj from outside. That needs
// CAP_SYS_RESOURCE, which some hosts withhold (a worker in a container,
// these CI machines); without it the init keeps the worker's score.
func protectInit(pid int) {
	os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte(strconv.Itoa(initOOMScore)), 0)
}

// lookPath finds a command in a PATH of the sandbox.
func lookPath(name, path string) (string, error) {
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", &notFound{name}
}

type notFound struct{ name string }

func (e *notFound) Error() string { return e.name + ": command not found in the sandbox" }

// cannotExec is a command that is there but cannot run: not executable,
// or no format the kernel runs (a shell says 126).
type cannotExec struct {
	name string
	err  error
}

func (e *cannotExec) Error() string {
	return fmt.Sprintf("%s: %v: it cannot be run in the sandbox (not an executable file)", e.name, e.err)
}

func envPath(env []string) string {
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "PATH="); ok {
			return v
		}
	}
	return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}

type mnt struct {
	src, target, fstype string
	flags               uintptr
	data                string
}

// leaveHostMounts gives the init a root of its own, an empty tmpfs, and
// drops every mount of the host from its namespace.
func leaveHostMounts(userns bool) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	// In a user namespace the kernel lets /proc and /sys be mounted only
	// while the host's are visible, and device nodes are not made but
	// bound from the host's: all staged before the pivot.
	var devs map[string]int
	if userns {
		var err error
		if devs, err = cloneDevices(); err != nil {
			return err
		}
	}
	const dir = "/tmp" // any directory: the tmpfs covers it in this namespace only
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=700,size=64k"); err != nil {
		return fmt.Errorf("mount the spare root: %w", err)
	}
	if err := stageKernelFS(dir, devs); err != nil {
		return err
	}
	return pivot(dir)
}

// cloneDevices clones the host's device nodes (detached mounts), for a
// namespace whose root may not make them.
func cloneDevices() (map[string]int, error) {
	devs := map[string]int{}
	for _, d := range Devices {
		fd, err := unix.OpenTree(unix.AT_FDCWD, "/dev/"+d.Name, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("clone the host's /dev/%s: %w", d.Name, err)
		}
		devs[d.Name] = fd
	}
	return devs, nil
}

// pivot makes dir the root and detaches the old one.
func pivot(dir string) error {
	if err := unix.Chdir(dir); err != nil {
		return err
	}
	// pivot_root(".", "."): the old root goes under the new one, and is
	// detached there, without a directory made for it in the new root.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the old root: %w", err)
	}
	return unix.Chdir("/")
}

// stageKernelFS mounts what a sandbox's root gets of the kernel (/proc
// of its pid namespace, with what it must not see masked or read-only, a
// minimal /dev, a read-only /sys) in the spare's own root (dir), ahead of
// the sandbox: a claim only moves them into the sandbox's root. The
// device nodes are made, or bound from devs (cloneDevices) when given.
func stageKernelFS(dir string, devs map[string]int) error {
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	for _, m := range []mnt{
		{"proc", "/proc", "proc", nodev, ""},
		{"tmpfs", "/dev", "tmpfs", unix.MS_NOSUID | unix.MS_STRICTATIME, "mode=755,size=65536k"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
		{"shm", "/dev/shm", "tmpfs", nodev, "mode=1777,size=65536k"},
		{"mqueue", "/dev/mqueue", "mqueue", nodev, ""},
		{"sysfs", "/sys", "sysfs", nodev | unix.MS_RDONLY, ""},
	} {
		target := dir + m.target
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
	}
	for _, d := range Devices {
		p := filepath.Join(dir, "dev", d.Name)
		if fd, ok := devs[d.Name]; ok {
			if err := os.WriteFile(p, nil, 0o666); err != nil {
				return err
			}
			if err := unix.MoveMount(fd, "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
				return fmt.Errorf("bind /dev/%s: %w", d.Name, err)
			}
			unix.Close(fd)
			continue
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.Major, d.Minor))); err != nil {
			return fmt.Errorf("mknod /dev/%s: %w", d.Name, err)
		}
		os.Chmod(p, 0o666)
		// Each node is a mount of its own, so /dev itself can be nodev.
		if err := unix.Mount(p, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", d.Name, err)
		}
	}
	// A node a sandbox makes in /dev never opens (nor anywhere else it
	// can write: every writable mount of a sandbox is nodev).
	if err := unix.Mount("", dir+"/dev", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_STRICTATIME, ""); err != nil {
		return fmt.Errorf("make /dev nodev: %w", err)
	}
	for link, target := range map[string]string{"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, filepath.Join(dir, "dev", link)); err != nil {
			return err
		}
	}
	return maskProc(dir)
}

// setupRoot attaches the sandbox's root (tree, a detached mount), moves
// the staged /proc, /dev and /sys into it and pivots into it.
func setupRoot(tree int) error {
	const root = "/root"
	if err := os.Mkdir(root, 0o755); err != nil {
		return err
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the sandbox root: %w", err)
	}
	unix.Close(tree)
	for _, d := range []string{"/proc", "/dev", "/sys"} {
		target := root + d
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(d, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the root: %w", d, err)
		}
	}
	return pivot(root)
}

// maskProc hides kernel interfaces a sandbox has no business reading and
// makes the ones that change the host read-only, as runc's defaults do.
func maskProc(dir string) error {
	for _, p := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/sysrq-trigger",
		"/proc/latency_stats", "/proc/kallsyms", "/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(dir+"/dev/null", p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/acpi", "/proc/scsi", "/sys/firmware"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY, "size=0"); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/sys", "/proc/irq", "/proc/bus", "/proc/fs"} {
		p = dir + p
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", p, err)
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make %s read-only: %w", p, err)
		}
	}
	return nil
}

// loopbackUp brings up lo, the only interface of the new net namespace.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	return nil
}

// dropBounding drops from this thread's bounding set every capability
// but KeptCaps: no command it forks gains another, even by exec of a
// file with capabilities.
func dropBounding() error {
	last := 40
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		last, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	keep := map[int]bool{}
	for _, c := range KeptCaps {
		keep[c] = true
	}
	for c := 0; c <= last; c++ {
		if !keep[c] {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d: %w", c, err)
			}
		}
	}
	return nil
}

// dropPrivileges shrinks the thread's capabilities to KeptCaps (the
// bounding set is dropBounding's) and sets no_new_privs; exec carries
// them to the command.
func dropPrivileges() error {
	var mask [2]uint32
	for _, c := range KeptCaps {
		mask[c/32] |= 1 << (c % 32)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: mask[0], Permitted: mask[0]},
		{Effective: mask[1], Permitted: mask[1]},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// apply loads the restrictions on the calling thread; no_new_privs is
// set already.
func (r *Restrictions) apply() error {
	if r == nil {
		return nil
	}
	if r.Writable != nil {
		if err := confineWrites(r.Writable); err != nil {
			return err
		}
	}
	if len(r.Seccomp) == 0 {
		return nil
	}
	if len(r.Seccomp)%8 != 0 || len(r.Seccomp)/8 > unix.BPF_MAXINSNS {
		return fmt.Errorf("seccomp program of %d bytes: not a filter", len(r.Seccomp))
	}
	filter := make([]unix.SockFilter, len(r.Seccomp)/8)
	for i := range filter {
		b := r.Seccomp[8*i:]
		filter[i] = unix.SockFilter{Code: binary.NativeEndian.Uint16(b), Jt: b[2], Jf: b[3], K: binary.NativeEndian.Uint32(b[4:])}
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if _, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&prog))); errno != 0 {
		return fmt.Errorf("load the seccomp filter: %w", errno)
	}
	return nil
}
