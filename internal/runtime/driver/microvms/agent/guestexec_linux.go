package agent

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"github.com/creack/pty"
	"github.com/hashicorp/yamux"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/journal"
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
func guestExec(st *yamux.Stream, fr *initproto.FrameReader, fw *initproto.FrameWriter, req initproto.Request, in chan<- initproto.Incoming) {
	p := &execPeer{st: st, fw: fw, tty: req.TTY}
	var files []*os.File
	fail := func(err error) {
		for _, f := range files {
			f.Close()
		}
		fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Error: err.Error()})
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
		files = []*os.File{tty, tty, tty}
		// pty.Open leaves the master blocking (its ioctls went through
		// Fd()), and the copy makes the open file non-blocking: stdin
		// is written through a non-blocking descriptor, which the
		// poller serves.
		if p.stdin, err = nonBlocking(master); err != nil {
			fail(fmt.Errorf("a terminal in the guest: %w", err))
			return
		}
		out, err := journal.Copy(frames{fw}, 0, p.stdin)
		if err != nil {
			p.stdin.Close()
			fail(fmt.Errorf("a terminal in the guest: %w", err))
			return
		}
		p.outs = []*journal.Pipe{out}
	} else {
		for i := range 3 {
			r, w, err := os.Pipe()
			if err != nil {
				fail(err)
				return
			}
			if i == 0 {
				files, p.stdin = append(files, r), w
				continue
			}
			files = append(files, w)
			out, err := journal.Copy(frames{fw}, i-1, r)
			r.Close() // the copy has its own
			if err != nil {
				fail(err)
				return
			}
			p.outs = append(p.outs, out)
		}
	}
	for _, o := range p.outs {
		go func() {
			<-o.Done()
			p.ended()
		}()
	}
	go p.pumpStdin(fr)
	in <- initproto.Incoming{Req: req, Files: files, Conn: p}
}

// execPeer hears an exec's replies on its stream, and carries its
// stdio: stdin frames in, output frames out.
type execPeer struct {
	st    *yamux.Stream
	fw    *initproto.FrameWriter
	tty   bool
	stdin *os.File // what stdin frames go to: a pipe, or the terminal
	outs  []*journal.Pipe

	mu     sync.Mutex
	done   int  // outs at their end
	exited bool // the exit (or a refusal) went out
	closed bool
}

func (p *execPeer) Send(r initproto.Reply) {
	if r.Exit == nil {
		p.fw.JSON(initproto.FrameReply, r)
		if r.Last() { // refused: nothing runs
			p.finish()
		}
		return
	}
	// The exit goes after every byte the command wrote before it ended:
	// what its pipes hold now; nothing after it goes (the host's shim
	// would drop it). Off the loop's thread: a slow host must not hold
	// up the guest's other commands.
	go func() {
		for _, o := range p.outs {
			o.End()
		}
		p.fw.JSON(initproto.FrameReply, r)
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
		case <-o.Done():
		default:
			return
		}
	}
	p.closed = true
	p.stdin.Close() // unblocks a write no reader will ever take
	p.st.Close()
}

// pumpStdin writes the stream's stdin frames into the command's stdin.
func (p *execPeer) pumpStdin(fr *initproto.FrameReader) {
	for {
		kind, b, err := fr.Next()
		if err != nil {
			break
		}
		switch kind {
		case initproto.FrameStdin:
			p.stdin.Write(b) // a command gone (EPIPE): dropped
		case initproto.FrameStdinEOF:
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

// frames sends a command's output to the shim as frames, stdout's and
// stderr's.
type frames struct{ fw *initproto.FrameWriter }

func (f frames) Write(stream int, b []byte) { f.fw.Frame(initproto.FrameStdout+byte(stream), b) }

// guestNet brings up the guest's eth0 with n's address and route.
// guestReNet makes eth0 what n describes in a guest restored from a
// snapshot, which had another sandbox's: its hardware address, its
// address and route, and no neighbour its old gateway left (the host's
// side is another tap, of another hardware address).
func guestReNet(n *initproto.GuestNet) error {
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("guest network: %w", err)
	}
	link, err := guestNIC()
	if err != nil {
		return err
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

// guestNIC is the guest's one NIC: eth0 in a microVM, and whatever
// name the guest's own init gave it in a full VM (enp0s3, say).
func guestNIC() (netlink.Link, error) {
	if l, err := netlink.LinkByName("eth0"); err == nil {
		return l, nil
	}
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("guest network: %w", err)
	}
	var nics []netlink.Link
	for _, l := range links {
		if a := l.Attrs(); a.EncapType == "ether" && len(a.HardwareAddr) == 6 && l.Type() == "device" {
			nics = append(nics, l)
		}
	}
	if len(nics) != 1 {
		return nil, fmt.Errorf("guest network: %d network interfaces, not the one the host gave", len(nics))
	}
	return nics[0], nil
}

func guestNet(n *initproto.GuestNet) error {
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
