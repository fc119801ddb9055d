package runtime

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/lower"
	"github.com/dsec-project/dsec/internal/runtime/sparse"
)

// Memory snapshots: a microVM's guest saved whole, devices, RAM and
// disk, and started again where it stopped, by a branch of the snapshot
// (the store's blobs) or by the sandbox itself once the worker evicted
// it, paused, to give its memory back (files in its directory).

// SavedVM is a paused microVM evicted to its directory: its device
// state and RAM image there (its disk is its own, as it was), and the
// nonce its agent waits for. Its machine is the state's Machine.
type SavedVM struct {
	Nonce string `json:"nonce"`
	RAM   bool   `json:"ram,omitempty"` // a RAM image beside the state
}

// saveTo has sb's running guest save itself into the files state, ram
// and disk (any may be a store's ingest), and returns what it took;
// with stop it stays stopped, and disk may be nil (see VM.Snapshot).
func saveTo(ctx context.Context, sb *Sandbox, state, ram, disk *os.File, stop bool) (*initproto.SnapshotInfo, error) {
	ms, ok := sb.d.(driver.MemorySnapshotter)
	if !ok {
		return nil, fmt.Errorf("the %s backend keeps no memory in a snapshot: %w", sb.backendName(), errdefs.ErrNotImplemented)
	}
	if sb.Machine == nil {
		return nil, fmt.Errorf("sandbox %s was started by an older dsec, which recorded no machine: stop and start it, then snapshot it: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	return ms.SaveGuest(ctx, sb.handle(), state, ram, disk, stop)
}

// snapshotMemory saves sb's guest into blobs of s, with its upper frozen
// by the caller (driver.UpperHolder) and left so.
func snapshotMemory(ctx context.Context, sb *Sandbox, s *store.Store) (*layer.Memory, time.Duration, error) {
	var ins [3]*store.Ingest
	for i := range ins {
		in, err := s.NewIngest()
		if err != nil {
			return nil, 0, err
		}
		defer in.Abort()
		ins[i] = in
	}
	info, err := saveTo(ctx, sb, ins[0].File, ins[1].File, ins[2].File, false)
	if err != nil {
		return nil, 0, err
	}
	commit := func(in *store.Ingest, mt string) (ocispec.Descriptor, error) {
		d, err := in.Commit("")
		d.MediaType = mt
		return d, err
	}
	m := &layer.Memory{Machine: *sb.Machine, DiskBytes: sb.Disk, Policy: sb.Policy, Nonce: info.Nonce}
	for i, ref := range sb.Layers {
		m.Layers = append(m.Layers, layer.Lower{Ref: ref, Digest: digest.Digest(sb.Digests[i])})
	}
	if m.State, err = commit(ins[0], layer.MediaTypeVMState); err != nil {
		return nil, 0, err
	}
	if m.RAMFile {
		ram, err := commit(ins[1], layer.MediaTypeVMRAM)
		if err != nil {
			return nil, 0, err
		}
		m.RAM = &ram
	}
	if m.Disk, err = commit(ins[2], layer.MediaTypeVMDisk); err != nil {
		return nil, 0, err
	}
	return m, time.Duration(info.PausedNS), nil
}

// MemoryOf is the memory snapshot ref holds, nil for a disk-only
// snapshot: a worker makes its branches microVMs by default, of its
// guest's RAM.
func (h *Host) MemoryOf(ctx context.Context, ref string) (*layer.Memory, error) {
	l, _, err := lower.Lineage(ctx, h.Source(), ref)
	if err != nil {
		return nil, err
	}
	return l.Memory, nil
}

// restoreFrom prepares sb, being created from the memory snapshot ref,
// to start from it: its blobs in the local store (fetched from the
// remote if need be), its disk the snapshot's, and start's restore set.
func (sb *Sandbox) restoreFrom(ctx context.Context, ref string, mem *layer.Memory) error {
	m := sb.host
	var missing []ocispec.Descriptor
	for _, d := range mem.Blobs() {
		if !m.Store.Exists(d.Digest) {
			missing = append(missing, d)
		}
	}
	if len(missing) > 0 {
		r, err := layer.ParseRef(ref)
		if err != nil {
			return err
		}
		if m.Remote == nil {
			return fmt.Errorf("snapshot %s: its memory is not in this host's store: pull it (dsec layer pull %s): %w", ref, ref, errdefs.ErrNotFound)
		}
		if _, err := remote.CopyBlobs(ctx, m.Remote, remote.Local(m.Store), r, missing, nil); err != nil {
			return fmt.Errorf("snapshot %s: fetch its memory: %w", ref, err)
		}
	}
	if err := readImage(m.Store.BlobPath(mem.Disk.Digest), disk.Image(sb.dir)); err != nil {
		return fmt.Errorf("snapshot %s: its disk: %w", ref, err)
	}
	sb.restore = &driver.Restore{What: "snapshot " + ref, Machine: mem.Machine, State: m.Store.BlobPath(mem.State.Digest),
		Nonce: mem.Nonce, Branch: true}
	if mem.RAM != nil {
		sb.restore.RAM = m.Store.BlobPath(mem.RAM.Digest)
	}
	return nil
}

// readImage makes the file dst from the sparse image src.
func readImage(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := sparse.Read(out, in); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}

// tightenRestored holds a guest restored from a saved one to its own
// policy: the saved guest's file and syscall rules are in its memory,
// and a branch may only add to them (as dsec policy apply does).
func (sb *Sandbox) tightenRestored(ctx context.Context, was *api.Policy) error {
	if was == nil {
		return nil
	}
	if err := policy.Tightens(was, sb.Policy); err != nil {
		return fmt.Errorf("the saved guest holds its sandbox's policy in its memory, which a branch may only add to: %w", err)
	}
	if err := sb.tighten(ctx, was, sb.Policy, &api.PolicyReport{}); err != nil {
		return fmt.Errorf("the saved guest's policy: %w", err)
	}
	return nil
}

// Eviction: a paused microVM's guest saved to its directory.
const (
	savedState = "saved.state"
	savedRAM   = "saved.ram"
)

// Evictable says whether the sandbox's backend can evict it (Evict).
func (sb *Sandbox) Evictable() bool {
	_, ok := sb.d.(driver.MemorySnapshotter)
	return ok
}

// Evict pauses a running microVM (a paused one stays so), saves its
// guest to its directory and ends its instance, giving its memory back
// to the host; Resume restores it. The worker evicts paused microVMs
// when the host needs their memory.
func (sb *Sandbox) Evict(ctx context.Context) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if _, ok := sb.d.(driver.MemorySnapshotter); !ok {
		return fmt.Errorf("the %s backend keeps a sandbox's memory in its processes alone: sandbox %s cannot be evicted (pause it): %w",
			sb.backendName(), sb.Name, errdefs.ErrNotImplemented)
	}
	if sb.Saved != nil {
		return nil
	}
	if !sb.Paused {
		if err := sb.pause(); err != nil {
			return err
		}
	}
	if sb.g == nil {
		return fmt.Errorf("sandbox %s has no running guest to evict: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if sb.c == nil { // paused when this worker found it: attached now
		if err := sb.g.Thaw(); err != nil {
			return err
		}
		h := sb.handle()
		h.Paused = false
		s, err := sb.d.Attach(ctx, h)
		if err == nil && s.Instance == nil {
			err = errors.New("its guest does not answer")
		}
		if err != nil {
			sb.g.Freeze()
			return fmt.Errorf("sandbox %s has no running guest to evict: %v: %w", sb.Name, err, errdefs.ErrFailedPrecondition)
		}
		sb.c = s.Instance
	}
	var files [2]*os.File
	for i, n := range []string{savedState, savedRAM} {
		f, err := os.OpenFile(filepath.Join(sb.dir, n), os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o600)
		if err != nil {
			return err
		}
		defer f.Close()
		files[i] = f
	}
	drop := func() {
		os.Remove(filepath.Join(sb.dir, savedState))
		os.Remove(filepath.Join(sb.dir, savedRAM))
	}
	if err := sb.g.Thaw(); err != nil {
		drop()
		return err
	}
	// The guest stays stopped once saved: its disk, the sandbox's own,
	// is then as its saved memory knows it.
	info, err := saveTo(ctx, sb, files[0], files[1], nil, true) // synced
	if err != nil {
		drop()
		if ferr := sb.g.Freeze(); ferr != nil {
			err = errors.Join(err, ferr)
		}
		return fmt.Errorf("evict sandbox %s: %w", sb.Name, err)
	}
	sb.Saved = &SavedVM{Nonce: info.Nonce, RAM: sb.Machine.RAMFile}
	if !sb.Saved.RAM {
		os.Remove(filepath.Join(sb.dir, savedRAM))
	}
	if err := sb.save(); err != nil {
		sb.Saved = nil
		drop()
		sb.g.Freeze()
		return err
	}
	// Its instance goes (its guest stopped: nothing to flush); its
	// disk and name stay.
	errs := sb.teardownInstance(false)
	sb.Pid = 0
	if err := sb.save(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return fmt.Errorf("evict sandbox %s: %w", sb.Name, errors.Join(errs...))
	}
	return nil
}

// resumeSaved restores an evicted guest from its directory; sb.mu is
// held. A guest that fails to restore stays saved, and paused.
func (sb *Sandbox) resumeSaved(ctx context.Context) error {
	if sb.host.Store == nil {
		return fmt.Errorf("sandbox %s was evicted: resume it through its worker: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if sb.Machine == nil {
		return fmt.Errorf("sandbox %s's saved guest names no machine: %w", sb.Name, errdefs.ErrDataLoss)
	}
	sb.restore = &driver.Restore{What: fmt.Sprintf("sandbox %s's saved guest", sb.Name), Machine: *sb.Machine,
		State: filepath.Join(sb.dir, savedState), Nonce: sb.Saved.Nonce}
	if sb.Saved.RAM {
		sb.restore.RAM = filepath.Join(sb.dir, savedRAM)
	}
	sb.Paused, sb.Hinted = false, false
	if err := sb.start(ctx); err != nil {
		sb.restore = nil
		errs := sb.teardownInstance(false)
		sb.Paused, sb.Pid = true, 0
		return errors.Join(fmt.Errorf("resume sandbox %s: %w", sb.Name, err), errors.Join(errs...), sb.save())
	}
	sb.dropSaved()
	sb.unsqueeze(ctx) // (a guest a hint squeezed was saved so)
	return sb.save()
}

// dropSaved forgets an evicted guest (the sandbox was stopped, or its
// guest restored).
func (sb *Sandbox) dropSaved() {
	if sb.Saved == nil {
		return
	}
	os.Remove(filepath.Join(sb.dir, savedState))
	os.Remove(filepath.Join(sb.dir, savedRAM))
	sb.Saved = nil
}

// GuestMemory is a running microVM's memory as its guest's balloon last
// reported it (nil: no running microVM, or no report yet).
func (sb *Sandbox) GuestMemory(ctx context.Context) *initproto.GuestMemory {
	sb.mu.Lock()
	vm, _ := sb.c.(driver.MemoryReporter)
	paused := sb.Paused
	sb.mu.Unlock()
	if vm == nil || paused {
		return nil
	}
	m, err := vm.Memory(ctx)
	if err != nil {
		return nil
	}
	return m
}
