package container

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

// maxResults bounds the exit codes the init keeps for Result.
const maxResults = 4096

type job struct {
	id   string
	pid  int  // in the sandbox's namespace; it leads its process group
	conn peer // who hears the exit; nil once it went away
	oom  int64
	// The writer of its output (a container's: not a terminal's):
	// the pipes' read ends into the journal's files.
	pipes []*journal.Pipe
	sink  *journal.Sink
	// exited: reaped, its output being closed; its pid is no longer its
	// own.
	exited bool
}

// ending is a command whose output is closed: its exit may be told.
type ending struct {
	j         *job
	code      int
	truncated int64
}

// exit is an ended command as the init keeps it.
type exit struct {
	code      int
	truncated int64
}

// peer hears an init's replies: a worker's connection to it, or in a
// microVM's guest the stream a request came on.
type peer interface{ send(reply) }

// connPeer is a worker's connection to the init.
type connPeer struct{ c *net.UnixConn }

func (p *connPeer) send(r reply) {
	b, _ := json.Marshal(r)
	p.c.Write(b)
}

// incoming is a request as it arrived, with its descriptors and its
// connection.
type incoming struct {
	req   request
	files []*os.File
	conn  peer
}

// serve reads c's requests into in until c goes, then sends it on gone.
func serve(c *net.UnixConn, in chan<- incoming, gone chan<- *connPeer) {
	buf, oob := make([]byte, 64<<10), make([]byte, unix.CmsgSpace(3*4))
	p := &connPeer{c}
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			gone <- p
			return
		}
		var r incoming
		if json.Unmarshal(buf[:n], &r.req) != nil {
			continue
		}
		r.conn = p
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

// loop is the init's table of commands: those running, by pid and id,
// and the exit codes of the last maxResults that ended. It runs on the
// init's locked thread only, which forks every command.
type loop struct {
	running   map[int]*job // by pid
	byID      map[string]*job
	done      map[string]exit
	doneOrder []string // oldest first
	// devNull, if set (a container's init), is the stdin of commands
	// without one, and ends makes the loop the writer of its commands'
	// output: each gets pipes, which the init copies into the
	// journal's files its request carries (a guest's agent has its
	// shim write them: it gets pipes already).
	devNull *os.File
	ends    chan ending
	// oomKills, if set, counts the kernel's OOM kills: a command killed
	// while it grew was the OOM killer's (a guest's kernel is the
	// sandbox's own; a container's exits are its group's to tell).
	oomKills func() int64
}

func newLoop() *loop {
	return &loop{running: map[int]*job{}, byID: map[string]*job{}, done: map[string]exit{}}
}

func send(c peer, r reply) {
	if c != nil {
		c.send(r)
	}
}

// handle answers one request.
func (l *loop) handle(r incoming) {
	id := r.req.ID
	switch r.req.Op {
	case opForget: // a guest restored as another sandbox: its ids are the new one's
		clear(l.done)
		l.doneOrder = nil
	case opResult, opProbe:
		if x, ok := l.done[id]; ok {
			send(r.conn, reply{ID: id, Exit: &x.code, Truncated: x.truncated})
		} else if j := l.byID[id]; j != nil && r.req.Op == opProbe {
			send(r.conn, reply{ID: id, Running: true})
		} else if j != nil {
			j.conn = r.conn // the exit goes to whoever asks last
		} else {
			send(r.conn, reply{ID: id, Unknown: true, Error: "no process " + id + " in this sandbox"})
		}
	case opRestrict:
		if err := applyRestrictions(r.req.Restrict); err != nil {
			send(r.conn, reply{ID: id, Error: err.Error()})
		} else {
			zero := 0
			send(r.conn, reply{ID: id, Exit: &zero})
		}
	case opSignal:
		switch j := l.byID[r.req.Exec]; {
		case j != nil:
			// The command leads its session, so its group holds what it
			// started (a shell's children); the pid too, should it have
			// left it. One reaped is done with.
			if !j.exited {
				unix.Kill(-j.pid, unix.Signal(r.req.Signal))
				unix.Kill(j.pid, unix.Signal(r.req.Signal))
			}
			fallthrough
		case l.hasDone(r.req.Exec):
			zero := 0
			send(r.conn, reply{ID: id, Exit: &zero})
		default:
			send(r.conn, reply{ID: id, Unknown: true, Error: "no process " + r.req.Exec + " in this sandbox"})
		}
	case opExec:
		if _, seen := l.done[id]; seen || l.byID[id] != nil {
			send(r.conn, reply{ID: id, Error: "exec id " + id + " was used already"})
			return
		}
		stdio, out, err := l.stdio(r)
		if err != nil {
			send(r.conn, reply{ID: id, Error: err.Error()})
			return
		}
		pid, err := start(r.req, stdio)
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
			fmt.Fprintf(r.files[len(r.files)-1], "%v\n", err)
			code := 127
			if ce != nil {
				code = 126
			}
			l.finish(id, exit{code: code})
			send(r.conn, reply{ID: id, Exit: &code})
		case err != nil:
			send(r.conn, reply{ID: id, Error: err.Error()})
		default:
			j := &job{id: id, pid: pid, conn: r.conn}
			if out != nil {
				n := len(r.files)
				j.sink = journal.NewSink(journal.Cap(r.req.MaxOutput), r.files[n-2], r.files[n-1])
				r.files[n-2], r.files[n-1] = nil, nil // the sink's now
				for i, p := range out {
					if cp, err := journal.CopyPipe(j.sink, i, p[0]); err == nil {
						j.pipes = append(j.pipes, cp)
					}
				}
			}
			if l.oomKills != nil {
				j.oom = l.oomKills()
			}
			l.running[pid], l.byID[id] = j, j
			send(r.conn, reply{ID: id, Pid: pid})
		}
	default:
		send(r.conn, reply{ID: id, Error: fmt.Sprintf("unknown request %q: the init and the worker are of different dsec versions", r.req.Op)})
	}
}

// stdio is what the command of an exec request gets: its stdin (the
// sandbox's /dev/null for none), and for its output, where the loop
// writes it (ends), the write ends of two pipes whose read ends (out)
// the loop copies into the request's files; else (a terminal's, a
// guest's) the request's own.
func (l *loop) stdio(r incoming) (stdio []*os.File, out [][2]*os.File, err error) {
	files := r.files
	if r.req.NullStdin && len(files) == 2 {
		files = append([]*os.File{l.devNull}, files...)
	}
	if len(files) != 3 || files[0] == nil {
		return nil, nil, errors.New("bad exec request")
	}
	if l.ends == nil || r.req.TTY {
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
func (l *loop) finish(id string, x exit) {
	l.done[id] = x
	l.doneOrder = append(l.doneOrder, id)
	if len(l.doneOrder) > maxResults {
		delete(l.done, l.doneOrder[0])
		l.doneOrder = l.doneOrder[1:]
	}
}

// hasDone says whether the command under id ended (and is remembered).
func (l *loop) hasDone(id string) bool {
	_, ok := l.done[id]
	return ok
}

// forget drops c, gone, as the hearer of any exit.
func (l *loop) forget(c peer) {
	for _, j := range l.byID {
		if j.conn == c {
			j.conn = nil
		}
	}
}

// reap collects every exited child: tracked commands report their
// status, orphans that reparented to the init just go away.
func (l *loop) reap() {
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
				l.ended(ending{j: j, code: code, truncated: j.sink.Close()})
				continue
			}
			go func() {
				for _, p := range j.pipes {
					p.End()
				}
				l.ends <- ending{j: j, code: code, truncated: j.sink.Close()}
			}()
			continue
		}
		delete(l.byID, j.id)
		l.finish(j.id, exit{code: code})
		oom := ws.Signaled() && ws.Signal() == unix.SIGKILL && l.oomKills != nil && l.oomKills() > j.oom
		send(j.conn, reply{ID: j.id, Exit: &code, OOM: oom})
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

// ended tells the exit of a command whose output is closed.
func (l *loop) ended(x ending) {
	delete(l.byID, x.j.id)
	l.finish(x.j.id, exit{code: x.code, truncated: x.truncated})
	send(x.j.conn, reply{ID: x.j.id, Exit: &x.code, Truncated: x.truncated})
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
