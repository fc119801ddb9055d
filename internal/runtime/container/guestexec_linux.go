package container

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"

	"github.com/creack/pty"
	"github.com/hashicorp/yamux"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// FIFREEZE and FITHAW freeze and thaw a file system (_IOWR('X', 119 and
// 120, int)).
const (
	fiFreeze = 0xc0045877
	fiThaw   = 0xc0045878
)

// guestExec starts an exec request's command in the guest: its stdio are
// pipes (or a terminal of the guest's) whose other ends the agent copies
// from and to the stream; the loop starts it from its thread.
func guestExec(st *yamux.Stream, fr *frameReader, fw *frameWriter, req request, in chan<- incoming) {
	p := &execPeer{st: st, fw: fw, tty: req.TTY}
	var files []*os.File
	fail := func(err error) {
		for _, f := range files {
			f.Close()
		}
		fw.json(frameReply, reply{ID: req.ID, Error: err.Error()})
		st.Close()
	}
	if req.TTY {
		master, tty, err := pty.Open()
		if err != nil {
			fail(fmt.Errorf("a terminal in the guest: %w", err))
			return
		}
		if req.Rows > 0 && req.Cols > 0 {
			pty.Setsize(master, &pty.Winsize{Rows: req.Rows, Cols: req.Cols})
		}
		// pty.Open leaves the master blocking (its ioctls went through
		// Fd()): a read of it would wait under the copier's lock, and
		// the exit, which drains it first, for the terminal's last
		// holder, a process the command left running. A non-blocking
		// descriptor of it instead, which the poller serves.
		if master, err = nonBlocking(master); err != nil {
			tty.Close()
			fail(fmt.Errorf("a terminal in the guest: %w", err))
			return
		}
		files = []*os.File{tty, tty, tty}
		p.stdin = master
		p.outs = []*outCopier{newOutCopier(master, frameStdout, fw)}
	} else {
		for i := range 3 {
			r, w, err := os.Pipe()
			if err != nil {
				fail(err)
				return
			}
			if i == 0 {
				files, p.stdin = append(files, r), w
			} else {
				files = append(files, w)
				p.outs = append(p.outs, newOutCopier(r, frameStdout+byte(i-1), fw))
			}
		}
	}
	for _, o := range p.outs {
		go func() {
			o.run()
			p.ended()
		}()
	}
	go p.pumpStdin(fr)
	in <- incoming{req: req, files: files, conn: p}
}

// execPeer hears an exec's replies on its stream, and carries its
// stdio: stdin frames in, output frames out.
type execPeer struct {
	st    *yamux.Stream
	fw    *frameWriter
	tty   bool
	stdin *os.File // what stdin frames go to: a pipe, or the terminal
	outs  []*outCopier

	mu     sync.Mutex
	done   int  // outs at their end
	exited bool // the exit (or a refusal) went out
	closed bool
}

func (p *execPeer) send(r reply) {
	if r.Exit == nil {
		p.fw.json(frameReply, r)
		if r.last() { // refused: nothing runs
			p.finish()
		}
		return
	}
	// The exit goes after every byte the command wrote before it ended:
	// what its pipes hold now. Off the loop's thread: a slow host must
	// not hold up the guest's other commands.
	go func() {
		for _, o := range p.outs {
			o.drain()
		}
		p.fw.json(frameReply, r)
		p.finish()
	}()
}

// finish notes the exit (or refusal) went out; the stream closes once
// the output has ended too.
func (p *execPeer) finish() {
	p.mu.Lock()
	p.exited = true
	p.mu.Unlock()
	p.ended()
}

// ended closes the stream once the exit went out and every output
// reached its end (the command's children may write on after it ended).
func (p *execPeer) ended() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.exited || p.closed {
		return
	}
	for _, o := range p.outs {
		select {
		case <-o.done:
		default:
			return
		}
	}
	p.closed = true
	if !p.tty {
		p.stdin.Close() // unblocks a write no reader will ever take
	}
	p.st.Close()
}

// pumpStdin writes the stream's stdin frames into the command's stdin.
func (p *execPeer) pumpStdin(fr *frameReader) {
	for {
		kind, b, err := fr.next()
		if err != nil {
			break
		}
		switch kind {
		case frameStdin:
			p.stdin.Write(b) // a command gone (EPIPE): dropped
		case frameStdinEOF:
			if !p.tty {
				p.stdin.Close()
			}
		}
	}
	if !p.tty {
		p.stdin.Close()
	}
}

// nonBlocking is a non-blocking descriptor of f's open file, which it
// closes.
func nonBlocking(f *os.File) (*os.File, error) {
	defer f.Close()
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// outCopier copies a command's output (a pipe's read end, or the
// terminal) into frames of one kind, and on drain takes what the pipe
// holds now, in order with what it copied before; what comes after is
// dropped (the host's shim would drop it).
type outCopier struct {
	mu     sync.Mutex // held while a read and its frame go out: order
	f      *os.File
	rc     syscall.RawConn
	kind   byte
	fw     *frameWriter
	buf    []byte
	tty    bool
	closed bool
	ended  bool // drained: what comes is dropped
	done   chan struct{}
}

func newOutCopier(f *os.File, kind byte, fw *frameWriter) *outCopier {
	rc, _ := f.SyscallConn()
	c := &outCopier{f: f, rc: rc, kind: kind, fw: fw, buf: make([]byte, 64<<10), done: make(chan struct{})}
	rc.Control(func(fd uintptr) {
		_, err := unix.IoctlGetTermios(int(fd), unix.TCGETS)
		c.tty = err == nil
	})
	return c
}

// read reads once from fd into a frame (or nowhere, once drained).
func (c *outCopier) read(fd uintptr, max int) (int, error) {
	n, err := unix.Read(int(fd), c.buf[:min(max, len(c.buf))])
	if n > 0 && !c.ended {
		c.fw.frame(c.kind, c.buf[:n])
	}
	return n, err
}

func (c *outCopier) run() {
	defer close(c.done)
	for {
		eof := false
		err := c.rc.Read(func(fd uintptr) bool {
			for {
				// One read a lock: a drain gets in between, however fast
				// a process the command left writes.
				c.mu.Lock()
				n, err := c.read(fd, len(c.buf))
				c.mu.Unlock()
				switch {
				case n > 0, err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					return false // wait until it is readable again
				}
				// It has ended: a pipe with no writer left; a terminal
				// whose last holder closed it (EIO).
				eof = true
				return true
			}
		})
		if err != nil || eof {
			break
		}
	}
	c.mu.Lock()
	c.closed = true
	c.f.Close()
	c.mu.Unlock()
}

// drain copies what the descriptor holds now, and no more: a terminal's
// count leaves out what is on its way through the line discipline,
// which a read takes in, so some more of a terminal's.
func (c *outCopier) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.rc.Control(func(fd uintptr) {
		left, err := unix.IoctlGetInt(int(fd), unix.TIOCINQ) // FIONREAD
		if err != nil {
			left = 0
		}
		if c.tty {
			left += 128 << 10
		}
		for left > 0 {
			n, err := c.read(fd, left)
			if n > 0 {
				left -= n
			} else if err != unix.EINTR {
				break
			}
		}
	})
	c.ended = true
}

// guestNet brings up the guest's eth0 with n's address and route.
// guestReNet makes eth0 what n describes in a guest restored from a
// snapshot, which had another sandbox's: its hardware address, its
// address and route, and no neighbour its old gateway left (the host's
// side is another tap, of another hardware address).
func guestReNet(n *GuestNet) error {
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("guest network: %w", err)
	}
	link, err := netlink.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("guest network: eth0: %w", err)
	}
	if link.Attrs().HardwareAddr.String() != mac.String() {
		if err := netlink.LinkSetDown(link); err != nil {
			return fmt.Errorf("guest network: down: %w", err)
		}
		if err := netlink.LinkSetHardwareAddr(link, mac); err != nil {
			return fmt.Errorf("guest network: hardware address %s: %w", mac, err)
		}
	}
	addrs, err := netlink.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	for _, a := range addrs {
		if a.IP.IsLinkLocalUnicast() {
			continue
		}
		if err := netlink.AddrDel(link, &a); err != nil {
			return fmt.Errorf("guest network: drop address %s: %w", a.IPNet, err)
		}
	}
	neighs, _ := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_ALL)
	for _, nb := range neighs {
		netlink.NeighDel(&nb)
	}
	return guestNet(n)
}

func guestNet(n *GuestNet) error {
	var link netlink.Link
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("guest network: %w", err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return err
	}
	for _, l := range links {
		if l.Attrs().HardwareAddr.String() == mac.String() {
			link = l
		}
	}
	if link == nil {
		return fmt.Errorf("guest network: no interface with address %s", n.MAC)
	}
	if err := netlink.LinkSetName(link, "eth0"); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("guest network: name eth0: %w", err)
	}
	addr, err := netlink.ParseAddr(n.Addr)
	if err != nil {
		return fmt.Errorf("guest network: %w", err)
	}
	if err := netlink.AddrAdd(link, addr); err != nil {
		return fmt.Errorf("guest network: address %s: %w", n.Addr, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("guest network: up: %w", err)
	}
	gw := net.ParseIP(n.Gateway)
	if gw == nil {
		return fmt.Errorf("guest network: gateway %q", n.Gateway)
	}
	if err := netlink.RouteReplace(&netlink.Route{LinkIndex: link.Attrs().Index, Gw: gw}); err != nil {
		return fmt.Errorf("guest network: route via %s: %w", n.Gateway, err)
	}
	return nil
}
