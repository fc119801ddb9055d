package runtime_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/policy"
	dsecrt "github.com/dsec-project/dsec/internal/runtime"
)

// buildAttacker builds the attack command statically into a toolkit
// layer, attack:1, at /opt/attack/attack.
func buildAttacker(t *testing.T, f *snapFixture) string {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "opt", "attack", "attack")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/dsec-project/dsec/internal/policy/attack")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the attacker: %v: %s", err, out)
	}
	ref, _ := layer.ParseRef("attack:1")
	if _, err := layer.Build(context.Background(), f.s, layer.BuildOptions{Source: dir, Kind: layer.KindToolkit, Ref: ref}); err != nil {
		t.Fatal(err)
	}
	return bin
}

// results parses the attacker's lines: attempt -> errno or "ok".
func results(t *testing.T, out string) map[string]string {
	t.Helper()
	r := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		name, res, ok := strings.Cut(l, "\t")
		if !ok {
			t.Fatalf("attacker said %q", out)
		}
		r[name] = res
	}
	return r
}

// xfsImage makes and loop-mounts a small XFS file system (reflink on,
// and the exchange-range feature, which this mkfs.xfs cannot set yet).
func xfsImage(t *testing.T) (dir, dev string) {
	t.Helper()
	return fsImage(t, "xfs")
}

// fsImage makes a small file system of type fstype on a loop device and
// mounts it: xfs (with exchange-range), ext4 or btrfs.
func fsImage(t *testing.T, fstype string) (dir, dev string) {
	t.Helper()
	mkfs := "mkfs." + fstype
	if _, err := exec.LookPath(mkfs); err != nil {
		t.Fatalf("%s is missing: make deps installs xfsprogs, e2fsprogs and btrfs-progs", mkfs)
	}
	img := filepath.Join(t.TempDir(), fstype+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(img, 320<<20)
	args := map[string][]string{"xfs": {"-q"}, "ext4": {"-q", "-b", "4096"}, "btrfs": {"-q"}}[fstype]
	if out, err := exec.Command(mkfs, append(args, img)...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", mkfs, err, out)
	}
	if fstype == "xfs" {
		xfsExchange(t, img)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	dev = strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	dir = t.TempDir()
	if err := unix.Mount(dev, dir, fstype, 0, ""); err != nil {
		t.Fatalf("mount %s: %v", fstype, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	os.WriteFile(filepath.Join(dir, "a"), []byte(fstype+" data"), 0o644)
	return dir, dev
}

// xfsExchange sets XFS_SB_FEAT_INCOMPAT_EXCHRANGE (1<<6) in the primary
// superblock of img and its checksum again: xfsprogs 6.10's `mkfs.xfs -i
// exchange=1`, which Debian 12's 6.1 lacks.
func xfsExchange(t *testing.T, img string) {
	t.Helper()
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sb := make([]byte, 512)
	if _, err := f.ReadAt(sb, 0); err != nil {
		t.Fatal(err)
	}
	const incompat, crc = 216, 224 // sb_features_incompat (big endian), sb_crc (crc32c, little endian)
	binary.BigEndian.PutUint32(sb[incompat:], binary.BigEndian.Uint32(sb[incompat:])|1<<6)
	binary.LittleEndian.PutUint32(sb[crc:], 0)
	binary.LittleEndian.PutUint32(sb[crc:], crc32.Checksum(sb, crc32.MakeTable(crc32.Castagnoli)))
	if _, err := f.WriteAt(sb, 0); err != nil {
		t.Fatal(err)
	}
}

// mountInto mounts an XFS device at target inside the mount namespace of
// pid (the sandbox's init), as a test harness would hand it a volume.
func mountInto(t *testing.T, pid int, dev, target string) {
	t.Helper()
	mountFSInto(t, pid, "xfs", dev, target)
}

// mountFSInto mounts a file system of type fstype from source at target
// inside the mount namespace of pid, without nodev.
func mountFSInto(t *testing.T, pid int, fstype, source, target string) {
	t.Helper()
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	fs, err := unix.Fsopen(fstype, unix.FSOPEN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fs)
	if err := unix.FsconfigSetString(fs, "source", source); err != nil {
		t.Fatal(err)
	}
	if err := unix.FsconfigCreate(fs); err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	errc := make(chan error)
	var enter func()
	enter = func() {
		// This thread enters the sandbox's mount namespace and dies with
		// the goroutine: never unlocked. Not the main thread, which Go
		// parks instead of ending: the namespace, and every mount in it
		// (a sandbox's overlay, the uppers file system under it), would
		// live as long as the test binary.
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() { // held here, so another thread runs it
			done := make(chan struct{})
			go func() { enter(); close(done) }()
			<-done
			runtime.UnlockOSThread()
			return
		}
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- err
			return
		}
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNS); err != nil {
			errc <- err
			return
		}
		os.MkdirAll(target, 0o755)
		errc <- unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH)
	}
	go enter()
	if err := <-errc; err != nil {
		t.Fatalf("mount %s into the sandbox: %v", fstype, err)
	}
}

// TestAttackSuite runs the attacker as root inside a sandbox under a
// policy, and as positive controls outside: as root on the host with
// nothing in its way (every attempt reaches the kernel), and on the
// host under the sandbox's seccomp profile alone (with every
// capability: the profile, not missing capabilities, stops it).
func TestAttackSuite(t *testing.T) {
	f := newSnapFixture(t)
	bin := buildAttacker(t, f)
	xfsDir, xfsDev := xfsImage(t)
	ext4Dir, ext4Dev := fsImage(t, "ext4")
	btrfsDir, btrfsDev := fsImage(t, "btrfs")

	denied := append(append([]string(nil), policy.Denied...), "unshare(CLONE_NEWUSER)", "clone(CLONE_NEWNET)", "AF_ALG", "AF_PACKET",
		"AF_VSOCK", "SOCK_RAW", "MPTCP socket", "connect mptcp", "TIOCSTI, high half set", "SOCK_RAW AF_INET6",
		"NETLINK_KOBJECT_UEVENT", "NETLINK_AUDIT", "NETLINK_CONNECTOR", "NETLINK_NETFILTER", "NETLINK_XFRM")
	for name := range policy.Ioctls {
		denied = append(denied, name)
	}
	// unshare(CLONE_NEWUTS) is a namespace too.
	denied = append(denied, "unshare(CLONE_NEWUTS)")

	// Control 1: the host, root, in namespaces of its own so that what
	// goes through changes nothing.
	blk := blockDevices(t, xfsDev)
	abstract, err := net.Listen("unix", "@dsec-attack-"+fmt.Sprint(os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	defer abstract.Close()
	escape := []string{"-hostpid", fmt.Sprint(os.Getpid()), "-abstract", strings.TrimPrefix(abstract.Addr().String(), "@")}
	// The host control opens the /proc entries of a process of its own.
	target := exec.Command("sleep", "60")
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { target.Process.Kill(); target.Wait() }()
	hostArgs := []string{"-dir", t.TempDir(), "-xfs", xfsDir, "-tcp", "127.0.0.1:1", "-udp", "127.0.0.1:9", "-devdir", t.TempDir(), "-blk", blk,
		"-ext4", ext4Dir, "-btrfs", btrfsDir}
	hostArgs = append(hostArgs, append(escape, "-initpid", fmt.Sprint(target.Process.Pid))...)
	// Its output a file, as the journal's files were a command's: the
	// journal attempts go through.
	output := func(cmd *exec.Cmd) (string, error) {
		f, err := os.CreateTemp(t.TempDir(), "out")
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cmd.Stdout = f
		err = cmd.Run()
		b, _ := os.ReadFile(f.Name())
		return string(b), err
	}
	cmd := exec.Command(bin, hostArgs...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS}
	out, err := output(cmd)
	if err != nil {
		t.Fatalf("attacker on the host: %v", err)
	}
	host := results(t, out)
	for name, res := range host {
		if res == "EPERM" || (name == "clone3" && res == "ENOSYS") || (strings.HasPrefix(name, "NETLINK_") && res == "EPROTONOSUPPORT") {
			t.Errorf("positive control: %s was refused on the host (%s): the attempt proves nothing", name, res)
		}
	}

	// Control 2: the host, root with every capability, under the profile.
	prog, err := policy.Seccomp(nil)
	if err != nil {
		t.Fatal(err)
	}
	pf := filepath.Join(t.TempDir(), "profile")
	os.WriteFile(pf, prog, 0o600)
	cmd = exec.Command(bin, append(hostArgs, "-seccomp", pf)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS}
	if out, err = output(cmd); err != nil {
		t.Fatalf("attacker under the profile: %v", err)
	}
	filtered := results(t, out)

	// The sandbox: root inside, under a policy allowing one TCP port.
	pol, err := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: 127.0.0.1/32\n    ports: [18081]\n    protocol: tcp\n"))
	if err != nil {
		t.Fatal(err)
	}
	// Its upper on the shared uppers file system, under a small bound
	// the attacker tries to lift.
	sb := f.create(dsecrt.Spec{Name: "attacked", Layers: []string{"attack:1", "bb:1"}, Policy: pol, DiskBound: 64 << 20})
	mountInto(t, sb.Current().Pid, xfsDev, "/mnt/xfs")
	mountFSInto(t, sb.Current().Pid, "ext4", ext4Dev, "/mnt/ext4")
	mountFSInto(t, sb.Current().Pid, "btrfs", btrfsDev, "/mnt/btrfs")
	run := func(args ...string) map[string]string {
		e, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: fmt.Sprint("attack-", f.n), Args: append([]string{"/opt/attack/attack"}, args...)})
		f.n++
		if err != nil {
			t.Fatal(err)
		}
		if res, err := e.Result(context.Background()); err != nil || res.ExitCode != 0 {
			errb, _ := os.ReadFile(e.StderrPath())
			t.Fatalf("attacker in the sandbox: %v %+v %s", err, res, errb)
		}
		b, _ := os.ReadFile(e.StdoutPath())
		return results(t, string(b))
	}
	// A volume a harness hands the sandbox, without nodev: there only
	// the device allowlist stands between a node and its device.
	mountFSInto(t, sb.Current().Pid, "tmpfs", "tmpfs", "/mnt/dev")
	inside := run("-dir", "/tmp", "-xfs", "/mnt/xfs", "-tcp", "127.0.0.1:18082", "-udp", "127.0.0.1:53", "-devdir", "/mnt/dev", "-blk", blk,
		"-ext4", "/mnt/ext4", "-btrfs", "/mnt/btrfs", "-inside", escape[0], escape[1], escape[2], escape[3])
	allowedPort := run("-dir", "/tmp", "-tcp", "127.0.0.1:18081")

	for _, name := range denied {
		h, ok := host[name]
		if !ok {
			continue // not an attempt the attacker makes (a call only a table knows)
		}
		want := "EPERM"
		switch {
		case name == "clone3":
			want = "ENOSYS"
		case strings.HasPrefix(name, "NETLINK_"): // as a kernel without the protocol
			want = "EPROTONOSUPPORT"
		}
		if got := inside[name]; got != want {
			t.Errorf("%s in the sandbox: %s, want %s (host: %s)", name, got, want, h)
		}
		if got := filtered[name]; got != want && !strings.HasPrefix(name, "connect") {
			t.Errorf("%s under the profile alone: %s, want %s (host: %s)", name, got, want, h)
		}
	}
	for _, c := range []struct{ name, want string }{
		{"connect tcp4", "EPERM"},
		{"connect tcp6 to ::ffff:127.0.0.1", "EPERM"},
		{"sendto udp", "EPERM"},
	} {
		if got := inside[c.name]; got != c.want {
			t.Errorf("%s to a port the policy does not allow: %s, want %s (host: %s)", c.name, got, c.want, host[c.name])
		}
	}
	// The allowed port reaches the network (nobody listens: refused).
	for _, name := range []string{"connect tcp4", "connect tcp6 to ::ffff:127.0.0.1"} {
		if got := allowedPort[name]; got != "ECONNREFUSED" {
			t.Errorf("%s to the allowed port: %s, want ECONNREFUSED", name, got)
		}
	}
	if got := inside["NETLINK_ROUTE (allowed)"]; got != "ok" {
		t.Errorf("a NETLINK_ROUTE socket in the sandbox: %s", got)
	}
	// The disk bound: its quota group and subvolume cannot be touched
	// from inside, and it still holds after the attempts.
	quota := 0
	for name, got := range inside {
		if strings.HasPrefix(name, "quota ") {
			quota++
			if got == "ok" {
				t.Errorf("%s in the sandbox: ok (host: %s)", name, host[name])
			}
		}
	}
	if quota != 8 {
		t.Errorf("%d quota attempts in the sandbox, want 8", quota)
	}
	if out, _ := sh(t, sb, "fill", "dd if=/dev/zero of=/tmp/fill bs=1M count=80 2>&1; rm -f /tmp/fill"); !strings.Contains(out, "Disk quota exceeded") {
		t.Errorf("80 MiB under a 64 MiB bound after the attack: %q", out)
	}
	checkDevices(t, host, inside)
	checkEscapes(t, host, inside)
	checkJournal(t, host, inside)
	checkIoctls(t, host, filtered, inside)
	if host["XFS_IOC_SWAPEXT"] == "ENOTTY" {
		t.Errorf("XFS_IOC_SWAPEXT on the host's XFS: ENOTTY: the control did not reach XFS")
	}
	t.Logf("%d attempts; host control %d reached the kernel; inside: %v", len(inside), len(host), inside)
}

// checkEscapes holds the escape classes' attempts to what the sandbox
// must answer; those that reach the host from the host show the attempt
// is real (the ones that would change the host run only inside).
func checkEscapes(t *testing.T, host, inside map[string]string) {
	t.Helper()
	for name, want := range map[string]string{
		"init's mem": "EACCES", "init's environ": "EACCES", "init's root": "EACCES", "init's cwd": "EACCES",
		"init's fd 0": "EACCES", "mount cgroup": "EPERM", "signal a host process": "ESRCH",
		"connect a host abstract socket": "ECONNREFUSED", "write init's exe": "EACCES", "write own exe": "ETXTBSY",
		"write core_pattern": "EROFS", "write modprobe": "EROFS|ENOENT", "write uevent_helper": "EROFS|ENOENT",
		"write drop_caches": "EROFS", "write release_agent": "ENOENT", "remove /dev/null": "EBUSY",
		"mknod over /dev/null's mount": "EEXIST",
	} {
		if got := inside[name]; !slices.Contains(strings.Split(want, "|"), got) {
			t.Errorf("%s in the sandbox: %s, want %s (host: %s)", name, got, want, host[name])
		}
		if h, ok := host[name]; ok && h != "ok" && name != "mount cgroup" {
			t.Errorf("positive control: %s on the host: %s", name, h)
		}
	}
}

// checkJournal holds the attempts on the exec journal to what a
// command's pipes answer; from the host, whose output is a file, each
// goes through.
func checkJournal(t *testing.T, host, inside map[string]string) {
	t.Helper()
	for name, want := range map[string]string{
		"stdout a file": "not a file", "stdout a host path": "pipe", "fallocate stdout": "ESPIPE", "ftruncate stdout": "EINVAL",
		"pwrite stdout": "ESPIPE", "truncate stdout by its /proc link": "EINVAL", "init's fd links": "EACCES",
	} {
		if got := inside[name]; got != want {
			t.Errorf("%s in the sandbox: %s, want %s (host: %s)", name, got, want, host[name])
		}
		if h := host[name]; h != "ok" {
			t.Errorf("positive control: %s on the host: %s", name, h)
		}
	}
}

// checkIoctls holds the content-exchange attempts to the profile: each
// made for real on its file system changes the files on the host ("ok")
// and is refused under the profile alone and in the sandbox; each denied
// request with other direction and size bits is refused too.
func checkIoctls(t *testing.T, host, filtered, inside map[string]string) {
	t.Helper()
	real := map[string]bool{}
	for name, h := range host {
		fs, req, _ := strings.Cut(name, " ")
		isReal := fs == "xfs" || fs == "ext4" || fs == "btrfs"
		if !isReal && !strings.Contains(name, " variant ") {
			continue
		}
		if isReal {
			real[req] = true
			if h != "ok" {
				t.Errorf("positive control: %s on the host: %s, want ok (the kernel acting on it)", name, h)
			}
		}
		if filtered[name] != "EPERM" || inside[name] != "EPERM" {
			t.Errorf("%s: %s under the profile, %s in the sandbox, want EPERM (host: %s)", name, filtered[name], inside[name], h)
		}
	}
	for name := range policy.Ioctls {
		if !real[name] && !strings.HasPrefix(name, "TIOC") {
			t.Errorf("%s is denied but never made for real on a file system", name)
		}
	}
}

// blockDevices names the host's block devices the attacker makes nodes
// of: the loop device holding a disk (another sandbox's, in life), the
// host's first disk, and nbd (which need not exist: the open must be
// refused before any driver is asked).
func blockDevices(t *testing.T, loop string) string {
	t.Helper()
	devOf := func(sys string) string {
		b, err := os.ReadFile(filepath.Join(sys, "dev"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	out := []string{"loop=" + devOf("/sys/class/block/"+filepath.Base(loop)), "nbd=43:0"}
	// The first disk the host lets its root open (these VMs' host
	// refuses its own root disk to root: no control could show it).
	var disks []string
	for _, pat := range []string{"/sys/block/vd*", "/sys/block/sd*", "/sys/block/nvme*", "/sys/block/xvd*", "/sys/block/zram*"} {
		m, _ := filepath.Glob(pat)
		disks = append(disks, m...)
	}
	for _, d := range disks {
		if f, err := os.Open("/dev/" + filepath.Base(d)); err == nil {
			f.Close()
			out = append(out, "disk="+devOf(d))
			break
		}
		t.Logf("the host refuses its root to open /dev/%s: not an attempt", filepath.Base(d))
	}
	if m, _ := filepath.Glob("/sys/block/dm-*"); len(m) > 0 {
		out = append(out, "dm="+devOf(m[0]))
	}
	return strings.Join(out, ",")
}

// checkDevices holds the attacker's device attempts to the allowlist: on
// the host every node opens (or its driver answers), so the attempt
// reaches a device; in the sandbox root may make any node, the allowlist
// refuses its open (EPERM) where the mount would allow it, and the
// sandbox's own root, nodev, refuses it first (EACCES); /dev opens.
func checkDevices(t *testing.T, host, inside map[string]string) {
	t.Helper()
	n := 0
	for name, h := range host {
		dev, ok := strings.CutPrefix(name, "open ")
		if !ok || strings.HasPrefix(dev, "/dev/") || strings.HasSuffix(dev, " (nodev)") {
			continue
		}
		n++
		if h == "EPERM" || h == "EACCES" {
			t.Errorf("positive control: open %s on the host: %s: the attempt proves nothing", dev, h)
		}
		if got := inside["mknod "+dev]; got != "ok" {
			t.Errorf("mknod %s in the sandbox: %s, want ok (made, never opened)", dev, got)
		}
		if got := inside[name]; got != "EPERM" {
			t.Errorf("open %s in the sandbox on a mount without nodev: %s, want EPERM (host: %s)", dev, got, h)
		}
		if got := inside[name+" (nodev)"]; got != "EACCES" {
			t.Errorf("open %s made in the sandbox's root: %s, want EACCES (nodev)", dev, got)
		}
	}
	if n < 12 {
		t.Errorf("only %d device attempts", n)
	}
	for _, d := range []string{"null", "zero", "full", "random", "urandom", "ptmx"} {
		if got := inside["open /dev/"+d]; got != "ok" {
			t.Errorf("open /dev/%s in the sandbox: %s", d, got)
		}
	}
	if got := inside["open /dev/tty"]; got != "ENXIO" && got != "ok" { // no controlling terminal: ENXIO
		t.Errorf("open /dev/tty in the sandbox: %s", got)
	}
}

// buildHarness builds harness:1, a toolkit with its own busybox under
// /opt/harness (a tree the base lacks) and /bin/hx (a file in a
// directory the base has), and answers:1, a workspace holding what an
// agent must not read and a test it must not change.
func buildHarness(t *testing.T, f *snapFixture) {
	t.Helper()
	tk := t.TempDir()
	os.MkdirAll(filepath.Join(tk, "opt", "harness", "bin"), 0o755)
	os.MkdirAll(filepath.Join(tk, "bin"), 0o755)
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatalf("busybox-static: %v (make deps installs it)", err)
	}
	os.WriteFile(filepath.Join(tk, "opt", "harness", "bin", "busybox"), bb, 0o755)
	os.WriteFile(filepath.Join(tk, "opt", "harness", "grader.py"), []byte("print('pass')\n"), 0o644)
	os.WriteFile(filepath.Join(tk, "bin", "hx"), []byte("#!/opt/harness/bin/busybox sh\necho genuine hx\n"), 0o755)
	ws := t.TempDir()
	os.MkdirAll(filepath.Join(ws, "answers"), 0o755)
	os.MkdirAll(filepath.Join(ws, "work", "tests"), 0o755)
	os.WriteFile(filepath.Join(ws, "answers", "a.txt"), []byte("the answer\n"), 0o644)
	os.WriteFile(filepath.Join(ws, "secret.txt"), []byte("secret\n"), 0o644)
	os.WriteFile(filepath.Join(ws, "work", "tests", "test.sh"), []byte("exit 0\n"), 0o644)
	for tag, l := range map[string]struct {
		dir  string
		kind layer.Kind
	}{"harness:1": {tk, layer.KindToolkit}, "answers:1": {ws, layer.KindWorkspace}} {
		ref, _ := layer.ParseRef(tag)
		if _, err := layer.Build(context.Background(), f.s, layer.BuildOptions{Source: l.dir, Kind: l.kind, Ref: ref}); err != nil {
			t.Fatal(err)
		}
	}
}

// The agent's attempts on files, as root in the sandbox; each line says
// whether one got through.
const fileAttacks = `
try() { if eval "$2" >/dev/null 2>&1; then echo "$1 ok"; else echo "$1 refused"; fi; }
try toolkit-write 'echo x > /opt/harness/grader.py'
try toolkit-file-write 'echo x > /bin/hx'
try toolkit-file-rm 'rm -f /bin/hx && ! test -e /bin/hx'
try toolkit-rename-parent 'mv /opt /opt.moved'
try read-answers 'cat /answers/a.txt | grep -q answer'
try read-secret 'grep -q secret /secret.txt'
try test-write 'echo "exit 1" > /work/tests/test.sh'
try test-rename-parent 'mv /work /work.moved'
try new-top-level 'mkdir /newdir'
try tmp-write 'echo x > /tmp/x'
try bin-new 'echo x > /bin/newtool'
rm -f /bin/sh && printf '#!/opt/harness/bin/busybox sh\necho pwned\n' > /bin/sh && chmod 755 /bin/sh && echo overwrote-sh
`

// TestFilePolicy runs the file attacks as root in a sandbox under file
// rules and, as the positive control, in one under none (with the
// toolkit writable): every attempt the rules stop goes through there.
// The harness' own exec path survives /bin/sh being overwritten; rules
// applied live hold at once (mounts) or for new processes (Landlock);
// loosening them is refused.
func TestFilePolicy(t *testing.T) {
	f := newSnapFixture(t)
	buildHarness(t, f)
	layers := []string{"harness:1", "answers:1", "bb:1"}
	strict, err := policy.Parse([]byte(`apiVersion: dsec/v1
kind: Policy
files:
  readOnly: [/work/tests]
  hidden: [/answers, /secret.txt]
  readWrite: [/tmp, /bin, /work]
`))
	if err != nil {
		t.Fatal(err)
	}
	open, _ := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nfiles:\n  toolkitWritable: true\n"))
	guarded := f.create(dsecrt.Spec{Name: "guarded", Layers: layers, Policy: strict})
	control := f.create(dsecrt.Spec{Name: "control", Layers: layers, Policy: open})
	live := f.create(dsecrt.Spec{Name: "live", Layers: layers, Policy: open})
	attack := func(sb *dsecrt.Sandbox) map[string]string {
		// The harness runs its own busybox: the agent cannot reach it.
		e, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: fmt.Sprint("files-", f.n),
			Args: []string{"/opt/harness/bin/busybox", "sh", "-c", fileAttacks}})
		f.n++
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Result(context.Background()); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(e.StdoutPath())
		got := map[string]string{}
		for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			k, v, _ := strings.Cut(l, " ")
			got[k] = v
		}
		return got
	}
	want := map[string]string{"toolkit-write": "refused", "toolkit-file-write": "refused", "toolkit-file-rm": "refused",
		"toolkit-rename-parent": "refused", "read-answers": "refused", "read-secret": "refused", "test-write": "refused",
		"test-rename-parent": "refused", "new-top-level": "refused", "tmp-write": "ok", "bin-new": "ok"}
	g, c := attack(guarded), attack(control)
	for k, w := range want {
		if g[k] != w {
			t.Errorf("guarded: %s %s, want %s", k, g[k], w)
		}
		if c[k] != "ok" {
			t.Errorf("positive control: %s %s under no file rules: the attempt proves nothing", k, c[k])
		}
	}
	if _, ok := g["overwrote-sh"]; !ok {
		t.Errorf("the agent could not overwrite /bin/sh in its own sandbox: %v", g)
	}
	out, _ := sh(t, guarded, "after-sh", "true")
	if !strings.Contains(out, "pwned") {
		t.Errorf("/bin/sh after the overwrite printed %q: the overwrite did not take", out)
	}
	e, _, err := guarded.Run(context.Background(), dsecrt.ExecSpec{ID: "harness", Args: []string{"/bin/hx"}})
	if err != nil {
		t.Fatal(err)
	}
	e.Result(context.Background())
	if b, _ := os.ReadFile(e.StdoutPath()); string(b) != "genuine hx\n" {
		t.Errorf("the harness' own command after /bin/sh was overwritten printed %q", b)
	}

	// Live: a sandbox under no file rules takes the strict ones; mounts
	// hold at once, Landlock for processes started from now on.
	rep, err := live.ApplyPolicy(context.Background(), strict)
	if err != nil {
		t.Fatal(err)
	}
	now, later := strings.Join(rep.Now, "\n"), strings.Join(rep.NewProcesses, "\n")
	if !strings.Contains(now, "hidden /answers, /secret.txt") || !strings.Contains(now, "read-only /bin/hx, /opt, /work/tests") ||
		!strings.Contains(later, "writes confined to /tmp, /bin, /work") {
		t.Errorf("report: now %q, new processes %q", now, later)
	}
	if l := attack(live); !maps.Equal(l, g) {
		t.Errorf("after a live apply: %v, want what the sandbox made under the rules got: %v", l, g)
	}
	if _, err := live.ApplyPolicy(context.Background(), open); err == nil || !strings.Contains(err.Error(), "would loosen") {
		t.Errorf("loosening the file rules of a running sandbox: %v", err)
	}
}
