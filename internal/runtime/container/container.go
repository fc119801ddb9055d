// Package container runs sandboxes in their own mount, pid, uts, ipc and
// net namespaces on an already composed root: the container backend's
// core, without the worker that will own sandboxes.
//
// A sandbox's pid 1 is its init, the dsec binary re-executed (as runc
// does). It starts ahead of need as a spare (Prestart): it leaves the
// host's mounts for an empty tmpfs root of its own, brings up the
// loopback interface, mounts /proc (sensitive paths masked or read-only),
// a minimal /dev and a read-only /sys there, and waits. Claim hands it
// its Spec and its root, a detached copy of the composed root's mount
// (open_tree), which it attaches in its namespace; it moves the staged
// mounts in, pivots, sets the hostname, then idles, reaping every
// process, and starts the processes Exec asks for over unix sockets (the
// claim's socket pair, then connections to a listener on the host; stdio
// descriptors passed along), forking them from the thread on which it
// dropped to a reduced capability set with no_new_privs and marked every
// descriptor close-on-exec. Create is Prestart and Claim at once. The
// sandbox lives until Destroy, whatever happens to the workers connected
// to it: a restarted worker Attaches and asks for the results of the
// commands its predecessor started. A binary that uses the package calls
// MaybeInit first thing in main.
//
// The protocol between the worker and an init is written down in
// proto.go. The worker's side: spare_linux.go (Prestart, Claim),
// client_linux.go (Conn: Attach, Exec, Result, Probe, Restrict),
// protect_linux.go (read-only and hidden paths, the hostname, from a
// thread that joined the sandbox's mount namespace) and spawn_linux.go
// (the namespace inits are forked from). The init's side: init_linux.go
// (its start and request loop), rootfs_linux.go, caps_linux.go,
// restrict_linux.go (seccomp, Landlock) and exec_linux.go (starting a
// command).
//
// No nsexec (runc's C constructor that joins namespaces before the Go
// runtime starts) is needed: new namespaces are clone flags on exec.Cmd,
// and the only namespace the worker joins is a sandbox's mount
// namespace, from a thread locked for the purpose and then thrown away
// (onSpentThread). Go cannot join a user or pid namespace from a
// threaded process, and dsec never does.
package container

import (
	"io"

	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// Spec describes a sandbox.
type Spec struct {
	Root     string `json:"root"` // the composed root file system
	Hostname string `json:"hostname"`
	// Socket is the host path the init listens on for workers.
	Socket string `json:"-"`

	// Where the init's own complaints go (the commands' output goes
	// where each Exec says); nil: nowhere.
	Stderr io.Writer `json:"-"`

	// Restrictions every command runs under.
	Restrictions *Restrictions `json:"restrictions,omitempty"`

	// Idle runs every process of the sandbox under SCHED_IDLE: batch
	// work that yields the CPU to anything else that wants it.
	Idle bool `json:"idle,omitempty"`
	// MergeMemory lets KSM merge the identical anonymous pages of every
	// process of the sandbox (PR_SET_MEMORY_MERGE, inherited by forks and
	// kept across exec); ksmd must run (/sys/kernel/mm/ksm/run).
	MergeMemory bool `json:"merge_memory,omitempty"`

	// Setup, if set, runs with the new process's host pid before the
	// process does anything (it waits for its spec): the place to put it
	// in its cgroup, so no instruction of the command runs outside it.
	Setup func(pid int) error `json:"-"`
}

// IDMap maps a user namespace's ids 0..Size-1, users and groups alike,
// to the host's Host..Host+Size-1.
type IDMap struct {
	Host uint32 `json:"host"`
	Size uint32 `json:"size"`
}

// Restrictions are what the kernel holds a sandbox's commands to beyond
// namespaces and capabilities.
type Restrictions = backend.Restrictions

// Cmd is a command to run in a sandbox.
type Cmd = backend.Cmd

// initEnv marks the re-executed binary as a sandbox init.
const initEnv = "_DSEC_CONTAINER_INIT"

// usernsEnv tells an init it runs in a user namespace of its own.
const usernsEnv = "_DSEC_CONTAINER_USERNS"

// KeptCaps are the capabilities a sandbox keeps: Docker's default set
// without CAP_NET_RAW (raw sockets are for the policy to allow, not the
// default).
var KeptCaps = []int{
	0,  // CAP_CHOWN
	1,  // CAP_DAC_OVERRIDE
	3,  // CAP_FOWNER
	4,  // CAP_FSETID
	5,  // CAP_KILL
	6,  // CAP_SETGID
	7,  // CAP_SETUID
	8,  // CAP_SETPCAP
	10, // CAP_NET_BIND_SERVICE
	18, // CAP_SYS_CHROOT
	27, // CAP_MKNOD
	29, // CAP_AUDIT_WRITE
	31, // CAP_SETFCAP
}

// Device is a character device node of a sandbox's /dev.
type Device = backend.DevNode

// Devices are the nodes of a sandbox's /dev (backend.DevNodes).
var Devices = backend.DevNodes
