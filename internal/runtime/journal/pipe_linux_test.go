package journal

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestPipe: a command's pipes copied into a sink keep at most the cap,
// both streams together, and count the rest; what a pipe holds when the
// step ends is kept, what comes after is read and dropped (the writer
// never blocks on a pipe no one reads), and the copy ends with the last
// writer.
func TestPipe(t *testing.T) {
	for name, copy := range copiers {
		t.Run(name, func(t *testing.T) { testPipe(t, copy) })
	}
}

// copiers are the two ways to copy a pipe: Copy, from a descriptor of
// its own in the runtime's poller (the caller keeps r), and CopyPipe,
// in the process's copier (which takes r).
var copiers = map[string]func(out Streams, i int, r *os.File) (*Pipe, error){
	"Copy": func(out Streams, i int, r *os.File) (*Pipe, error) {
		defer r.Close() // the copy has its own
		return Copy(out, i, r)
	},
	"CopyPipe": CopyPipe,
}

func testPipe(t *testing.T, copy func(Streams, int, *os.File) (*Pipe, error)) {
	dir := t.TempDir()
	var files [2]*os.File
	for i, name := range []string{"stdout", "stderr"} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		files[i] = f
	}
	sink := NewSink(10, files[0], files[1])
	var ws [2]*os.File
	var pipes [2]*Pipe
	for i := range 2 {
		r, w, err := Pipes()
		if err != nil {
			t.Fatal(err)
		}
		if pipes[i], err = copy(sink, i, r); err != nil {
			t.Fatal(err)
		}
		ws[i] = w
	}
	ws[1].WriteString("err\n")
	ws[0].WriteString("0123456789abcdef") // 6 bytes fit
	for _, p := range pipes {
		p.End()
	}
	if n := sink.Close(); n != 10 {
		t.Errorf("truncated %d, want 10", n)
	}
	out, _ := os.ReadFile(files[0].Name())
	errb, _ := os.ReadFile(files[1].Name())
	if got := string(out) + string(errb); len(got) != 10 || !bytes.HasPrefix([]byte("err\n"), errb) || !bytes.HasPrefix([]byte("0123456789abcdef"), out) {
		t.Errorf("stdout %q, stderr %q: want 10 bytes, the first of each", out, errb)
	}
	// After the end: 4 MiB, far more than a pipe holds, goes nowhere and
	// never blocks.
	done := make(chan error, 1)
	go func() {
		_, err := ws[0].Write(make([]byte, 4<<20))
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a write after the step's end blocks")
	}
	if after, _ := os.ReadFile(files[0].Name()); !bytes.Equal(after, out) {
		t.Errorf("the output changed after the step's end: %d bytes, was %d", len(after), len(out))
	}
	for i, w := range ws {
		w.Close()
		select {
		case <-pipes[i].Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("pipe %d's copy outlives its last writer", i)
		}
	}
}

// TestPipeEnd: what a pipe holds when the step ends is the step's, all
// of it, however soon after the write the end comes.
func TestPipeEnd(t *testing.T) {
	for name, copy := range copiers {
		t.Run(name, func(t *testing.T) { testPipeEnd(t, copy) })
	}
}

func testPipeEnd(t *testing.T, copy func(Streams, int, *os.File) (*Pipe, error)) {
	for i := range 50 {
		p, sink, r, w := stdoutPipe(t)
		pipe, err := copy(sink, 0, r)
		if err != nil {
			t.Fatal(err)
		}
		want := bytes.Repeat([]byte{'x'}, 1000+i*997)
		w.Write(want)
		pipe.End()
		sink.Close()
		w.Close()
		if got, _ := os.ReadFile(p); !bytes.Equal(got, want) {
			t.Fatalf("round %d: %d bytes journaled, want %d", i, len(got), len(want))
		}
	}
}

// stdoutPipe is a sink of 1 MiB whose stdout is the file at p, and a
// pipe for it.
func stdoutPipe(t *testing.T) (p string, sink *Sink, r, w *os.File) {
	p = filepath.Join(t.TempDir(), "stdout")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if r, w, err = Pipes(); err != nil {
		t.Fatal(err)
	}
	return p, NewSink(1<<20, f, nil), r, w
}

// TestTryEnd: a CopyPipe's step ends at once where its pipe holds
// nothing (all it wrote is in the stream), and not where it holds
// something, which End then takes; a write after either end is dropped.
func TestTryEnd(t *testing.T) {
	for _, unread := range []bool{false, true} {
		p, sink, r, w := stdoutPipe(t)
		var pipe *Pipe
		var err error
		want := "read "
		if !unread {
			if pipe, err = CopyPipe(sink, 0, r); err != nil {
				t.Fatal(err)
			}
			w.WriteString(want)
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
				if got, _ := os.ReadFile(p); string(got) == want {
					break
				} else if time.Now().After(deadline) {
					t.Fatalf("the copier wrote %q, want %q", got, want)
				}
			}
		} else {
			// A pipe the copier does not read (as one it has not
			// got to yet): what it holds is End's.
			pipe = &Pipe{out: sink, r: r, fd: int(r.Fd()), copier: &copier{epfd: -1, pipes: map[int32]*Pipe{}}, done: make(chan struct{})}
			w.WriteString(want)
		}
		if got := pipe.TryEnd(); got == unread {
			t.Errorf("TryEnd = %v with a pipe that holds something: %v", got, unread)
		}
		if unread {
			pipe.End()
			pipe.Close()
		}
		w.WriteString("after")
		sink.Close()
		w.Close()
		select {
		case <-pipe.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the copy outlives its last writer")
		}
		if got, _ := os.ReadFile(p); string(got) != want {
			t.Errorf("journaled %q, want %q", got, want)
		}
	}
}
