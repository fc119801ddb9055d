// Package vms is the vm backend's driver: a full VM per sandbox, QEMU's
// q35 machine booted through UEFI firmware (Debian's OVMF) from a disk
// image of its own (package vm builds them), its bootloader, kernel and
// init (systemd) the image's. The sandbox's disk is a qcow2 overlay over
// the image's disk in the store, which every VM of that image shares
// read-only; the overlay is in the sandbox's upper, where its disk
// bound holds it, and outlives a stop. The guest's agent (the microVM's,
// as a systemd service the image's units start) comes on a read-only
// disk of the host's and speaks the init protocol over a virtio-serial
// port through the same shim as a microVM's: commands, their journal and
// files are a microVM's.
package vms

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/driver/shim"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// Host is what this host runs full VMs with.
type Host struct {
	Accel       microvm.Accel
	QEMU        string
	QEMUVersion string
	Agent       string
	BootTimeout time.Duration
}

// Driver runs the vm backend's sandboxes.
type Driver struct {
	settings Settings
	mu       sync.Mutex
	resolved *Host
	disk     sync.Mutex // making the agent's disk
}

var (
	_ driver.Driver          = (*Driver)(nil)
	_ driver.BaseResolver    = (*Driver)(nil)
	_ driver.FileOpener      = (*Driver)(nil)
	_ driver.UpperHolder     = (*Driver)(nil)
	_ driver.DiskSnapshotter = (*Driver)(nil)
	_ driver.VNCServer       = (*Driver)(nil)
	_ driver.FSFreezer       = (*vmm.VM)(nil)
	_ driver.Screener        = (*vmm.VM)(nil)
)

// New makes the driver for full VMs as s configures them.
func New(s Settings) *Driver { return &Driver{settings: s} }

func (*Driver) Name() string { return VM }

// Available says what the host lacks to run full VMs.
func (d *Driver) Available() error {
	_, err := d.Host()
	return err
}

// Host is what this host runs full VMs with, resolved once (an error
// says what it lacks, and is asked again next time).
func (d *Driver) Host() (*Host, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.resolved != nil {
		return d.resolved, nil
	}
	s := d.settings
	accel, err := microvm.ChooseAccel(s.Accel)
	if err != nil {
		return nil, err
	}
	qemu, err := microvm.FindQEMU(s.QEMU, "vm.qemu")
	if err != nil {
		return nil, err
	}
	for _, f := range []string{vm.OVMFCode, vm.OVMFVars} {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("the UEFI firmware (%s) is missing: install ovmf (make deps): %w", f, errdefs.ErrNotImplemented)
		}
	}
	if _, err := exec.LookPath("qemu-img"); err != nil {
		return nil, fmt.Errorf("qemu-img is missing: install qemu-utils (make deps): %w", errdefs.ErrNotImplemented)
	}
	agent := s.Agent
	if agent == "" {
		if agent, err = container.InitBinary(); err != nil {
			return nil, err
		}
	}
	timeout := s.BootTimeout
	if timeout <= 0 {
		timeout = 60 * time.Second
		if accel.Name == microvm.AccelTCG {
			timeout = 300 * time.Second
		}
	}
	d.resolved = &Host{Accel: accel, QEMU: qemu, QEMUVersion: microvm.QEMUVersion(qemu), Agent: agent, BootTimeout: timeout}
	return d.resolved, nil
}

// ResolveBase finds the VM image ref names in src: the digests of its
// disk's chain, and their files. A sandbox that stands on one already
// (want) takes that chain, whatever the tag names now. A disk the store
// lacks (its image was pulled from the shared remote without it) is
// read lazily from there, checked as a pulled disk is.
func (d *Driver) ResolveBase(ctx context.Context, src driver.BaseSource, ref string, want []string) (b driver.Base, err error) {
	s := src.Store
	if s == nil {
		return b, fmt.Errorf("a vm sandbox boots a VM image of the store: this worker has none: %w", errdefs.ErrFailedPrecondition)
	}
	digests := want
	var img *vm.Image // (a restart's, looked up for a disk the store lacks)
	if len(want) == 0 {
		if img, err = vm.Lookup(ctx, s, ref); err != nil {
			return b, err
		}
		if img.Disk.Agent == "" {
			return b, fmt.Errorf("VM image %s has no dsec agent (its tree has no systemd, or an older dsec built it): build it again from a tree with systemd: %w", img.Tag, errdefs.ErrFailedPrecondition)
		}
		digests = img.Digests()
		if img.Memory != nil && img.State != nil {
			b.Saved = &driver.Restore{What: "snapshot " + img.Tag, Machine: img.Memory.Machine, State: s.BlobPath(img.State.Digest),
				Nonce: img.Memory.Nonce, Branch: true, Policy: img.Memory.Policy}
		}
	}
	var holds []io.Closer
	b.Release = func() {
		for _, h := range holds {
			h.Close()
		}
	}
	defer func() {
		if err != nil {
			b.Release()
		}
	}()
	b.Digests = digests
	for _, w := range digests {
		dg, err := digest.Parse(w)
		if err != nil {
			return b, fmt.Errorf("VM image %s: its disk %q: %w", ref, w, errdefs.ErrDataLoss)
		}
		p := s.BlobPath(dg)
		if _, err := os.Stat(p); err != nil {
			if img == nil {
				img, _ = vm.Lookup(ctx, s, ref) // (nil: its tag is gone, or moved on)
			}
			hold, lazy, err := serveDisk(ctx, src, ref, img, dg)
			if err != nil {
				return b, err
			}
			holds, p = append(holds, hold), lazy
		}
		b.Files = append(b.Files, p)
	}
	return b, nil
}

// serveDisk serves disk dg of VM image ref (img, if the store still
// tags it), which the store lacks, lazily from the worker's shared
// remote, as img names it there (else the store's image of fewest disks
// that lists it: a sandbox whose tag moved on), checked before QEMU
// opens it.
func serveDisk(ctx context.Context, src driver.BaseSource, ref string, img *vm.Image, dg digest.Digest) (io.Closer, string, error) {
	lender, disk, w, ok := (*vm.Image)(nil), ocispec.Descriptor{}, layer.Windows{}, false
	if img != nil {
		for _, d := range img.Chain {
			if d.Digest == dg {
				lender, disk = img, d
				w, ok = img.Windows(d)
			}
		}
	}
	if !ok {
		lender, disk, w, ok = vm.Lender(ctx, src.Store, dg)
	}
	switch {
	case !ok:
		return nil, "", fmt.Errorf("the disk of VM image %s (%s) is gone from the store: %w", ref, dg, errdefs.ErrNotFound)
	case src.Serve == nil:
		return nil, "", fmt.Errorf("the disk of VM image %s (%s) was left in a shared remote, and this worker has none now: give it its remote (remote:), or dsec vm image pull %s: %w",
			ref, dg, ref, errdefs.ErrFailedPrecondition)
	}
	table, err := src.Store.ReadBlob(w.Digest, int64(w.Count)*32)
	if err != nil {
		return nil, "", fmt.Errorf("VM image %s: the window table of its disk %s: %w", ref, dg, err)
	}
	p, hold, err := src.Serve(ctx, lender.Tag, disk, w, table)
	if err != nil {
		return nil, "", fmt.Errorf("VM image %s: read its disk %s from the shared remote: %v: %w", ref, dg, err, errdefs.ErrUnavailable)
	}
	if err := vm.CheckDisk(ctx, p); err != nil {
		hold.Close()
		return nil, "", fmt.Errorf("VM image %s: its disk %s: %w", ref, dg, err)
	}
	return hold, p, nil
}

// minMemory is the least RAM a full VM gets: its firmware and a
// distribution's kernel and systemd.
const minMemory = 256 << 20

// memory is the guest's RAM for a memory limit (none: 2 GiB), whole MiB.
func memory(l cgroup.Limits) (int64, error) {
	m := l.MemoryBytes
	if m <= 0 {
		m = 2 << 30
	}
	if m < minMemory {
		return 0, fmt.Errorf("a full VM needs at least %d MiB of memory, not %d MiB: give --memory 256M or more: %w", minMemory>>20, m>>20, errdefs.ErrInvalidArgument)
	}
	return (m + 1<<20 - 1) &^ (1<<20 - 1), nil
}

// overhead is what QEMU takes beyond the guest's RAM (its heap, the
// firmware's, and under TCG its 64 MiB code cache).
func overhead(accel string) int64 {
	if accel == microvm.AccelTCG {
		return 256 << 20
	}
	return 128 << 20
}

// Start boots the sandbox's VM in its group: its overlay and firmware
// variables made on its first start, kept after.
func (d *Driver) Start(ctx context.Context, s driver.StartSpec) (out driver.Started, err error) {
	h, err := d.Host()
	if err != nil {
		return out, err
	}
	if err := checkStart(s); err != nil {
		return out, err
	}
	d.disk.Lock()
	agent, err := agentDisk(ctx, filepath.Join(s.Root, "vm"), h.Agent)
	d.disk.Unlock()
	if err != nil {
		return out, err
	}
	this, err := d.machine(h, s, agent)
	if err != nil {
		return out, err
	}
	ram := this.MemoryBytes
	disk, err := top(ctx, s.Upper, s.Images, s.DiskTop)
	if err != nil {
		return out, err
	}
	vars := filepath.Join(s.Dir, "efivars.fd")
	if err := copyNew(vars, vm.OVMFVars); err != nil {
		return out, fmt.Errorf("the firmware's variables: %w", err)
	}
	lim, extra := h.groupOf(s.Limits, ram)
	g, devices, err := driver.NewGroup(s.Groups, s.Group, lim, extra...)
	if err != nil {
		return out, err
	}
	out.Group = g
	defer devices() // never left writing to a group teardown removes
	if err := policy.ApplyNetwork(g.Path(), nil, s.Allowlist); err != nil {
		return out, err
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return out, err
	}
	defer logf.Close()
	mach := Machine{QEMU: h.QEMU, Accel: h.Accel.Name, CPUs: this.CPUs, Memory: ram, Code: vm.OVMFCode, Vars: vars,
		Base: s.Images, Disk: disk, AgentDisk: agent, AgentFD: 3, QMPFD: 4, VNC: vncSocket(s.Handle)}
	os.Remove(mach.VNC)
	seed := make([]byte, 64)
	rand.Read(seed)
	spec := vmm.VMSpec{BootTimeout: h.BootTimeout, Accel: h.Accel.Name,
		Guest:  initproto.GuestSpec{Hostname: s.Hostname, Restrictions: s.Restrict, ReadOnly: s.ReadOnly, Hidden: s.Hidden, Seed: seed},
		Socket: filepath.Join(s.Dir, "init.sock"), FilesSocket: filepath.Join(s.Dir, "files.sock"), Console: filepath.Join(s.Dir, "console.log"),
		Stderr: logf, Setup: driver.Adder(g, devices), Idle: s.Limits.Idle, MergeMemory: s.MergeMemory, Display: true}
	r := s.Restore
	if s.NAT {
		if r != nil && r.Machine.MAC == "" {
			return out, fmt.Errorf("%s had no network device: a sandbox of network mode nat cannot continue it (give another policy, or boot its disk alone: --disk-only): %w", r.What, errdefs.ErrInvalidArgument)
		}
		nat, tap, guest, err := driver.UpNIC(g, s.Slot)
		out.NAT = nat
		if err != nil {
			return out, err
		}
		defer tap.Close() // QEMU holds it
		mach.NetFD, mach.MAC, this.MAC = 5, nat.MAC(), nat.MAC()
		spec.Tap, spec.Guest.Net = tap, guest
	} else if r != nil && r.Machine.MAC != "" {
		// Its NIC stays, on no network.
		mach.Unplugged, mach.MAC, this.MAC = true, r.Machine.MAC, r.Machine.MAC
	}
	if r != nil {
		// The saved guest goes on where it stopped (its screen too):
		// QEMU takes its device state and RAM, on its chain's disk
		// under a top of this sandbox's own.
		state, err := os.Open(r.State)
		if err != nil {
			return out, fmt.Errorf("%s: its saved guest: %w", r.What, err)
		}
		defer state.Close()
		mach.Incoming, spec.State = true, state
		spec.Restore = &initproto.VMRestore{Nonce: r.Nonce}
		spec.Guest.Thaw, spec.Guest.Forget = true, r.Branch
	}
	spec.Argv = mach.Args()
	v, err := vmm.StartVM(spec)
	if err != nil { // the guest failed: the host's, never the request's
		return out, fmt.Errorf("start VM: %v: %w", err, errdefs.ErrUnavailable)
	}
	out.Instance, out.Pid = v, v.Pid()
	out.VM = &api.VMInfo{Accel: h.Accel.Name, QEMU: h.QEMUVersion}
	out.Machine = &this
	if err := devices(); err != nil {
		return out, fmt.Errorf("device allowlist: %w", err)
	}
	return out, nil
}

// checkStart refuses what a full VM cannot be started with.
func checkStart(s driver.StartSpec) error {
	switch {
	case s.UserNS:
		return fmt.Errorf("a full VM's guest has a kernel of its own: --userns is for containers: %w", errdefs.ErrInvalidArgument)
	case len(s.Images) == 0 || len(s.Images) > vm.MaxChain || s.Upper == "":
		return fmt.Errorf("a full VM boots one disk image (a chain of 1 to %d images, not %d): %w", vm.MaxChain, len(s.Images), errdefs.ErrInvalidArgument)
	}
	return nil
}

// groupOf gives the limits of a VM of ram bytes' group (its memory
// limit the guest's RAM and QEMU's own) and the devices it adds.
func (h *Host) groupOf(l cgroup.Limits, ram int64) (cgroup.Limits, []policy.Device) {
	if l.MemoryBytes > 0 {
		l.MemoryBytes = ram + overhead(h.Accel.Name)
	}
	if h.Accel.Name == microvm.AccelKVM {
		return l, []policy.Device{policy.KVM}
	}
	return l, nil
}

// machine is the machine the sandbox's VM runs on, with the agent's
// disk agentDisk: what s asks for on h, or a saved guest's, which must
// run on h with the RAM asked.
func (d *Driver) machine(h *Host, s driver.StartSpec, agentDisk string) (layer.Machine, error) {
	ram, err := memory(s.Limits)
	if err != nil {
		return layer.Machine{}, err
	}
	q, err := microvm.FileDigest(h.QEMU)
	if err != nil {
		return layer.Machine{}, fmt.Errorf("QEMU: %w", err)
	}
	fw, err := microvm.FileDigest(vm.OVMFCode)
	if err != nil {
		return layer.Machine{}, fmt.Errorf("the UEFI firmware: %w", err)
	}
	// The agent's disk, which a continued guest may read again: its
	// bytes, not the binary's (another mke2fs lays the same binary out
	// otherwise).
	agent, err := microvm.FileDigest(agentDisk)
	if err != nil {
		return layer.Machine{}, fmt.Errorf("the guest agent's disk: %w", err)
	}
	// The guest's kernel is its disk's: the machine's is its firmware.
	this := layer.Machine{MemoryBytes: ram, CPUs: max(1, min(int((s.Limits.CPUMilli+999)/1000), goruntime.NumCPU())),
		Accel: h.Accel.Name, Kernel: firmware, KernelDigest: fw, QEMU: h.QEMUVersion, QEMUDigest: q, Agent: agent, CPU: microvm.HostCPU(h.Accel.Name)}
	if r := s.Restore; r != nil {
		if why := r.Machine.Runs(this); why != "" {
			return layer.Machine{}, fmt.Errorf("%s cannot run here: %s: %w", r.What, why, errdefs.ErrFailedPrecondition)
		}
		if r.Machine.MemoryBytes != ram {
			return layer.Machine{}, fmt.Errorf("%s has %d MiB of RAM, not the %d MiB asked: give --memory %dM or none: %w",
				r.What, r.Machine.MemoryBytes>>20, ram>>20, r.Machine.MemoryBytes>>20, errdefs.ErrInvalidArgument)
		}
		this.CPUs = r.Machine.CPUs
	}
	return this, nil
}

// firmware names a full VM's firmware in its machine (layer.Machine's
// Kernel: a saved guest continues only on the same build of it).
const firmware = "ovmf"

// copyNew copies src to dst unless dst is there.
func copyNew(dst, src string) error {
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := os.WriteFile(dst+".tmp", b, 0o600); err != nil {
		return err
	}
	return os.Rename(dst+".tmp", dst)
}

// Attach finds the sandbox's group and, unless it is paused, its
// VM's shim.
func (d *Driver) Attach(_ context.Context, h driver.Handle) (driver.Started, error) {
	return shim.Attach(h), nil
}

// Teardown removes the sockets of the VM's shim, and its VNC server's.
func (d *Driver) Teardown(_ context.Context, h driver.Handle) []error {
	errs := shim.Teardown(h)
	if err := os.Remove(vncSocket(h)); err != nil && !os.IsNotExist(err) {
		errs = append(errs, err)
	}
	return errs
}

// vncSocket is where the VM's VNC server listens.
func vncSocket(h driver.Handle) string { return filepath.Join(h.Dir, "vnc.sock") }

// VNC is the unix socket the running VM's VNC server listens on.
func (d *Driver) VNC(h driver.Handle) (string, error) {
	p := vncSocket(h)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("sandbox %s's VM has no VNC server (an older dsec started it): stop and start it: %w", h.Name, errdefs.ErrFailedPrecondition)
	}
	return p, nil
}

// Files opens the VM's files through its agent's file server.
func (d *Driver) Files(h driver.Handle) (backend.Files, error) { return shim.Files(h) }

// HoldUpper: a full VM's files are its disk's, which no diff of files
// reads: its snapshots are block diffs (SnapshotDisk). Refused, so that
// nothing packs the overlay's file as if it were the sandbox's files.
func (d *Driver) HoldUpper(context.Context, driver.Handle) (string, func() error, error) {
	return "", nil, fmt.Errorf("a vm sandbox's files are its own disk's, which a snapshot keeps as a block diff, not as files: %w", errdefs.ErrNotImplemented)
}
