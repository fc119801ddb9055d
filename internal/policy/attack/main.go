//go:build linux

// Command attack is the policy test suite's attacker: run as root inside
// a sandbox (or, as the positive control, outside), it tries what a
// sandbox policy must stop and prints one line per attempt: the attempt's
// name and its errno ("ok" when the call went through). It is built by
// the tests, statically, and never shipped.
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

type attempt struct {
	name string
	try  func() error
}

func raw(nr uintptr, args ...uintptr) error {
	var a [6]uintptr
	copy(a[:], args)
	r, _, e := unix.Syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5])
	if e != 0 {
		return e
	}
	if nr == unix.SYS_SOCKET || nr == unix.SYS_FSOPEN || nr == unix.SYS_OPEN_TREE || nr == unix.SYS_USERFAULTFD {
		unix.Close(int(r))
	}
	return nil
}

func str(s string) uintptr {
	p, _ := unix.BytePtrFromString(s)
	return uintptr(unsafe.Pointer(p))
}

func ioctlOn(path string, req uint64) func() error {
	return func() error {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		buf := make([]byte, 256)
		_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&buf[0])))
		if e != 0 {
			return e
		}
		return nil
	}
}

// onThread runs f on a thread of its own that dies after it (unshare
// changes the calling thread).
func onThread(f func() error) error {
	ch := make(chan error)
	go func() {
		runtime.LockOSThread()
		ch <- f()
	}()
	return <-ch
}

func dial(network, addr string) func() error {
	return func() error {
		c, err := net.DialTimeout(network, addr, time.Second)
		if err != nil {
			return err
		}
		if network == "udp" {
			_, err = c.Write([]byte("x"))
		}
		c.Close()
		return err
	}
}

func main() {
	dir := flag.String("dir", os.TempDir(), "a scratch directory")
	xfs := flag.String("xfs", "", "a directory on XFS, for the XFS ioctls")
	ext4 := flag.String("ext4", "", "a directory on ext4, for the ext4 ioctls")
	btrfs := flag.String("btrfs", "", "a directory on Btrfs, for the Btrfs ioctls")
	tcp := flag.String("tcp", "", "HOST:PORT to connect to over TCP, IPv4, IPv4-mapped IPv6 and MPTCP")
	udp := flag.String("udp", "", "HOST:PORT to send a datagram to")
	filter := flag.String("seccomp", "", "load this seccomp program (struct sock_filter array) on every thread first")
	devDir := flag.String("devdir", "", "a directory on a mount without nodev, for device nodes")
	blk := flag.String("blk", "", "NAME=MAJOR:MINOR,... block devices of the host to make and open")
	inside := flag.Bool("inside", false, "also try what would change the host if it went through (only inside a sandbox)")
	hostPid := flag.Int("hostpid", 0, "a process of the host to signal (signal 0)")
	initPid := flag.Int("initpid", 1, "the process whose /proc entries to open (the sandbox's init)")
	abstract := flag.String("abstract", "", "an abstract unix socket of the host to connect to")
	floodKind := flag.String("flood", "", "instead: take kernel memory without end, pipes or tcp")
	floodN := flag.Int("n", 4096, "-flood: how many")
	floodHold := flag.Duration("hold", 0, "-flood: hold them this long before exiting")
	flag.Parse()
	if *floodKind != "" {
		flood(*floodKind, *floodN, *floodHold)
		return
	}
	if *filter != "" {
		if err := loadFilter(*filter); err != nil {
			fmt.Fprintln(os.Stderr, "attack:", err)
			os.Exit(2)
		}
	}
	scratch := filepath.Join(*dir, "attack-scratch")
	os.MkdirAll(scratch, 0o755)
	file := filepath.Join(scratch, "f")
	os.WriteFile(file, []byte("data"), 0o644)
	as := syscallAttempts(scratch, file)
	as = append(as, escapeAttempts(*inside, *initPid, *hostPid, *abstract)...)
	as = append(as, journalAttempts(*initPid)...)
	if *devDir != "" {
		as = append(as, deviceAttempts(*devDir, scratch, *blk)...)
	}
	as = append(as, variantAttempts(file, exchangeRequests)...)
	if *xfs != "" {
		as = append(as, xfsAttempts(*xfs)...)
	}
	if *ext4 != "" {
		as = append(as, ext4Attempts(*ext4)...)
	}
	if *btrfs != "" {
		as = append(as, btrfsAttempts(*btrfs)...)
		as = append(as, quotaAttempts(*btrfs, "quota btrfs")...)
	}
	if *inside { // on the host, dir's file system could be the host's own Btrfs
		as = append(as, quotaAttempts(*dir, "quota upper")...)
	}
	if *tcp != "" {
		as = append(as, tcpAttempts(*tcp)...)
	}
	if *udp != "" {
		as = append(as, udpAttempt(*udp))
	}
	for _, a := range as {
		fmt.Printf("%s\t%s\n", a.name, outcome(a.try()))
	}
	unix.Unmount(scratch, unix.MNT_DETACH)
	os.RemoveAll(scratch)
}

// syscallAttempts are the attempts of every run: system calls, ioctls
// on a file and sockets a sandbox must not have (NETLINK_ROUTE, allowed,
// the control).
func syscallAttempts(scratch, file string) []attempt {
	return []attempt{
		{"mount", func() error { return unix.Mount("none", scratch, "tmpfs", 0, "") }},
		{"umount2", func() error { return unix.Unmount("/nonexistent-dsec", 0) }},
		{"fsopen", func() error { return raw(unix.SYS_FSOPEN, str("tmpfs"), 0) }},
		{"fsconfig", func() error { return raw(unix.SYS_FSCONFIG, ^uintptr(0), 0) }},
		{"fsmount", func() error { return raw(unix.SYS_FSMOUNT, ^uintptr(0), 0, 0) }},
		{"move_mount", func() error { return raw(unix.SYS_MOVE_MOUNT, ^uintptr(0), str(""), ^uintptr(0), str(""), 0) }},
		{"open_tree", func() error { return raw(unix.SYS_OPEN_TREE, atFDCWD, str("/"), 0) }},
		{"mount_setattr", func() error { return raw(unix.SYS_MOUNT_SETATTR, ^uintptr(0), str(""), 0, 0, 0) }},
		{"pivot_root", func() error { return raw(unix.SYS_PIVOT_ROOT, str("/nonexistent-dsec"), str("/nonexistent-dsec")) }},
		{"unshare(CLONE_NEWUTS)", func() error { return onThread(func() error { return unix.Unshare(unix.CLONE_NEWUTS) }) }},
		{"unshare(CLONE_NEWUSER)", func() error { return onThread(func() error { return unix.Unshare(unix.CLONE_NEWUSER) }) }},
		{"setns", func() error { return raw(unix.SYS_SETNS, ^uintptr(0), 0) }},
		{"clone(CLONE_NEWNET)", func() error {
			// The child, if any, exits at once without touching Go state.
			r, _, e := syscall.RawSyscall6(unix.SYS_CLONE, unix.CLONE_NEWNET|uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
			if e == 0 && r == 0 {
				syscall.RawSyscall(unix.SYS_EXIT_GROUP, 0, 0, 0)
			}
			if e != 0 {
				return e
			}
			var ws unix.WaitStatus
			unix.Wait4(int(r), &ws, 0, nil)
			return nil
		}},
		{"clone3", func() error { return raw(unix.SYS_CLONE3, 0, 8) }},
		{"ptrace", func() error { return raw(unix.SYS_PTRACE, unix.PTRACE_PEEKDATA, 0x7ffffff0, 0, 0) }},
		{"process_vm_readv", func() error { return raw(unix.SYS_PROCESS_VM_READV, 0x7ffffff0, 0, 0, 0, 0, 0) }},
		{"bpf", func() error { return raw(unix.SYS_BPF, 0xffff, 0, 0) }},
		{"perf_event_open", func() error { return raw(unix.SYS_PERF_EVENT_OPEN, 0, 0, ^uintptr(0), ^uintptr(0), 0) }},
		{"userfaultfd", func() error { return raw(unix.SYS_USERFAULTFD, 0) }},
		{"keyctl", func() error { return raw(unix.SYS_KEYCTL, 0xffff) }},
		{"add_key", func() error { return raw(unix.SYS_ADD_KEY, 0, 0, 0, 0, 0) }},
		{"request_key", func() error { return raw(unix.SYS_REQUEST_KEY, 0, 0, 0, 0) }},
		{"io_uring_setup", func() error { return raw(unix.SYS_IO_URING_SETUP, 0, 0) }},
		{"kexec_load", func() error { return raw(unix.SYS_KEXEC_LOAD, 0, 0, 0, 0xdead0000) }},
		{"init_module", func() error { return raw(unix.SYS_INIT_MODULE, 0, 0, str("")) }},
		{"finit_module", func() error { return raw(unix.SYS_FINIT_MODULE, ^uintptr(0), str(""), 0) }},
		{"delete_module", func() error { return raw(unix.SYS_DELETE_MODULE, str("dsec_no_such_module"), 0) }},
		{"open_by_handle_at", func() error { return raw(unix.SYS_OPEN_BY_HANDLE_AT, ^uintptr(0), 0, 0) }},
		{"swapon", func() error { return raw(unix.SYS_SWAPON, str("/nonexistent-dsec"), 0) }},
		{"swapoff", func() error { return raw(unix.SYS_SWAPOFF, str("/nonexistent-dsec")) }},
		{"acct", func() error { return raw(unix.SYS_ACCT, str("/nonexistent-dsec/acct")) }},
		{"syslog", func() error { _, err := unix.Klogctl(10, nil); return err }},
		{"FICLONE", ioctlOn(file, unix.FICLONE)},
		{"FICLONERANGE", ioctlOn(file, unix.FICLONERANGE)},
		{"FIDEDUPERANGE", ioctlOn(file, unix.FIDEDUPERANGE)},
		{"EXT4_IOC_MOVE_EXT", ioctlOn(file, 0xc028660f)},
		{"TIOCSTI", ioctlOn(file, unix.TIOCSTI)},
		{"TIOCSTI, high half set", ioctlOn(file, 1<<32|unix.TIOCSTI)},
		{"TIOCLINUX", ioctlOn(file, unix.TIOCLINUX)},
		{"AF_ALG", func() error { return raw(unix.SYS_SOCKET, unix.AF_ALG, unix.SOCK_SEQPACKET, 0) }},
		{"AF_PACKET", func() error { return raw(unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_DGRAM, 0) }},
		{"AF_VSOCK", func() error { return raw(unix.SYS_SOCKET, unix.AF_VSOCK, unix.SOCK_STREAM, 0) }},
		{"SOCK_RAW", func() error { return raw(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_ICMP) }},
		{"MPTCP socket", func() error { return raw(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_MPTCP) }},
		{"SOCK_RAW AF_INET6", func() error { return raw(unix.SYS_SOCKET, unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6) }},
		{"NETLINK_KOBJECT_UEVENT", func() error {
			return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_KOBJECT_UEVENT)
		}},
		{"NETLINK_AUDIT", func() error { return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_AUDIT) }},
		{"NETLINK_CONNECTOR", func() error { return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_CONNECTOR) }},
		{"NETLINK_NETFILTER", func() error { return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_NETFILTER) }},
		{"NETLINK_XFRM", func() error { return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_XFRM) }},
		{"NETLINK_ROUTE (allowed)", func() error { return raw(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE) }},
	}
}

// tcpAttempts connect to tcp over IPv4, IPv4-mapped IPv6 and MPTCP.
func tcpAttempts(tcp string) []attempt {
	host, port, _ := net.SplitHostPort(tcp)
	return []attempt{
		{"connect tcp4", dial("tcp4", tcp)},
		{"connect tcp6 to ::ffff:" + host, func() error {
			// Go's dialer turns a mapped address back into IPv4:
			// this is the IPv6 socket an attacker would open.
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			p, _ := strconv.Atoi(port)
			sa := &unix.SockaddrInet6{Port: p}
			copy(sa.Addr[:], net.ParseIP(host).To16())
			return unix.Connect(fd, sa)
		}},
		{"connect mptcp", func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_MPTCP)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			ap, _ := net.ResolveTCPAddr("tcp4", tcp)
			sa := &unix.SockaddrInet4{Port: ap.Port}
			copy(sa.Addr[:], ap.IP.To4())
			return unix.Connect(fd, sa)
		}},
	}
}

// udpAttempt sends a datagram to udp.
func udpAttempt(udp string) attempt {
	return attempt{"sendto udp", func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ap, _ := net.ResolveUDPAddr("udp4", udp)
		sa := &unix.SockaddrInet4{Port: ap.Port}
		copy(sa.Addr[:], ap.IP.To4())
		return unix.Sendto(fd, []byte("x"), 0, sa)
	}}
}

// outcome is what an attempt's line says of err: ok, the errno's name,
// or the error.
func outcome(err error) string {
	res := "ok"
	if err != nil {
		var e syscall.Errno
		if errors.As(err, &e) && !isOpError(err) {
			res = unix.ErrnoName(e)
		} else if op, ok := err.(*net.OpError); ok {
			res = op.Err.Error()
			if se, ok := op.Err.(*os.SyscallError); ok {
				if e, ok := se.Err.(syscall.Errno); ok {
					res = unix.ErrnoName(e)
				}
			}
		} else {
			res = err.Error()
		}
	}
	return res
}

// escapeAttempts are the classes of published container escapes that
// apply to a sandbox: the runtime's own process reached through /proc
// (runc CVE-2019-5736's binary overwrite, CVE-2016-9962's ptrace of the
// init, "leaky vessels" CVE-2024-21626's inherited descriptors), the
// kernel's host-wide knobs (core_pattern, modprobe, uevent_helper: CDK's
// and deepce's escapes), cgroup v1's release_agent (CVE-2022-0492),
// masked paths undone (runc CVE-2025-31133's /dev/null), the host's
// processes and its abstract unix sockets (containerd-shim CVE-2020-15257).
func escapeAttempts(inside bool, initPid, hostPid int, abstract string) []attempt {
	openAt := func(p string, flags int) func() error {
		return func() error {
			fd, err := unix.Open(p, flags|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
			if err == nil {
				unix.Close(fd)
			}
			return err
		}
	}
	as := []attempt{
		{"init's mem", openAt(fmt.Sprintf("/proc/%d/mem", initPid), unix.O_RDONLY)},
		{"init's environ", openAt(fmt.Sprintf("/proc/%d/environ", initPid), unix.O_RDONLY)},
		{"init's root", openAt(fmt.Sprintf("/proc/%d/root/", initPid), unix.O_RDONLY|unix.O_DIRECTORY)},
		{"init's cwd", openAt(fmt.Sprintf("/proc/%d/cwd/", initPid), unix.O_RDONLY|unix.O_DIRECTORY)},
		{"init's fd 0", openAt(fmt.Sprintf("/proc/%d/fd/0", initPid), unix.O_RDONLY)},
		{"mount cgroup", func() error { return unix.Mount("cgroup", "/nonexistent-dsec", "cgroup", 0, "memory") }},
	}
	if hostPid > 0 {
		as = append(as, attempt{"signal a host process", func() error { return unix.Kill(hostPid, 0) }})
	}
	if abstract != "" {
		as = append(as, attempt{"connect a host abstract socket", func() error {
			fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			return unix.Connect(fd, &unix.SockaddrUnix{Name: "@" + abstract})
		}})
	}
	if !inside {
		return as
	}
	writeTo := func(p, v string) func() error {
		return func() error {
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = f.WriteString(v)
			return err
		}
	}
	return append(as,
		attempt{"write init's exe", writeTo(fmt.Sprintf("/proc/%d/exe", initPid), "x")},
		attempt{"write own exe", writeTo("/proc/self/exe", "")},
		attempt{"write core_pattern", writeTo("/proc/sys/kernel/core_pattern", "|/tmp/x")},
		attempt{"write modprobe", writeTo("/proc/sys/kernel/modprobe", "/tmp/x")},
		attempt{"write uevent_helper", writeTo("/sys/kernel/uevent_helper", "/tmp/x")},
		attempt{"write drop_caches", writeTo("/proc/sys/vm/drop_caches", "3")},
		attempt{"write release_agent", writeTo("/sys/fs/cgroup/memory/release_agent", "/tmp/x")},
		attempt{"remove /dev/null", func() error { return os.Remove("/dev/null") }},
		attempt{"mknod over /dev/null's mount", func() error { return unix.Mknod("/dev/null", unix.S_IFCHR|0o666, int(unix.Mkdev(1, 1))) }},
	)
}

// hostDevices are character devices no sandbox may open.
var hostDevices = []struct {
	name         string
	major, minor uint32
}{
	{"kvm", 10, 232}, {"fuse", 10, 229}, {"loop-control", 10, 237}, {"net/tun", 10, 200}, {"kmsg", 1, 11},
	{"mem", 1, 1}, {"port", 1, 4}, {"input/mice", 13, 63}, {"tty1", 4, 1}, {"ttyS0", 4, 64}, {"console", 5, 1},
}

// deviceAttempts make a node of each device (in dir, on a mount without
// nodev, and in scratch, the sandbox's own root) and open it: "mknod X",
// "open X" and "open X (nodev)".
func deviceAttempts(dir, scratch, blk string) []attempt {
	type dev struct {
		name         string
		mode         uint32
		major, minor uint32
	}
	var devs []dev
	for _, d := range hostDevices {
		devs = append(devs, dev{"c " + d.name, unix.S_IFCHR, d.major, d.minor})
	}
	for _, b := range strings.Split(blk, ",") {
		name, mm, ok := strings.Cut(b, "=")
		var major, minor uint32
		if _, err := fmt.Sscanf(mm, "%d:%d", &major, &minor); !ok || err != nil {
			continue
		}
		devs = append(devs, dev{"b " + name, unix.S_IFBLK, major, minor})
	}
	var as []attempt
	for i, d := range devs {
		for _, where := range []struct{ dir, suffix string }{{dir, ""}, {scratch, " (nodev)"}} {
			p := filepath.Join(where.dir, fmt.Sprintf("dev%d", i))
			if where.suffix == "" {
				as = append(as, attempt{"mknod " + d.name, func() error {
					os.Remove(p)
					return unix.Mknod(p, d.mode|0o600, int(unix.Mkdev(d.major, d.minor)))
				}})
			} else {
				os.Remove(p)
				unix.Mknod(p, d.mode|0o600, int(unix.Mkdev(d.major, d.minor)))
			}
			as = append(as, attempt{"open " + d.name + where.suffix, func() error {
				fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
				if err == nil {
					unix.Close(fd)
				}
				return err
			}})
		}
	}
	// What a sandbox's /dev holds opens.
	for _, n := range []string{"null", "zero", "full", "random", "urandom", "tty", "ptmx"} {
		as = append(as, attempt{"open /dev/" + n, func() error {
			fd, err := unix.Open("/dev/"+n, unix.O_RDWR|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
			if err == nil {
				unix.Close(fd)
			}
			return err
		}})
	}
	return as
}

func isOpError(err error) bool { _, ok := err.(*net.OpError); return ok }

var atFDCWD = func() uintptr { fd := unix.AT_FDCWD; return uintptr(fd) }()

func loadFilter(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	filter := make([]unix.SockFilter, len(b)/8)
	for i := range filter {
		f := b[8*i:]
		filter[i] = unix.SockFilter{Code: binary.NativeEndian.Uint16(f), Jt: f[2], Jf: f[3], K: binary.NativeEndian.Uint32(f[4:])}
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return err
	}
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&prog))); e != 0 {
		return fmt.Errorf("load the filter: %w", e)
	}
	return nil
}
