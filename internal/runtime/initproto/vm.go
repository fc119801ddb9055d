package initproto

import "github.com/dsec-project/dsec/internal/runtime/sparse"

// GuestSpec is what a microVM guest's root is made of and runs under:
// the first request its agent gets (opSetup). The guest finds its
// devices at fixed PCI slots (the QEMU command line puts them there):
// layer i's virtio-pmem device at slot FirstLayerSlot+i, topmost first,
// and its upper's disk, the one virtio-blk device.
type GuestSpec struct {
	// Layers is how many layer devices the guest has; LayerDisks: they
	// are read-only virtio-blk disks, not pmem devices (no DAX: each
	// guest caches what it reads; a benchmark's baseline).
	Layers     int    `json:"layers"`
	LayerDisks bool   `json:"layer_disks,omitempty"`
	Hostname   string `json:"hostname"`
	// Restrictions every command runs under; ReadOnly and Hidden are
	// the paths Protect holds from the first command on.
	Restrictions *Restrictions `json:"restrictions,omitempty"`
	ReadOnly     []string      `json:"read_only,omitempty"`
	Hidden       []string      `json:"hidden,omitempty"`
	// Net is the guest's eth0 (nil: it has loopback only).
	Net *GuestNet `json:"net,omitempty"`
	// Time is the host's clock (Unix nanoseconds) as it sent the spec:
	// the guest's clock is set from it.
	Time int64 `json:"time"`
	// Seed is entropy from the host, added to the guest's pool.
	Seed []byte `json:"seed,omitempty"`
	// Thaw: a resume (opResume) thaws the upper's file system, which
	// the snapshot it follows froze. Forget: the guest is another
	// sandbox now (a branch): the exits of the commands the one it was
	// ran are forgotten, their ids the new one's to use.
	Thaw   bool `json:"thaw,omitempty"`
	Forget bool `json:"forget,omitempty"`
}

// GuestNet is a guest's network interface: its address (CIDR), its
// gateway and its hardware address.
type GuestNet struct {
	Addr    string `json:"addr"`
	Gateway string `json:"gateway"`
	MAC     string `json:"mac"`
}

// PCI slots of a guest's devices on the q35 root bus.
const (
	SerialSlot     = 0x02 // the agent's virtio-serial port
	RNGSlot        = 0x03
	BalloonSlot    = 0x04
	UpperSlot      = 0x05 // the upper's virtio-blk disk
	NetSlot        = 0x06
	FirstLayerSlot = 0x08
	// MaxLayers is how many layer devices fit the root bus's free slots
	// (up to 0x1e; 0x1f is the chipset's).
	MaxLayers = 0x1e - FirstLayerSlot + 1
)

// GuestEnv marks a guest's pid 1 (the kernel's command line sets it for
// /init): dsec-init then serves as the guest's agent.
const GuestEnv = "DSEC_GUEST"

// GuestSystem is GuestEnv's value for a full VM's agent, a service of
// the guest's own init (package vm's units set it).
const GuestSystem = "system"

// SnapshotInfo is what a microVM's memory snapshot took: the nonce its
// agent's next session comes after (a guest restored from it is at that
// point), how long the guest was paused, and the images of its RAM
// (none: its RAM is anonymous, in the device state) and disk.
type SnapshotInfo struct {
	Nonce    string       `json:"nonce"`
	PausedNS int64        `json:"paused_ns"`
	RAM      sparse.Stats `json:"ram"`
	Disk     sparse.Stats `json:"disk"`
}

// GuestMemory is a guest's memory as its kernel sees it (its balloon
// reports it every few seconds): its RAM, and how much of it is
// available (free, or cache it can drop). Actual is the memory the
// balloon leaves the guest now (QEMU's query-balloon, which follows each
// page the guest gives up; 0 from an older shim).
type GuestMemory struct {
	Total     int64 `json:"total"`
	Available int64 `json:"available"`
	Actual    int64 `json:"actual,omitempty"`
}

// VMRestore starts a guest from a memory snapshot: its disk is a copy of
// the snapshot's already (the image in argv), its RAM is read from the
// sparse image RAM (none: its RAM comes in the device state), its
// device state from VMSpec.State, and its agent waits for Nonce.
type VMRestore struct {
	Nonce string `json:"nonce"`
	RAM   string `json:"ram,omitempty"`
}
