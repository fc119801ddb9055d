package runtime_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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

// xfsImage makes and loop-mounts a small XFS file system, or skips.
func xfsImage(t *testing.T) (dir, dev string) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		t.Fatal("mkfs.xfs is missing: make deps installs xfsprogs")
	}
	img := filepath.Join(t.TempDir(), "xfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(img, 320<<20)
	if out, err := exec.Command("mkfs.xfs", "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v: %s", err, out)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	dev = strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	dir = t.TempDir()
	if err := unix.Mount(dev, dir, "xfs", 0, ""); err != nil {
		t.Fatalf("mount XFS: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	os.WriteFile(filepath.Join(dir, "a"), []byte("xfs data"), 0o644)
	return dir, dev
}

// mountInto mounts an XFS device at target inside the mount namespace of
// pid (the sandbox's init), as a test harness would hand it a volume.
func mountInto(t *testing.T, pid int, dev, target string) {
	t.Helper()
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	fs, err := unix.Fsopen("xfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fs)
	if err := unix.FsconfigSetString(fs, "source", dev); err != nil {
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
	go func() {
		// This thread enters the sandbox's mount namespace and dies with
		// the goroutine: never unlocked.
		runtime.LockOSThread()
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
	}()
	if err := <-errc; err != nil {
		t.Fatalf("mount XFS into the sandbox: %v", err)
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

	denied := append(append([]string(nil), policy.Denied...), "unshare(CLONE_NEWUSER)", "clone(CLONE_NEWNET)", "AF_ALG", "AF_PACKET",
		"AF_VSOCK", "SOCK_RAW", "MPTCP socket", "connect mptcp", "TIOCSTI, high half set")
	for name := range policy.Ioctls {
		denied = append(denied, name)
	}
	// unshare(CLONE_NEWUTS) is a namespace too.
	denied = append(denied, "unshare(CLONE_NEWUTS)")

	// Control 1: the host, root, in namespaces of its own so that what
	// goes through changes nothing.
	hostArgs := []string{"-dir", t.TempDir(), "-xfs", xfsDir, "-tcp", "127.0.0.1:1", "-udp", "127.0.0.1:9"}
	cmd := exec.Command(bin, hostArgs...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("attacker on the host: %v", err)
	}
	host := results(t, string(out))
	for name, res := range host {
		if res == "EPERM" || (name == "clone3" && res == "ENOSYS") {
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
	if out, err = cmd.Output(); err != nil {
		t.Fatalf("attacker under the profile: %v", err)
	}
	filtered := results(t, string(out))

	// The sandbox: root inside, under a policy allowing one TCP port.
	pol, err := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: 127.0.0.1/32\n    ports: [18081]\n    protocol: tcp\n"))
	if err != nil {
		t.Fatal(err)
	}
	sb := f.create(dsecrt.Options{Name: "attacked", Layers: []string{"attack:1", "bb:1"}, Policy: pol})
	mountInto(t, sb.Snapshot().Pid, xfsDev, "/mnt/xfs")
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
	inside := run("-dir", "/tmp", "-xfs", "/mnt/xfs", "-tcp", "127.0.0.1:18082", "-udp", "127.0.0.1:53")
	allowedPort := run("-dir", "/tmp", "-tcp", "127.0.0.1:18081")

	for _, name := range denied {
		h, ok := host[name]
		if !ok {
			continue // not an attempt the attacker makes (a call only a table knows)
		}
		want := "EPERM"
		if name == "clone3" {
			want = "ENOSYS"
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
	if host["XFS_IOC_SWAPEXT"] == "ENOTTY" {
		t.Errorf("XFS_IOC_SWAPEXT on the host's XFS: ENOTTY: the control did not reach XFS")
	}
	t.Logf("%d attempts; host control %d reached the kernel; inside: %v", len(inside), len(host), inside)
}
