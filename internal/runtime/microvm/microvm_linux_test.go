package microvm

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

// busybox is the real cpio reader the archive is checked against.
func busybox(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatalf("busybox-static is missing (make deps installs it): %v", err)
	}
	return p
}

// TestCpio: what the writer makes, busybox's cpio lists and unpacks as
// made: directories, files with their bytes and modes, symlinks; and
// the same contents make the same bytes.
func TestCpio(t *testing.T) {
	write := func() []byte {
		var b bytes.Buffer
		c := newCpio(&b)
		for _, err := range []error{c.Dir("bin", 0o755), c.File("bin/tool", 0o755, []byte("#!/bin/sh\necho tool\n")),
			c.File("data", 0o600, bytes.Repeat([]byte("x"), 5003)), c.File("empty", 0o644, nil), c.Symlink("bin/sh", "busybox"), c.Close()} {
			if err != nil {
				t.Fatal(err)
			}
		}
		return b.Bytes()
	}
	b := write()
	if !bytes.Equal(b, write()) {
		t.Fatal("the same contents made other bytes")
	}
	if len(b)%4 != 0 {
		t.Errorf("archive of %d bytes: newc pads every entry to 4", len(b))
	}
	dir := t.TempDir()
	cmd := exec.Command(busybox(t), "cpio", "-i", "-d")
	cmd.Dir, cmd.Stdin = dir, bytes.NewReader(b)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("busybox cpio -i: %v: %s", err, out)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "bin", "tool")); string(got) != "#!/bin/sh\necho tool\n" {
		t.Errorf("bin/tool: %q", got)
	}
	if fi, err := os.Stat(filepath.Join(dir, "data")); err != nil || fi.Size() != 5003 || fi.Mode().Perm() != 0o600 {
		t.Errorf("data: %v %v", fi, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "bin", "tool")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("bin/tool's mode: %v %v", fi, err)
	}
	if l, err := os.Readlink(filepath.Join(dir, "bin", "sh")); err != nil || l != "busybox" {
		t.Errorf("bin/sh: %q %v", l, err)
	}
	if err := newCpio(&bytes.Buffer{}).File("/abs", 0o644, nil); err == nil {
		t.Error("an absolute name was written")
	}
}

// TestParseModinfo: a module's name and dependencies, and what no module
// could name refused.
func TestParseModinfo(t *testing.T) {
	m, err := parseModinfo([]byte("license=GPL\x00depends=virtio_ring,virtio-pci-modern-dev,\x00name=virtio_pci\x00vermagic=6.1\x00"))
	if err != nil || m.name != "virtio_pci" || !slices.Equal(m.depends, []string{"virtio_ring", "virtio_pci_modern_dev"}) {
		t.Fatalf("%+v %v", m, err)
	}
	for _, bad := range []string{"name=../x", "depends=a,b/c", "name=" + strings.Repeat("a", 65)} {
		if _, err := parseModinfo([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

func FuzzModinfo(f *testing.F) {
	f.Add([]byte("name=erofs\x00depends=libcrc32c\x00"))
	f.Add([]byte("depends=\x00\x00=\x00name"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseModinfo(b)
		if err != nil {
			return
		}
		for _, n := range append([]string{m.name}, m.depends...) {
			if n != "" && (!validModName(n) || strings.Contains(n, "-")) {
				t.Fatalf("a module name %q from %q", n, b)
			}
		}
	})
}

// kernel is the guest kernel make kernel unpacked, for the tests that
// read its modules.
func kernel(t *testing.T) *Kernel {
	t.Helper()
	dir := os.Getenv("DSEC_MICROVM_KERNEL")
	if dir == "" {
		dir = filepath.Join("..", "..", "..", "bin", "microvm")
	}
	k, err := OpenKernel(dir)
	if err != nil {
		if os.Getenv("DSEC_REQUIRE_ROOT") != "" || os.Getenv("CI") != "" {
			t.Fatalf("no guest kernel: %v (make test runs make kernel first)", err)
		}
		t.Skipf("SKIPPED: no guest kernel (%v): run make kernel", err)
	}
	return k
}

// TestResolveModules: the guest's modules from Debian's kernel, each
// after what its depends= names; a module the kernel lacks is an error
// that says so.
func TestResolveModules(t *testing.T) {
	k := kernel(t)
	mods, err := ResolveModules(k.Modules(), GuestModules)
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, p := range mods {
		pos[modName(strings.TrimSuffix(filepath.Base(p), ".ko"))] = i
	}
	for _, before := range [][2]string{{"virtio_ring", "virtio_pci"}, {"virtio", "virtio_pmem"}, {"libnvdimm", "nd_pmem"},
		{"nd_virtio", "virtio_pmem"}, {"libcrc32c", "erofs"}, {"jbd2", "ext4"}, {"mbcache", "ext4"}, {"net_failover", "virtio_net"}} {
		a, ok1 := pos[before[0]]
		b, ok2 := pos[before[1]]
		if !ok1 || !ok2 || a > b {
			t.Errorf("%s (%v at %d) must load before %s (%v at %d)", before[0], ok1, a, before[1], ok2, b)
		}
	}
	if len(pos) != len(mods) {
		t.Errorf("a module listed twice: %v", mods)
	}
	if _, err := ResolveModules(k.Modules(), []string{"no_such_module"}); !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "no_such_module") {
		t.Errorf("a missing module: %v", err)
	}
}

// TestInitramfs: the agent as /init, busybox, and the modules numbered
// in load order; built once, found after.
func TestInitramfs(t *testing.T) {
	k := kernel(t)
	bb := busybox(t)
	dir := t.TempDir()
	p, err := Initramfs(dir, k, bb) // any static binary serves as the agent here
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(p)
	again, err := Initramfs(dir, k, bb)
	if err != nil || again != p {
		t.Fatalf("a second build: %s %v, want %s", again, err, p)
	}
	if fi2, _ := os.Stat(again); !fi2.ModTime().Equal(fi.ModTime()) {
		t.Error("built again")
	}
	f, _ := os.Open(p)
	defer f.Close()
	cmd := exec.Command(bb, "cpio", "-t")
	cmd.Stdin = f
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	names := strings.Fields(string(out))
	for _, want := range []string{"init", "bin/busybox", "bin/sh", "modules/000-virtio_ring.ko"} {
		if !slices.Contains(names, want) {
			t.Errorf("no %s in %v", want, names)
		}
	}
	if _, err := Initramfs(dir, k, filepath.Join(os.Getenv("GOROOT"), "no-such-agent")); err == nil {
		t.Error("a missing agent was taken")
	}
	self, _ := os.Executable() // a test binary under -race: linked dynamically
	if _, err := Initramfs(dir, k, self); err != nil && !errdefs.IsNotImplemented(err) {
		t.Errorf("a dynamic agent: %v", err)
	}
}

// TestPmemImage: an image of a multiple of 2 MiB is mapped as it is;
// another is padded, once, with zeros after its bytes; one that is no
// multiple of the page size is refused with what to do.
func TestPmemImage(t *testing.T) {
	dir := t.TempDir()
	aligned := filepath.Join(dir, "aligned")
	os.WriteFile(aligned, make([]byte, PmemAlign), 0o644)
	if p, size, err := PmemImage(filepath.Join(dir, "pmem"), "a", aligned); err != nil || p != aligned || size != PmemAlign {
		t.Errorf("an aligned image: %s %d %v", p, size, err)
	}
	small := filepath.Join(dir, "small")
	body := bytes.Repeat([]byte("erofs"), 4096*3/5)
	os.WriteFile(small, append(body, make([]byte, 3*4096-len(body))...), 0o644)
	p, size, err := PmemImage(filepath.Join(dir, "pmem"), "b", small)
	if err != nil || size != PmemAlign {
		t.Fatalf("a small image: %s %d %v", p, size, err)
	}
	b, _ := os.ReadFile(p)
	if len(b) != PmemAlign || !bytes.Equal(b[:len(body)], body) || bytes.Count(b[3*4096:], []byte{0}) != PmemAlign-3*4096 {
		t.Errorf("the padded copy: %d bytes, its head or tail wrong", len(b))
	}
	fi, _ := os.Stat(p)
	if p2, _, _ := PmemImage(filepath.Join(dir, "pmem"), "b", small); p2 != p {
		t.Errorf("a second ask: %s", p2)
	} else if fi2, _ := os.Stat(p2); !fi2.ModTime().Equal(fi.ModTime()) {
		t.Error("padded again")
	}
	odd := filepath.Join(dir, "odd")
	os.WriteFile(odd, make([]byte, 4097), 0o644)
	if _, _, err := PmemImage(filepath.Join(dir, "pmem"), "c", odd); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "page size") {
		t.Errorf("an image of 4097 bytes: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "pmem", ".pmem-*")); len(left) > 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

// TestArgs: QEMU's command line for a machine: its devices at their
// slots, memory room for the layers, a path with a comma escaped, no
// NIC without a network.
func TestArgs(t *testing.T) {
	m := Machine{QEMU: "/usr/bin/qemu-system-x86_64", Accel: AccelTCG, CPUs: 2, Memory: 512 << 20, Kernel: "/k/vmlinux", Initrd: "/k/i.cpio",
		Layers: []Pmem{{"/l/a,b", 4 << 20}, {"/l/c", 2 << 20}}, Upper: "/s/disk.img", Direct: true, AgentFD: 3, QMPFD: 4}
	a := strings.Join(m.Args(), " ")
	for _, want := range []string{"-m 512M,slots=2,maxmem=518M", "-smp 2", "-accel tcg,tb-size=64",
		"mem-path=/l/a,,b,size=4194304", "virtio-pmem-pci,memdev=layer0,id=pmem0,addr=0x8", "virtio-pmem-pci,memdev=layer1,id=pmem1,addr=0x9",
		"file=/s/disk.img,if=none,id=upper,format=raw,cache=none", "socket,id=agent,fd=3", "socket,id=qmp,fd=4", "DSEC_GUEST=1",
		"-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny", "-bios " + Firmware} {
		if !strings.Contains(a, want) {
			t.Errorf("no %q in %s", want, a)
		}
	}
	if strings.Contains(a, "netdev") {
		t.Errorf("a NIC without a network: %s", a)
	}
	m.LayerDisks = true // the baseline: layers on disks, no memory-device room
	a = strings.Join(m.Args(), " ")
	for _, want := range []string{"-m 512M -", "file=/l/a,,b,if=none,id=layer0,format=raw,readonly=on", "virtio-blk-pci,drive=layer1,addr=0x9"} {
		if !strings.Contains(a, want) {
			t.Errorf("layers on disks: no %q in %s", want, a)
		}
	}
	m.LayerDisks = false
	m.Accel, m.NetFD, m.MAC, m.Direct = AccelKVM, 5, "52:54:00:00:00:01", false
	a = strings.Join(m.Args(), " ")
	for _, want := range []string{"-accel kvm", "-cpu host", "tap,id=net0,fd=5,vhost=off", "mac=52:54:00:00:00:01", "cache=writeback"} {
		if !strings.Contains(a, want) {
			t.Errorf("no %q in %s", want, a)
		}
	}
}

// TestDetectAccel: hardware virtualization is KVM; PVM's /dev/kvm, a
// CPU without vmx or svm, or no /dev/kvm at all are TCG, saying why.
func TestDetectAccel(t *testing.T) {
	dir := t.TempDir()
	kvm, cpu, pvm := filepath.Join(dir, "kvm"), filepath.Join(dir, "cpuinfo"), filepath.Join(dir, "kvm_pvm")
	os.WriteFile(kvm, nil, 0o600)
	os.WriteFile(cpu, []byte("processor : 0\nflags : fpu vme vmx sse\n"), 0o644)
	if a := detectAccel(kvm, cpu, pvm); a.Name != AccelKVM {
		t.Errorf("vmx: %+v", a)
	}
	os.Mkdir(pvm, 0o755)
	if a := detectAccel(kvm, cpu, pvm); a.Name != AccelTCG || !strings.Contains(a.Why, "PVM") {
		t.Errorf("PVM: %+v", a)
	}
	os.Remove(pvm)
	os.WriteFile(cpu, []byte("flags : fpu sse\n"), 0o644)
	if a := detectAccel(kvm, cpu, pvm); a.Name != AccelTCG || !strings.Contains(a.Why, "no vmx or svm") {
		t.Errorf("no vmx: %+v", a)
	}
	if a := detectAccel(filepath.Join(dir, "none"), cpu, pvm); a.Name != AccelTCG || !strings.Contains(a.Why, "no usable") {
		t.Errorf("no /dev/kvm: %+v", a)
	}
	if _, err := ChooseAccel("warp"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("an unknown accelerator: %v", err)
	}
	if a, err := ChooseAccel(AccelTCG); err != nil || a.Name != AccelTCG {
		t.Errorf("tcg asked for: %+v %v", a, err)
	}
}

// TestCPUOf: a processor is its first entry's vendor, model and flags
// (a digest), whatever the entries after say; hosts whose flags differ
// differ; a cpuinfo of nothing is unknown; only KVM shows it.
func TestCPUOf(t *testing.T) {
	entry := func(model, flags string) string {
		return "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: " + model + "\nflags\t\t: " + flags + "\n\n"
	}
	a := CPUOf([]byte(entry("Intel(R)  Xeon(R) Gold", "fpu vme sse avx512f") + entry("other", "fpu")))
	if !strings.HasPrefix(a, "GenuineIntel Intel(R) Xeon(R) Gold [flags ") {
		t.Errorf("CPUOf: %q", a)
	}
	if b := CPUOf([]byte(entry("Intel(R) Xeon(R) Gold", "fpu vme sse avx512f"))); b != a {
		t.Errorf("one processor's entry: %q, want %q", b, a)
	}
	if b := CPUOf([]byte(entry("Intel(R) Xeon(R) Gold", "fpu vme sse"))); b == a {
		t.Errorf("other flags: %q, the same as %q", b, a)
	}
	if u := CPUOf(nil); u != "unknown" {
		t.Errorf("no cpuinfo: %q", u)
	}
	if h := HostCPU(AccelTCG); h != "" {
		t.Errorf("under TCG: %q, want none", h)
	}
	if h := HostCPU(AccelKVM); h == "" || h == "unknown" {
		t.Errorf("this host's processor: %q", h)
	}
}
