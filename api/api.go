// Package api is the wire format of the dsec worker's HTTP/JSON API, served
// on a unix socket under the root (<root>/dsec.sock). Every path starts
// with the version, /v1. Fields may be added, never change meaning.
// Routes lists every route, with its request and answer types
// (docs/reference/api.md is written from it and from these types).
//
// Errors are an HTTP status and an Error body; the status tells the
// class (ErrorOf). An error in the middle of a tar stream (GET
// archive) is its X-Dsec-Error trailer, an Error; what it left out its
// X-Dsec-Skipped trailer, a CopyReport.
package api

import (
	"io/fs"
	"strings"
	"time"
)

// PathStat describes a path in a sandbox (also the X-Dsec-Stat header
// of GET archive, as JSON): Mode is Go's fs.FileMode; LinkTarget is a symlink's target.
type PathStat struct {
	Name       string      `json:"name"`
	Mode       fs.FileMode `json:"mode"`
	Size       int64       `json:"size"`
	Mtime      time.Time   `json:"mtime"`
	LinkTarget string      `json:"link_target,omitempty"`
}

// DirEntry is an entry of a directory listing: its path in the sandbox
// and what it is.
type DirEntry struct {
	Path string `json:"path"`
	PathStat
}

// CopyReport says what a copy left out (sockets, device nodes, fifos,
// entries on another mount), each with the reason.
type CopyReport struct {
	Skipped []Skipped `json:"skipped,omitempty"`
}

// Skipped is one entry a copy left out.
type Skipped struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// Headers of the archive endpoints.
const (
	HeaderStat    = "X-Dsec-Stat"
	HeaderError   = "X-Dsec-Error"   // trailer: an Error
	HeaderSkipped = "X-Dsec-Skipped" // trailer: a CopyReport
)

// Version is the API version this package describes.
const Version = "v1"

// Socket is the worker's socket, relative to the root.
const Socket = "dsec.sock"

// When a sandbox's image is fetched from its registry
// (SandboxSpec.Pull), as docker run --pull says.
const (
	PullMissing = "missing"
	PullNever   = "never"
	PullAlways  = "always"
)

// SandboxSpec asks for a sandbox.
type SandboxSpec struct {
	Name    string   `json:"name,omitempty"`    // default: generated
	Backend string   `json:"backend,omitempty"` // default: container
	Layers  []string `json:"layers"`            // topmost first: toolkit, workspace, base
	// Image is a container image (python:3.12, ghcr.io/org/env:v1,
	// 127.0.0.1:5000/repo@sha256:...) whose layers stack under Layers,
	// imported from its registry on first use; its config's environment,
	// working directory and user are the defaults of Env, Workdir and
	// User.
	Image string `json:"image,omitempty"`
	// Pull says when an Image is fetched from its registry: PullMissing
	// (the default: when neither the store nor the shared remote holds
	// it), PullNever (never: an image not held is not found) or
	// PullAlways (its tag resolved at the registry on every create,
	// layers already stored not fetched again).
	Pull string `json:"pull,omitempty"`
	// Resources. CPU zero means no limit; Memory and Pids zero mean the
	// worker's default (HostLimits), Unlimited none of the sandbox's own.
	CPU    float64 `json:"cpu,omitempty"` // CPUs
	Memory int64   `json:"memory,omitempty"`
	Pids   int64   `json:"pids,omitempty"`
	// Disk bounds what the sandbox writes (its upper), in bytes, on a
	// file system of its own (an image: its own inodes, df shows it).
	// Zero: the worker's default bound (HostLimits) on the file system
	// all such sandboxes share; Unlimited: only that file system's size.
	Disk int64 `json:"disk,omitempty"`
	// Requests: what the worker reserves for the sandbox when admitting
	// it (default: the limit; a sandbox without either reserves
	// nothing). The worker admits sandboxes while the requests of all
	// fit the host times its overcommit ratios, and queues the rest.
	CPURequest    float64 `json:"cpu_request,omitempty"`
	MemoryRequest int64   `json:"memory_request,omitempty"`
	// Class is SchedLatency (default) or SchedBatch.
	Class string `json:"class,omitempty"`
	// Defaults for every exec. User is as ExecRequest's (a name, a uid
	// or uid:gid; default root): a command that names no user runs as
	// it.
	Env     []string `json:"env,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"`
	// Hostname defaults to the name.
	Hostname string `json:"hostname,omitempty"`
	// Snapshot, instead of Layers, starts the sandbox on a snapshot
	// (NAME:STEP): the snapshot over the layers it was taken on, its
	// files restored and fresh processes started. A memory snapshot
	// (PackRequest.Memory) starts a microVM (the default backend for
	// one) that continues the snapshot's guest where it stopped, its
	// processes and memory as they were, unless DiskOnly.
	Snapshot string `json:"snapshot,omitempty"`
	DiskOnly bool   `json:"disk_only,omitempty"`
	// Policy is the sandbox's policy document; PolicyName one stored
	// with the worker (PUT /v1/policies/{name}). Neither: the secure
	// default. A sandbox's description carries its effective policy.
	Policy     *Policy `json:"policy,omitempty"`
	PolicyName string  `json:"policy_name,omitempty"`
	// UserNS runs the sandbox in a user namespace of its own: its root
	// is root over the sandbox's files and nobody on the host (65536
	// host ids of its own, from 2^31 up).
	UserNS bool `json:"userns,omitempty"`
}

// PolicyRequest applies a policy to a running sandbox: Policy, or the
// stored one named Name.
type PolicyRequest struct {
	Policy *Policy `json:"policy,omitempty"`
	Name   string  `json:"name,omitempty"`
	// Reset ends the connections the new policy no longer allows (by
	// default they live on: the allowlist is checked when one opens).
	Reset bool `json:"reset,omitempty"`
}

// PackRequest asks for a snapshot of a running sandbox's changes.
type PackRequest struct {
	Tag string `json:"tag"` // NAME:STEP, new
	// Bounds on what the sandbox wrote; zero: the worker's defaults.
	MaxBytes   int64 `json:"max_bytes,omitempty"`
	MaxEntries int   `json:"max_entries,omitempty"`
	MaxDepth   int   `json:"max_depth,omitempty"`
	// Memory: the snapshot holds the sandbox's guest whole too, its
	// memory and device state and its disk (a microVM's; another
	// backend's sandbox is refused, not implemented).
	Memory bool `json:"memory,omitempty"`
}

// Snapshot is a snapshot layer pack-diff made.
type Snapshot struct {
	Name        string    `json:"name"`    // NAME:STEP
	Digest      string    `json:"digest"`  // of the layer
	Size        int64     `json:"size"`    // bytes of the layer
	Parent      string    `json:"parent"`  // the layer it was taken over
	Layers      []string  `json:"layers"`  // what it stands on, its parent first
	Sandbox     string    `json:"sandbox"` // where it was packed from
	Incremental bool      `json:"incremental"`
	Created     time.Time `json:"created"`
	// What went in: paths (whiteouts included), bytes of file data,
	// paths left out as unchanged since the parent, and entries a layer
	// may not carry (device nodes), dropped.
	Entries   int      `json:"entries"`
	Bytes     int64    `json:"bytes"`
	Whiteouts int      `json:"whiteouts"`
	Unchanged int      `json:"unchanged"`
	Dropped   []string `json:"dropped,omitempty"`
	// FrozenSeconds is how long the sandbox's processes were frozen.
	FrozenSeconds float64 `json:"frozen_seconds"`
	// Folded: for a squash, how many snapshots went into this one.
	Folded int `json:"folded,omitempty"`
	// Memory: a memory snapshot's guest.
	Memory *SnapshotMemory `json:"memory,omitempty"`
	// BlockDiff: a full VM's snapshot, a block diff of its disk (Size
	// and Bytes its bytes; no files counted), which branches boot.
	BlockDiff bool `json:"block_diff,omitempty"`
}

// SnapshotMemory is the guest a memory snapshot holds: its machine, and
// the bytes of its device state, RAM and disk images (the RAM's and
// disk's hold only the data the guest had, not their holes).
type SnapshotMemory struct {
	MemoryBytes int64  `json:"memory_bytes"` // the guest's RAM
	CPUs        int    `json:"cpus"`
	Accel       string `json:"accel"`
	Kernel      string `json:"kernel"`
	QEMU        string `json:"qemu"`
	StateBytes  int64  `json:"state_bytes"`
	RAMBytes    int64  `json:"ram_bytes"`
	DiskBytes   int64  `json:"disk_bytes"`
	// PausedSeconds is how long the guest was paused (pack-diff only).
	PausedSeconds float64 `json:"paused_seconds,omitempty"`
}

// SnapshotNode is a snapshot in the lineage DAG.
type SnapshotNode struct {
	Name        string    `json:"name"` // NAME:STEP
	Digest      string    `json:"digest"`
	Size        int64     `json:"size"`
	Parent      string    `json:"parent"` // the layer it was taken over
	Layers      []string  `json:"layers"` // all it stands on, its parent first
	Sandbox     string    `json:"sandbox"`
	Incremental bool      `json:"incremental"`
	Created     time.Time `json:"created"`
	// MemoryBytes: a memory snapshot's guest, the bytes of its device
	// state, RAM and disk images (0: files only).
	MemoryBytes int64    `json:"memory_bytes,omitempty"`
	Children    []string `json:"children"`  // snapshots taken over it
	Branches    []string `json:"branches"`  // sandboxes started on it
	Sandboxes   []string `json:"sandboxes"` // sandboxes standing on it now
	// HeldBy are the fork groups and leases holding it ("group ID",
	// "lease ID"): it goes when they end, unless something stands on it.
	HeldBy []string `json:"held_by,omitempty"`
}

// SquashRequest folds the chain of snapshots ending in Snapshot into one
// new snapshot tagged Tag, over the same base layers.
type SquashRequest struct {
	Snapshot string `json:"snapshot"`
	Tag      string `json:"tag"`
}

// BranchRequest asks for N sandboxes on one snapshot, named
// NamePrefix-1 ... NamePrefix-N. Spec's resources, env, workdir and
// backend apply to each; its name, layers and snapshot are ignored.
// Either every branch is made or none.
type BranchRequest struct {
	Snapshot   string `json:"snapshot"`
	N          int    `json:"n"`
	NamePrefix string `json:"name_prefix,omitempty"` // default: from the snapshot's name (BranchPrefix)
	// First is the first branch's number, PREFIX-FIRST (0: 1 with a
	// NamePrefix, else the worker's next free number after PREFIX-).
	First int         `json:"first,omitempty"`
	Spec  SandboxSpec `json:"spec,omitempty"`
	// Like, instead of Spec, names a sandbox of the caller's whose
	// resources, class, env, workdir, backend, user namespace and
	// effective policy each branch takes (E2B's fork): what that sandbox
	// was given, the caller's token need not be allowed to ask for.
	Like string `json:"like,omitempty"`
}

// BranchPrefix is the name prefix of a snapshot's branches when the
// request gives none: its name with / and : as -.
func BranchPrefix(snapshot string) string {
	return strings.NewReplacer("/", "-", ":", "-").Replace(snapshot)
}

// Scheduling classes.
const (
	// SchedLatency: interactive steps; a high CPU weight.
	SchedLatency = "latency"
	// SchedBatch: background builds and test suites; they run idle
	// (cpu.idle, SCHED_IDLE): only on CPU nothing else wants.
	SchedBatch = "batch"
)

// Sandbox states.
const (
	StatusQueued   = "queued"   // waiting for admission
	StatusCreating = "creating" // admitted, being made
	StatusRunning  = "running"
	StatusStopped  = "stopped" // no process; its files are kept (start it again)
	StatusPaused   = "paused"  // its processes frozen, their memory kept (resume it)
	StatusDead     = "dead"    // its init died without being stopped
	// StatusUnreachable is a gateway's word for a sandbox whose worker
	// does not answer: as that worker last listed it.
	StatusUnreachable = "unreachable"
)

// Sandbox describes a sandbox.
type Sandbox struct {
	SandboxSpec
	// ID is the sandbox's for good, as the host knows it (its directory
	// and cgroup); Name is a label. An older dsec's sandbox's ID is its
	// name.
	ID string `json:"id,omitempty"`
	// Node is the worker that holds it, when a gateway answers (its
	// TCP API).
	Node string `json:"node,omitempty"`
	// Owner is the id of the API token that made it (dsec token ls;
	// none: made over the worker's unix socket).
	Owner   string    `json:"owner,omitempty"`
	Status  string    `json:"status"`
	Pid     int       `json:"pid,omitempty"` // the init's host pid while running
	Digests []string  `json:"digests"`       // of Layers
	Created time.Time `json:"created"`
	Cgroup  string    `json:"cgroup,omitempty"` // the cgroup2 directory
	// HostID is the host id a user namespace's root is, while it runs
	// (its 65536 ids start there).
	HostID uint32 `json:"host_id,omitempty"`
	// Address is eth0's in network mode nat, Gateway the host side's.
	Address string `json:"address,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	// MemoryBytes is the memory charged to the sandbox now; OOMKills
	// counts the processes its memory limit killed.
	MemoryBytes int64 `json:"memory_bytes,omitempty"`
	OOMKills    int   `json:"oom_kills,omitempty"`
	// MemoryLimit and PidsLimit are the limits the kernel holds it to
	// now (its own, the worker's defaults, or a policy's; 0: none).
	MemoryLimit int64 `json:"memory_limit,omitempty"`
	PidsLimit   int64 `json:"pids_limit,omitempty"`
	// Frozen: its processes are frozen (a batch sandbox, while the
	// host's memory pressure lasts; or a pack-diff in progress).
	Frozen bool `json:"frozen,omitempty"`
	// DiskUsed is what the sandbox's writes take; DiskLimit bounds
	// them (its quota, or the worker's default bound; 0: only the file
	// system all sandboxes without a quota share).
	DiskUsed  int64 `json:"disk_used,omitempty"`
	DiskLimit int64 `json:"disk_limit,omitempty"`
	// CPUSeconds is the CPU time its processes used while running;
	// IdleSeconds how long no exec started or ended in it (0 while one
	// runs); Reclaimed when the worker last took back its idle memory.
	CPUSeconds  float64 `json:"cpu_seconds,omitempty"`
	IdleSeconds float64 `json:"idle_seconds"`
	// Hinted: frozen by an idle hint (IdleRequest), its memory given back,
	// until its next exec resumes it; its status says running.
	Hinted    bool       `json:"hinted,omitempty"`
	Reclaimed *time.Time `json:"reclaimed,omitempty"`
	// Pool names the FnCall pool a warm sandbox waits in.
	Pool string `json:"pool,omitempty"`
	// Rm says the sandbox goes when its one command ends (dsec run
	// --rm: a call on the container backend).
	Rm    bool `json:"rm,omitempty"`
	Execs int  `json:"execs"` // journaled execs
	// VM is a microVM's machine (the microvm backend's sandboxes).
	VM *VMInfo `json:"vm,omitempty"`
	// E2B is what the worker's E2B front keeps of a sandbox its API
	// made or touched (a gateway's front reads it here); nil: none.
	E2B *E2BState `json:"e2b,omitempty"`
}

// E2BState is an E2B sandbox's state beside dsec's: its template ID and
// metadata, when it started, and when its timeout passes (OnTimeout:
// kill, or pause).
type E2BState struct {
	Template  string            `json:"template"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	Started   time.Time         `json:"started"`
	EndAt     time.Time         `json:"end_at"`
	OnTimeout string            `json:"on_timeout,omitempty"`
	// AccessToken is the sandbox's envd access token: only in the
	// answer to the create that gave the worker its record (a
	// gateway's front's, e2b.HeaderRecord).
	AccessToken string `json:"access_token,omitempty"`
}

// VMInfo is what a microVM runs on: the accelerator (kvm, or tcg: QEMU's
// translator, some 20-50 times slower), the guest kernel (its release
// and Debian package version) and QEMU's version.
type VMInfo struct {
	Accel  string `json:"accel"`
	Kernel string `json:"kernel"`
	QEMU   string `json:"qemu"`
	// GuestMemory is the guest's RAM and GuestMemoryUsed what its
	// kernel uses of it (its balloon's figures; the host holds
	// Sandbox.MemoryBytes for it, its freed pages given back).
	GuestMemory     int64 `json:"guest_memory,omitempty"`
	GuestMemoryUsed int64 `json:"guest_memory_used,omitempty"`
	// Evicted: paused, its guest saved to disk and its memory given
	// back to the host (resuming it restores it).
	Evicted bool `json:"evicted,omitempty"`
}

// ExecRequest runs a command. An ID makes it a step that runs at most
// once: the same ID again returns the recorded output and exit code, or
// waits for them while the command still runs.
type ExecRequest struct {
	ID   string   `json:"id,omitempty"` // default: generated
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"` // added to the sandbox's
	Cwd  string   `json:"cwd,omitempty"` // default: the sandbox's workdir
	// User runs the command as a user of the sandbox: a name of its
	// /etc/passwd, a uid, or uid:gid (default root). HOME, USER and
	// LOGNAME are then that user's; without a Cwd or workdir it starts
	// in the user's home.
	User  string `json:"user,omitempty"`
	Stdin bool   `json:"stdin,omitempty"`
	TTY   bool   `json:"tty,omitempty"`
	Rows  int    `json:"rows,omitempty"`
	Cols  int    `json:"cols,omitempty"`
	// Detach answers with the first frame (the id) and leaves the
	// command running; its output and result stay in the journal.
	Detach bool `json:"detach,omitempty"`
}

// SignalRequest signals a running exec: its process group (the
// command leads one), with Signal (default 9, SIGKILL).
type SignalRequest struct {
	Signal int `json:"signal,omitempty"`
}

// Frame is one line of an exec's response: output, then one result or
// one error.
type Frame struct {
	ID string `json:"id,omitempty"` // the first frame names the exec
	// Call, in a call's first frame, says where it ran.
	Call   *CallInfo   `json:"call,omitempty"`
	Stdout []byte      `json:"stdout,omitempty"`
	Stderr []byte      `json:"stderr,omitempty"`
	Result *ExecResult `json:"result,omitempty"`
	Error  *Error      `json:"error,omitempty"`
}

// ExecResult is how a command ended.
type ExecResult struct {
	ID       string    `json:"id"`
	ExitCode int       `json:"exit_code"` // 128+N: killed by signal N; 127: not found
	OOM      bool      `json:"oom,omitempty"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	// Replayed says the result was recorded by an earlier request with
	// the same ID: the command did not run again.
	Replayed bool `json:"replayed,omitempty"`
	// OutputTruncated says the command wrote more than the exec's cap
	// (the worker's exec.max_output, lowered to the sandbox's disk
	// bound), stdout and stderr together: the journal kept the first
	// bytes up to the cap and dropped OutputTruncatedBytes more.
	OutputTruncated      bool  `json:"output_truncated,omitempty"`
	OutputTruncatedBytes int64 `json:"output_truncated_bytes,omitempty"`
	// OutputDropped says the journal emptied the output later, to keep
	// the sandbox's journal within its disk bound (the oldest ended
	// execs' outputs go first): a replay has the result, no output.
	OutputDropped bool `json:"output_dropped,omitempty"`
}

// CallRequest is the first line of POST /v1/calls: one command in a
// fresh sandbox of the FnCall backend, taken warm from the pool named
// Pool, or from the pool whose template is Spec (without one, a sandbox
// is made for the call). The sandbox is discarded after the call: no
// state passes from one call to the next. Stdin follows as for an exec;
// Detach is refused.
//
// With Run it is dsec run --rm: a sandbox made for the call from Spec
// (never a pool's, and on Spec's backend) with Spec's name, listed while
// the command runs and removed by the worker when it ends or the client
// goes away; its name is free again once the removal is done (a create of
// it meanwhile waits for that).
type CallRequest struct {
	Pool string       `json:"pool,omitempty"`
	Spec *SandboxSpec `json:"spec,omitempty"`
	Run  bool         `json:"run,omitempty"`
	ExecRequest
}

// CallInfo says where a call ran.
type CallInfo struct {
	Sandbox string `json:"sandbox"`
	Pool    string `json:"pool,omitempty"`
	Warm    bool   `json:"warm"` // taken from the pool, not made for the call
}

// PoolSpec creates or resizes a FnCall pool (PUT /v1/pools/{name}):
// Spec is the template of its sandboxes (required to create one; when
// given for an existing pool it must be the same).
type PoolSpec struct {
	Size int          `json:"size"`
	Spec *SandboxSpec `json:"spec,omitempty"`
}

// EstimateRequest is POST /v1/estimates (an admin's): what a create on
// Layers would fetch on a worker, with the refs as Tenant (a token's ID;
// "": the admin) names them. A gateway asks it to place a create where
// its layers are.
type EstimateRequest struct {
	Layers []string `json:"layers"`
	Tenant string   `json:"tenant,omitempty"`
}

// Estimate is a worker's answer to an EstimateRequest.
type Estimate struct {
	// FetchBytes are the bytes of the layers its local store lacks, as
	// its remote holds them, less what its lazy cache holds of each: at
	// most what a create there fetches.
	FetchBytes int64 `json:"fetch_bytes"`
	// Missing counts the layers it finds nowhere.
	Missing int `json:"missing"`
}

// ClaimRequest is POST /v1/claims (an admin's): gateways make a
// sandbox name the fleet's by claiming it, before their create, on one
// worker that every gateway picks for that name (its home). Claims are
// all of Names or none, held by Holder for TTLMillis (a create under
// way renews its claim; one made keeps it a few heartbeats, until every
// gateway's lists show the sandbox: Made, name by name). Release drops
// Holder's claims of Names instead; Release with no Holder drops their
// claims whoever holds them (their sandboxes removed: a name removed is
// free at once), and their holders' late settles are ignored.
type ClaimRequest struct {
	Names  []string `json:"names"`
	Holder string   `json:"holder,omitempty"`
	// Holders, if any, are each name's holder, in place of Holder (a
	// gateway settles many creates' claims at once).
	Holders   []string `json:"holders,omitempty"`
	TTLMillis int64    `json:"ttl_ms,omitempty"`
	// Made: their creates are over (the sandboxes exist).
	Made    bool `json:"made,omitempty"`
	Release bool `json:"release,omitempty"`
}

// MaxClaims bounds a ClaimRequest's Names (a batch's names).
const MaxClaims = MaxBatch

// CordonRequest is PUT /v1/cordon (an admin's): a cordoned worker is
// given no create by a gateway (it still takes those sent to it), and
// keeps saying so across its own and every gateway's restarts.
type CordonRequest struct {
	Cordoned bool `json:"cordoned"`
}

// Pool is a FnCall pool.
type Pool struct {
	Name    string      `json:"name"`
	Size    int         `json:"size"`    // warm sandboxes it keeps
	Warm    int         `json:"warm"`    // ready now
	Filling int         `json:"filling"` // being made
	Spec    SandboxSpec `json:"spec"`
	Calls   int64       `json:"calls"`
	Misses  int64       `json:"misses"` // calls that found it empty and waited for a sandbox
	Error   string      `json:"error,omitempty"`
}

// Error is an API error.
type Error struct {
	Class   string `json:"class"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return e.Message }

// VersionInfo is GET /v1/version.
type VersionInfo struct {
	API      string   `json:"api"`
	Version  string   `json:"version"` // the worker binary's
	Pid      int      `json:"pid"`
	Backends []string `json:"backends"`
	// Limits are the bounds in force on this worker's sandboxes.
	Limits *HostLimits `json:"limits,omitempty"`
	// Features are what the worker found the host can do, each probed
	// once: a missing one says what dsec does without it.
	Features []Feature `json:"features,omitempty"`
	// Warm is what the worker holds ready ahead of creates.
	Warm *Warm `json:"warm,omitempty"`
	// MicroVM is what the microvm backend runs its guests with here, or
	// why it cannot.
	MicroVM *MicroVMHost `json:"microvm,omitempty"`
	// Gateway: this is a gateway of workers (dsec gateway), not one;
	// its Backends are those some worker up runs.
	Gateway bool `json:"gateway,omitempty"`
	// PublishesSnapshots: the worker publishes each snapshot it packs to
	// its remote, where every worker sharing that remote branches it
	// (snap.publish), so a gateway may place their branches anywhere.
	PublishesSnapshots bool `json:"publishes_snapshots,omitempty"`
	// Capacity is what the worker's admission holds now.
	Capacity *Capacity `json:"capacity,omitempty"`
	// Cordoned: gateways place no create here (PUT /v1/cordon).
	Cordoned bool `json:"cordoned,omitempty"`
	// E2B: the worker's E2B front serves its gateways' fronts (a
	// sandbox's E2B state is kept there).
	E2B bool `json:"e2b,omitempty"`
	// TokenID is the ID of the token that asked (none: the socket): a
	// gateway learns its admin token's on each worker, whose sandboxes
	// it made as the admin name it as their owner.
	TokenID string `json:"token_id,omitempty"`
}

// Capacity is what a worker's admission holds: the CPU and memory
// requests it admits in all (its CPUs and memory times its overcommit
// ratios) and what its sandboxes and creates hold of them, the creates
// waiting in its queue, and, while a disk of its is below its floor (a
// create is refused), why.
type Capacity struct {
	CPURequests        float64 `json:"cpu_requests"`
	CPURequestsUsed    float64 `json:"cpu_requests_used"`
	MemoryRequests     int64   `json:"memory_requests"`
	MemoryRequestsUsed int64   `json:"memory_requests_used"`
	Queued             int     `json:"queued"`
	DiskFull           string  `json:"disk_full,omitempty"`
}

// BatchRequest asks for Count sandboxes of one spec at once (POST
// /v1/batches): a rollout's burst. Each is made as a create of Spec
// would be, named Spec.Name-I (I from 0) or, without a name, as a
// create names one.
type BatchRequest struct {
	Spec  SandboxSpec `json:"spec"`
	Count int         `json:"count"`
}

// MaxBatch bounds a batch's Count.
const MaxBatch = 8192

// BatchItem is a line of a batch's answer (JSON lines, one per sandbox,
// as each is made or fails, in no order): the sandbox, or why it was not
// made.
type BatchItem struct {
	Index   int      `json:"index"`
	Sandbox *Sandbox `json:"sandbox,omitempty"`
	Error   *Error   `json:"error,omitempty"`
}

// Node is a worker of a gateway's fleet, as the gateway knows it (dsec
// node ls).
type Node struct {
	URL string `json:"url"` // its TCP API
	// Up: it answered its last heartbeats. Error is why the last one
	// failed, Seen when it last answered.
	Up    bool      `json:"up"`
	Error string    `json:"error,omitempty"`
	Seen  time.Time `json:"seen,omitzero"`
	// Cordoned: no create is placed there (dsec node cordon).
	Cordoned  bool     `json:"cordoned,omitempty"`
	Sandboxes int      `json:"sandboxes"`
	Version   string   `json:"version,omitempty"`
	Backends  []string `json:"backends,omitempty"`
	// MemoryBytes bounds all its sandboxes together; MemoryFree is what
	// is left once its sandboxes' limits are counted (placement's
	// measure).
	MemoryBytes int64 `json:"memory_bytes,omitempty"`
	MemoryFree  int64 `json:"memory_free"`
	// Capacity is what its admission held at its last heartbeat: a
	// create goes first to a worker that admits it at once.
	Capacity *Capacity `json:"capacity,omitempty"`
}

// GetMicroVM is v's MicroVM, nil for a nil v.
func (v *VersionInfo) GetMicroVM() *MicroVMHost {
	if v == nil {
		return nil
	}
	return v.MicroVM
}

// MicroVMHost is what a worker runs microVMs with: the accelerator and
// why (kvm where the CPU has hardware virtualization; else tcg, QEMU's
// translator: the same guests, slowly), the guest kernel and QEMU; or
// Error, what the host lacks to run them at all.
type MicroVMHost struct {
	Accel    string `json:"accel,omitempty"`
	AccelWhy string `json:"accel_why,omitempty"`
	Kernel   string `json:"kernel,omitempty"`
	QEMU     string `json:"qemu,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Warm counts what a worker made ahead of need and holds ready: spare
// inits, and sandboxes primed on the layers of the last create.
type Warm struct {
	Spares int `json:"spares"`
	Primed int `json:"primed"`
}

// Feature is a capability of the host a worker uses.
type Feature struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	// Reason is why it is missing; Without what dsec does then.
	Reason  string `json:"reason,omitempty"`
	Without string `json:"without,omitempty"`
}

// HostLimits are the bounds a worker holds its sandboxes to: every
// sandbox together (the kernel enforces them on the group all
// sandboxes live under: the host's memory less the reserve), and each
// sandbox that asks for no limit of its own.
type HostLimits struct {
	MemoryBytes   int64 `json:"memory_bytes"`   // all sandboxes together
	Pids          int64 `json:"pids"`           // all sandboxes together
	HostReserve   int64 `json:"host_reserve"`   // memory kept for the host
	DefaultMemory int64 `json:"default_memory"` // a sandbox's, unless it asks
	DefaultPids   int64 `json:"default_pids"`   // a sandbox's, unless it asks
	// DiskBytes is the size of the file system all sandboxes without a
	// disk quota of their own write to; DefaultDisk each one's bound.
	DiskBytes   int64 `json:"disk_bytes"`
	DefaultDisk int64 `json:"default_disk"`
	// WorkerGroup is the cgroup2 group the worker runs in, and
	// WorkerMemoryMin and WorkerMemoryLow the protection of its memory
	// there, as the kernel holds them (memory.min, memory.low): none on
	// a host whose memory controller is on cgroup v1, which has none.
	WorkerGroup     string `json:"worker_group,omitempty"`
	WorkerMemoryMin int64  `json:"worker_memory_min"`
	WorkerMemoryLow int64  `json:"worker_memory_low"`
}

// Unlimited, as a sandbox's Memory, Pids or Disk, asks for no limit of
// its own: an explicit opt-in, for 0 takes the worker's default. The
// limit on all sandboxes together still holds.
const Unlimited = -1

// IdleRequest hints that a sandbox waits (for the model's next turn)
// about ExpectedSeconds: the worker may freeze it and give its memory
// back to the host, and resumes it at its next exec.
type IdleRequest struct {
	ExpectedSeconds float64 `json:"expected_seconds"`
}

// IdleReport is what an idle hint did: whether the sandbox was frozen,
// and the memory charged to it before and after.
type IdleReport struct {
	Frozen       bool  `json:"frozen"`
	MemoryBefore int64 `json:"memory_before"`
	MemoryAfter  int64 `json:"memory_after"`
}
