package policy

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/errdefs"
	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// argRule returns Ret when the low 32 bits of argument Arg, and Mask
// (0: all of them), equal Value; with AnyBit, when any bit of Mask is
// set; with Always, whatever the arguments. With Allow, a call that
// matches is let through (and no later rule asked) when argument
// AllowArg's low 32 bits are one of Allow, and gets Ret when not.
type argRule struct {
	Syscall  string
	Arg      uint32
	Mask     uint32
	Value    uint32
	AnyBit   bool
	Always   bool
	Ret      uint32
	AllowArg uint32
	Allow    []uint32
}

// NetlinkAllowed are the netlink protocols a sandbox may open:
// NETLINK_ROUTE (addresses, links and routes of its own network
// namespace, what ip, getifaddrs, Go's net.Interfaces and Node's
// os.networkInterfaces read; changing them needs CAP_NET_ADMIN, which
// no sandbox has), NETLINK_SOCK_DIAG (its own namespace's sockets, for
// ss) and NETLINK_GENERIC (families the kernel marks safe in other
// namespaces, such as ethtool's). The rest are refused: KOBJECT_UEVENT
// (the host's device events reach every namespace), AUDIT (the host's
// audit log, which AUDIT_WRITE would let it forge), CONNECTOR (every
// process's fork and exec), NETFILTER, XFRM, CRYPTO, SELINUX, ISCSI,
// RDMA and the others no agent needs.
var NetlinkAllowed = map[string]uint32{"NETLINK_ROUTE": unix.NETLINK_ROUTE, "NETLINK_SOCK_DIAG": unix.NETLINK_SOCK_DIAG,
	"NETLINK_GENERIC": unix.NETLINK_GENERIC}

const nsFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER |
	unix.CLONE_NEWPID | unix.CLONE_NEWNET

// Ioctls are the ioctl requests no sandbox may make, refused by their
// type and number (the low 16 bits) whatever their direction and size
// bits say: every request that exchanges or commits file contents
// behind the files' backs (XFS, ext4, Btrfs and the generic clone and
// dedupe family, which Btrfs' CLONE, CLONE_RANGE and FILE_EXTENT_SAME
// are), and the terminal injections.
var Ioctls = map[string]uint32{
	// XFS
	"XFS_IOC_SWAPEXT":        0xc0c0586d, // _IOWR('X', 109)
	"XFS_IOC_EXCHANGE_RANGE": 0x40285881, // _IOW('X', 129)
	"XFS_IOC_START_COMMIT":   0x80585882, // _IOR('X', 130)
	"XFS_IOC_COMMIT_RANGE":   0x40585883, // _IOW('X', 131)
	// ext4
	"EXT4_IOC_MOVE_EXT":  0xc028660f, // _IOWR('f', 15)
	"EXT4_IOC_SWAP_BOOT": 0x00006611, // _IO('f', 17)
	// Btrfs and the generic family
	"FICLONE":                 0x40049409, // _IOW(0x94, 9), BTRFS_IOC_CLONE
	"FICLONERANGE":            0x4020940d, // _IOW(0x94, 13), BTRFS_IOC_CLONE_RANGE
	"FIDEDUPERANGE":           0xc0189436, // _IOWR(0x94, 54), BTRFS_IOC_FILE_EXTENT_SAME
	"BTRFS_IOC_ENCODED_WRITE": 0x40809440, // _IOW(0x94, 64)
	// Terminals
	"TIOCSTI":   0x5412,
	"TIOCLINUX": 0x541c,
}

// ioctlTypeNr is the part of a request a rule compares.
const ioctlTypeNr = 0xffff

const (
	retEPERM = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	retKill  = unix.SECCOMP_RET_KILL_PROCESS
	// retNoProto answers a netlink protocol the sandbox may not open as
	// a kernel without it would: programs that use one when it is there
	// (useradd, through libaudit, and so every package whose install
	// adds a user) carry on without it, where EPERM makes them abort.
	retNoProto = unix.SECCOMP_RET_ERRNO | uint32(unix.EPROTONOSUPPORT)
)

func argRules() []argRule {
	rs := []argRule{
		// Namespaces: clone with any namespace flag (CLONE_NEWTIME is
		// a signal bit to clone), unshare with any.
		{Syscall: "clone", Arg: 0, Mask: nsFlags, AnyBit: true, Ret: retEPERM},
		{Syscall: "unshare", Arg: 0, Mask: nsFlags | unix.CLONE_NEWTIME, AnyBit: true, Ret: retEPERM},
		// clone3 passes its flags in memory a filter cannot read:
		// ENOSYS makes libcs fall back to clone, which it can.
		{Syscall: "clone3", Always: true, Ret: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
		// Sockets: netlink of the allowed protocols (raw or datagram,
		// as netlink has it), families, raw and packet types, MPTCP
		// (which Landlock's TCP rules do not cover).
		{Syscall: "socket", Arg: 0, Value: unix.AF_NETLINK, Ret: retNoProto, AllowArg: 2,
			Allow: slices.Sorted(maps.Values(NetlinkAllowed))},
		{Syscall: "socket", Arg: 0, Value: unix.AF_ALG, Ret: retEPERM},
		{Syscall: "socket", Arg: 0, Value: unix.AF_PACKET, Ret: retEPERM},
		{Syscall: "socket", Arg: 0, Value: unix.AF_VSOCK, Ret: retEPERM},
		{Syscall: "socket", Arg: 1, Mask: 0xf, Value: unix.SOCK_RAW, Ret: retEPERM},
		{Syscall: "socket", Arg: 1, Mask: 0xf, Value: unix.SOCK_PACKET, Ret: retEPERM},
		{Syscall: "socket", Arg: 2, Value: unix.IPPROTO_MPTCP, Ret: retEPERM},
		{Syscall: "socketpair", Arg: 0, Value: unix.AF_ALG, Ret: retEPERM},
	}
	for _, name := range slices.Sorted(maps.Keys(Ioctls)) {
		rs = append(rs, argRule{Syscall: "ioctl", Arg: 1, Mask: ioctlTypeNr, Value: Ioctls[name] & ioctlTypeNr, Ret: retEPERM})
	}
	return rs
}

// Offsets in struct seccomp_data.
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

// Seccomp assembles the profile, with deny's system calls denied too,
// into a classic BPF program for seccomp(2), as the kernel's struct
// sock_filter array (8 bytes an instruction, native byte order).
// Programs are assembled once per deny list; callers must not change
// what they get.
func Seccomp(deny []string) ([]byte, error) {
	key := strings.Join(deny, ",")
	if prog, ok := profiles.Load(key); ok {
		return prog.([]byte), nil
	}
	prog, err := assemble(deny)
	if err == nil {
		profiles.Store(key, prog)
	}
	return prog, err
}

var profiles sync.Map // deny list -> program

func assemble(deny []string) ([]byte, error) {
	a, err := nativeArch()
	if err != nil {
		return nil, err
	}
	known := func(names []string) []string {
		var out []string
		for _, n := range names {
			if _, ok := a.SyscallNames[n]; ok && !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
		return out
	}
	for _, n := range deny {
		if err := checkDeny(n); err != nil {
			return nil, fmt.Errorf("syscalls.deny: %v: %w", err, errdefs.ErrInvalidArgument)
		}
	}
	refused := known(append(slices.Clone(Denied), deny...))
	allow := map[int]bool{}
	for _, n := range known(allowed) {
		if !slices.Contains(refused, n) {
			allow[a.SyscallNames[n]] = true
		}
	}

	// Ours first: another architecture or the x32 ABI is killed; then
	// the argument rules, each on the low 32 bits.
	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(a.ID), SkipTrue: 1},
		bpf.RetConstant{Val: retKill},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
	}
	if a.ID == arch.X86_64.ID {
		prog = append(prog,
			bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: uint32(arch.X32.SeccompMask), SkipFalse: 1},
			bpf.RetConstant{Val: retKill})
	}
	for _, r := range argRules() {
		nr, ok := a.SyscallNames[r.Syscall]
		if !ok || slices.Contains(refused, r.Syscall) { // refused whole by the tree below
			continue
		}
		var check []bpf.Instruction
		switch {
		case r.Always:
			check = []bpf.Instruction{bpf.RetConstant{Val: r.Ret}}
		case r.Allow != nil:
			// ld Arg; jne Value -> ld nr; ld AllowArg; jeq each -> allow;
			// ret Ret; allow: ret ALLOW; ld nr.
			n := len(r.Allow)
			check = append(check, bpf.LoadAbsolute{Off: offArgs + 8*r.Arg + loOffset(), Size: 4},
				bpf.JumpIf{Cond: bpf.JumpEqual, Val: r.Value, SkipFalse: uint8(3 + n)},
				bpf.LoadAbsolute{Off: offArgs + 8*r.AllowArg + loOffset(), Size: 4})
			for i, v := range r.Allow {
				check = append(check, bpf.JumpIf{Cond: bpf.JumpEqual, Val: v, SkipTrue: uint8(n - i)})
			}
			check = append(check, bpf.RetConstant{Val: r.Ret}, bpf.RetConstant{Val: unix.SECCOMP_RET_ALLOW},
				bpf.LoadAbsolute{Off: offNr, Size: 4})
		default:
			check = append(check, bpf.LoadAbsolute{Off: offArgs + 8*r.Arg + loOffset(), Size: 4})
			switch {
			case r.AnyBit:
				check = append(check, bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: r.Mask, SkipFalse: 1})
			case r.Mask != 0:
				check = append(check, bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: r.Mask},
					bpf.JumpIf{Cond: bpf.JumpEqual, Val: r.Value, SkipFalse: 1})
			default:
				check = append(check, bpf.JumpIf{Cond: bpf.JumpEqual, Val: r.Value, SkipFalse: 1})
			}
			check = append(check, bpf.RetConstant{Val: r.Ret}, bpf.LoadAbsolute{Off: offNr, Size: 4})
		}
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(nr), SkipTrue: uint8(len(check))})
		prog = append(prog, check...)
	}
	last := slices.Max(slices.Collect(maps.Values(a.SyscallNames)))
	raw, err := bpf.Assemble(append(prog, searchTree(allow, last)...))
	if err != nil {
		return nil, fmt.Errorf("assemble the seccomp profile: %w", err)
	}
	if len(raw) > unix.BPF_MAXINSNS {
		return nil, fmt.Errorf("the seccomp profile has %d instructions, more than the kernel's %d: %w", len(raw), unix.BPF_MAXINSNS, errdefs.ErrInvalidArgument)
	}
	return encode(raw), nil
}

// searchTree is the profile's verdict on the system call number in A:
// the numbers in allow are let through, all others refused (EPERM). A
// chain of one comparison per call, as go-seccomp-bpf emits, makes the
// kernel walk up to ~450 of them for every number when it loads the
// filter and caches which calls it always allows (half a millisecond a
// sandbox here); this is a binary search over the ranges of numbers
// that share a verdict, a few comparisons each. Numbers past last are
// refused. TestSearchTree holds it to the library's chain.
func searchTree(allow map[int]bool, last int) []bpf.Instruction {
	type span struct{ lo, ret uint32 }
	var spans []span
	for nr := 0; nr <= last+1; nr++ {
		ret := retEPERM
		if allow[nr] {
			ret = unix.SECCOMP_RET_ALLOW
		}
		if len(spans) == 0 || spans[len(spans)-1].ret != ret {
			spans = append(spans, span{uint32(nr), ret})
		}
	}
	var emit func([]span) []bpf.Instruction
	emit = func(s []span) []bpf.Instruction {
		if len(s) == 1 {
			return []bpf.Instruction{bpf.RetConstant{Val: s[0].ret}}
		}
		mid := len(s) / 2
		left, right := emit(s[:mid]), emit(s[mid:])
		var out []bpf.Instruction
		if len(left) <= 255 {
			out = append(out, bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: s[mid].lo, SkipTrue: uint8(len(left))})
		} else {
			out = append(out, bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: s[mid].lo, SkipFalse: 1},
				bpf.Jump{Skip: uint32(len(left))})
		}
		return append(append(out, left...), right...)
	}
	return emit(spans)
}

// loOffset is where an argument's low 32 bits are in its 8 bytes.
func loOffset() uint32 {
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return 0
	}
	return 4
}

// SeccompDeny assembles a small filter that denies names (EPERM) and
// lets everything else through to the filters under it: what a policy
// applied to a running sandbox stacks on the profile its init already
// holds (seccomp runs every filter and the strictest answer wins).
func SeccompDeny(names []string) ([]byte, error) {
	for _, n := range names {
		if err := checkDeny(n); err != nil {
			return nil, fmt.Errorf("syscalls.deny: %v: %w", err, errdefs.ErrInvalidArgument)
		}
	}
	p := seccomp.Policy{DefaultAction: seccomp.ActionAllow, Syscalls: []seccomp.SyscallGroup{{Names: names, Action: seccomp.ActionErrno}}}
	ins, err := p.Assemble()
	if err != nil {
		return nil, fmt.Errorf("assemble the seccomp filter: %w", err)
	}
	raw, err := bpf.Assemble(ins)
	if err != nil {
		return nil, fmt.Errorf("assemble the seccomp filter: %w", err)
	}
	return encode(raw), nil
}

func encode(raw []bpf.RawInstruction) []byte {
	out := make([]byte, 0, 8*len(raw))
	for _, in := range raw {
		out = binary.NativeEndian.AppendUint16(out, in.Op)
		out = append(out, in.Jt, in.Jf)
		out = binary.NativeEndian.AppendUint32(out, in.K)
	}
	return out
}
