package vmm

// The shim's side of a guest's execs: each one's stdio copied between
// the caller and the agent, its exit passed on; the guest's file
// service; and the ring that keeps its console's tail. Split from
// vmm_linux.go, which boots the guest and serves its callers.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
	"github.com/hashicorp/yamux"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/journal"
)

// forward is an exec the shim copies: its stdio, and who hears its exit.
type forward struct {
	id     string
	files  []*os.File // stdin (nil: none), stdout, stderr
	sink   *journal.Sink
	hearer initproto.Peer // guarded by vmm.mu
}

// forward sends a request to the guest on a stream of its own and
// relays its replies; an exec's (f) output goes to its stdio.
func (v *vmm) forward(req initproto.Request, conn initproto.Peer, f *forward) {
	fail := func(err error) {
		if errors.Is(err, yamux.ErrSessionShutdown) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, net.ErrClosed) {
			// The agent's session ended (or its link broke before the
			// session knew: QEMU killed): the guest is going, and its
			// shim with it, which tells the sandbox died.
			select {
			case <-v.exited:
				return
			case <-time.After(2 * time.Second):
			}
		}
		if f != nil {
			f.sink.Close()
			v.end(f, nil, 0)
			v.mu.Lock()
			conn = f.hearer
			v.mu.Unlock()
		}
		initproto.Send(conn, initproto.Reply{ID: req.ID, Error: err.Error()})
	}
	sess, err := v.session()
	var st *yamux.Stream
	if err == nil {
		st, err = sess.OpenStream()
	}
	if err != nil {
		fail(fmt.Errorf("the guest's agent: %w", err))
		return
	}
	defer st.Close()
	fw, fr := initproto.NewFrameWriter(st), initproto.NewFrameReader(st)
	if f != nil && req.TTY && f.files[0] != nil {
		if ws, err := pty.GetsizeFull(f.files[0]); err == nil {
			req.Rows, req.Cols = ws.Rows, ws.Cols
		}
	}
	if err := fw.JSON(initproto.FrameRequest, req); err != nil {
		fail(fmt.Errorf("the guest's agent: %w", err))
		return
	}
	if f != nil {
		go copyStdin(fw, f.files[0])
	}
	ended := false
	for {
		kind, b, err := fr.Next()
		if err != nil {
			break
		}
		switch kind {
		case initproto.FrameStdout, initproto.FrameStderr:
			if f != nil { // after the exit: dropped
				f.sink.Write(int(kind-initproto.FrameStdout), b)
			}
		case initproto.FrameReply:
			var r initproto.Reply
			if json.Unmarshal(b, &r) != nil {
				continue
			}
			r.ID = req.ID // a stream answers its own request only
			if f == nil {
				initproto.Send(conn, r)
				continue
			}
			if r.Last() {
				// The output closed before the exit is told.
				ended = true
				r.Truncated = f.sink.Close()
				v.end(f, r.Exit, r.Truncated)
			}
			v.mu.Lock()
			hearer := f.hearer
			v.mu.Unlock()
			initproto.Send(hearer, r)
		}
	}
	if f != nil {
		if !ended {
			select {
			case <-v.exited:
				// The VM is gone: so is the shim, and the sandbox has
				// died under the command for whoever waits for it.
				return
			case <-time.After(2 * time.Second):
				fail(errors.New("the guest's agent lost the command"))
			}
		}
		closeAll(f.files)
	}
}

// end takes an exec off the running table, keeping its exit (nil: it
// never ran).
func (v *vmm) end(f *forward, code *int, truncated int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.running[f.id] != f {
		return
	}
	delete(v.running, f.id)
	if code == nil {
		return
	}
	v.done[f.id] = initproto.Exit{Code: *code, Truncated: truncated}
	v.doneOrder = append(v.doneOrder, f.id)
	if len(v.doneOrder) > initproto.MaxResults {
		delete(v.done, v.doneOrder[0])
		v.doneOrder = v.doneOrder[1:]
	}
}

// copyStdin sends what the command's stdin gives as frames, and its end.
func copyStdin(fw *initproto.FrameWriter, in *os.File) {
	if in == nil {
		fw.Frame(initproto.FrameStdinEOF, nil)
		return
	}
	buf := make([]byte, 64<<10)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if fw.Frame(initproto.FrameStdin, buf[:n]) != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				fw.Frame(initproto.FrameStdinEOF, nil)
			}
			return
		}
	}
}

// forget drops c, gone, as the hearer of any exit.
func (v *vmm) forget(c initproto.Peer) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, f := range v.running {
		if f.hearer == c {
			f.hearer = nil
		}
	}
}

// serveFiles makes each connection to the files socket a stream of the
// file protocol to the guest's agent.
func (v *vmm) serveFiles(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			continue
		}
		go func() {
			defer c.Close()
			sess, err := v.session()
			if err != nil {
				return
			}
			st, err := sess.OpenStream()
			if err != nil {
				return
			}
			defer st.Close()
			if initproto.NewFrameWriter(st).JSON(initproto.FrameRequest, initproto.Request{Op: initproto.OpFiles, ID: "#files"}) != nil {
				return
			}
			done := make(chan struct{})
			go func() {
				io.Copy(c, st)
				c.(*net.UnixConn).CloseWrite()
				close(done)
			}()
			io.Copy(st, c)
			st.Close()
			<-done
		}()
	}
}

// ring keeps the end of what the guest's console printed, and writes up
// to maxConsole bytes of it to a file.
type ring struct {
	done    chan struct{} // closed once the console ended
	mu      sync.Mutex
	max     int
	buf     []byte
	written int
}

func (r *ring) copy(from io.Reader, to *os.File) {
	defer close(r.done)
	defer to.Close()
	b := make([]byte, 16<<10)
	for {
		n, err := from.Read(b)
		if n > 0 {
			r.mu.Lock()
			r.buf = append(r.buf, b[:n]...)
			if len(r.buf) > r.max {
				r.buf = r.buf[len(r.buf)-r.max:]
			}
			if r.written < maxConsole {
				m := min(n, maxConsole-r.written)
				to.Write(b[:m])
				r.written += m
			}
			r.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

// tail is the console's last lines that say something (a stack trace's
// and register dumps' left out), at most 8, on one line: once it
// ended, if it ends within a second (QEMU exited).
func (r *ring) tail() string {
	select {
	case <-r.done:
	case <-time.After(time.Second):
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, l := range strings.Split(string(bytes.ReplaceAll(r.buf, []byte("\r"), nil)), "\n") {
		if l = strings.TrimSpace(l); l != "" && !consoleNoise().MatchString(l) {
			out = append(out, l)
		}
	}
	if len(out) > 8 {
		out = out[len(out)-8:]
	}
	if len(out) == 0 {
		return "(nothing)"
	}
	return strings.Join(out, " | ")
}

// consoleNoise matches the lines of a kernel's stack trace and register
// dump. Compiled on first use: every sandbox's init links this package.
var consoleNoise = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`\+0x[0-9a-f]+/0x[0-9a-f]+|^\[[ 0-9.]+\]\s+(\? |</?TASK>|Call Trace:|Code:|[A-Z0-9]{2,3}: |RIP: |RSP: |EFLAGS)`)
})
