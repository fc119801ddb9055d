package runtime

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/journal"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// Spec describes a sandbox: in Options as a create asks for it, in
// State as the create resolved it (its class's and policy's limits, its
// host name, its disk bound), which is what it then runs with.
type Spec struct {
	Name string `json:"name"` // "": a primed sandbox's, until taken
	// Backend names the sandbox's backend (package backend), as the
	// worker resolved it; "" is the container backend.
	Backend string        `json:"backend,omitempty"`
	Layers  []string      `json:"layers"` // refs, topmost first: toolkit, workspace, base
	Limits  cgroup.Limits `json:"limits"`
	// Disk bounds what the sandbox writes (its upper), in bytes: the
	// size of a file system of its own (0: none of its own).
	Disk int64 `json:"disk,omitempty"`
	// DiskBound bounds what a sandbox without Disk writes, on the
	// root's uppers file system. Asked: 0 the Host's DiskBound,
	// api.Unlimited only by that file system's size; resolved: the bound
	// (0: that file system's size only).
	DiskBound int64    `json:"disk_bound,omitempty"`
	Hostname  string   `json:"hostname"`          // asked: "" for the name
	Env       []string `json:"env,omitempty"`     // every exec's environment, before its own
	Workdir   string   `json:"workdir,omitempty"` // every exec's default directory
	User      string   `json:"user,omitempty"`    // every exec's default user ("": root)
	// Image names the container image whose layers are at the bottom
	// of Layers (its normalized reference), for those who look.
	Image string `json:"image,omitempty"`
	// From, instead of Layers, starts the sandbox on a snapshot: the
	// snapshot over exactly the layers it was taken on, with the env,
	// workdir and user of the sandbox it was taken from unless Env,
	// Workdir and User are given. Resolved, Layers are those.
	From string `json:"from,omitempty"`
	// Policy holds the sandbox to files, syscall and network rules;
	// asked, nil: the secure default; resolved: the effective policy.
	Policy *api.Policy `json:"policy,omitempty"`
	// Class is api.SchedLatency (the default) or api.SchedBatch.
	Class string `json:"class,omitempty"`
	// MergeMemory lets KSM merge the sandbox's identical anonymous pages.
	MergeMemory bool `json:"merge_memory,omitempty"`
	// What the worker admitted it with, kept for a worker that restarts.
	CPURequest    float64 `json:"cpu_request,omitempty"`
	MemoryRequest int64   `json:"memory_request,omitempty"`
	// Pool names what the sandbox is made for, if not a user's create:
	// a FnCall pool, or the worker's own marks of a call's, a run's (run
	// --rm) or a grader's sandbox. A worker that starts removes these.
	Pool string `json:"pool,omitempty"`
	// UserNS runs the sandbox in a user namespace of its own: its root
	// is an unprivileged user of the host (ids taken per sandbox).
	UserNS bool `json:"userns,omitempty"`
	// Owner is the id of the API token that made it ("": the admin).
	Owner string `json:"owner,omitempty"`
	// DiskOnly starts a microVM on a memory snapshot's files alone, or a
	// full VM on a memory snapshot's disk alone, booted, its processes
	// fresh (by default it continues the snapshot's guest).
	DiskOnly bool `json:"disk_only,omitempty"`
}

// options are a create's: what it asks, on the host it is made on.
type options struct {
	Spec
	*Host
}

// Sandbox states: the API's (one set of names from the state file to
// the SDK).
const (
	Creating = api.StatusCreating // a worker died before finishing: recovery removes it
	Running  = api.StatusRunning
	Stopped  = api.StatusStopped
	Dead     = api.StatusDead // the init died without a stop
)

// State is what survives a worker restart, in <root>/sandboxes/ID/state.json:
// the resolved spec, and what starting it made.
type State struct {
	// ID names the sandbox's directory, cgroup and layer user, for good
	// (ident_linux.go); Spec.Name is the user's label.
	ID string `json:"id,omitempty"`
	Spec
	Status  string   `json:"status"`
	Pid     int      `json:"pid,omitempty"` // the init's host pid
	Digests []string `json:"digests"`
	// UpperFS names the subvolume of the root's uppers file system that
	// holds the upper of a sandbox without Disk.
	UpperFS    string    `json:"upper_fs,omitempty"`
	CgroupName string    `json:"cgroup"` // the group's name
	Created    time.Time `json:"created"`
	// Top is the last snapshot packed from this sandbox: the parent of
	// the next, which then holds only what changed since.
	Top *layer.Lower `json:"top,omitempty"`
	// DiskTop is the number of the top a full VM's disk runs on while
	// that is not its chain's length (a snapshot flattened the chain:
	// driver.DiskSnap.Depth); 0 otherwise, and after a start.
	DiskTop int `json:"disk_top,omitempty"`
	// Allowlist is the policy's egress rules as applied, with the
	// addresses its domain rules learned (Learned).
	Allowlist []policy.Entry `json:"allowlist,omitempty"`
	// Learned are the addresses the sandbox's resolver answered for its
	// domain rules, each allowed until it expires.
	Learned []egress.Learned `json:"learned,omitempty"`
	// Toolkit are the paths the toolkit layers bring, read-only unless
	// the policy lets them be written.
	Toolkit []string `json:"toolkit,omitempty"`
	// NAT is the sandbox's way out in network mode nat.
	NAT *network.NAT `json:"nat,omitempty"`
	// IDs: a UserNS sandbox's ids while it runs (taken at each start,
	// given back at stop: what it wrote is stored unmapped, so a restart
	// may get other ids).
	IDs *container.IDMap `json:"ids,omitempty"`
	// Paused: its processes are frozen until Resume (Pause), across
	// worker restarts; since PausedAt.
	Paused   bool      `json:"paused,omitempty"`
	PausedAt time.Time `json:"paused_at,omitzero"`
	// Hinted: paused by an idle hint (Hint), resumed by the next exec;
	// Ballooned: its guest's balloon took what it did not use then.
	Hinted    bool `json:"hinted,omitempty"`
	Ballooned bool `json:"ballooned,omitempty"`
	// VM is a microVM's machine, as its last start ran it; Machine the
	// same in full, what a memory snapshot of it records.
	VM      *api.VMInfo    `json:"vm,omitempty"`
	Machine *layer.Machine `json:"machine,omitempty"`
	// Saved: a paused microVM's guest is saved in its directory, its
	// memory given back to the host (the worker needed it); resuming it
	// restores it from there.
	Saved *SavedVM `json:"saved,omitempty"`
}

// Sandbox is a sandbox: its layers mounted, its overlay root, its cgroup
// and its init while it runs, and the journal of its execs.
type Sandbox struct {
	mu sync.Mutex // guards State and c, g
	State
	dir  string
	host *Host            // the host it is made on
	d    driver.Driver    // its backend's
	c    backend.Instance // while it runs
	g    *cgroup.Group    // the group every process of it runs in

	// prestarted is the warm instance its driver made ahead for this
	// sandbox's first start (nil: none, or start took it).
	prestarted driver.Warm
	// egress is its worker's egress service (nil: not a worker's, and
	// domain rules fail closed); link its hold on it while its
	// resolver and proxy serve (domain rules); netView its policy as
	// they ask it.
	egress  *network.Egress
	link    *network.Link
	netView atomic.Pointer[network.View]
	// lease holds what a create resolved until its state names it (nil:
	// not being created).
	lease *store.Lease
	// restore starts the instance from a saved guest (a microVM's
	// memory snapshot, or its own eviction), not afresh: start's, once.
	restore *driver.Restore

	journalOnce sync.Once
	// logMade: its results log was made with it, by this worker, before
	// a state synced with its directory (journal.Open's synced).
	logMade bool
	steps   *journal.Journal // its execs (journal)

	active    atomic.Int64 // unix nanoseconds of the last exec's start or end
	running   atomic.Int32 // execs running
	reclaimed time.Time    // guarded by mu
	screen    screenSize   // guarded by mu: its screen as last seen
}

// RandomName is prefix and 12 random hex digits: a name for a sandbox,
// a spare's group or a primed sandbox that no other takes.
func RandomName(prefix string) string { return driver.RandomName(prefix) }

// cgroupName is the group of the sandbox id, unique per root, so that
// two roots on a host (two workers, two test runs) never share a group.
func cgroupName(root, id string) string { return driver.GroupName(root, id) }

// Create composes the layers under an upper on local disk, makes the
// cgroup and starts the init. On any failure everything done so far is
// undone: no mount, cgroup or directory is left behind. A worker killed
// half-way leaves a sandbox in state creating, which Recover removes.
func (h *Host) Create(ctx context.Context, s Spec) (*Sandbox, error) {
	return h.create(ctx, s, h.Primed)
}

// CreateAhead is Create for a sandbox made ahead of need (a pool's): it
// never takes a primed sandbox, which is for the creates users make
// next.
func (h *Host) CreateAhead(ctx context.Context, s Spec) (*Sandbox, error) {
	return h.create(ctx, s, nil)
}

// create checks s's name and makes it on h, taking a sandbox p primed
// if one fits (nil: none).
func (h *Host) create(ctx context.Context, s Spec, p *Primed) (*Sandbox, error) {
	if err := api.ValidName(s.Name); err != nil {
		return nil, err
	}
	h.init()
	return create(ctx, options{Spec: s, Host: h}, p)
}

// create is Create, for a name already checked; with p, o may take a
// sandbox p primed.
func create(ctx context.Context, o options, p *Primed) (_ *Sandbox, err error) {
	root := o.Root
	// What it resolves is leased until its state names it: no removal
	// counts it unused, no collection takes it, meanwhile.
	lease, err := createLease(o.Store)
	if err != nil {
		return nil, err
	}
	defer lease.Release()
	r, err := resolve(ctx, &o, lease)
	if err != nil {
		return nil, err
	}
	d, mem, quota := r.d, r.mem, r.quota
	spec := o.Spec // as resolved:
	spec.Limits, spec.Policy, spec.Disk, spec.DiskBound = r.limits, r.policy, quota, 0
	spec.Hostname, spec.Class = cmp.Or(o.Hostname, o.Name), classOf(o.Class)
	st := State{Spec: spec, Status: Creating, Digests: r.digests, Allowlist: r.allow, Created: time.Now().UTC()}
	if pr, ok := p.recipe(ctx, o, d, r.limits, r.asked); ok {
		if pr := p.take(pr, o.Layers); pr != nil {
			sb, err := takePrimed(pr, root, o, st)
			if err == nil || errdefs.IsAlreadyExists(err) {
				return sb, err
			}
			// made anew, as if none had been primed
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "sandboxes"), 0o700); err != nil {
		return nil, err
	}
	sb := &Sandbox{State: st, host: o.Host, d: d, egress: o.Drivers.Egress(), lease: lease}
	defer func() { sb.lease = nil }() // released: its state names what it stands on
	sb.ID = sb.newID()
	sb.dir, sb.CgroupName = sandboxDir(root, sb.ID), cgroupName(root, sb.ID)
	sb.Hostname = cmp.Or(sb.Hostname, sb.ID) // primed: named when taken
	if err := os.Mkdir(sb.dir, 0o700); err != nil {
		sb.dropPrestarted()
		return nil, err
	}
	if bound := cmp.Or(o.Spec.DiskBound, o.Host.DiskBound); quota == 0 && bound != 0 {
		// Named before the state is saved: teardown removes it.
		sb.UpperFS, sb.DiskBound = disk.NewUpperName(), max(bound, 0)
	}
	sb.touch()
	defer func() {
		if err != nil {
			sb.teardown(true)
		}
	}()
	if err := sb.save(); err != nil {
		return nil, err
	}
	if sb.Name != "" {
		if err := claimName(root, sb.Name, sb.ID); err != nil {
			return nil, err
		}
	}
	release, err := sb.makeDirs(ctx, root, o, mem, quota)
	defer release()
	if err != nil {
		return nil, err
	}
	// The results log now, so that the synced state after the start
	// syncs its name too, and the sandbox's first exec needs no more.
	if f, err := os.OpenFile(filepath.Join(sb.dir, resultsLog), os.O_CREATE|os.O_WRONLY, 0o600); err == nil {
		f.Close()
		sb.logMade = true
	}
	if err := sb.start(ctx); err != nil {
		if o.From != "" && errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("snapshot %s stands on a layer this host cannot find (pull it: dsec layer pull): %w", o.From, err)
		}
		return nil, err
	}
	if mem != nil {
		if err := sb.tightenRestored(ctx, mem.Policy); err != nil {
			return nil, err
		}
	}
	sb.resolvConf()
	return sb, nil
}

// makeDirs makes the sandbox's directories and what its upper is on: a
// memory snapshot's disk restored, a disk of its own (quota), or its
// part of the root's shared file system. The caller calls release once
// the sandbox has started: a memory snapshot's blobs stay while they are
// fetched and the guest reads them (a collection waits).
func (sb *Sandbox) makeDirs(ctx context.Context, root string, o options, mem *layer.Memory, quota int64) (release func(), err error) {
	release = func() {}
	dirs := []string{"rootfs", "execs", "upper", "work"}
	switch {
	case mem != nil: // the snapshot's disk
		dirs = dirs[:2]
		if release, err = o.Store.Writer(); err != nil {
			return func() {}, err
		}
		if err := sb.restoreFrom(ctx, o.From, mem); err != nil {
			return release, err
		}
	case quota > 0: // upper and work are made on the quota when it is mounted
		dirs = dirs[:2]
		if err := disk.Make(sb.dir, quota); err != nil {
			return release, err
		}
	case sb.UpperFS != "":
		dirs = dirs[:2]
		if err := disk.NewUpper(root, sb.UpperFS, sb.DiskBound); err != nil {
			return release, err
		}
	}
	for _, d := range dirs {
		if err := os.Mkdir(filepath.Join(sb.dir, d), 0o755); err != nil {
			return release, err
		}
	}
	return release, nil
}

// acquire holds what sb stands on, leased: its layers mounted (lowers,
// with their images and kinds), or the base of its own kind resolved
// (images: its files). The caller calls release once the driver's Start
// has the base's lazily served files open.
func (sb *Sandbox) acquire(ctx context.Context) (lowers, images []string, kinds []layer.Kind, release func(), err error) {
	var digests []string
	release = func() {}
	if err := leased(sb.host.Store, sb.lease, func() ([]string, error) {
		if b, ok := sb.d.(driver.BaseResolver); ok { // its own base, no layers
			base, err := b.ResolveBase(ctx, sb.host.baseSource(), sb.Layers[0], sb.Digests)
			if base.Release != nil {
				release = base.Release
			}
			digests, images = base.Digests, base.Files
			if base.Saved != nil && sb.Status == Creating && !sb.DiskOnly && sb.restore == nil {
				// A saved guest's base: the new sandbox continues it.
				sb.restore = base.Saved
			}
			return digests, err
		}
		for i, ref := range sb.Layers {
			want := ""
			if len(sb.Digests) > i {
				want = sb.Digests[i]
			}
			mnt, f, err := sb.host.Lowers().Acquire(ctx, sb.host.Source(), ref, sb.lowerUser(), want)
			if err != nil {
				return digests, err
			}
			lowers = append(lowers, mnt)
			digests = append(digests, f.Digest)
			img := f.Image
			if _, guest := sb.d.(driver.ImageUpper); guest && img == "" && f.Whole != nil {
				// A guest maps each layer as one file: a store's layer,
				// made again once per host if the store packs it.
				if img, err = f.Whole(); err != nil {
					return digests, err
				}
			}
			images = append(images, img)
			kinds = append(kinds, f.Kind)
		}
		return digests, nil
	}); err != nil {
		return lowers, images, kinds, release, err
	}
	sb.Digests = digests
	return lowers, images, kinds, release, nil
}

// start mounts the layers and the overlay, makes the cgroup and starts
// the init: creating a sandbox, or starting a stopped one on its upper.
func (sb *Sandbox) start(ctx context.Context) error {
	if sb.d == nil {
		return fmt.Errorf("sandbox %s: unknown backend %q: a newer dsec's to start: %w", sb.Name, sb.Backend, errdefs.ErrNotImplemented)
	}
	root := sb.root()
	lowers, images, kinds, release, err := sb.acquire(ctx)
	defer release()
	if err != nil {
		return err
	}
	if _, guest := sb.d.(driver.ImageUpper); sb.Disk > 0 && !guest {
		if err := disk.Mount(sb.dir, sb.Status == Creating); err != nil {
			return err
		}
	}
	if sb.UpperFS != "" { // after a reboot, say
		if _, err := disk.MountUppers(root, 0); err != nil {
			return err
		}
	}
	if sb.Policy == nil { // made by a dsec without policies
		sb.Policy = policy.Effective(nil)
		if sb.Allowlist, err = allowlist(sb.Policy, nil); err != nil {
			return err
		}
	}
	restrict, err := restrictions(sb.Policy)
	if err != nil {
		return err
	}
	// Held before the first command: the toolkit and the policy's
	// read-only and hidden paths.
	if sb.Toolkit, err = toolkitPaths(lowers, kinds); err != nil {
		return err
	}
	readOnly := sb.Policy.Files.ReadOnly
	if !sb.Policy.Files.ToolkitWritable {
		readOnly = append(slices.Clip(sb.Toolkit), readOnly...)
	}
	var rootfs []mount.Mount
	if !ownBase(sb.d) {
		ov := mount.Overlay(lowers, sb.Upper(), sb.work())
		ov.Options = append(ov.Options, "nodev") // a node made in the sandbox never opens
		rootfs = []mount.Mount{ov}
	}
	s := driver.StartSpec{Handle: sb.handle(), Hostname: sb.Hostname, RootFS: rootfs, Images: images, Layers: sb.Layers,
		Digests: sb.Digests, Limits: sb.Limits, Allowlist: sb.Allowlist, NAT: sb.Policy.Network.Mode == api.NetworkNAT,
		MergeMemory: sb.MergeMemory, Restrict: restrict, ReadOnly: readOnly, Hidden: sb.Policy.Files.Hidden, Warm: sb.prestarted,
		Upper: sb.Upper(), DiskTop: sb.DiskTop}
	sb.prestarted = nil // the driver's now
	s.Restore, sb.restore = sb.restore, nil
	started, err := sb.d.Start(ctx, s)
	sb.took(started)
	if err != nil {
		return err
	}
	sb.DiskTop = 0 // (its top renumbered the chain's: saved below)
	if err := sb.startDNS(sb.Policy); err != nil {
		return err
	}
	if r := s.Restore; r != nil && r.Branch && r.Policy != nil {
		if err := sb.tightenRestored(ctx, r.Policy); err != nil {
			return err
		}
	}
	sb.Status = Running
	return sb.save()
}

// ownBase says whether d's sandboxes boot a base of their own, not
// layers (driver.BaseResolver).
func ownBase(d driver.Driver) bool {
	_, ok := d.(driver.BaseResolver)
	return ok
}

// resultsLog is the file in a sandbox's directory its execs' results are
// appended to (package journal).
const resultsLog = "results.log"

// save writes the state atomically and durably. Some states are written
// only atomically, as their loss in a crash changes nothing: a sandbox's
// first, while it is being made (lost, it leaves a directory without a
// state, which Load removes as it would the state), and every state of
// a sandbox a worker that starts removes whatever its state says: a
// pool's, a call's or a run's (Spec.Pool), and one no name points at (a
// primed one, made ahead for the next create).
func (sb *Sandbox) save() error {
	b, _ := json.MarshalIndent(sb.State, "", "  ")
	p := filepath.Join(sb.dir, "state.json")
	if sb.Status == Creating || sb.Pool != "" || sb.Name == "" {
		return durable.Replace(p, b, 0o600)
	}
	return durable.WriteFile(p, b, 0o600)
}

// Load re-adopts a sandbox a previous worker created: a running one's
// init is attached again (a sandbox whose init is gone is Dead), and the
// results of execs that were running when that worker died are collected
// as they finish. A sandbox a worker died creating is removed, and Load
// says it does not exist.
func (h *Host) Load(name string) (*Sandbox, error) {
	if err := api.ValidName(name); err != nil {
		return nil, err
	}
	h.init()
	root, ds := h.Root, h.Drivers
	id := IDOf(root, name)
	if id == "" {
		return nil, fmt.Errorf("no sandbox %s: %w", name, errdefs.ErrNotFound)
	}
	dir := sandboxDir(root, id)
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err == nil && len(bytes.TrimRight(b, "\x00")) == 0 {
		// Emptied by a crash: only a state written without waiting for
		// the disk (save) can be, and such a sandbox is removed anyway.
		err = os.ErrNotExist
	}
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(dir); serr == nil { // an older dsec died before its first state, or a crash emptied it
			sb := unloaded(h, id)
			sb.Name = name
			sb.teardown(true)
		} else if err := dropName(root, name, id); err != nil { // a worker died removing it
			return nil, err
		}
		return nil, fmt.Errorf("no sandbox %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	sb := &Sandbox{dir: dir, host: h, egress: ds.Egress()}
	if fi, err := os.Stat(filepath.Join(dir, "execs")); err == nil { // its last exec began then
		sb.active.Store(fi.ModTime().UnixNano())
	}
	if err := json.Unmarshal(b, &sb.State); err != nil {
		return nil, fmt.Errorf("sandbox %s: state: %v: %w", name, err, errdefs.ErrDataLoss)
	}
	sb.ID = id // an older dsec's records none: its name
	// A backend this worker lacks (a newer dsec's): the sandbox is
	// listed, and only a running one is refused.
	d, derr := ds.Driver(sb.Backend)
	sb.d = d
	switch sb.Status {
	case Creating:
		sb.teardown(true)
		return nil, fmt.Errorf("no sandbox %s (a worker died creating it; removed): %w", name, errdefs.ErrNotFound)
	case Running:
		if derr != nil {
			return nil, fmt.Errorf("sandbox %s: %w", name, derr)
		}
		if err := sb.attach(context.Background()); err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", name, err)
		}
		if sb.c == nil && !sb.Paused {
			sb.Status = Dead
		}
		if sb.Status == Running {
			if err := sb.startDNS(sb.Policy); err != nil {
				slog.Warn("the sandbox's resolver did not start: its names do not resolve", "sandbox", name, "err", err)
			}
		}
	}
	if !sb.Paused { // a paused one's execs are recovered when it resumes
		sb.journal().Recover(sb.c)
	}
	return sb, nil
}

// touch marks the sandbox active now.
func (sb *Sandbox) touch() { sb.active.Store(time.Now().UnixNano()) }

// Idle is how long no exec started or ended in the sandbox (its
// background processes may run); zero while an exec runs.
func (sb *Sandbox) Idle() time.Duration {
	if sb.running.Load() > 0 {
		return 0
	}
	return time.Since(time.Unix(0, sb.active.Load()))
}

// Reclaim takes back the memory the kernel can of a running sandbox: its
// page cache, and (on cgroup v2 with swap) cold anonymous memory.
func (sb *Sandbox) Reclaim() error {
	sb.mu.Lock()
	g := sb.g
	sb.mu.Unlock()
	if g == nil {
		return fmt.Errorf("sandbox %s is not running: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if err := g.Reclaim(); err != nil {
		return err
	}
	sb.mu.Lock()
	sb.reclaimed = time.Now().UTC()
	sb.mu.Unlock()
	return nil
}

// Reclaimed is when Reclaim last ran (zero: never, in this worker).
func (sb *Sandbox) Reclaimed() time.Time {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.reclaimed
}

// Dir is the sandbox's directory.
func (sb *Sandbox) Dir() string { return sb.dir }

// Upper is the directory holding everything the sandbox wrote.
func (sb *Sandbox) Upper() string { return filepath.Join(sb.base(), "upper") }

// work is overlay's work directory, on the upper's file system.
func (sb *Sandbox) work() string { return filepath.Join(sb.base(), "work") }

// base holds the upper and work directories: the disk with a quota,
// the subvolume on the root's uppers file system.
func (sb *Sandbox) base() string {
	switch {
	case sb.Disk > 0:
		return disk.Dir(sb.dir)
	case sb.UpperFS != "":
		return filepath.Join(disk.UppersDir(sb.root()), sb.UpperFS)
	}
	return sb.dir
}

// root is the root the sandbox is made under.
func (sb *Sandbox) root() string { return filepath.Dir(filepath.Dir(sb.dir)) }

// RootFS is the sandbox's composed root, as the host sees it.
func (sb *Sandbox) RootFS() string { return filepath.Join(sb.dir, "rootfs") }

// Current returns a copy of the state now. A running sandbox whose
// init died is Dead from then on.
func (sb *Sandbox) Current() State {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.noteDeath()
	return sb.State
}

// noteDeath marks a running sandbox whose init died Dead; sb.mu is held.
func (sb *Sandbox) noteDeath() {
	if sb.Status == Running && sb.c != nil {
		select {
		case <-sb.c.Done():
			sb.Status = Dead
			sb.save()
		default:
		}
	}
}

// Cgroup is the sandbox's control group, nil when it is not running.
func (sb *Sandbox) Cgroup() *cgroup.Group {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.g
}

// Close lets go of the sandbox, which keeps running.
func (sb *Sandbox) Close() error {
	sb.mu.Lock()
	c := sb.c
	sb.c = nil
	sb.mu.Unlock()
	if c != nil {
		return c.Close()
	}
	return nil
}

// lowerUser is the name the sandbox holds its layers by: its ID.
func (sb *Sandbox) lowerUser() string { return sb.ID }

// slot names the sandbox among every root's on this host (the key of
// its subnet and id range): its directory's absolute path. (State.Owner
// is another thing: the token that made it.)
func (sb *Sandbox) slot() string {
	abs, _ := filepath.Abs(sb.dir)
	return abs
}
