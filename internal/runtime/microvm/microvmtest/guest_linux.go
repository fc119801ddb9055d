package microvmtest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
)

// A package's tests can run on a host of another kind than this one: in
// a guest booted on the microVM backend's kernel, whose only cgroup
// hierarchy is cgroup2 with every controller on it (a pure v2 host; this
// one bounds memory with v1). RunInGuest boots the package's test binary,
// built static, as the guest's /init; MaybeGuest, first in the package's
// TestMain, makes that guest a host to test on and runs the tests there.

// guestEnv marks a test binary that is a guest's pid 1 (the kernel's
// command line sets it for /init).
const guestEnv = "DSEC_TEST_GUEST"

// exitMark starts the console line that carries the tests' exit code.
const exitMark = "DSEC-GUEST-EXIT "

// MaybeGuest returns at once but in a guest RunInGuest booted. There it
// mounts what a host has (/proc, /sys, /dev, cgroup2 alone at
// /sys/fs/cgroup, /tmp on an ext4 scratch disk), on a root of tmpfs (the
// initramfs's root cannot be pivoted from, and sandboxes pivot), runs m's
// tests, writes their exit code to the console and ends the guest.
func MaybeGuest(m *testing.M) {
	if os.Getpid() != 1 || os.Getenv(guestEnv) != "1" {
		return
	}
	os.Unsetenv(guestEnv) // for no child to take itself for pid 1's tests
	code := 1
	if err := guestHost(); err != nil {
		fmt.Printf("the guest as a host to test on: %v\n", err)
	} else {
		code = m.Run()
	}
	fmt.Printf("\n%s%d\n", exitMark, code)
	unix.Sync()
	// QEMU runs with -no-reboot: a restart ends it.
	unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	select {}
}

// guestHost makes the initramfs's root a host's: it moves what is in it
// to a tmpfs, which becomes the root, and mounts the rest there.
func guestHost() error {
	if err := unix.Mount("devtmpfs", "/dev", "devtmpfs", 0, ""); err != nil { // /dev/null for exec
		return fmt.Errorf("mount /dev: %w", err)
	}
	if err := agent.LoadModules("/modules"); err != nil { // the scratch disk's
		return err
	}
	if err := os.MkdirAll("/newroot", 0o755); err != nil {
		return err
	}
	if err := unix.Mount("root", "/newroot", "tmpfs", 0, "mode=0755"); err != nil {
		return fmt.Errorf("tmpfs root: %w", err)
	}
	for _, f := range []string{"init", "bin/busybox"} {
		if err := copyFile("/"+f, "/newroot/"+f); err != nil {
			return err
		}
	}
	for _, d := range []string{"proc", "sys", "dev", "tmp", "etc", "sbin", "usr/bin", "usr/sbin"} {
		if err := os.MkdirAll("/newroot/"+d, 0o755); err != nil {
			return err
		}
	}
	// Every applet busybox has, as the host's commands.
	out, err := exec.Command("/bin/busybox", "--list-full").Output()
	if err != nil {
		return fmt.Errorf("busybox --list-full: %w", err)
	}
	for _, a := range strings.Fields(string(out)) {
		if _, err := os.Lstat("/newroot/" + a); err == nil {
			continue
		}
		os.Symlink("/bin/busybox", "/newroot/"+a)
	}
	if err := os.WriteFile("/newroot/etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\n"), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile("/newroot/etc/group", []byte("root:x:0:\n"), 0o644); err != nil {
		return err
	}
	// switch_root: the tmpfs over /, and / the tmpfs.
	if err := os.Chdir("/newroot"); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	os.Setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
	os.Setenv("TMPDIR", "/tmp")
	os.Setenv("HOME", "/")
	for _, mnt := range []struct{ src, dir, fs, data string }{
		{"proc", "/proc", "proc", ""},
		{"sysfs", "/sys", "sysfs", ""},
		{"devtmpfs", "/dev", "devtmpfs", ""},
		{"cgroup2", "/sys/fs/cgroup", "cgroup2", ""},
	} {
		if err := unix.Mount(mnt.src, mnt.dir, mnt.fs, 0, mnt.data); err != nil {
			return fmt.Errorf("mount %s: %w", mnt.dir, err)
		}
	}
	// /tmp on the scratch disk, a file system whose page cache the
	// kernel can reclaim (a tmpfs's it cannot, with no swap).
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if _, err = os.Stat(scratchDev); err == nil {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("the scratch disk: %w", err)
	}
	if out, err := exec.Command("mke2fs", "-q", "-F", scratchDev).CombinedOutput(); err != nil {
		return fmt.Errorf("mke2fs %s: %v: %s", scratchDev, err, out)
	}
	if err := unix.Mount(scratchDev, "/tmp", "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount /tmp: %w", err)
	}
	if err := os.Chmod("/tmp", 0o1777); err != nil {
		return err
	}
	return nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// scratchDev is the guest's scratch disk, its /tmp.
const scratchDev = "/dev/vda"

// Guest is what RunInGuest boots.
type Guest struct {
	// Memory and CPUs are the guest's (default 768 MiB, 2); Disk the
	// size of its /tmp (default 1 GiB).
	Memory, Disk int64
	CPUs         int
	// Timeout bounds a boot (default 10 minutes); Stall how long its
	// console may say nothing (default 3 minutes).
	Timeout, Stall time.Duration
}

// RunInGuest runs the tests of the package pkg (a path from the
// repository's root, "./internal/runtime/cgroup") that match run, in a
// guest: the package's test binary, built static (no -race: its runtime
// needs the host's libraries), boots as /init on the microVM backend's
// kernel, and MaybeGuest in its TestMain runs them. The guest's console
// goes to t's log; t fails when the tests do. Under TCG a boot takes
// seconds, and the tests run some times slower than on the host.
func RunInGuest(t *testing.T, g Guest, pkg, run string) {
	t.Helper()
	s := Settings(t)
	h, err := microvm.Resolve(s)
	if err != nil {
		t.Fatal(err)
	}
	if g.Memory == 0 {
		g.Memory = 768 << 20
	}
	if g.Disk == 0 {
		g.Disk = 1 << 30
	}
	if g.CPUs == 0 {
		g.CPUs = 2
	}
	if g.Timeout == 0 {
		g.Timeout = 10 * time.Minute
	}
	if g.Stall == 0 {
		g.Stall = 3 * time.Minute
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, filepath.Base(pkg)+".test")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "test", "-c", "-trimpath", "-o", bin, pkg)
	build.Dir = repo()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build %s's tests for the guest: %v: %s", pkg, err, out)
	}
	initrd, err := microvm.Initramfs(dir, h.Kernel, bin)
	if err != nil {
		t.Fatal(err)
	}
	accel, cpu := "tcg,tb-size=64", "qemu64"
	if h.Accel.Name == microvm.AccelKVM {
		accel, cpu = "kvm", "host"
	}
	scratch := filepath.Join(dir, "scratch.img")
	if f, err := os.Create(scratch); err != nil {
		t.Fatal(err)
	} else if err := errors.Join(f.Truncate(g.Disk), f.Close()); err != nil {
		t.Fatal(err)
	}
	params := slices.Concat(microvm.KernelParams, []string{guestEnv + "=1", "--", "-test.v", "-test.run=" + run,
		// A test that hangs panics with every goroutine's stack first.
		"-test.timeout=" + (g.Timeout * 9 / 10).String()})
	args := []string{"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-machine", "q35", "-accel", accel, "-cpu", cpu, "-bios", microvm.Firmware,
		"-smp", strconv.Itoa(g.CPUs), "-m", strconv.FormatInt(g.Memory>>20, 10) + "M",
		"-kernel", h.Kernel.Vmlinux(), "-initrd", initrd, "-append", strings.Join(params, " "),
		"-drive", "file=" + scratch + ",if=none,id=scratch,format=raw,cache=unsafe",
		"-device", "virtio-blk-pci,drive=scratch",
		"-serial", "stdio"}
	// A guest whose console says nothing for Stall (or only the kernel's
	// lockup reports) has stopped: a hung test would have panicked with
	// its stacks. Seen once under TCG on a loaded
	// 2-core host (the emulator's vCPUs spun on, starving the host's
	// other tests for the whole timeout): it is stopped then and booted
	// once more, saying so; a second stall fails.
	for try := 1; ; try++ {
		code, stalled := boot(t, h.QEMU, args, g)
		switch {
		case stalled && try == 1:
			t.Logf("GUEST STALLED: its console printed nothing but lockup reports for %v; QEMU stopped, booting the guest once more", g.Stall)
			if err := os.Truncate(scratch, 0); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(scratch, g.Disk); err != nil {
				t.Fatal(err)
			}
			continue
		case stalled:
			t.Fatalf("the guest stalled again: its console printed nothing but lockup reports for %v", g.Stall)
		case code != 0:
			t.Fatalf("the tests in the guest failed (exit %d): see its console above", code)
		}
		return
	}
}

// lockupReport says whether a console line is the kernel's report of a
// CPU stuck (its soft lockup and RCU stall detectors): a guest whose
// console says only that for Stall has stalled as one that says nothing
// (seen once under TCG on a loaded 2-core host: a vCPU stuck from 24 s
// after boot to the timeout, reporting it every 28 s).
func lockupReport(line string) bool {
	_, rest, _ := strings.Cut(line, "] ")
	return strings.HasPrefix(rest, "rcu: ") || strings.HasPrefix(rest, "watchdog: BUG: soft lockup")
}

// boot runs the guest once and returns its tests' exit code, or stalled
// when its console printed nothing for g.Stall but the kernel's reports
// of a CPU stuck.
func boot(t *testing.T, qemu string, args []string, g Guest) (code int, stalled bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), g.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var quiet atomic.Bool
	watch := time.AfterFunc(g.Stall, func() { quiet.Store(true); cancel() })
	defer watch.Stop()
	code = -1
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		if !lockupReport(line) { // (a kernel that only reports its own stall is stalled)
			watch.Reset(g.Stall)
		}
		if c, ok := strings.CutPrefix(line, exitMark); ok {
			code, _ = strconv.Atoi(strings.TrimSpace(c))
		}
		t.Log("guest: " + line)
	}
	err = cmd.Wait()
	switch {
	case quiet.Load():
		return -1, true
	case ctx.Err() != nil:
		t.Fatalf("the guest ran past %v: killed", g.Timeout)
	case code == -1:
		t.Fatalf("the guest ended without the tests' exit code (QEMU: %v)", err)
	}
	return code, false
}
