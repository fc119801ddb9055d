package runtime

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// microvmDriver runs the microvm backend's sandboxes: a QEMU guest per
// sandbox (package microvm builds its command line, kernel and
// initramfs), its layers virtio-pmem devices over their images (one
// page cache for every guest on a layer, read through DAX), its upper
// an ext4 disk image of its own (the --disk image, bounded by its size),
// and its agent dsec-init, reached through the guest's shim (package
// container's VM), which speaks the init protocol as a container's init
// does. QEMU and its shim live in the sandbox's cgroup, so admission,
// classes, limits, freezing and figures are the same as a container's.
type microvmDriver struct{}

// MicroVM is the microvm backend's name.
const MicroVM = "microvm"

func (microvmDriver) Name() string { return MicroVM }

// Available says what the host lacks to run microVMs.
func (microvmDriver) Available() error {
	_, err := MicroVMHost()
	return err
}

// vmSettings are the worker's microvm settings (SetMicroVM).
var (
	vmMu       sync.Mutex
	vmSettings microvm.Settings
	vmResolved *microvm.Host
)

// SetMicroVM configures the microvm backend (a worker does, as it
// starts, from its config's microvm:).
func SetMicroVM(s microvm.Settings) {
	vmMu.Lock()
	defer vmMu.Unlock()
	vmSettings, vmResolved = s, nil
}

// MicroVMHost is what this host runs microVMs with, resolved once (an
// error says what it lacks, and is asked again next time).
func MicroVMHost() (*microvm.Host, error) {
	vmMu.Lock()
	defer vmMu.Unlock()
	if vmResolved != nil {
		return vmResolved, nil
	}
	h, err := microvm.Resolve(vmSettings)
	if err != nil {
		return nil, err
	}
	vmResolved = h
	return h, nil
}

func (microvmDriver) newID(*Sandbox, Mounter) string { return newID() }

// imageUpper: the sandbox's upper is a disk image its guest mounts,
// never the host (package disk makes it; the guest formats nothing).
func (microvmDriver) imageUpper() bool { return true }

// pausesWarm: a guest made ahead of need waits paused (frozen in its
// group: no CPU for its kernel's timers).
func (microvmDriver) pausesWarm() bool { return true }

// minGuestMemory is the least RAM a guest boots in with room to spare.
const minGuestMemory = 128 << 20

// guestMemory is the guest's RAM for a sandbox's memory limit (none:
// 2 GiB), whole MiB.
func guestMemory(l cgroup.Limits) (int64, error) {
	m := l.MemoryBytes
	if m <= 0 {
		m = 2 << 30
	}
	if m < minGuestMemory {
		return 0, fmt.Errorf("a microVM needs at least %d MiB of memory, not %d MiB: give --memory 128M or more: %w", minGuestMemory>>20, m>>20, errdefs.ErrInvalidArgument)
	}
	return (m + 1<<20 - 1) &^ (1<<20 - 1), nil
}

// guestCPUs are the guest's vCPUs for a CPU limit: as many as it may
// use, at least one, at most the host's.
func guestCPUs(l cgroup.Limits) int {
	n := int((l.CPUMilli + 999) / 1000)
	return max(1, min(n, numCPU()))
}

func (d microvmDriver) start(ctx context.Context, sb *Sandbox, m Mounter, s startSpec) error {
	h, err := MicroVMHost()
	if err != nil {
		return err
	}
	if sb.UserNS {
		return fmt.Errorf("a microVM's guest has a kernel of its own: --userns is for containers: %w", errdefs.ErrInvalidArgument)
	}
	if len(s.images) > container.MaxLayers {
		return fmt.Errorf("%d layers: a microVM takes %d at most: fold the snapshot chain with dsec snap squash: %w", len(s.images), container.MaxLayers, errdefs.ErrOutOfRange)
	}
	dir := filepath.Join(sb.root(), "microvm")
	initrd, err := microvm.Initramfs(dir, h.Kernel, h.Agent)
	if err != nil {
		return err
	}
	var pmem []microvm.Pmem
	for i, img := range s.images {
		p, size, err := microvm.PmemImage(filepath.Join(dir, "pmem"), digest.Digest(sb.Digests[i]).Encoded(), img)
		if err != nil {
			return fmt.Errorf("layer %s: %w", sb.Layers[i], err)
		}
		pmem = append(pmem, microvm.Pmem{Path: p, Size: size})
	}
	ram, err := guestMemory(sb.Limits)
	if err != nil {
		return err
	}
	build, err := h.Build()
	if err != nil {
		return err
	}
	this := layer.Machine{MemoryBytes: ram, CPUs: guestCPUs(sb.Limits), LayerDisks: h.LayerDisks, RAMFile: !sb.MergeMemory,
		Accel: h.Accel.Name, Kernel: h.Kernel.String(), KernelDigest: build.Kernel, QEMU: h.QEMUVersion, QEMUDigest: build.QEMU}
	r := sb.restore
	sb.restore = nil
	if r != nil {
		// The saved guest's machine, on this host's.
		if why := r.machine.Runs(this); why != "" {
			return fmt.Errorf("%s cannot run here: %s: %w", r.what, why, errdefs.ErrFailedPrecondition)
		}
		if r.machine.MemoryBytes != ram {
			return fmt.Errorf("%s has %d MiB of RAM, not the %d MiB asked: give --memory %dM or none: %w",
				r.what, r.machine.MemoryBytes>>20, ram>>20, r.machine.MemoryBytes>>20, errdefs.ErrInvalidArgument)
		}
		this.CPUs, this.RAMFile, this.MAC = r.machine.CPUs, r.machine.RAMFile, r.machine.MAC
	}
	if host := hostMemory(); ram > host {
		return fmt.Errorf("a microVM of %d MiB is more than this host's memory (%d MiB): ask for less: %w", ram>>20, host>>20, errdefs.ErrInvalidArgument)
	}
	// The group holds the guest's RAM and QEMU's own memory.
	lim := sb.Limits
	if lim.MemoryBytes > 0 {
		lim.MemoryBytes = ram + h.Overhead()
	}
	var extra []policy.Device
	if h.Accel.Name == microvm.AccelKVM {
		extra = append(extra, policy.KVM)
	}
	g, devices, err := newGroup(sb.CgroupName, lim, extra...)
	if err != nil {
		return err
	}
	sb.g = g
	defer devices() // never left writing to a group teardown removes
	// QEMU reaches nothing: it has a network namespace of its own, and
	// the sandbox's egress rules hold it too.
	if err := policy.ApplyNetwork(g.Path(), nil, sb.Allowlist); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(sb.dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	mach := microvm.Machine{QEMU: h.QEMU, Accel: h.Accel.Name, CPUs: this.CPUs, Memory: ram, Kernel: h.Kernel.Vmlinux(),
		Initrd: initrd, Layers: pmem, Upper: disk.Image(sb.dir), Direct: directIO(disk.Image(sb.dir)), AgentFD: 3, QMPFD: 4, LayerDisks: h.LayerDisks,
		NoFreePageReporting: h.NoFreePageReporting}
	seed := make([]byte, 64)
	rand.Read(seed)
	spec := container.VMSpec{BootTimeout: h.BootTimeout, Accel: h.Accel.Name,
		Guest:  container.GuestSpec{Layers: len(pmem), LayerDisks: h.LayerDisks, Hostname: sb.Hostname, Restrictions: s.restrict, ReadOnly: s.readOnly, Hidden: s.hidden, Seed: seed},
		Socket: filepath.Join(sb.dir, "init.sock"), FilesSocket: filepath.Join(sb.dir, "files.sock"), Console: filepath.Join(sb.dir, "console.log"),
		Stderr: logf, Setup: g.Add, Idle: sb.Limits.Idle, MergeMemory: sb.MergeMemory, RAM: this.RAMFile, Disk: disk.Image(sb.dir)}
	next := 5 // QEMU's next fd: the tap's, then the RAM's
	if sb.Policy.Network.Mode == api.NetworkNAT {
		if r != nil && r.machine.MAC == "" {
			return fmt.Errorf("%s had no network device: a sandbox of network mode nat cannot run it (give another policy, or start on its files alone: --disk-only): %w", r.what, errdefs.ErrInvalidArgument)
		}
		// A tap on the host, the guest's NIC its other end: the guest
		// has the sandbox's address, and what it sends passes the
		// tap's filter (the sandbox's allowlist) and the host's guards.
		nat, tap, err := network.UpTap(sb.owner())
		if err != nil {
			return err
		}
		defer tap.Close() // QEMU holds it
		sb.NAT = nat
		if err := policy.ApplyTap(g.Path(), nat.Link); err != nil {
			return err
		}
		mach.NetFD, mach.MAC, this.MAC = next, nat.MAC(), nat.MAC()
		next++
		spec.Tap, spec.Guest.Net = tap, &container.GuestNet{Addr: nat.Sandbox + "/30", Gateway: nat.Host, MAC: nat.MAC()}
	} else if r != nil && r.machine.MAC != "" {
		// Its NIC stays, on no network.
		mach.Unplugged, mach.MAC = true, r.machine.MAC
	}
	if this.RAMFile {
		mach.RAMFD = next
	}
	if r != nil {
		state, err := os.Open(r.state)
		if err != nil {
			return fmt.Errorf("%s: its device state: %w", r.what, err)
		}
		defer state.Close()
		mach.Incoming, spec.State = true, state
		spec.Restore = &container.VMRestore{Nonce: r.nonce, RAM: r.ram}
		spec.Guest.Thaw, spec.Guest.Forget = true, r.branch
	}
	spec.Argv = mach.Args()
	vm, err := container.StartVM(spec)
	if err != nil { // the guest failed: the host's, never the request's
		return fmt.Errorf("start microVM: %v: %w", err, errdefs.ErrUnavailable)
	}
	sb.c, sb.Pid = vm, vm.Pid()
	sb.VM = &api.VMInfo{Accel: h.Accel.Name, Kernel: h.Kernel.String(), QEMU: h.QEMUVersion}
	sb.Machine = &this
	if err := devices(); err != nil {
		return fmt.Errorf("device allowlist: %w", err)
	}
	return nil
}

// directIO says whether img's file system takes O_DIRECT (tmpfs does
// not): the guest's disk then bypasses the host's page cache, which
// would hold a second copy of what the guest caches.
func directIO(img string) bool {
	f, err := os.OpenFile(img, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

func (microvmDriver) attach(sb *Sandbox) error {
	sb.g, _ = cgroup.Open(sb.CgroupName)
	if sb.g != nil && sb.g.Frozen() && !sb.Paused { // a worker died packing it
		sb.g.Thaw()
	}
	if sb.Paused {
		return nil
	}
	if vm, err := container.AttachVM(filepath.Join(sb.dir, "init.sock"), filepath.Join(sb.dir, "files.sock"), sb.Pid); err == nil {
		sb.c = vm
	}
	return nil
}

func (microvmDriver) teardown(sb *Sandbox, keep bool) []error {
	var errs []error
	if vm, ok := sb.c.(*container.VM); ok && keep {
		// Stopped, not removed: the guest's writes reach its disk
		// before the guest goes.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		vm.FreezeFS(ctx)
		cancel()
	}
	errs = append(errs, sb.killInstance()...)
	for _, s := range []string{"init.sock", "files.sock"} {
		if err := os.Remove(filepath.Join(sb.dir, s)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errs
}

func (microvmDriver) files(sb *Sandbox) (backend.Files, error) {
	sb.mu.Lock()
	vm, _ := sb.c.(*container.VM)
	sb.mu.Unlock()
	if vm == nil {
		return nil, fmt.Errorf("sandbox %s has no running guest: start it first: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	return vm.Files()
}

// holdUpper makes a running guest's upper consistent on its disk image
// (the guest flushes and freezes its file system) and mounts the image
// read-only on the host until release, which thaws the guest's file
// system: what pack-diff reads, while the sandbox is frozen too.
func (microvmDriver) holdUpper(ctx context.Context, sb *Sandbox) (string, func() error, error) {
	vm, _ := sb.c.(*container.VM)
	if vm == nil {
		return "", nil, fmt.Errorf("sandbox %s has no running guest: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if err := vm.FreezeFS(ctx); err != nil {
		return "", nil, fmt.Errorf("flush the guest's disk: %w", err)
	}
	mnt := filepath.Join(sb.dir, "packing")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		vm.ThawFS(ctx)
		return "", nil, err
	}
	// The image as the guest left it: read-only, nothing in it runs or
	// opens a device, and the host never writes it.
	m := mount.Mount{Type: "ext4", Source: disk.Image(sb.dir), Options: []string{"loop", "ro", "nodev", "nosuid", "noexec", "noload"}}
	if err := m.Mount(mnt); err != nil {
		vm.ThawFS(ctx)
		return "", nil, fmt.Errorf("read the guest's disk: %w", err)
	}
	return filepath.Join(mnt, "upper"), func() error {
		err := errors.Join(disk.UnmountImage(mnt), vm.ThawFS(context.Background()))
		os.Remove(mnt)
		return err
	}, nil
}
