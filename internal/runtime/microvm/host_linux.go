package microvm

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/runtime/container"
)

// Host is what a worker runs its microVMs with: its settings resolved.
type Host struct {
	Kernel      *Kernel
	Accel       Accel
	QEMU        string
	Agent       string
	BootTimeout time.Duration
	// QEMUVersion is what the binary says of itself (its first line).
	QEMUVersion string
	// LayerDisks and NoFreePageReporting: Settings'.
	LayerDisks, NoFreePageReporting bool
}

// Resolve finds what s names on this host: an error (not implemented,
// saying what to install) when it lacks something a microVM needs.
func Resolve(s Settings) (*Host, error) {
	accel, err := ChooseAccel(s.Accel)
	if err != nil {
		return nil, err
	}
	qemu, err := FindQEMU(s.QEMU, "microvm.qemu")
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(Firmware); err != nil {
		return nil, fmt.Errorf("QEMU's qboot firmware (%s) is missing: install qemu-system-data: %w", Firmware, errdefs.ErrNotImplemented)
	}
	k, err := FindKernel(s.Kernel)
	if err != nil {
		return nil, err
	}
	agent := s.Agent
	if agent == "" {
		if agent, err = container.InitBinary(); err != nil {
			return nil, err
		}
	}
	if err := staticBinary(agent); err != nil {
		return nil, err
	}
	timeout := s.BootTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
		if accel.Name == AccelTCG {
			timeout = 90 * time.Second
		}
	}
	return &Host{Kernel: k, Accel: accel, QEMU: qemu, Agent: agent, BootTimeout: timeout, QEMUVersion: QEMUVersion(qemu), LayerDisks: s.LayerDisks,
		NoFreePageReporting: s.NoFreePageReporting}, nil
}

// FindQEMU is the QEMU binary path names ("": qemu-system-x86_64 on
// PATH), made absolute; key is the configuration's key that names it,
// for the error when it is no executable.
func FindQEMU(path, key string) (string, error) {
	var err error
	if path == "" {
		if path, err = exec.LookPath("qemu-system-x86_64"); err != nil {
			return "", fmt.Errorf("QEMU is missing (qemu-system-x86_64): install qemu-system-x86 (make deps): %w", errdefs.ErrNotImplemented)
		}
	}
	if path, err = filepath.Abs(path); err != nil {
		return "", err
	}
	if fi, err := os.Stat(path); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("QEMU is missing (%s is no executable): install qemu-system-x86 (make deps) or point %s at it: %w", path, key, errdefs.ErrNotImplemented)
	}
	return path, nil
}

// Build is what a memory snapshot must run on again: the guest kernel
// and QEMU, each the digest of its file (another build of either would
// not take the snapshot's state, or would run another kernel's code
// over its memory).
type Build struct {
	Kernel digest.Digest
	QEMU   digest.Digest
}

var fileDigests sync.Map // path+mtime+size -> digest.Digest

// Build digests the host's kernel and QEMU (once per file as it is).
func (h *Host) Build() (Build, error) {
	k, err := FileDigest(h.Kernel.Vmlinux())
	if err != nil {
		return Build{}, fmt.Errorf("the guest kernel: %w", err)
	}
	q, err := FileDigest(h.QEMU)
	if err != nil {
		return Build{}, fmt.Errorf("QEMU: %w", err)
	}
	return Build{Kernel: k, QEMU: q}, nil
}

// FileDigest is the digest of the file at path, computed once per
// version of it (its path, size and modification time).
func FileDigest(path string) (digest.Digest, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	key := fmt.Sprintf("%s\x00%d\x00%d", path, fi.ModTime().UnixNano(), fi.Size())
	if d, ok := fileDigests.Load(key); ok {
		return d.(digest.Digest), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	d, err := digest.SHA256.FromReader(f)
	if err != nil {
		return "", err
	}
	fileDigests.Store(key, d)
	return d, nil
}

var qemuVersions sync.Map // binary -> version line

// HostCPU is what a guest under accel sees of this host's processor:
// under KVM (-cpu host) the host's own model and features, which a
// saved guest needs again wherever it continues; "" under TCG, whose
// qemu64 is the same on every host.
func HostCPU(accel string) string {
	if accel != AccelKVM {
		return ""
	}
	return hostCPU()
}

// hostCPU is this host's processor, read once (/proc/cpuinfo is long on
// a large host).
var hostCPU = sync.OnceValue(func() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	return CPUOf(b)
})

// CPUOf is the processor the first entry of a /proc/cpuinfo describes:
// its vendor and model name, and a digest of its flags (what a guest
// may use); "unknown" where it says none of them.
func CPUOf(cpuinfo []byte) string {
	var vendor, model, flags string
	for _, line := range strings.Split(string(cpuinfo), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			if strings.TrimSpace(line) == "" && model+flags != "" {
				break // the first processor's entry ends
			}
			continue
		}
		switch strings.TrimSpace(k) {
		case "vendor_id":
			vendor = strings.TrimSpace(v)
		case "model name":
			model = strings.Join(strings.Fields(v), " ")
		case "flags", "Features": // (x86, arm64)
			flags = strings.Join(strings.Fields(v), " ")
		}
	}
	if vendor+model+flags == "" {
		return "unknown"
	}
	sum := sha256.Sum256([]byte(flags))
	return strings.TrimSpace(vendor+" "+model) + " [flags " + hex.EncodeToString(sum[:6]) + "]"
}

// QEMUVersion is the first line the QEMU binary qemu says of itself
// (-version), asked once per binary.
func QEMUVersion(qemu string) string {
	if v, ok := qemuVersions.Load(qemu); ok {
		return v.(string)
	}
	out, _ := exec.Command(qemu, "-version").Output()
	v := cmp.Or(firstLine(string(out)), "unknown")
	qemuVersions.Store(qemu, v)
	return v
}

func firstLine(s string) string {
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

// Overhead is what a guest's QEMU takes of host memory beyond the
// guest's RAM: its own heap, device state, and under TCG the code cache
// (64 MiB, Machine.Args's tb-size). A sandbox's group is bounded at its
// guest's RAM plus this.
func (h *Host) Overhead() int64 {
	if h.Accel.Name == AccelTCG {
		return 192 << 20
	}
	return 96 << 20
}
