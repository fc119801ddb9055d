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
type Pipe struct {
	mu    sync.Mutex // held while a read and its write go on: order
	src   *os.File
	rc    syscall.RawConn
	out   Streams
	i     int
	tty   bool
	ended bool // the step ended: what is read is dropped
	buf   []byte
	done  chan struct{}
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
	return start(out, i, os.NewFile(uintptr(fd), src.Name()), terr == nil)
}

// CopyPipe is Copy of the read end of a pipe Pipes made, which it takes
// (no descriptor of its own to make: an exec's start pays for none).
func CopyPipe(out Streams, i int, r *os.File) (*Pipe, error) { return start(out, i, r, false) }

func start(out Streams, i int, src *os.File, tty bool) (*Pipe, error) {
	p := &Pipe{src: src, out: out, i: i, tty: tty, buf: make([]byte, 64<<10), done: make(chan struct{})}
	var err error
	if p.rc, err = p.src.SyscallConn(); err != nil {
		p.src.Close()
		return nil, err
	}
	go p.run()
	return p, nil
}

// Close stops the copy (after End: what comes is not read).
func (p *Pipe) Close() { p.src.Close() }

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

// terminalSlack is what End reads of a terminal beyond what it reports
// it holds: a terminal's count leaves out what is on its way through
// the line discipline, which a read takes in.
const terminalSlack = 128 << 10

// End ends the step for this stream: what the descriptor holds now
// (and no more, however fast a process the command left writes) goes
// into its stream, in order with what came before; what comes after is
// dropped. The caller then closes the sink, if a Sink.
func (p *Pipe) End() {
	p.rc.Control(func(fd uintptr) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.ended {
			return
		}
		p.ended = true
		left, err := unix.IoctlGetInt(int(fd), unix.TIOCINQ) // FIONREAD
		if err != nil {
			left = 0
		}
		if p.tty {
			left += terminalSlack
		}
		for left > 0 {
			n, err := unix.Read(int(fd), p.buf[:min(len(p.buf), left)])
			if n > 0 {
				p.out.Write(p.i, p.buf[:n])
				left -= n
			} else if err != unix.EINTR {
				break
			}
		}
	})
}

// Done is closed once the source reached its end and is closed.
func (p *Pipe) Done() <-chan struct{} { return p.done }

// Pipes makes a pipe whose write end, for a command, blocks as a
// command expects (os.Pipe's ends are both non-blocking); its read end
// is non-blocking, in the runtime's poller, for CopyPipe.
func Pipes() (r, w *os.File, err error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		return nil, nil, err
	}
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, nil, err
	}
	return os.NewFile(uintptr(fds[0]), "|0"), os.NewFile(uintptr(fds[1]), "|1"), nil
}
