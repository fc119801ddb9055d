package journal

import (
	"os"
	"sync"
)

// DefaultMaxOutput is an exec's cap on journaled output (stdout and
// stderr together) where the worker sets none (exec.max_output).
const DefaultMaxOutput = 64 << 20

// Cap is the cap a request's max_output asks for: 0 DefaultMaxOutput,
// negative none (all output is dropped).
func Cap(maxOutput int64) int64 {
	switch {
	case maxOutput == 0:
		return DefaultMaxOutput
	case maxOutput < 0:
		return 0
	}
	return maxOutput
}

// Sink is an exec's output files as the one process that writes them
// holds them: the sandbox's init, the worker (a terminal) or a microVM's
// shim, never the sandbox. What passes the cap (both streams together)
// is dropped and counted; once the step ended (Close), nothing more is
// written.
type Sink struct {
	mu        sync.Mutex
	files     [2]*os.File // stdout, stderr
	left      int64       // what the cap allows still
	truncated int64
	closed    bool
}

// NewSink writes stdout and stderr, taking them, within limit bytes.
func NewSink(limit int64, stdout, stderr *os.File) *Sink {
	return &Sink{files: [2]*os.File{stdout, stderr}, left: max(limit, 0)}
}

// Write appends b to stream i (0: stdout, 1: stderr) as far as the cap
// allows; what it cannot write (past the cap, or a host file system that
// fails) is counted as truncated. After Close it drops b uncounted.
func (s *Sink) Write(i int, b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	n := min(int64(len(b)), s.left)
	s.truncated += int64(len(b)) - n
	if n == 0 {
		return
	}
	s.left -= n
	w, err := s.files[i].Write(b[:n])
	if err != nil {
		s.truncated += n - int64(w)
	}
}

// Close ends the step's output: the files are closed and what comes
// after is dropped. It returns the bytes the cap (or the host) cut.
func (s *Sink) Close() (truncated int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		for _, f := range s.files {
			if f != nil {
				f.Close()
			}
		}
	}
	return s.truncated
}
