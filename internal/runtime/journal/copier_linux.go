package journal

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// copier is the one goroutine of a process that copies the Pipes of
// CopyPipe: their read ends are in an epoll set of its own, which it
// waits on in a system call (its own thread), and it reads each as it
// is ready until its end. An exec's start then starts no goroutine, and
// a command that writes nothing wakes no thread but this one when it
// exits: a goroutine per stream in the runtime's poller cost an exec of
// `true` some 3% (BENCHMARKS.md).
type copier struct {
	epfd  int
	mu    sync.Mutex
	pipes map[int32]*Pipe // by descriptor
	buf   []byte          // what the copier reads into
}

// theCopier is the process's copier, started on first use.
var theCopier = sync.OnceValues(func() (*copier, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("the journal's copier: %w", err)
	}
	c := &copier{epfd: fd, pipes: map[int32]*Pipe{}, buf: make([]byte, 64<<10)}
	go c.run()
	return c, nil
})

// StartCopier starts the process's copier now: a sandbox's init, before
// its sandbox's pids limit, for the thread the copier keeps.
func StartCopier() error {
	_, err := theCopier()
	return err
}

func (c *copier) add(p *Pipe) error {
	p.copier = c
	c.mu.Lock()
	c.pipes[int32(p.fd)] = p
	c.mu.Unlock()
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.fd)}
	if err := unix.EpollCtl(c.epfd, unix.EPOLL_CTL_ADD, p.fd, &ev); err != nil {
		c.mu.Lock()
		delete(c.pipes, int32(p.fd))
		c.mu.Unlock()
		return fmt.Errorf("the journal's copier: %w", err)
	}
	return nil
}

// remove takes p's descriptor out of the set, before p closes it.
func (c *copier) remove(p *Pipe) {
	c.mu.Lock()
	delete(c.pipes, int32(p.fd))
	c.mu.Unlock()
	// Closing is not enough: a child forked meanwhile may hold the read
	// end until its exec, and the set would report it under a number
	// that a later pipe takes.
	unix.EpollCtl(c.epfd, unix.EPOLL_CTL_DEL, p.fd, nil)
}

func (c *copier) run() {
	events := make([]unix.EpollEvent, 128)
	for {
		n, err := unix.EpollWait(c.epfd, events, -1)
		if err != nil {
			continue // EINTR
		}
		for _, ev := range events[:n] {
			c.mu.Lock()
			p := c.pipes[ev.Fd]
			c.mu.Unlock()
			if p != nil {
				p.copyOnce(c.buf)
			}
		}
	}
}

// copyOnce reads what p holds, up to buf, into its stream (or nowhere,
// once ended), and closes it at its end. Once a wake: the set is level
// triggered, so what is left wakes the copier again, after every other
// pipe that is ready had its turn and End could take the lock.
func (p *Pipe) copyOnce(buf []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.fd >= 0 {
		n, err := unix.Read(p.fd, buf)
		switch {
		case n > 0:
			if !p.ended {
				p.out.Write(p.i, buf[:n])
			}
			return
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return
		}
		p.closeFD() // its end (or a descriptor that failed)
	}
}

// closeFD closes a CopyPipe's read end, under p.mu.
func (p *Pipe) closeFD() {
	if p.fd < 0 {
		return
	}
	p.copier.remove(p)
	p.r.Close()
	p.fd = -1
	close(p.done)
}
