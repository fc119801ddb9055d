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
		if pipes[i], err = Copy(sink, i, r); err != nil {
			t.Fatal(err)
		}
		r.Close() // the copy has its own
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
	for i := range 50 {
		p := filepath.Join(t.TempDir(), "stdout")
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		sink := NewSink(1<<20, f, nil)
		r, w, err := Pipes()
		if err != nil {
			t.Fatal(err)
		}
		pipe, err := Copy(sink, 0, r)
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
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
