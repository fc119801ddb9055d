// Package microvms is the microvm backend's driver: a QEMU guest per
// sandbox (package microvm builds its command line, kernel and
// initramfs), its layers virtio-pmem devices over their images (one
// page cache for every guest on a layer, read through DAX), its upper an
// ext4 disk image of its own (the --disk image, bounded by its size),
// and its agent dsec-init, reached through the guest's shim (package
// container's VM), which speaks the init protocol as a container's init
// does. QEMU and its shim live in the sandbox's cgroup, so admission,
// classes, limits, freezing and figures are the same as a container's.
package microvms

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sync"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/driver/shim"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
)

// Driver runs the microvm backend's sandboxes, on the host its Settings
// resolve to.
type Driver struct {
	mu       sync.Mutex
	settings microvm.Settings
	resolved *microvm.Host
}

var (
	_ driver.Driver      = (*Driver)(nil)
	_ driver.ImageUpper  = (*Driver)(nil)
	_ driver.WarmPauser  = (*Driver)(nil)
	_ driver.UpperHolder = (*Driver)(nil)
	_ driver.FileOpener  = (*Driver)(nil)

	_ driver.MemorySnapshotter = (*Driver)(nil)
	_ driver.FSFreezer         = (*vmm.VM)(nil)
	_ driver.MemoryReporter    = (*vmm.VM)(nil)
	_ driver.Ballooner         = (*vmm.VM)(nil)
)

// New makes the driver for microVMs as s configures them.
func New(s microvm.Settings) *Driver { return &Driver{settings: s} }

// MicroVM is the microvm backend's name.
const MicroVM = "microvm"

func (*Driver) Name() string { return MicroVM }

// Available says what the host lacks to run microVMs.
func (d *Driver) Available() error {
	_, err := d.Host()
	return err
}

// Host is what this host runs microVMs with, resolved once (an error
// says what it lacks, and is asked again next time).
func (d *Driver) Host() (*microvm.Host, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.resolved != nil {
		return d.resolved, nil
	}
	h, err := microvm.Resolve(d.settings)
	if err != nil {
		return nil, err
	}
	d.resolved = h
	return h, nil
}

// UpperIsImage: the sandbox's upper is a disk image its guest mounts,
// never the host (package disk makes it; the guest formats nothing).
func (*Driver) UpperIsImage() bool { return true }

// PausesWarm: a guest made ahead of need waits paused (frozen in its
// group: no CPU for its kernel's timers).
func (*Driver) PausesWarm() bool { return true }

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

// MaxLayers is how many layer devices a guest takes (driver.LayerBound).
func (d *Driver) MaxLayers() int { return initproto.MaxLayers }

// Start boots the sandbox's guest (or restores a saved one) in its
// group.
func (d *Driver) Start(ctx context.Context, s driver.StartSpec) (out driver.Started, err error) {
	h, err := d.Host()
	if err != nil {
		return out, err
	}
	if s.UserNS {
		return out, fmt.Errorf("a microVM's guest has a kernel of its own: --userns is for containers: %w", errdefs.ErrInvalidArgument)
	}
	if len(s.Images) > initproto.MaxLayers {
		return out, fmt.Errorf("%d layers: a microVM takes %d at most: fold the snapshot chain with dsec snap squash: %w", len(s.Images), initproto.MaxLayers, errdefs.ErrOutOfRange)
	}
	dir := filepath.Join(s.Root, "microvm")
	initrd, err := microvm.Initramfs(dir, h.Kernel, h.Agent)
	if err != nil {
		return out, err
	}
	pmem, err := guestLayers(dir, s)
	if err != nil {
		return out, err
	}
	this, ram, err := guestMachine(h, s)
	if err != nil {
		return out, err
	}
	r := s.Restore
	g, devices, err := guestGroup(h, s, ram)
	if err != nil {
		return out, err
	}
	out.Group = g
	defer devices() // never left writing to a group teardown removes
	// QEMU reaches nothing: it has a network namespace of its own, and
	// the sandbox's egress rules hold it too.
	if err := policy.ApplyNetwork(g.Path(), nil, s.Allowlist); err != nil {
		return out, err
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return out, err
	}
	defer logf.Close()
	mach := microvm.Machine{QEMU: h.QEMU, Accel: h.Accel.Name, CPUs: this.CPUs, Memory: ram, Kernel: h.Kernel.Vmlinux(),
		Initrd: initrd, Layers: pmem, Upper: disk.Image(s.Dir), Direct: directIO(disk.Image(s.Dir)), AgentFD: 3, QMPFD: 4, LayerDisks: h.LayerDisks,
		NoFreePageReporting: h.NoFreePageReporting}
	seed := make([]byte, 64)
	rand.Read(seed)
	spec := vmm.VMSpec{BootTimeout: h.BootTimeout, Accel: h.Accel.Name,
		Guest:  initproto.GuestSpec{Layers: len(pmem), LayerDisks: h.LayerDisks, Hostname: s.Hostname, Restrictions: s.Restrict, ReadOnly: s.ReadOnly, Hidden: s.Hidden, Seed: seed},
		Socket: filepath.Join(s.Dir, "init.sock"), FilesSocket: filepath.Join(s.Dir, "files.sock"), Console: filepath.Join(s.Dir, "console.log"),
		Stderr: logf, Setup: driver.Adder(g, devices), Idle: s.Limits.Idle, MergeMemory: s.MergeMemory, RAM: this.RAMFile, Disk: disk.Image(s.Dir)}
	next := 5 // QEMU's next fd: the tap's, then the RAM's
	if s.NAT {
		if r != nil && r.Machine.MAC == "" {
			return out, fmt.Errorf("%s had no network device: a sandbox of network mode nat cannot run it (give another policy, or start on its files alone: --disk-only): %w", r.What, errdefs.ErrInvalidArgument)
		}
		// A tap on the host, the guest's NIC its other end: the guest
		// has the sandbox's address, and what it sends passes the
		// tap's filter (the sandbox's allowlist) and the host's guards.
		nat, tap, guest, err := driver.UpNIC(g, s.Slot)
		out.NAT = nat
		if err != nil {
			return out, err
		}
		defer tap.Close() // QEMU holds it
		mach.NetFD, mach.MAC, this.MAC = next, nat.MAC(), nat.MAC()
		next++
		spec.Tap, spec.Guest.Net = tap, guest
	} else if r != nil && r.Machine.MAC != "" {
		// Its NIC stays, on no network.
		mach.Unplugged, mach.MAC = true, r.Machine.MAC
	}
	if this.RAMFile {
		mach.RAMFD = next
	}
	if r != nil {
		state, err := os.Open(r.State)
		if err != nil {
			return out, fmt.Errorf("%s: its device state: %w", r.What, err)
		}
		defer state.Close()
		mach.Incoming, spec.State = true, state
		spec.Restore = &initproto.VMRestore{Nonce: r.Nonce, RAM: r.RAM}
		spec.Guest.Thaw, spec.Guest.Forget = true, r.Branch
	}
	spec.Argv = mach.Args()
	vm, err := vmm.StartVM(spec)
	if err != nil { // the guest failed: the host's, never the request's
		return out, fmt.Errorf("start microVM: %v: %w", err, errdefs.ErrUnavailable)
	}
	out.Instance, out.Pid = vm, vm.Pid()
	out.VM = &api.VMInfo{Accel: h.Accel.Name, Kernel: h.Kernel.String(), QEMU: h.QEMUVersion}
	out.Machine = &this
	if err := devices(); err != nil {
		return out, fmt.Errorf("device allowlist: %w", err)
	}
	return out, nil
}

// guestLayers are the sandbox's layers as the guest's pmem devices,
// each an image under dir.
func guestLayers(dir string, s driver.StartSpec) ([]microvm.Pmem, error) {
	var pmem []microvm.Pmem
	for i, img := range s.Images {
		p, size, err := microvm.PmemImage(filepath.Join(dir, "pmem"), digest.Digest(s.Digests[i]).Encoded(), img)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", s.Layers[i], err)
		}
		pmem = append(pmem, microvm.Pmem{Path: p, Size: size})
	}
	return pmem, nil
}

// guestMachine is the machine the guest runs on, and its RAM: what s
// asks for on h, or a restored guest's, which must run on h with the RAM
// asked.
func guestMachine(h *microvm.Host, s driver.StartSpec) (layer.Machine, int64, error) {
	ram, err := guestMemory(s.Limits)
	if err != nil {
		return layer.Machine{}, 0, err
	}
	build, err := h.Build()
	if err != nil {
		return layer.Machine{}, 0, err
	}
	this := layer.Machine{MemoryBytes: ram, CPUs: guestCPUs(s.Limits), LayerDisks: h.LayerDisks, RAMFile: !s.MergeMemory,
		Accel: h.Accel.Name, Kernel: h.Kernel.String(), KernelDigest: build.Kernel, QEMU: h.QEMUVersion, QEMUDigest: build.QEMU, CPU: microvm.HostCPU(h.Accel.Name)}
	r := s.Restore
	if r != nil {
		// The saved guest's machine, on this host's.
		if why := r.Machine.Runs(this); why != "" {
			return layer.Machine{}, 0, fmt.Errorf("%s cannot run here: %s: %w", r.What, why, errdefs.ErrFailedPrecondition)
		}
		if r.Machine.MemoryBytes != ram {
			return layer.Machine{}, 0, fmt.Errorf("%s has %d MiB of RAM, not the %d MiB asked: give --memory %dM or none: %w",
				r.What, r.Machine.MemoryBytes>>20, ram>>20, r.Machine.MemoryBytes>>20, errdefs.ErrInvalidArgument)
		}
		this.CPUs, this.RAMFile, this.MAC = r.Machine.CPUs, r.Machine.RAMFile, r.Machine.MAC
	}
	if host := hostMemory(); ram > host {
		return layer.Machine{}, 0, fmt.Errorf("a microVM of %d MiB is more than this host's memory (%d MiB): ask for less: %w", ram>>20, host>>20, errdefs.ErrInvalidArgument)
	}
	return this, ram, nil
}

// guestGroup makes the sandbox's group on h for a guest of ram bytes of
// RAM (with KVM among its devices when h has it).
func guestGroup(h *microvm.Host, s driver.StartSpec, ram int64) (*cgroup.Group, func() error, error) {
	// The group holds the guest's RAM and QEMU's own memory.
	lim := s.Limits
	if lim.MemoryBytes > 0 {
		lim.MemoryBytes = ram + h.Overhead()
	}
	var extra []policy.Device
	if h.Accel.Name == microvm.AccelKVM {
		extra = append(extra, policy.KVM)
	}
	return driver.NewGroup(s.Groups, s.Group, lim, extra...)
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

// Attach finds the sandbox's group and, unless it is paused, its
// guest's shim.
func (d *Driver) Attach(_ context.Context, h driver.Handle) (driver.Started, error) {
	return shim.Attach(h), nil
}

// Teardown removes the sockets of the guest's shim.
func (d *Driver) Teardown(_ context.Context, h driver.Handle) []error { return shim.Teardown(h) }

// Files opens the guest's files through its agent's file server.
func (d *Driver) Files(h driver.Handle) (backend.Files, error) { return shim.Files(h) }

// HoldUpper makes a running guest's upper consistent on its disk image
// (the guest flushes and freezes its file system) and mounts the image
// read-only on the host until release, which thaws the guest's file
// system: what pack-diff reads, while the sandbox is frozen too.
func (d *Driver) HoldUpper(ctx context.Context, h driver.Handle) (string, func() error, error) {
	vm, _ := h.Instance.(*vmm.VM)
	if vm == nil {
		return "", nil, fmt.Errorf("sandbox %s has no running guest: %w", h.Name, errdefs.ErrFailedPrecondition)
	}
	if err := vm.FreezeFS(ctx); err != nil {
		return "", nil, fmt.Errorf("flush the guest's disk: %w", err)
	}
	mnt := filepath.Join(h.Dir, "packing")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		vm.ThawFS(ctx)
		return "", nil, err
	}
	// The image as the guest left it: read-only, nothing in it runs or
	// opens a device, and the host never writes it.
	m := mount.Mount{Type: "ext4", Source: disk.Image(h.Dir), Options: []string{"loop", "ro", "nodev", "nosuid", "noexec", "noload"}}
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

func numCPU() int { return goruntime.NumCPU() }

// hostMemory is the host's memory (none read: unbounded).
func hostMemory() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return 1 << 62
	}
	return int64(si.Totalram) * int64(si.Unit)
}

// SaveGuest has the sandbox's running guest save itself into the files
// state, ram and disk (see vmm.VM.Snapshot).
func (d *Driver) SaveGuest(ctx context.Context, h driver.Handle, state, ram, disk *os.File, stop bool) (*initproto.SnapshotInfo, error) {
	vm, _ := h.Instance.(*vmm.VM)
	if vm == nil {
		return nil, fmt.Errorf("sandbox %s has no running guest: %w", h.Name, errdefs.ErrFailedPrecondition)
	}
	return vm.Snapshot(ctx, state, ram, disk, stop)
}
