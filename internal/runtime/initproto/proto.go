// Package initproto is the init protocol: how the worker and a
// sandbox's init talk, written down here once, and what every init
// serves with it. Conn (client_linux.go) speaks the worker's side; Loop
// (loop_linux.go) is an init's table of commands, which a container's
// init (package container, whose spare_linux.go holds the claim) and a
// microVM guest's agent (driver/microvms/agent) run; a microVM's shim
// (driver/microvms/vmm) forwards it to the guest over one serial port
// in frames (frame.go) on a resumable link (link.go).
//
//	worker (Prestart)                         init (a re-exec of dsec-init)
//	  socketpair; fork the init, fd 3 ──────▶ leave the host's mounts, bring lo up,
//	                                          drop the bounding set
//	                      ◀──── "ready" ───── (fd 3)          a spare now: it waits
//	worker (Claim)
//	  claimSpec JSON + SCM_RIGHTS
//	  {listener, root tree, log} ───────────▶ attach the root, pivot, hostname,
//	                                          close every other fd, drop privileges,
//	                                          load the restrictions
//	                      ◀── greeting ────── on fd 3, which is the claimer's connection
//	worker (Attach, after a restart)
//	  connect to the init's socket ─────────▶ accept
//	                      ◀── greeting ──────
//	then, on any connection, one datagram (unixpacket) per message:
//	  request{op: exec, id} + SCM_RIGHTS
//	  {stdin, stdout, stderr} ──────────────▶ fork the command
//	                      ◀── reply{id, pid}  started (or reply{id, exit} for a
//	                                          command not found: 127, or unusable: 126)
//	                      ◀── reply{id, exit} when it ends
//	  request{op: result, id} ──────────────▶ reply{id, exit} now or when it ends; the
//	                                          exit then goes to this connection only
//	  request{op: probe, id}  ──────────────▶ reply{id, exit}, or reply{id, running}
//	  request{op: restrict}   ──────────────▶ reply{id, exit: 0} once later commands
//	                                          run under it too
//	  request{op: signal, exec, signal} ────▶ reply{id, exit: 0} once the command's
//	                                          process group has the signal (a no-op
//	                                          for one that ended), or reply{id, unknown}
//	  any of them             ◀── reply{id, error}, or reply{id, unknown} for an id
//	                                          the init never started (or forgot: it
//	                                          keeps the last maxResults)
//
// Exec ids are used once: an exec under an id the init has seen is
// refused, which is what makes a retried step run exactly once. Closing
// a connection never stops a command; its exit is kept for Result.
package initproto

import (
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/screen"
)

// Restrictions are what the kernel holds a sandbox's commands to beyond
// namespaces and capabilities.
type Restrictions = backend.Restrictions

// Cmd is a command to run in a sandbox.
type Cmd = backend.Cmd

// Op is what a request asks the init for.
type Op string

const (
	OpExec     Op = "exec"     // start a command with the request's stdio
	OpResult   Op = "result"   // the exit code of a command, waiting for it
	OpProbe    Op = "probe"    // whether a command runs, else its exit code
	OpRestrict Op = "restrict" // restrict every command started from now on
	OpSignal   Op = "signal"   // signal a running command's process group
)

// What only a microVM's guest agent answers (frame.go); a container's
// init does these from the host, or not at all.
const (
	OpSetup    Op = "setup"    // the guest's first request: mount its root, become its init
	OpProtect  Op = "protect"  // make paths read-only or hidden (Protect)
	OpHostname Op = "hostname" // name the guest's host
	OpFiles    Op = "files"    // the rest of the stream speaks the file protocol
	OpFreezeFS Op = "freezefs" // flush and freeze the upper's file system (FIFREEZE)
	OpThawFS   Op = "thawfs"   // thaw it (FITHAW)
	OpQuiesce  Op = "quiesce"  // freeze the upper, answer a nonce, end the session (a memory snapshot)
	OpResume   Op = "resume"   // the first request of the session after one: clock, RNG, name, network, thaw
	OpForget   Op = "forget"   // the agent's own, after a resume as another sandbox: forget the exits kept
)

// What only a microVM's shim answers (the worker's requests about the
// machine, not the guest).
const (
	OpSnapshot Op = "snapshot" // save the guest's memory, device state and disk (SCM_RIGHTS: their files)
	OpMemory   Op = "memory"   // the guest's memory as its balloon last reported it
	OpBalloon  Op = "balloon"  // set the balloon's target: the guest's memory, Balloon bytes (0: all of it)
	OpScreen   Op = "screen"   // write the screen as PNG to Path (a full VM's)
	OpInput    Op = "input"    // press Keys, then send Events (a full VM's keyboard and tablet)
	OpDiskSnap Op = "disksnap" // stack the empty image Path, as node Node, over the disk's top, node Current (a full VM's)
)

// Request is what the worker sends the init.
type Request struct {
	Op   Op       `json:"op"`
	ID   string   `json:"id"`
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	TTY  bool     `json:"tty,omitempty"`
	// MakeCwd: create Cwd if it is missing.
	MakeCwd bool `json:"make_cwd,omitempty"`
	// User: who it runs as (a name of the sandbox's /etc/passwd, uid or
	// uid:gid; none: root). Its HOME, USER and LOGNAME are then that
	// user's, and without Cwd it starts in its home.
	User string `json:"user,omitempty"`
	// OOMScore: the command's oom_score_adj (0: 1000).
	OOMScore int `json:"oom_score,omitempty"`
	// NullStdin: the command's stdin is the sandbox's /dev/null, and
	// the request carries two descriptors, stdout and stderr (else
	// three, stdin first).
	NullStdin bool `json:"null_stdin,omitempty"`
	// MaxOutput caps the output the init (a shim) writes into the
	// stdout and stderr the request carries, both together (0:
	// journal.DefaultMaxOutput; negative: none).
	MaxOutput int64 `json:"max_output,omitempty"`
	// Restrict: what commands started from now on run under, on top
	// of what they did.
	Restrict *Restrictions `json:"restrict,omitempty"`
	// Exec and Signal: the command a signal request is for (by its
	// id; ID is the request's own) and the signal.
	Exec   string `json:"exec,omitempty"`
	Signal int    `json:"signal,omitempty"`
	// Rows and Cols: a terminal's size (a guest makes the terminal; a
	// container's is the worker's).
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	// Protect: the paths to make read-only and hidden; Hostname: the
	// host name to set (a guest's).
	ReadOnly []string `json:"read_only,omitempty"`
	Hidden   []string `json:"hidden,omitempty"`
	Hostname string   `json:"hostname,omitempty"`
	// Balloon: the memory the guest keeps (OpBalloon; 0: all of it).
	Balloon int64 `json:"balloon,omitempty"`
	// Path: where OpScreen writes the screen (a file of the sandbox's
	// directory). Keys and Events: OpInput's key presses (each one's
	// qcodes held together) and pointer events.
	// OpDiskSnap: the image to stack (Path) as the node Node, over the
	// top it goes over, the node Current.
	Path    string         `json:"path,omitempty"`
	Current string         `json:"current,omitempty"`
	Node    string         `json:"node,omitempty"`
	Keys    []screen.Key   `json:"keys,omitempty"`
	Events  []screen.Event `json:"events,omitempty"`
	// Setup: what a guest's root is made of (opSetup).
	Setup *GuestSpec `json:"setup,omitempty"`
	// Stop: a memory snapshot leaves the guest stopped, never to run
	// again (it is being evicted: its disk is the sandbox's own).
	Stop bool `json:"stop,omitempty"`
}

// Reply is what the init answers a request with, once or twice (exec:
// started, then ended).
type Reply struct {
	ID   string `json:"id"`
	Pid  int    `json:"pid,omitempty"`  // started, as this pid in the sandbox's namespace
	Exit *int   `json:"exit,omitempty"` // ended with this code (128+N for signal N)
	// Running answers a probe of a command that has not ended. Inits
	// an earlier dsec started say so with Pid -1, still understood.
	Running bool   `json:"running,omitempty"`
	Error   string `json:"error,omitempty"`
	Unknown bool   `json:"unknown,omitempty"` // an id the init never started
	// Missing: the paths a protect request named that the root lacks.
	Missing []string `json:"missing,omitempty"`
	// OOM: the command's exit came from the OOM killer (a guest's).
	OOM bool `json:"oom,omitempty"`
	// Truncated: the bytes of the command's output past its cap, with
	// its exit (a guest's is its shim's to count).
	Truncated int64 `json:"truncated,omitempty"`
	// Nonce: what a quiesced guest's next session comes after (and a
	// snapshot's record of it).
	Nonce string `json:"nonce,omitempty"`
	// Frozen: the upper was frozen before the guest quiesced (a
	// pack-diff reads it), and stays so after.
	Frozen bool `json:"frozen,omitempty"`
	// Memory: the guest's memory (opMemory).
	Memory *GuestMemory `json:"memory,omitempty"`
	// Snapshot: what a memory snapshot took (opSnapshot).
	Snapshot *SnapshotInfo `json:"snapshot,omitempty"`
}

// Last reports whether r is the Last reply to its request: all but an
// exec's "started".
func (r Reply) Last() bool {
	return r.Exit != nil || r.Error != "" || r.Unknown || r.Running || r.Pid == -1
}

// Greeting is the init's first message on every connection: it is
// ready, and what it can do beyond what every init could (an older
// dsec's init greets without them).
var Greeting = []byte(`{"ready":true,"users":true,"journal":true}`)

// Hello is a greeting as the worker reads it.
type Hello struct {
	Ready bool `json:"ready"`
	// Users: the init runs commands as the request's user; an init
	// that does not would run them as root, so they are refused.
	Users bool `json:"users"`
	// Journal: the init (a shim) writes the journal's files itself,
	// from pipes, bounded; an init that does not would hand them to
	// the command, so its execs are refused.
	Journal bool `json:"journal"`
}

// ReadyMessage is a spare's word on fd 3 that it waits to be claimed.
var ReadyMessage = []byte("ready")
