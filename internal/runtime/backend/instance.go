package backend

import (
	"context"
	"errors"
	"os"
	"syscall"

	"github.com/dsec-project/dsec/internal/archive"
)

// Instance is a running sandbox as the runtime drives it: the
// connection to what starts its commands (a container's init, a VM's
// agent), each under an id that runs once. The sandbox outlives the
// worker: Close lets go of it and it runs on, and a worker that
// restarts gets another Instance from the backend, whose Probe and
// Result then answer for the commands its predecessor started.
//
// Every backend's processes live in a control group the runtime reads
// and bounds (memory, pids, CPU, freezing for a consistent pack-diff):
// a container's init and its commands, a VM's hypervisor process.
type Instance interface {
	// Pid is the host pid of the sandbox's init (a VM's hypervisor).
	Pid() int
	// Exec runs cmd and returns its exit code once it ends (128+N for
	// signal N, 127 for a command not found, 126 for one that cannot
	// run). ErrDied: the sandbox died under it.
	Exec(ctx context.Context, cmd Cmd) (int, error)
	// Result waits for the end of the command under id, also one an
	// earlier connection started. ErrUnknownExec: never started.
	Result(ctx context.Context, id string) (Exit, error)
	// Probe says whether the command under id still runs; if it ended,
	// how. ErrUnknownExec: never started.
	Probe(ctx context.Context, id string) (running bool, x Exit, err error)
	// Done is closed when the sandbox is lost: its init died, or Close.
	Done() <-chan struct{}
	// Close lets go of the sandbox, which runs on.
	Close() error
	// Destroy kills every process of the sandbox.
	Destroy() error
}

// Abilities an Instance may have, found by type assertion.
type (
	// Restricter holds the commands started from now on to r too.
	Restricter interface {
		Restrict(ctx context.Context, r Restrictions) error
	}
	// Protecter makes paths of the sandbox read-only or hidden (empty,
	// unreadable), for every process from now on, root's included;
	// missing lists those of them the sandbox lacks.
	Protecter interface {
		Protect(readOnly, hidden []string) (missing []string, err error)
	}
	// Renamer sets the sandbox's host name.
	Renamer interface {
		SetHostname(name string) error
	}
	// Terminaler allocates a terminal for a command (Cmd.TTY): master
	// is the runtime's (non-blocking, for its poller; what the command
	// shows is read there), tty the command's end.
	Terminaler interface {
		Terminal() (master, tty *os.File, err error)
	}
	// Signaler signals a running command (its process group) by its
	// id; one that ended is left be. ErrUnknownExec: never started.
	Signaler interface {
		Signal(ctx context.Context, id string, sig syscall.Signal) error
	}
)

// Files is a running sandbox's files as its processes resolve them
// (names relative to its root, never leading outside it), for copies in
// and out: an archive.FS, whose IDs map the owners it shows to the
// sandbox's own (nil: the same). Close lets go of it. A backend that
// has them says so by its driver (runtime.Sandbox.Files).
type Files interface {
	archive.FS
	IDs() archive.IDMap
	Close() error
}

// ErrDied says the sandbox died (or was lost) under a request: an
// infrastructure failure, not the command's.
var ErrDied = errors.New("sandbox died")

// ErrUnknownExec says the sandbox never started a command under the id
// asked for (or forgot it: it keeps the last few thousand).
var ErrUnknownExec = errors.New("no such exec in the sandbox")

// Exit is how a command ended, once the writer of its output has
// closed its files: the output is all there.
type Exit struct {
	Code int
	// Truncated counts the bytes of its output past its cap, which the
	// writer read and dropped.
	Truncated int64
}

// Cmd is a command to run in a sandbox.
type Cmd struct {
	// ID names the command for Result; it must be unique in the sandbox.
	ID   string
	Args []string
	Env  []string
	Cwd  string
	// MakeCwd creates Cwd in the sandbox (as its root, resolved in its
	// root, mode 0755) when it is missing: the sandbox's own working
	// directory, as docker makes a WORKDIR.
	MakeCwd bool
	// User runs it as that user of the sandbox (a name of its
	// /etc/passwd, uid or uid:gid; none: root).
	User string
	// TTY makes Stdin the command's controlling terminal.
	TTY bool
	// Stdin nil: /dev/null (the sandbox's own). Stdout and Stderr are
	// the journal's files, which the command never gets: the sandbox's
	// writer of its output (a container's init, a VM's host-side shim),
	// which outlives the worker, copies the command's pipes into them,
	// within MaxOutput, and closes them when the command ends, before
	// telling its exit. With TTY all three are the terminal, which the
	// command gets (the caller journals what it shows). The caller may
	// close them once Started ran (or Exec returned).
	Stdin, Stdout, Stderr *os.File
	// MaxOutput caps what is written to Stdout and Stderr together
	// (past it output is read and dropped); Truncated, if set, is set
	// to what was dropped.
	MaxOutput int64
	Truncated *int64
	// Started, if set, is called with the command's pid in the
	// sandbox's pid namespace once it runs.
	Started func(pid int)
	// OOMScore is the command's oom_score_adj, above the init's (0:
	// 1000, the first the OOM killer takes).
	OOMScore int
	// OOM, if set, is set when the sandbox's own kernel's OOM killer
	// took the command (a VM's guest: the host's group never sees it).
	OOM *bool
}

// Restrictions are what the kernel holds a sandbox's commands to beyond
// namespaces and capabilities.
type Restrictions struct {
	// Seccomp is a classic BPF program for seccomp(2), as an array of
	// struct sock_filter (policy.Seccomp makes one).
	Seccomp []byte `json:"seccomp,omitempty"`
	// Writable, when not nil, are the only trees (besides /dev and
	// /proc) commands may change: a Landlock domain.
	Writable []string `json:"writable,omitempty"`
}

// DevNode is a character device node of a sandbox's /dev.
type DevNode struct {
	Name         string
	Major, Minor uint32
}

// DevNodes are the nodes of a sandbox's /dev (ptmx is its devpts
// instance's, and the pseudo-terminals are there too): what the device
// allowlist (package policy) lets it open, whatever its backend.
var DevNodes = []DevNode{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}}
