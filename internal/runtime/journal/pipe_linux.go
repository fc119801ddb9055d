package journal

import (
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Streams is where a Pipe writes: stream i of a command's output (0:
// stdout, 1: stderr). A Sink is one; a guest's agent sends frames.
type Streams interface {
	Write(stream int, b []byte)
}

// Pipe copies the read end of a command's stdout or stderr (or a
// terminal's master) into a stream of a Sink until its end (EOF: no
// writer is left; a terminal: EIO) or Close. Once the step ended (End)
// it keeps reading, dropping what comes: what the command left running
// may write on, never blocking and never killed by SIGPIPE, but nothing
// of it reaches the journal.
//
// A Pipe of Copy is read by a goroutine of its own in the runtime's
// poller; one of CopyPipe by the process's one copier (copier), which
// an exec's start and end do not wake: the two are what a terminal and
// a frame stream need, and what an exec of a command that writes little
// costs least.
type Pipe struct {
	mu    sync.Mutex // held while a read and its write go on: order
	out   Streams
	i     int
	tty   bool
	ended bool // the step ended: what is read is dropped
	done  chan struct{}

	// Copy's: its own descriptor in the runtime's poller, and its
	// buffer.
	src *os.File
	rc  syscall.RawConn
	buf []byte
	// CopyPipe's: the read end and its descriptor, -1 once at its end
	// and closed.
	r      *os.File
	fd     int
	copier *copier
}

// Copy copies src into stream i of out, from a descriptor of its own
// (src's open file, made non-blocking, for the runtime's poller): the
// caller closes src when it will.
func Copy(out Streams, i int, src *os.File) (*Pipe, error) {
	rc, err := src.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	rc.Control(func(sfd uintptr) { fd, err = unix.FcntlInt(sfd, unix.F_DUPFD_CLOEXEC, 0) })
	if err != nil {
		return nil, err
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	_, terr := unix.IoctlGetTermios(fd, unix.TCGETS)
	p := &Pipe{src: os.NewFile(uintptr(fd), src.Name()), out: out, i: i, tty: terr == nil, fd: -1,
		buf: make([]byte, 64<<10), done: make(chan struct{})}
	if p.rc, err = p.src.SyscallConn(); err != nil {
		p.src.Close()
		return nil, err
	}
	go p.run()
	return p, nil
}

// CopyPipe is Copy of the read end of a pipe Pipes made, which it takes
// (no descriptor of its own to make, no goroutine to start: the
// process's copier reads it).
func CopyPipe(out Streams, i int, r *os.File) (*Pipe, error) {
	c, err := theCopier()
	if err != nil {
		r.Close()
		return nil, err
	}
	// r is not in the runtime's poller (Pipes made it blocking): its
	// descriptor is the copier's to read, made non-blocking.
	p := &Pipe{out: out, i: i, r: r, fd: int(r.Fd()), done: make(chan struct{})}
	if err := unix.SetNonblock(p.fd, true); err != nil {
		r.Close()
		return nil, err
	}
	if err := c.add(p); err != nil {
		r.Close()
		return nil, err
	}
	return p, nil
}

// Close stops the copy (after End: what comes is not read).
func (p *Pipe) Close() {
	if p.rc != nil {
		p.src.Close()
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeFD()
}

// read reads once from fd into its stream (or nowhere, once ended).
func (p *Pipe) read(fd uintptr, max int) (n int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n, err = unix.Read(int(fd), p.buf[:min(len(p.buf), max)])
	if n > 0 && !p.ended {
		p.out.Write(p.i, p.buf[:n])
	}
	return n, err
}

func (p *Pipe) run() {
	defer close(p.done)
	defer p.src.Close()
	for {
		eof := false
		err := p.rc.Read(func(fd uintptr) bool {
			for {
				// One read a lock, so that End gets in between under a
				// writer that never stops.
				n, err := p.read(fd, len(p.buf))
				switch {
				case n > 0, err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					return false // wait until it is readable again
				}
				eof = true
				return true
			}
		})
		if err != nil || eof {
			return
		}
	}
}

// control runs f on the Pipe's descriptor, under its lock; not at all
// once a CopyPipe's is at its end (nothing is left to read).
func (p *Pipe) control(f func(fd int)) {
	if p.rc != nil {
		p.rc.Control(func(fd uintptr) {
			p.mu.Lock()
			defer p.mu.Unlock()
			f(int(fd))
		})
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd >= 0 {
		f(p.fd)
	}
}

// terminalSlack is what End reads of a terminal beyond what it reports
// it holds: a terminal's count leaves out what is on its way through
// the line discipline, which a read takes in.
const terminalSlack = 128 << 10

// End ends the step for this stream: what the descriptor holds now
// (and no more, however fast a process the command left writes) goes
// into its stream, in order with what came before; what comes after is
// dropped. The caller then closes the sink, if a Sink.
func (p *Pipe) End() {
	p.control(func(fd int) {
		if p.ended {
			return
		}
		p.ended = true
		left, err := unix.IoctlGetInt(fd, unix.TIOCINQ) // FIONREAD
		if err != nil {
			left = 0
		}
		if p.tty {
			left += terminalSlack
		}
		buf := p.buf
		if buf == nil && left > 0 {
			buf = make([]byte, min(left, 64<<10))
		}
		for left > 0 {
			n, err := unix.Read(fd, buf[:min(len(buf), left)])
			if n > 0 {
				p.out.Write(p.i, buf[:n])
				left -= n
			} else if err != unix.EINTR {
				break
			}
		}
	})
	p.mu.Lock()
	p.ended = true // a CopyPipe's at its end already: all of it was read
	p.mu.Unlock()
}

// TryEnd is End where it has nothing to write: it ends the step and
// says true only if the descriptor holds nothing and no copy is under
// way (a step whose output is all in its stream already, as most are
// when their command exits). Else it changes nothing: End, which may
// write to a slow disk, is for another thread.
func (p *Pipe) TryEnd() (ended bool) {
	if p.rc != nil || !p.mu.TryLock() {
		return false
	}
	defer p.mu.Unlock()
	if p.ended || p.fd < 0 {
		p.ended = true
		return true
	}
	left, err := unix.IoctlGetInt(p.fd, unix.TIOCINQ) // FIONREAD
	p.ended = err == nil && left == 0
	return p.ended
}

// Done is closed once the source reached its end and is closed.
func (p *Pipe) Done() <-chan struct{} { return p.done }

// Pipes makes a pipe whose ends block (os.Pipe's are both
// non-blocking): its write end, for a command, as a command expects;
// its read end, for CopyPipe (or Copy), outside the runtime's poller.
func Pipes() (r, w *os.File, err error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		return nil, nil, err
	}
	return os.NewFile(uintptr(fds[0]), "|0"), os.NewFile(uintptr(fds[1]), "|1"), nil
}
