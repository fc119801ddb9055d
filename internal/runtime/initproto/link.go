package initproto

import (
	"bytes"
	"io"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// Link carries yamux sessions between a microVM's shim and its guest's
// agent over one byte stream (the agent's virtio-serial port; on the
// host, the socket to QEMU's end of it), one session after another. A
// memory snapshot replaces the session: the agent, asked to quiesce,
// answers a nonce and ends its session, and waits for resyncMarker and
// the nonce; the host ends its own, and (after the snapshot, or in the
// shim of a guest restored from it) writes the marker and the nonce and
// starts a new session right after them. One goroutine reads the
// stream and hands each session what is its own: a session that ended
// never reads a byte of the next, and what the old one still had on
// its way is dropped.
type Link struct {
	rw io.ReadWriter

	mu       sync.Mutex
	pw       *io.PipeWriter // the current session's input; nil: dropped
	first    *io.PipeReader // the first session's, until it starts: what comes before is its
	want     []byte         // the marker awaited before the next session (guest side)
	nextPipe chan *io.PipeReader
	err      error // the stream's end
	done     chan struct{}
}

// resyncMarker precedes a new session on the agent's port (the nonce
// and a newline follow it).
const resyncMarker = "\x00\x00dsec-agent-resync-1\x00"

func NewLink(rw io.ReadWriter) *Link {
	l := &Link{rw: rw, nextPipe: make(chan *io.PipeReader, 1), done: make(chan struct{})}
	l.first, l.pw = io.Pipe()
	go l.pump()
	return l
}

func (l *Link) pump() {
	buf := make([]byte, 64<<10)
	var tail []byte // the bytes read while a marker is awaited
	for {
		n, err := l.rw.Read(buf)
		data := buf[:n]
		for len(data) > 0 {
			l.mu.Lock()
			pw, want := l.pw, l.want
			if want != nil {
				tail = append(tail, data...)
				i := bytes.Index(tail, want)
				if i < 0 {
					if len(tail) > len(want) {
						tail = append(tail[:0], tail[len(tail)-len(want)+1:]...)
					}
					l.mu.Unlock()
					break
				}
				data = append([]byte(nil), tail[i+len(want):]...)
				tail, l.want = nil, nil
				pr, npw := io.Pipe()
				l.pw, pw = npw, npw
				l.nextPipe <- pr
			}
			l.mu.Unlock()
			if pw != nil {
				pw.Write(data) // a session that ended drops it: its pipe is closed
			}
			break
		}
		if err != nil {
			l.mu.Lock()
			l.err = err
			if l.pw != nil {
				l.pw.CloseWithError(err)
			}
			l.mu.Unlock()
			close(l.done)
			return
		}
	}
}

// linkConn is a session's end of the link.
type linkConn struct {
	r *io.PipeReader
	w io.Writer
}

func (c *linkConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *linkConn) Write(p []byte) (int, error) { return c.w.Write(p) }
func (c *linkConn) Close() error                { return c.r.Close() }

// Start starts a session that reads what the stream brings from now on,
// the first one what it brought since the link was made (the host's
// side: it writes the marker itself, if one is due).
func (l *Link) Start(server bool) (*yamux.Session, error) {
	l.mu.Lock()
	pr := l.first
	if pr != nil {
		l.first = nil
	} else {
		var pw *io.PipeWriter
		pr, pw = io.Pipe()
		if l.pw != nil {
			l.pw.Close()
		}
		l.pw = pw
	}
	l.mu.Unlock()
	return l.session(pr, server)
}

func (l *Link) session(pr *io.PipeReader, server bool) (*yamux.Session, error) {
	c := &linkConn{r: pr, w: l.rw}
	if server {
		return yamux.Server(c, muxConfig())
	}
	return yamux.Client(c, muxConfig())
}

// End ends sess, and drops what the stream brings until the next
// session starts.
func (l *Link) End(sess *yamux.Session) {
	l.mu.Lock()
	if l.pw != nil {
		l.pw.Close()
		l.pw = nil
	}
	l.mu.Unlock()
	sess.Close()
}

// Expect drops what the stream brings from now on until the marker and
// nonce come (the guest's side: its session is about to end). The
// session still writes: its last answer goes out after this, so that
// no marker can come before it is awaited (a restored guest's host
// writes one as soon as the guest runs).
func (l *Link) Expect(nonce string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.want = []byte(resyncMarker + nonce + "\n")
	l.pw = nil // its reader is the session's, closed with it
}

// Next waits for the marker expect named and returns the session after
// it (the guest's side).
func (l *Link) Next() (*yamux.Session, error) {
	select {
	case pr := <-l.nextPipe:
		return l.session(pr, true)
	case <-l.done:
		return nil, l.err
	}
}

// Resync writes the marker and nonce and starts the session after them
// (the host's side).
func (l *Link) Resync(nonce string) (*yamux.Session, error) {
	sess, err := l.Start(false)
	if err != nil {
		return nil, err
	}
	if _, err := l.rw.Write([]byte(resyncMarker + nonce + "\n")); err != nil {
		sess.Close()
		return nil, err
	}
	return sess, nil
}

// muxConfig is the yamux session's configuration at both ends: no
// keepalives and no write deadline, since a paused sandbox's guest
// answers nothing for as long as it is paused, and is not dead.
func muxConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.EnableKeepAlive = false
	c.ConnectionWriteTimeout = 365 * 24 * time.Hour
	c.StreamOpenTimeout = 0
	c.LogOutput = nil
	c.Logger = discardLogger{}
	return c
}

type discardLogger struct{}

func (discardLogger) Print(...any)          {}
func (discardLogger) Printf(string, ...any) {}
func (discardLogger) Println(...any)        {}
