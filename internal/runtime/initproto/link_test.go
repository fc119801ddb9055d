package initproto

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// pair is a host's and a guest's link over one stream, as a microVM's
// agent port is.
func linkPair(t *testing.T) (host, guest *Link) {
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	return NewLink(a), NewLink(b)
}

// echo serves sess's streams: each answers what it reads.
func echo(sess *yamux.Session) {
	for {
		st, err := sess.AcceptStream()
		if err != nil {
			return
		}
		go func() { io.Copy(st, st); st.Close() }()
	}
}

func roundTrip(t *testing.T, sess *yamux.Session, msg string) {
	t.Helper()
	st, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := st.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, len(msg))
	if _, err := io.ReadFull(st, b); err != nil || string(b) != msg {
		t.Fatalf("echo of %q: %q %v", msg, b, err)
	}
}

// TestLinkResync: sessions one after another on one stream, the guest's
// next taken only after the marker and its nonce, whatever the stream
// carried between (the old session's last bytes, a restored guest's
// port's leftovers).
func TestLinkResync(t *testing.T) {
	host, guest := linkPair(t)
	gs, err := guest.Start(true)
	if err != nil {
		t.Fatal(err)
	}
	go func(gs *yamux.Session) { // a quiesce: it awaits the nonce, then answers
		st, err := gs.AcceptStream()
		if err != nil {
			return
		}
		b := make([]byte, 1)
		io.ReadFull(st, b)
		guest.Expect("n1")
		st.Write([]byte("nonce n1"))
		st.Close()
		gs.Close()
	}(gs)
	hs, err := host.Start(false)
	if err != nil {
		t.Fatal(err)
	}
	st, err := hs.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	st.Write([]byte("q"))
	st.SetDeadline(time.Now().Add(5 * time.Second))
	if b, err := io.ReadAll(st); string(b) != "nonce n1" {
		t.Fatalf("the quiesce's answer: %q %v", b, err)
	}
	host.End(hs)
	// Bytes no session reads: a stale frame, and another nonce.
	host.rw.Write([]byte("garbage" + resyncMarker + "n0\n"))
	next := make(chan *yamux.Session, 1)
	go func() {
		s, err := guest.Next()
		if err != nil {
			t.Error(err)
		}
		next <- s
	}()
	hs, err = host.Resync("n1")
	if err != nil {
		t.Fatal(err)
	}
	gs = <-next
	go echo(gs)
	roundTrip(t, hs, "second")
	roundTrip(t, hs, "third")
}

// TestLinkEarly: what comes before the first session starts is its own
// (a host's request waits in the guest's port for its agent).
func TestLinkEarly(t *testing.T) {
	host, guest := linkPair(t)
	hs, err := host.Start(false)
	if err != nil {
		t.Fatal(err)
	}
	st := make(chan error, 1)
	go func() {
		s, err := hs.OpenStream()
		if err == nil {
			_, err = s.Write([]byte("early"))
		}
		st <- err
	}()
	time.Sleep(50 * time.Millisecond) // the guest's pump has read it
	gs, err := guest.Start(true)
	if err != nil {
		t.Fatal(err)
	}
	s, err := gs.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 5)
	s.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "early" {
		t.Fatalf("the first session lost what came before it: %q %v", b, err)
	}
	if err := <-st; err != nil {
		t.Fatal(err)
	}
}
