package initproto

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"

	"github.com/dsec-project/dsec/internal/runtime/journal"
	"golang.org/x/sys/unix"
)

// MaxResults bounds the exit codes the init keeps for Result.
const MaxResults = 4096

type job struct {
	id   string
	pid  int  // in the sandbox's namespace; it leads its process group
	conn Peer // who hears the exit; nil once it went away
	oom  int64
	// The writer of its output (a container's: not a terminal's):
	// the pipes' read ends into the journal's files.
	pipes []*journal.Pipe
	sink  *journal.Sink
	// exited: reaped, its output being closed; its pid is no longer its
	// own.
	exited bool
}

// Ending is a command whose output is closed: its exit may be told.
type Ending struct {
	j         *job
	code      int
	truncated int64
}

// Exit is an ended command as the init keeps it.
type Exit struct {
	Code      int
	Truncated int64
}

// Peer hears an init's replies: a worker's connection to it, or in a
// microVM's guest the stream a request came on.
type Peer interface{ Send(Reply) }

// ConnPeer is a worker's connection to the init.
type ConnPeer struct{ C *net.UnixConn }

func (p *ConnPeer) Send(r Reply) {
	b, _ := json.Marshal(r)
	p.C.Write(b)
}

// Incoming is a request as it arrived, with its descriptors and its
// connection.
type Incoming struct {
	Req   Request
	Files []*os.File
	Conn  Peer
}

// Serve reads c's requests into in until c goes, then sends it on gone.
func Serve(c *net.UnixConn, in chan<- Incoming, gone chan<- *ConnPeer) {
	buf, oob := make([]byte, 64<<10), make([]byte, unix.CmsgSpace(3*4))
	p := &ConnPeer{c}
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			gone <- p
			return
		}
		var r Incoming
		if json.Unmarshal(buf[:n], &r.Req) != nil {
			continue
		}
		r.Conn = p
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
			if fds, err := unix.ParseUnixRights(&msgs[0]); err == nil {
				for _, fd := range fds {
					r.Files = append(r.Files, os.NewFile(uintptr(fd), "stdio"))
				}
			}
		}
		in <- r
	}
}

// Loop is the init's table of commands: those running, by pid and id,
// and the exit codes of the last maxResults that ended. It runs on the
// init's locked thread only, which forks every command.
type Loop struct {
	running   map[int]*job // by pid
	byID      map[string]*job
	done      map[string]Exit
	doneOrder []string // oldest first
	// DevNull, if set (a container's init), is the stdin of commands
	// without one, and ends makes the loop the writer of its commands'
	// output: each gets pipes, which the init copies into the
	// journal's files its request carries (a guest's agent has its
	// shim write them: it gets pipes already).
	DevNull *os.File
	Ends    chan Ending
	// OOMKills, if set, counts the kernel's OOM kills: a command killed
	// while it grew was the OOM killer's (a guest's kernel is the
	// sandbox's own; a container's exits are its group's to tell).
	OOMKills func() int64
}

func NewLoop() *Loop {
	return &Loop{running: map[int]*job{}, byID: map[string]*job{}, done: map[string]Exit{}}
}

func Send(c Peer, r Reply) {
	if c != nil {
		c.Send(r)
	}
}

// Handle answers one request.
func (l *Loop) Handle(r Incoming) {
	id := r.Req.ID
	switch r.Req.Op {
	case OpForget: // a guest restored as another sandbox: its ids are the new one's
		clear(l.done)
		l.doneOrder = nil
	case OpResult, OpProbe:
		if x, ok := l.done[id]; ok {
			Send(r.Conn, Reply{ID: id, Exit: &x.Code, Truncated: x.Truncated})
		} else if j := l.byID[id]; j != nil && r.Req.Op == OpProbe {
			Send(r.Conn, Reply{ID: id, Running: true})
		} else if j != nil {
			j.conn = r.Conn // the exit goes to whoever asks last
		} else {
			Send(r.Conn, Reply{ID: id, Unknown: true, Error: "no process " + id + " in this sandbox"})
		}
	case OpRestrict:
		if err := ApplyRestrictions(r.Req.Restrict); err != nil {
			Send(r.Conn, Reply{ID: id, Error: err.Error()})
		} else {
			zero := 0
			Send(r.Conn, Reply{ID: id, Exit: &zero})
		}
	case OpSignal:
		switch j := l.byID[r.Req.Exec]; {
		case j != nil:
			// The command leads its session, so its group holds what it
			// started (a shell's children); the pid too, should it have
			// left it. One reaped is done with.
			if !j.exited {
				unix.Kill(-j.pid, unix.Signal(r.Req.Signal))
				unix.Kill(j.pid, unix.Signal(r.Req.Signal))
			}
			fallthrough
		case l.hasDone(r.Req.Exec):
			zero := 0
			Send(r.Conn, Reply{ID: id, Exit: &zero})
		default:
			Send(r.Conn, Reply{ID: id, Unknown: true, Error: "no process " + r.Req.Exec + " in this sandbox"})
		}
	case OpExec:
		if _, seen := l.done[id]; seen || l.byID[id] != nil {
			Send(r.Conn, Reply{ID: id, Error: "exec id " + id + " was used already"})
			return
		}
		stdio, out, err := l.stdio(r)
		if err != nil {
			Send(r.Conn, Reply{ID: id, Error: err.Error()})
			return
		}
		pid, err := start(r.Req, stdio)
		for _, p := range out {
			p[1].Close() // the command's
		}
		if err != nil {
			for _, p := range out {
				p[0].Close()
			}
		}
		var nf *notFound
		var ce *cannotExec
		switch {
		case errors.As(err, &nf), errors.As(err, &ce):
			// Like a shell: a message on the command's stderr, 127
			// for a command not found, 126 for one that cannot run.
			fmt.Fprintf(r.Files[len(r.Files)-1], "%v\n", err)
			code := 127
			if ce != nil {
				code = 126
			}
			l.finish(id, Exit{Code: code})
			Send(r.Conn, Reply{ID: id, Exit: &code})
		case err != nil:
			Send(r.Conn, Reply{ID: id, Error: err.Error()})
		default:
			j := &job{id: id, pid: pid, conn: r.Conn}
			if out != nil {
				n := len(r.Files)
				j.sink = journal.NewSink(journal.Cap(r.Req.MaxOutput), r.Files[n-2], r.Files[n-1])
				r.Files[n-2], r.Files[n-1] = nil, nil // the sink's now
				for i, p := range out {
					if cp, err := journal.CopyPipe(j.sink, i, p[0]); err == nil {
						j.pipes = append(j.pipes, cp)
					}
				}
			}
			if l.OOMKills != nil {
				j.oom = l.OOMKills()
			}
			l.running[pid], l.byID[id] = j, j
			Send(r.Conn, Reply{ID: id, Pid: pid})
		}
	default:
		Send(r.Conn, Reply{ID: id, Error: fmt.Sprintf("unknown request %q: the init and the worker are of different dsec versions", r.Req.Op)})
	}
}

// stdio is what the command of an exec request gets: its stdin (the
// sandbox's /dev/null for none), and for its output, where the loop
// writes it (ends), the write ends of two pipes whose read ends (out)
// the loop copies into the request's files; else (a terminal's, a
// guest's) the request's own.
func (l *Loop) stdio(r Incoming) (stdio []*os.File, out [][2]*os.File, err error) {
	files := r.Files
	if r.Req.NullStdin && len(files) == 2 {
		files = append([]*os.File{l.DevNull}, files...)
	}
	if len(files) != 3 || files[0] == nil {
		return nil, nil, errors.New("bad exec request")
	}
	if l.Ends == nil || r.Req.TTY {
		return files, nil, nil
	}
	stdio = []*os.File{files[0]}
	for range 2 {
		pr, pw, err := journal.Pipes()
		if err != nil {
			for _, p := range out {
				p[0].Close()
				p[1].Close()
			}
			return nil, nil, fmt.Errorf("the command's output: %w", err)
		}
		out = append(out, [2]*os.File{pr, pw})
		stdio = append(stdio, pw)
	}
	return stdio, out, nil
}

// finish records the exit of the command under id, forgetting the
// oldest beyond maxResults.
func (l *Loop) finish(id string, x Exit) {
	l.done[id] = x
	l.doneOrder = append(l.doneOrder, id)
	if len(l.doneOrder) > MaxResults {
		delete(l.done, l.doneOrder[0])
		l.doneOrder = l.doneOrder[1:]
	}
}

// hasDone says whether the command under id ended (and is remembered).
func (l *Loop) hasDone(id string) bool {
	_, ok := l.done[id]
	return ok
}

// Forget drops c, gone, as the hearer of any exit.
func (l *Loop) Forget(c Peer) {
	for _, j := range l.byID {
		if j.conn == c {
			j.conn = nil
		}
	}
}

// Reap collects every exited child: tracked commands report their
// status, orphans that reparented to the init just go away.
func (l *Loop) Reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
		j, ok := l.running[pid]
		if !ok {
			continue
		}
		delete(l.running, pid)
		code := ws.ExitStatus()
		if ws.Signaled() {
			code = 128 + int(ws.Signal())
		}
		if j.sink != nil {
			// The step's output is what its pipes hold now: taken,
			// and its files closed, before the exit is told. Here if
			// the pipes are empty; else off this thread (the host's
			// disk may be slow), and probes meanwhile find it running.
			j.exited = true
			if j.endNow() {
				l.Ended(Ending{j: j, code: code, truncated: j.sink.Close()})
				continue
			}
			go func() {
				for _, p := range j.pipes {
					p.End()
				}
				l.Ends <- Ending{j: j, code: code, truncated: j.sink.Close()}
			}()
			continue
		}
		delete(l.byID, j.id)
		l.finish(j.id, Exit{Code: code})
		oom := ws.Signaled() && ws.Signal() == unix.SIGKILL && l.OOMKills != nil && l.OOMKills() > j.oom
		Send(j.conn, Reply{ID: j.id, Exit: &code, OOM: oom})
	}
}

// endNow ends the step of j, exited, here if that writes nothing (its
// pipes are empty): the exit is then told without a thread's handoff.
func (j *job) endNow() bool {
	for _, p := range j.pipes {
		if !p.TryEnd() {
			return false
		}
	}
	return true
}

// Ended tells the exit of a command whose output is closed.
func (l *Loop) Ended(x Ending) {
	delete(l.byID, x.j.id)
	l.finish(x.j.id, Exit{Code: x.code, Truncated: x.truncated})
	Send(x.j.conn, Reply{ID: x.j.id, Exit: &x.code, Truncated: x.truncated})
}

// InitThreads is how many idle threads an init keeps for the runtime.
const InitThreads = 4

// SpareThreads makes n threads that the Go runtime then keeps idle. An
// init's threads count against its sandbox's pids.max, which commands
// may fill: a runtime that then needs a thread (one is blocked in a
// fork, say) cannot create it and aborts, and the sandbox dies with its
// init. Made now, before any limit, the runtime finds idle ones (they
// take four of the sandbox's pids.max, as the init's other threads do).
func SpareThreads(n int) {
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

// LoopbackUp brings up lo, the only interface of the new net namespace.
func LoopbackUp() error {
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

// Run runs an init (who names it in its last word) on the thread it was
// started on, and exits: 127 when run fails. Capabilities and
// no_new_privs are per thread: an init drops them on this thread and
// forks every command from it.
func Run(who string, run func() error) {
	runtime.LockOSThread()
	err := run()
	fmt.Fprintf(os.Stderr, "%s: %v\n", who, err)
	os.Exit(127)
}
