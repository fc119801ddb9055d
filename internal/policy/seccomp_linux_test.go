package policy

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"testing"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// run runs the profile over one system call, as the kernel would.
// x/net/bpf's VM loads words big-endian (packets), so seccomp_data is
// written big-endian here; the program only loads 32-bit words.
func run(t *testing.T, prog []byte, auditArch uint32, nr int, args ...uint64) uint32 {
	t.Helper()
	var raw []bpf.RawInstruction
	for i := 0; i < len(prog); i += 8 {
		raw = append(raw, bpf.RawInstruction{Op: binary.NativeEndian.Uint16(prog[i:]), Jt: prog[i+2], Jf: prog[i+3],
			K: binary.NativeEndian.Uint32(prog[i+4:])})
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("the profile does not disassemble")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 64)
	binary.BigEndian.PutUint32(data[0:], uint32(nr))
	binary.BigEndian.PutUint32(data[4:], auditArch)
	for i, a := range args {
		binary.BigEndian.PutUint32(data[16+8*i+int(loOffset()):], uint32(a))
		binary.BigEndian.PutUint32(data[16+8*i+4-int(loOffset()):], uint32(a>>32))
	}
	out, err := vm.Run(data)
	if err != nil {
		t.Fatal(err)
	}
	return uint32(out)
}

func TestSeccompProfile(t *testing.T) {
	a, err := arch.GetInfo("")
	if err != nil {
		t.Skipf("no seccomp tables for this architecture: %v", err)
	}
	prog, err := Seccomp([]string{"chroot"})
	if err != nil {
		t.Fatal(err)
	}
	nr := func(name string) int {
		n, ok := a.SyscallNames[name]
		if !ok {
			t.Fatalf("no %s on %s", name, a.Name)
		}
		return n
	}
	native := uint32(a.ID)
	const allow = unix.SECCOMP_RET_ALLOW
	eperm := uint32(unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM))
	noproto := uint32(unix.SECCOMP_RET_ERRNO | uint32(unix.EPROTONOSUPPORT)) // a netlink protocol the sandbox may not open
	for _, c := range []struct {
		what string
		arch uint32
		nr   int
		args []uint64
		want uint32
	}{
		{"read", native, nr("read"), nil, allow},
		{"a plain clone (a thread, a fork)", native, nr("clone"), []uint64{unix.CLONE_VM | unix.CLONE_THREAD}, allow},
		{"clone into a new pid namespace", native, nr("clone"), []uint64{unix.CLONE_NEWPID | uint64(unix.SIGCHLD)}, eperm},
		{"clone3", native, nr("clone3"), nil, unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
		{"unshare(CLONE_FILES)", native, nr("unshare"), []uint64{unix.CLONE_FILES}, allow},
		{"unshare(CLONE_NEWUSER)", native, nr("unshare"), []uint64{unix.CLONE_NEWUSER}, eperm},
		{"unshare(CLONE_NEWTIME)", native, nr("unshare"), []uint64{unix.CLONE_NEWTIME}, eperm},
		{"an AF_INET stream socket", native, nr("socket"), []uint64{unix.AF_INET, unix.SOCK_STREAM | unix.SOCK_CLOEXEC, 0}, allow},
		{"AF_ALG", native, nr("socket"), []uint64{unix.AF_ALG, unix.SOCK_SEQPACKET, 0}, eperm},
		{"AF_PACKET", native, nr("socket"), []uint64{unix.AF_PACKET, unix.SOCK_DGRAM, 0}, eperm},
		{"AF_VSOCK", native, nr("socket"), []uint64{unix.AF_VSOCK, unix.SOCK_STREAM, 0}, eperm},
		{"SOCK_RAW with flags", native, nr("socket"), []uint64{unix.AF_INET, unix.SOCK_RAW | unix.SOCK_NONBLOCK, unix.IPPROTO_ICMP}, eperm},
		{"MPTCP", native, nr("socket"), []uint64{unix.AF_INET6, unix.SOCK_STREAM, unix.IPPROTO_MPTCP}, eperm},
		{"AF_ALG with high garbage", native, nr("socket"), []uint64{1<<40 | unix.AF_ALG, unix.SOCK_SEQPACKET, 0}, eperm},
		{"NETLINK_ROUTE", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW | unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE}, allow},
		{"NETLINK_ROUTE, datagram", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_ROUTE}, allow},
		{"NETLINK_SOCK_DIAG", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_SOCK_DIAG}, allow},
		{"NETLINK_GENERIC", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_GENERIC}, allow},
		{"NETLINK_ROUTE with high garbage", native, nr("socket"), []uint64{1<<40 | unix.AF_NETLINK, unix.SOCK_RAW, 1<<33 | unix.NETLINK_ROUTE}, allow},
		{"NETLINK_KOBJECT_UEVENT", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_KOBJECT_UEVENT}, noproto},
		{"NETLINK_AUDIT", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_AUDIT}, noproto},
		{"NETLINK_CONNECTOR", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_CONNECTOR}, noproto},
		{"NETLINK_NETFILTER", native, nr("socket"), []uint64{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_NETFILTER}, noproto},
		{"SOCK_RAW of AF_INET6", native, nr("socket"), []uint64{unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6}, eperm},
		{"an ordinary ioctl", native, nr("ioctl"), []uint64{0, unix.TCGETS}, allow},
		{"FICLONE with other size bits", native, nr("ioctl"), []uint64{3, unix.FICLONE&0xffff | 0x10<<16}, eperm},
		{"XFS_IOC_SWAPEXT as _IO", native, nr("ioctl"), []uint64{3, uint64(Ioctls["XFS_IOC_SWAPEXT"]) & 0xffff}, eperm},
		{"TIOCSTI", native, nr("ioctl"), []uint64{0, unix.TIOCSTI}, eperm},
		{"TIOCSTI with the high half set", native, nr("ioctl"), []uint64{0, 1<<32 | unix.TIOCSTI}, eperm},
		{"XFS_IOC_SWAPEXT", native, nr("ioctl"), []uint64{3, uint64(Ioctls["XFS_IOC_SWAPEXT"])}, eperm},
		{"FICLONE", native, nr("ioctl"), []uint64{3, unix.FICLONE}, eperm},
		{"mount", native, nr("mount"), nil, eperm},
		{"bpf", native, nr("bpf"), nil, eperm},
		{"io_uring_setup", native, nr("io_uring_setup"), nil, eperm},
		{"a policy's deny", native, nr("chroot"), nil, eperm},
		{"a number no table has", native, 1000, nil, eperm},
		{"another architecture", unix.AUDIT_ARCH_I386, 11, nil, unix.SECCOMP_RET_KILL_PROCESS},
	} {
		if got := run(t, prog, c.arch, c.nr, c.args...); got != c.want {
			t.Errorf("%s: %#x, want %#x", c.what, got, c.want)
		}
	}
	// A policy that denies socket denies netlink too: no rule lets a
	// refused call through.
	noSocket, err := Seccomp([]string{"socket"})
	if err != nil {
		t.Fatal(err)
	}
	if got := run(t, noSocket, native, nr("socket"), unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE); got != eperm {
		t.Errorf("NETLINK_ROUTE under a policy denying socket: %#x", got)
	}
	if a.ID == arch.X86_64.ID {
		if got := run(t, prog, native, 0x40000000|nr("read")); got != unix.SECCOMP_RET_KILL_PROCESS {
			t.Errorf("x32 read: %#x, want the process killed", got)
		}
	}
	for _, d := range Denied {
		for _, ok := range allowed {
			if d == ok {
				t.Errorf("%s is both denied and allowed", d)
			}
		}
	}
}

func TestSeccompDeny(t *testing.T) {
	a, err := arch.GetInfo("")
	if err != nil {
		t.Skipf("no seccomp tables for this architecture: %v", err)
	}
	prog, err := SeccompDeny([]string{"chroot", "mknod"})
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]uint32{"chroot": unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM),
		"mknod": unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM), "read": unix.SECCOMP_RET_ALLOW, "mount": unix.SECCOMP_RET_ALLOW} {
		if got := run(t, prog, uint32(a.ID), a.SyscallNames[name]); got != want {
			t.Errorf("%s: %#x, want %#x (what the profile under it denies is its business)", name, got, want)
		}
	}
	if _, err := SeccompDeny([]string{"wait4"}); err == nil {
		t.Fatal("denied what the init needs")
	}
}

// TestSearchTree: the binary search answers every system call number as
// the library's chain of comparisons does, for the default profile and
// one with a deny list, and numbers past every table fall to the default.
func TestSearchTree(t *testing.T) {
	a, err := arch.GetInfo("")
	if err != nil {
		t.Skipf("no seccomp tables for this architecture: %v", err)
	}
	asBytes := func(ins []bpf.Instruction) []byte {
		raw, err := bpf.Assemble(ins)
		if err != nil {
			t.Fatal(err)
		}
		return encode(raw)
	}
	for _, deny := range [][]string{nil, {"chroot", "read", "personality"}} {
		lib, err := chain(a, append(slices.Clone(Denied), deny...), allowed, deny)
		if err != nil {
			t.Fatal(err)
		}
		allow := map[int]bool{}
		for _, n := range allowed {
			if nr, ok := a.SyscallNames[n]; ok && !slices.Contains(Denied, n) && !slices.Contains(deny, n) {
				allow[nr] = true
			}
		}
		tree := searchTree(allow, slices.Max(slices.Collect(maps.Values(a.SyscallNames))))
		if len(tree) >= len(lib) {
			t.Errorf("deny %v: the search has %d instructions, the chain %d", deny, len(tree), len(lib))
		}
		libProg, treeProg := asBytes(lib), asBytes(append([]bpf.Instruction{bpf.LoadAbsolute{Off: offNr, Size: 4}}, tree...))
		nrs := []int{1 << 20, 0x3fffffff}
		for nr := 0; nr < 1100; nr++ {
			nrs = append(nrs, nr)
		}
		differ := 0
		for _, nr := range nrs {
			want := run(t, libProg, uint32(a.ID), nr, 3, 5)
			if got := run(t, treeProg, uint32(a.ID), nr, 3, 5); got != want {
				t.Errorf("deny %v: system call %d: %#x, the library says %#x", deny, nr, got, want)
			}
			if want != unix.SECCOMP_RET_ALLOW {
				differ++
			}
		}
		if differ == 0 || differ == len(nrs) {
			t.Fatalf("deny %v: %d of %d numbers refused: the comparison tells nothing", deny, differ, len(nrs))
		}
		if !slices.ContainsFunc(deny, func(n string) bool { return n == "read" }) {
			continue
		}
		if got := run(t, treeProg, uint32(a.ID), a.SyscallNames["read"]); got == unix.SECCOMP_RET_ALLOW {
			t.Errorf("a denied read is allowed")
		}
	}
}

// chain is go-seccomp-bpf's program for the profile (the reference
// searchTree answers as): deny's and denied's
// calls refused, allowed's (less deny's) let through, the rest refused,
// one comparison after another.
func chain(a *arch.Info, denied, allowed, deny []string) ([]bpf.Instruction, error) {
	groups := []seccomp.SyscallGroup{{Names: denied, Action: seccomp.ActionErrno}}
	var allow []string
	for _, n := range allowed {
		if !slices.Contains(deny, n) {
			allow = append(allow, n)
		}
	}
	groups = append(groups, seccomp.SyscallGroup{Names: allow, Action: seccomp.ActionAllow})
	p := seccomp.Policy{DefaultAction: seccomp.ActionErrno, Syscalls: groups}
	lib, err := p.Assemble()
	if err != nil {
		return nil, fmt.Errorf("assemble the seccomp profile: %w", err)
	}
	return lib, nil
}
