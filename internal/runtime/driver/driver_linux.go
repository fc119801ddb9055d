// Package driver is the backend seam: what a kind of sandbox implements
// for the runtime to run it, from outside package runtime. A Driver
// starts a sandbox's instance on what the runtime resolved for it (the
// root as mounts, the layers' images, limits, restrictions, network),
// finds it again after a worker restart, and takes down what it made;
// it never sees the runtime's Sandbox, only a StartSpec and a Handle,
// and returns what it started and what the sandbox's state keeps.
//
// What a backend can do beyond that is an ability: an interface of this
// package (or of package backend, for a running Instance) that its
// Driver or Instance implements, found by type assertion. The runtime
// asks an ability; it never compares backend names.
//
// The drivers a worker runs are built in one place (runtime.Drivers), as
// restic's backend/all lists its backends; a test may add its own.
package driver

import (
	"context"
	"io"
	"net/netip"
	"os"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/network"
	"github.com/dsec-project/dsec/internal/runtime/screen"
)

// Driver runs the sandboxes of one backend.
type Driver interface {
	backend.Backend
	// Start starts a sandbox's instance: its group made (NewGroup) and
	// held to s.Allowlist before anything of the sandbox runs, its
	// root composed from s.Root, its policy's restrictions and paths
	// held before its first command. On an error, Started holds what
	// was made so far, which the runtime then has Teardown take down.
	Start(ctx context.Context, s StartSpec) (Started, error)
	// Attach finds a running sandbox's instance again (a worker
	// restarted): Started.Instance nil says it died while no worker was
	// there. A paused sandbox's instance cannot answer: Attach finds
	// its group only, and the runtime attaches again when it resumes.
	Attach(ctx context.Context, h Handle) (Started, error)
	// Teardown takes down what Start made beyond the group, once the
	// runtime killed every process of the sandbox and removed its group
	// and network: mounts, id ranges, sockets. Every error is returned.
	Teardown(ctx context.Context, h Handle) []error
}

// StartSpec is what the backend-neutral part of a start resolved.
type StartSpec struct {
	Handle
	Hostname string
	// RootFS describes the sandbox's root, not mounted: the overlay of
	// its layers' mounts on the host (topmost first, nodev) under its
	// upper. A backend mounts it (idmapped into a user namespace, where
	// the sandbox has one) or hands its parts over.
	RootFS []mount.Mount
	// Images are the layers' image files, topmost first, for a backend
	// that maps them itself (a lazy layer's: its fetcher's padded
	// file); Layers their refs and Digests their digests.
	Images, Layers, Digests []string
	Limits                  cgroup.Limits
	// Allowlist is the sandbox's egress rules as applied to its group.
	Allowlist []policy.Entry
	// NAT: the sandbox's network mode is nat (a way out through the
	// host); else it has none.
	NAT         bool
	MergeMemory bool
	Restrict    *backend.Restrictions
	// ReadOnly and Hidden are the policy's paths, the toolkit's among
	// the read-only ones unless the policy lets them be written.
	ReadOnly, Hidden []string
	// Warm is what the driver's Prestarter made ahead for this
	// sandbox (nil: none).
	Warm Warm
	// Restore starts the instance from a saved guest, not afresh (a
	// MemorySnapshotter's).
	Restore *Restore
	// Upper is the sandbox's upper directory, bounded as its disk is
	// (--disk, or the host's bound): where a backend that composes no
	// root of layers (a BaseResolver) keeps what the sandbox writes.
	Upper string
	// DiskTop is the number of the top a DiskSnapshotter's disk was on
	// when it last ran, where that is not its chain's length (a chain a
	// snapshot flattened: DiskSnap.Depth); 0 otherwise.
	DiskTop int
}

// Handle is what a driver is given of a sandbox it started: where it
// is, and what its state recorded.
type Handle struct {
	ID, Name string // Name: the user's, for messages
	// Dir is the sandbox's directory (state, sockets, logs, rootfs),
	// Root the worker's root it is under (caches shared by sandboxes).
	Dir, Root string
	// Slot names the sandbox among every root's on this host: the key
	// of its subnet and its id range.
	Slot string
	// Group is the name of its cgroup, in Groups.
	Groups *cgroup.Tree
	Group  string
	Pid    int
	Paused bool
	UserNS bool
	// Instance is the running instance (nil: none).
	Instance backend.Instance
	Record
}

// Started is what a start made.
type Started struct {
	Instance backend.Instance
	// Group is the group every process of the sandbox runs in.
	Group *cgroup.Group
	Pid   int
	Record
}

// Record is what a sandbox's state keeps of its instance, for Attach and
// Teardown and for users to read.
type Record struct {
	// IDs: a user namespace's sandbox's ids while it runs.
	IDs *container.IDMap
	// NAT is its way out in network mode nat.
	NAT *network.NAT
	// VM is a guest's machine as users see it; Machine the same in
	// full, what a memory snapshot of it records.
	VM      *api.VMInfo
	Machine *layer.Machine
}

// Restore starts a guest from a saved one rather than booting it: the
// machine it ran on, where its device state and RAM image are, and the
// nonce its agent waits for.
type Restore struct {
	What       string // "snapshot NAME:STEP", for errors
	Machine    layer.Machine
	State, RAM string // files; RAM "": the RAM is in the state
	Nonce      string
	// Branch: the guest becomes another sandbox (a branch of a memory
	// snapshot), not the one saved (an evicted one resuming).
	Branch bool
	// Policy is the saved sandbox's, whose file rules its guest holds
	// in its memory: a branch's may only add to it (nil: the runtime
	// checks it otherwise, or none was recorded).
	Policy *api.Policy
}

// Abilities a Driver may have, found by type assertion.
type (
	// ImageUpper: a sandbox's upper is always a disk image of its own
	// (its --disk, else one of the default bound's size), which its
	// instance mounts; the host never mounts it while the sandbox runs.
	ImageUpper interface{ UpperIsImage() bool }
	// WarmPauser: the sandboxes made ahead of need (primed, a pool's)
	// wait paused, the CPU an idle one spends (a guest kernel's timers)
	// saved until it is taken.
	WarmPauser interface{ PausesWarm() bool }
	// LayerBound: a sandbox stacks at most MaxLayers layers (a guest's
	// layer devices); the runtime folds the deepest of a deeper stack
	// into one.
	LayerBound interface{ MaxLayers() int }
	// Prestarter makes instances ahead of need: Prestart takes one for
	// a sandbox about to be made, which then has its ID (and gets it as
	// StartSpec.Warm); ok false: none is ready (or fits p), and the
	// sandbox gets a new ID.
	Prestarter interface {
		Prestart(p Prestart) (id string, w Warm, ok bool)
	}
	// MemorySnapshotter saves a running guest whole into the files
	// state, ram and disk (any may be a store's ingest): what a memory
	// snapshot takes, and what an eviction saves (stop: it stays
	// stopped; disk may be nil). Its sandboxes start from a saved guest
	// (StartSpec.Restore).
	MemorySnapshotter interface {
		SaveGuest(ctx context.Context, h Handle, state, ram, disk *os.File, stop bool) (*initproto.SnapshotInfo, error)
	}
	// UpperHolder makes a running sandbox's upper readable on the host,
	// consistent, until release (pack-diff reads it so).
	UpperHolder interface {
		HoldUpper(ctx context.Context, h Handle) (dir string, release func() error, err error)
	}
	// FileOpener opens a running sandbox's files as its processes
	// resolve them, for copies in and out.
	FileOpener interface {
		Files(h Handle) (backend.Files, error)
	}
	// BaseResolver: a sandbox boots a base of the backend's own kind (a
	// full VM's disk image), not a stack of layers: its one layer ref
	// names that base, which ResolveBase resolves in src (want: the
	// digests a sandbox stands on already, nil none yet). The runtime
	// mounts no layers for it; StartSpec.Images holds the base's files.
	BaseResolver interface {
		ResolveBase(ctx context.Context, src BaseSource, ref string, want []string) (Base, error)
	}
	// VNCServer: a running sandbox's screen is served over VNC (RFB) on
	// a unix socket only the host reaches (a full VM's), which VNC
	// names.
	VNCServer interface {
		VNC(h Handle) (socket string, err error)
	}
	// DiskSnapshotter: a sandbox's disk is a chain of copy-on-write
	// images, its base's (StartSpec.Images) under a top of its own in
	// its upper (a full VM's). SnapshotDisk ends that top where the
	// guest is now, its file systems frozen meanwhile, and stacks a new
	// one over it; it writes the ended top to d.Diff, the block diff a
	// snapshot adds to the chain of d.Depth images (one of more than
	// d.Max bytes, d.Max > 0, is refused before anything is done), and
	// with d.State the guest's device state and RAM as they were at
	// that instant (a memory snapshot: the guest is stopped meanwhile).
	// A chain of the most images the backend keeps is flattened: the
	// diff is then the whole disk, standing alone (DiskSnapped.Flat),
	// the chain its one image, and the new top (Depth+1) over it. The ended
	// top's file stays in the upper until Commit, which the caller calls
	// once its state names the diff's blob (its chain one longer, or
	// the diff alone): a sandbox started before that finds both tops,
	// and merges them.
	DiskSnapshotter interface {
		SnapshotDisk(ctx context.Context, h Handle, d DiskSnap) (DiskSnapped, error)
	}
	// SocketCloser: a running sandbox's sockets are the host kernel's
	// (a container's), and CloseSockets ends its established TCP
	// connections that closed says its policy no longer allows, the
	// process seeing them aborted and the peer a reset. A backend
	// without it keeps its sockets in a guest: the host forgets its
	// flows' connection tracking instead, and drops their packets.
	SocketCloser interface {
		CloseSockets(h Handle, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error)
	}
)

// DiskSnap is what a DiskSnapshotter is asked to take: the disk's top is
// the Depth-th (the chain's length, but after a flatten), over a chain
// of Chain images.
type DiskSnap struct {
	Upper string
	Depth int
	Chain int
	Max   int64
	Diff  *os.File
	State *os.File // nil: the disk alone
	// Images are the chain's files, topmost first, which release lets
	// go of (asked for a flatten only).
	Images func() (files []string, release func(), err error)
}

// DiskSnapped is what a DiskSnapshotter took: Commit drops the ended
// top; Frozen is how long the guest's file systems were frozen (or the
// guest stopped, for its memory); Memory the saved guest's agent's
// nonce, with its memory.
type DiskSnapped struct {
	Commit func() error
	Frozen time.Duration
	Memory *initproto.SnapshotInfo
	// Flat: the chain was flattened first, and the diff is the whole
	// disk, standing alone.
	Flat bool
}

// Base is a backend's own base as a sandbox stands on it: the digests
// its state keeps (a collection keeps those blobs while the sandbox is),
// and the files the backend starts from, both topmost first (a VM
// snapshot's block diffs over its image's disk). Saved is the guest the
// base holds saved, if it does (a VM snapshot of its memory): a sandbox
// that continues it starts from it (StartSpec.Restore).
type Base struct {
	Digests []string
	Files   []string
	Saved   *Restore
	// Release lets go of the base's files served lazily (BaseSource's
	// Serve) once the backend has them open; nil: none.
	Release func()
}

// BaseSource is where a backend's base is found: the local store, and
// a blob of it the store lacks, which Serve serves lazily from the
// worker's shared remote as a file (nil: the worker has none): ref
// names the artifact that holds it there, w and table its windows. The
// file is served while it is open anywhere: hold keeps it open until
// the backend opens it.
type BaseSource struct {
	Store *store.Store
	Serve func(ctx context.Context, ref string, blob ocispec.Descriptor, w layer.Windows, table []byte) (path string, hold io.Closer, err error)
}

// Warm is an instance a Prestarter made ahead of need, which its
// driver's Start takes (StartSpec.Warm); Discard drops one no Start took.
type Warm interface{ Discard() }

// Prestart is what decides whether a warm instance fits a sandbox.
type Prestart struct {
	Idle   bool // class batch: its CPU group under the idle parent
	UserNS bool
}

// Abilities a running Instance may have beyond package backend's.
type (
	// MemoryReporter reports a guest's memory as its balloon last
	// did.
	MemoryReporter interface {
		Memory(ctx context.Context) (*initproto.GuestMemory, error)
	}
	// Ballooner sets the memory a guest keeps (0: all it was given).
	Ballooner interface {
		Balloon(ctx context.Context, target int64) error
	}
	// Screener shows a guest's screen (as PNG, written to path) and
	// drives its keyboard and mouse (a full VM's).
	Screener interface {
		Screenshot(ctx context.Context, path string) error
		Input(ctx context.Context, keys []screen.Key, events []screen.Event) error
	}
	// FSFreezer flushes and freezes the file system of a guest's disk
	// (FreezeFS) and lets it be written again (ThawFS): the runtime
	// freezes a guest stopped (not removed) before killing it.
	FSFreezer interface {
		FreezeFS(ctx context.Context) error
		ThawFS(ctx context.Context) error
	}
)
