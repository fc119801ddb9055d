package initproto

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// pair is a connected unixpacket pair, as the init's connections are.
func pair(t *testing.T) (init, worker *net.UnixConn) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

func answer(t *testing.T, l *Loop, in *ConnPeer, out *net.UnixConn, r Request) Reply {
	t.Helper()
	l.Handle(Incoming{Req: r, Conn: in})
	buf := make([]byte, 4096)
	n, err := out.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	var rep Reply
	if err := json.Unmarshal(buf[:n], &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

// The init's table without commands: what it answers for ids it never
// started, for exits it keeps (the last maxResults, whichever way they
// ended), for running commands, and for a request it does not know.
func TestLoopTable(t *testing.T) {
	c, out := pair(t)
	in := &ConnPeer{c}
	l := NewLoop()
	if rep := answer(t, l, in, out, Request{Op: OpResult, ID: "never"}); !rep.Unknown {
		t.Fatalf("result of an id never started: %+v, want unknown", rep)
	}
	for i := range MaxResults + 1 {
		l.finish(fmt.Sprint(i), Exit{Code: i % 256})
	}
	if rep := answer(t, l, in, out, Request{Op: OpProbe, ID: "0"}); !rep.Unknown {
		t.Fatalf("the oldest of %d exits is kept: %+v", MaxResults+1, rep)
	}
	if rep := answer(t, l, in, out, Request{Op: OpResult, ID: "300"}); rep.Exit == nil || *rep.Exit != 300%256 {
		t.Fatalf("result of a kept exit: %+v", rep)
	}
	if len(l.done) != MaxResults || len(l.doneOrder) != MaxResults {
		t.Fatalf("%d exits kept (%d in order), want %d", len(l.done), len(l.doneOrder), MaxResults)
	}
	if rep := answer(t, l, in, out, Request{Op: OpExec, ID: "300", Args: []string{"true"}}); !strings.Contains(rep.Error, "used already") {
		t.Fatalf("exec under a used id: %+v", rep)
	}
	j := &job{id: "busy"}
	l.running[1<<22], l.byID["busy"] = j, j
	if rep := answer(t, l, in, out, Request{Op: OpProbe, ID: "busy"}); !rep.Running || rep.Exit != nil {
		t.Fatalf("probe of a running command: %+v", rep)
	}
	l.Forget(in)
	if rep := answer(t, l, in, out, Request{Op: "shutdown", ID: "x"}); !strings.Contains(rep.Error, `unknown request "shutdown"`) {
		t.Fatalf("an unknown request: %+v", rep)
	}
}

// An init an earlier dsec started answers a probe of a running command
// with pid -1: the client takes it for running, and is free to wait on
// the command next.
func TestProbeOfAnEarlierInit(t *testing.T) {
	init, worker := pair(t)
	init.Write(Greeting)
	c, err := Greet(worker, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 4096)
	answerWith := func(rep string) {
		n, err := init.Read(buf)
		if err != nil {
			t.Error(err)
			return
		}
		var r Request
		json.Unmarshal(buf[:n], &r)
		init.Write([]byte(strings.ReplaceAll(rep, "ID", r.ID)))
	}
	go answerWith(`{"id":"ID","pid":-1}`)
	if running, _, err := c.Probe(t.Context(), "step"); !running || err != nil {
		t.Fatalf("probe answered with pid -1: running %v, %v", running, err)
	}
	go answerWith(`{"id":"ID","exit":4}`)
	if x, err := c.Result(t.Context(), "step"); x.Code != 4 || err != nil {
		t.Fatalf("result after the probe: %+v %v", x, err)
	}
}

// An init an earlier dsec started greets without "users" or without
// "journal". Without "users" it would run a command as root whatever
// user the request named: the client refuses such an exec before the
// init sees it. Without "journal" it hands a command the descriptors it
// gets: it gets pipes (and stdin, as it takes three), which the worker
// copies into the journal within the cap until the command's end.
func TestExecOfAnEarlierInit(t *testing.T) {
	init, worker := pair(t)
	init.Write([]byte(`{"ready":true}`))
	c, err := Greet(worker, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Exec(t.Context(), Cmd{ID: "as-agent", Args: []string{"id"}, User: "agent"}); err == nil || !strings.Contains(err.Error(), "older dsec") {
		t.Fatalf("as another user to an init without users: %v", err)
	}
	init.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, _ := init.Read(make([]byte, 4096)); n > 0 {
		t.Fatal("the older init was sent a request")
	}

	init, worker = pair(t)
	init.Write([]byte(`{"ready":true,"users":true}`))
	if c, err = Greet(worker, os.Getpid()); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dir := t.TempDir()
	var files [2]*os.File
	for i := range files {
		if files[i], err = os.Create(filepath.Join(dir, fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	ended := make(chan struct{})
	go func() { // the older init: runs the "command" on what it got
		buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(3*4))
		n, oobn, _, _, err := init.ReadMsgUnix(buf, oob)
		if err != nil {
			t.Error(err)
			return
		}
		var r Request
		json.Unmarshal(buf[:n], &r)
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		fds, _ := unix.ParseUnixRights(&msgs[0])
		if len(fds) != 3 {
			t.Errorf("the older init got %d descriptors", len(fds))
			return
		}
		for i, fd := range fds {
			var st unix.Stat_t
			unix.Fstat(fd, &st)
			if i > 0 && st.Mode&unix.S_IFMT != unix.S_IFIFO {
				t.Errorf("descriptor %d is not a pipe: %o", i, st.Mode)
			}
		}
		init.Write([]byte(`{"id":"` + r.ID + `","pid":1}`))
		unix.Write(fds[2], []byte("err "))
		unix.Write(fds[1], []byte("0123456789abcdefghij"))
		init.Write([]byte(`{"id":"` + r.ID + `","exit":3}`))
		<-ended
		unix.Write(fds[1], []byte("after the step"))
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	var truncated int64
	code, err := c.Exec(t.Context(), Cmd{ID: "s", Args: []string{"x"}, Stdout: files[0], Stderr: files[1], MaxOutput: 14, Truncated: &truncated})
	close(ended)
	if err != nil || code != 3 {
		t.Fatalf("exec in an older init: %d %v", code, err)
	}
	time.Sleep(50 * time.Millisecond) // what comes after the step must not be kept
	// The cap is the two streams': which comes first is the copiers'.
	got := 0
	for i, all := range []string{"0123456789abcdefghij", "err "} {
		b, _ := os.ReadFile(files[i].Name())
		if !strings.HasPrefix(all, string(b)) {
			t.Errorf("journaled stream %d: %q, not a start of %q", i, b, all)
		}
		got += len(b)
	}
	if got != 14 {
		t.Errorf("journaled %d bytes, want the cap, 14", got)
	}
	if truncated != 10 {
		t.Errorf("truncated %d bytes, want 10", truncated)
	}
}
