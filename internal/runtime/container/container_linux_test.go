package container_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

func init() {
	if os.Getenv(spendHelper) == "1" {
		runtime.LockOSThread() // TestSpentThread's child: the main goroutine keeps the main thread
	}
}

const spendHelper = "DSEC_TEST_SPEND_HELPER"

func TestMain(m *testing.M) {
	container.MaybeInit()
	if os.Getenv(spendHelper) == "1" {
		spendOnMainThread()
	}
	if os.Getenv("DSEC_TEST_INIT_HELPER") == "1" { // TestInitBinarySibling's child
		p, err := container.InitBinary()
		fmt.Printf("init binary: %s %v\n", p, err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// spendOnMainThread is TestSpentThread's child: on the main thread, it
// has spend run a function that enters a mount namespace of its own,
// and prints the threads' ids and namespaces.
func spendOnMainThread() {
	if unix.Gettid() != os.Getpid() {
		fmt.Println("not on the main thread")
		os.Exit(1)
	}
	host, _ := os.Readlink("/proc/thread-self/ns/mnt")
	var tid int
	var ns string
	done := make(chan struct{})
	runtime.LockOSThread() // as onSpentThread's goroutine is
	container.Spend(func() {
		tid = unix.Gettid()
		if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		ns, _ = os.Readlink("/proc/thread-self/ns/mnt")
	}, done)
	<-done
	main, _ := os.Readlink("/proc/thread-self/ns/mnt")
	gone := false
	for deadline := time.Now().Add(5 * time.Second); !gone && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid))
		gone = os.IsNotExist(err)
	}
	fmt.Println(os.Getpid(), unix.Gettid(), tid, gone, host, main, ns)
	os.Exit(0)
}

// TestSpentThread: work that leaves its thread in a sandbox's namespace
// (Protect) never runs on the main thread, which Go would park for good
// in that namespace instead of ending it: the main thread stays in the
// host's namespace, and the thread that ran the work ends.
func TestSpentThread(t *testing.T) {
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = append(os.Environ(), spendHelper+"=1")
	out, err := cmd.CombinedOutput()
	f := strings.Fields(string(out))
	if err != nil || len(f) != 7 {
		t.Fatalf("%v: %s", err, out)
	}
	pid, main, tid, gone, host, mainNS, fnNS := f[0], f[1], f[2], f[3], f[4], f[5], f[6]
	switch {
	case main != pid:
		t.Fatalf("the child ran off its main thread: %s", out)
	case tid == pid:
		t.Fatalf("the work ran on the main thread: %s", out)
	case fnNS == host:
		t.Fatalf("the work did not enter a namespace of its own: %s", out)
	case mainNS != host:
		t.Fatalf("the main thread is in namespace %s, not the host's %s", mainNS, host)
	case gone != "true":
		t.Fatalf("the thread %s that ran the work did not end", tid)
	}
}

func busyboxRoot(t *testing.T) string { return layertest.BusyboxRoot(t, t.TempDir()) }

// create starts a sandbox on root and destroys it when the test ends.
func create(t *testing.T, root string) *container.Conn {
	return createSpec(t, container.Spec{Root: root})
}

func createSpec(t *testing.T, spec container.Spec) *container.Conn {
	t.Helper()
	layertest.RequireRoot(t)
	var initErr bytes.Buffer
	spec.Hostname, spec.Stderr, spec.Socket = "sandbox", &initErr, filepath.Join(t.TempDir(), "init.sock")
	sb, err := container.Create(spec)
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	t.Cleanup(func() { sb.Destroy() })
	return sb
}

var ids int

// sh runs a script in the sandbox and returns its output and exit code.
func sh(t *testing.T, sb *container.Conn, script string) (string, int) {
	t.Helper()
	out, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	ids++
	code, err := sb.Exec(context.Background(), container.Cmd{ID: fmt.Sprint("step-", ids), Args: []string{"/bin/sh", "-c", script}, Env: []string{"PATH=/bin"}, Stdout: out, Stderr: out})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(out.Name())
	return string(b), code
}

func run(t *testing.T, root, script string) (string, int) {
	return sh(t, create(t, root), script)
}

func TestIsolation(t *testing.T) {
	layertest.RequireRoot(t)
	root := busyboxRoot(t)
	// A descriptor the parent leaks without CLOEXEC must not reach the
	// sandbox.
	leak, err := os.Open(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	defer leak.Close()
	fd, err := unix.Dup(int(leak.Fd())) // dup clears close-on-exec
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	out, code := run(t, root, `
		echo host=$(hostname)
		echo ifs=$(ls /sys/class/net)
		echo lo=$(cat /sys/class/net/lo/flags)
		echo kallsyms=$(wc -c < /proc/kallsyms)
		echo timers=$(wc -c < /proc/timer_list)
		echo fds=$(ls /proc/self/fd | tr '\n' ' ')
		grep -E '^(CapBnd|CapEff|NoNewPrivs)' /proc/self/status
		echo procs=$(ls /proc | grep -c '^[0-9]')
		mount -t tmpfs tmpfs /tmp 2>/dev/null && echo mount=yes || echo mount=no
		echo 1 > /proc/sys/kernel/hostname 2>/dev/null && echo sysctl=yes || echo sysctl=no
		cat /proc/1/environ >/dev/null 2>&1 && echo initenv=yes || echo initenv=no
		readlink /proc/1/exe >/dev/null 2>&1 && echo initexe=yes || echo initexe=no
		ls /dev | tr '\n' ' '; echo
		exit 7`)
	if code != 7 {
		t.Fatalf("exit code %d, want 7\n%s", code, out)
	}
	// The kept set: chown dac_override fowner fsetid kill setgid setuid
	// setpcap net_bind_service sys_chroot mknod audit_write setfcap.
	for _, want := range []string{"host=sandbox\n", "ifs=lo\n", "lo=0x9\n", "kallsyms=0\n", "timers=0\n",
		"mount=no\n", "sysctl=no\n", "initenv=no\n", "initexe=no\n", "NoNewPrivs:\t1\n", "CapBnd:\t00000000a80405fb\n", "CapEff:\t00000000a80405fb\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if f, ok := strings.CutPrefix(line, "fds="); ok && strings.TrimSpace(f) != "0 1 2 3" { // 3: ls's own directory
			t.Errorf("sandbox sees descriptors %q, want only 0 1 2 (and ls's own)", f)
		}
		// init, sh, the $(...) subshell, ls and grep: the host has hundreds.
		if n, ok := strings.CutPrefix(line, "procs="); ok && len(n) > 1 {
			t.Errorf("sandbox sees %s processes: the host's pid namespace leaks", n)
		}
	}
}

func TestCommandNotFound(t *testing.T) {
	sb := create(t, busyboxRoot(t))
	out, err := os.CreateTemp(t.TempDir(), "err")
	if err != nil {
		t.Fatal(err)
	}
	code, err := sb.Exec(context.Background(), container.Cmd{ID: "x", Args: []string{"no-such-tool"}, Stderr: out})
	b, _ := os.ReadFile(out.Name())
	if err != nil || code != 127 || !strings.Contains(string(b), "command not found") {
		t.Fatalf("exit %d, %v, %q", code, err, b)
	}
}

// TestOOMScores: the OOM killer takes a sandbox's commands before its
// init: they run at 1000 and, where the worker may lower it, the init at
// -999.
func TestOOMScores(t *testing.T) {
	sb := create(t, busyboxRoot(t))
	want := "-999\n1000\n"
	if !hasCap(t, unix.CAP_SYS_RESOURCE) {
		own, err := os.ReadFile("/proc/self/oom_score_adj")
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("SKIPPING the init's -999: this process lacks CAP_SYS_RESOURCE, the init keeps its %s", strings.TrimSpace(string(own)))
		want = string(own) + "1000\n"
	}
	out, code := sh(t, sb, "cat /proc/1/oom_score_adj; sh -c 'cat /proc/self/oom_score_adj'")
	if code != 0 || out != want {
		t.Fatalf("oom_score_adj of the init, then of a command's child: %q (exit %d), want %q", out, code, want)
	}
}

// hasCap says whether this process has capability c in effect.
func hasCap(t *testing.T, c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n&(1<<c) != 0
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return false
}

// TestStateAndReaping: files and processes persist across execs; orphans
// are reaped by the init; exit codes and signals come back.
func TestStateAndReaping(t *testing.T) {
	sb := create(t, busyboxRoot(t))
	// sleep 301 outlives its exec; sleep 0.1, an orphan too, ends after
	// it: only the init can reap it.
	if _, code := sh(t, sb, "mkdir -p /work && echo step1 > /work/state && (sleep 301 &) && (sleep 0.1 &) && exit 3"); code != 3 {
		t.Fatalf("exit %d, want 3", code)
	}
	// Until the orphan sleep 0.1 has ended (and so was reaped, or is a
	// zombie the count below finds).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if out, _ := sh(t, sb, "ps -o args | grep -c '^sleep 0.1' || true"); out == "0\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the orphan sleep 0.1 never ended")
		}
	}
	out, code := sh(t, sb, "cat /work/state; ps -o stat,args | grep -c '^Z' || true")
	if code != 0 || !strings.HasPrefix(out, "step1\n") {
		t.Fatalf("state lost between execs: %q (exit %d)", out, code)
	}
	if !strings.HasSuffix(out, "0\n") {
		t.Fatalf("zombies in the sandbox: %q", out)
	}
	out, _ = sh(t, sb, "ps -o args | grep -c '[s]leep 301'")
	if strings.TrimSpace(out) != "1" {
		t.Fatalf("a background process did not survive its exec: %q", out)
	}
	if _, code := sh(t, sb, "kill -TERM $$"); code != 128+15 {
		t.Fatalf("signalled command: exit %d, want 143", code)
	}
	sb.Destroy()
	if _, err := sb.Exec(context.Background(), container.Cmd{ID: "after", Args: []string{"true"}}); !errors.Is(err, container.ErrSandboxDied) {
		t.Fatalf("exec into a destroyed sandbox: %v", err)
	}
}

// TestWorkerCrash: the worker's connection dies mid-step; the sandbox and
// the step go on, and a new connection gets the step's result without
// running it again.
func TestWorkerCrash(t *testing.T) {
	layertest.RequireRoot(t)
	socket := filepath.Join(t.TempDir(), "init.sock")
	var initErr bytes.Buffer
	sb, err := container.Create(container.Spec{Root: busyboxRoot(t), Socket: socket, Stderr: &initErr})
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	defer sb.Destroy()
	res := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, err := sb.Exec(context.Background(), container.Cmd{ID: "step-7",
			Args: []string{"/bin/sh", "-c", "sleep 0.5; echo once >> /ran; exit 5"}, Env: []string{"PATH=/bin"},
			Started: func(int) { close(started) }})
		res <- err
	}()
	<-started
	sb.Close() // the worker dies, the command running
	if err := <-res; !errors.Is(err, container.ErrSandboxDied) {
		t.Fatalf("exec across a lost connection: %v", err)
	}
	again, err := container.Attach(socket, sb.Pid())
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	x, err := again.Result(context.Background(), "step-7")
	if err != nil || x.Code != 5 {
		t.Fatalf("result after reattaching: %+v, %v", x, err)
	}
	if _, err := again.Exec(context.Background(), container.Cmd{ID: "step-7", Args: []string{"true"}}); err == nil {
		t.Fatal("an exec id ran twice")
	}
	out, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if code, err := again.Exec(context.Background(), container.Cmd{ID: "step-8", Args: []string{"cat", "/ran"}, Env: []string{"PATH=/bin"}, Stdout: out, Stderr: out}); err != nil || code != 0 {
		t.Fatalf("exec after reattaching: %d %v", code, err)
	}
	if b, _ := os.ReadFile(out.Name()); string(b) != "once\n" {
		t.Fatalf("the step ran %q", b)
	}
	if _, err := again.Result(context.Background(), "never"); err == nil {
		t.Fatal("result of an unknown id")
	}
}

func TestIdleAndMergeableCommands(t *testing.T) {
	// Field 41 of stat is the scheduling policy: 5 is SCHED_IDLE.
	const script = `cut -d' ' -f41 /proc/self/stat; grep ksm_merge_any /proc/self/ksm_stat`
	out, code := sh(t, createSpec(t, container.Spec{Root: busyboxRoot(t), Idle: true, MergeMemory: true}), script)
	if code != 0 || out != "5\nksm_merge_any: yes\n" {
		t.Fatalf("an idle, mergeable sandbox's command (exit %d) says:\n%s", code, out)
	}
	out, _ = run(t, busyboxRoot(t), script)
	if out != "0\nksm_merge_any: no\n" {
		t.Fatalf("a plain sandbox's command says:\n%s", out)
	}
	// Core scheduling: an idle sandbox's commands get a cookie of their
	// own, where the kernel can.
	if !initproto.CoreScheduling() {
		t.Log("NOTE: no core scheduling on this host (CONFIG_SCHED_CORE unset or no SMT): the cookie is not exercised here")
		return
	}
	out, _ = sh(t, createSpec(t, container.Spec{Root: busyboxRoot(t), Idle: true}), `grep core_cookie /proc/self/sched`)
	if !strings.Contains(out, "core_cookie") || strings.Contains(out, ": 0\n") || strings.HasSuffix(strings.TrimSpace(out), " 0") {
		t.Fatalf("an idle sandbox's command has no core-scheduling cookie: %q", out)
	}
}

// TestSpares: a spare waits outside every host mount (a mount the host
// makes or removes meanwhile never reaches it), and a claim gives it a
// root made after it started.
func TestSpares(t *testing.T) {
	layertest.RequireRoot(t)
	var moved []int
	sp, err := container.Prestart(func(pid int) error { moved = append(moved, pid); return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(moved) != 1 || moved[0] != sp.Pid() || !sp.Alive() {
		t.Fatalf("setup ran with %v, the spare is %d (alive %v)", moved, sp.Pid(), sp.Alive())
	}
	// A host mount made after the spare started.
	later := t.TempDir()
	if err := unix.Mount("tmpfs", later, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(later, unix.MNT_DETACH)
	info, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", sp.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(info)), "\n") {
		fs := strings.Fields(strings.SplitN(line, " - ", 2)[1])[0]
		if f := strings.Fields(line); !slices.Contains([]string{"tmpfs", "proc", "devpts", "mqueue", "sysfs"}, fs) || strings.Contains(f[4], later) {
			t.Errorf("the spare holds a host mount: %s", line)
		}
	}

	root := busyboxRoot(t) // made after the spare
	var initErr bytes.Buffer
	sb, err := sp.Claim(container.Spec{Root: root, Hostname: "claimed", Stderr: &initErr, Socket: filepath.Join(t.TempDir(), "init.sock")})
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	t.Cleanup(func() { sb.Destroy() })
	if sb.Pid() != sp.Pid() {
		t.Fatalf("the sandbox's init is %d, the spare was %d", sb.Pid(), sp.Pid())
	}
	out, code := sh(t, sb, `hostname; cat /proc/self/mountinfo`)
	host, mounts, _ := strings.Cut(out, "\n")
	if code != 0 || host != "claimed" {
		t.Fatalf("in the claimed spare (exit %d): %q", code, out)
	}
	for _, line := range strings.Split(strings.TrimSpace(mounts), "\n") {
		// The root is the only mount of a host file system.
		if f := strings.Fields(line); strings.Contains(line, " - ext4 ") && f[4] != "/" {
			t.Errorf("the sandbox sees a host mount: %s", line)
		}
	}
	// Claiming it again fails; a discarded spare is gone.
	if _, err := sp.Claim(container.Spec{Root: root, Socket: filepath.Join(t.TempDir(), "again.sock")}); err == nil {
		t.Fatal("a spare was claimed twice")
	}
	other, err := container.Prestart(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	other.Discard()
	if other.Alive() || unix.Kill(other.Pid(), 0) == nil {
		t.Fatalf("discarded spare %d still runs", other.Pid())
	}
	// A setup that fails leaves no process.
	var failed int
	if _, err := container.Prestart(func(pid int) error { failed = pid; return errors.New("no cgroup") }, nil); err == nil || unix.Kill(failed, 0) == nil {
		t.Fatalf("a failed setup: %v, pid %d alive %v", err, failed, unix.Kill(failed, 0) == nil)
	}
}

// TestUserNamespace: with IDs the init runs in a user namespace of its
// own: root inside, an unprivileged user of the host outside; the root
// shows the host's root-owned files as root's through an idmapped mount,
// and what the sandbox writes is stored as the host's root would store it.
func TestUserNamespace(t *testing.T) {
	layertest.RequireRoot(t)
	ids := &container.IDMap{Host: 3_000_000_000, Size: 65536}
	sp, err := container.Prestart(nil, ids)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if sp.Alive() {
			sp.Discard()
		}
	}()
	userns, err := sp.UserNamespace()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(userns)
	src := busyboxRoot(t)
	tree, err := mount.IDMapped(src, userns)
	if errors.Is(err, unix.EINVAL) {
		t.Skipf("SKIPPED: this kernel cannot idmap %s's file system: %v", src, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	err = mount.Attach(tree, root)
	unix.Close(tree)
	if err != nil {
		t.Fatal(err)
	}
	defer mount.Unmount(root)
	var initErr bytes.Buffer
	sb, err := sp.Claim(container.Spec{Root: root, Hostname: "userns", Stderr: &initErr, Socket: filepath.Join(t.TempDir(), "init.sock")})
	if err != nil {
		t.Fatalf("%v: %s", err, initErr.String())
	}
	t.Cleanup(func() { sb.Destroy() })
	out, code := sh(t, sb, `cat /proc/self/uid_map /proc/self/gid_map; id -u; stat -c %u:%g /bin/busybox; echo hi >/written; `+
		`stat -c %u /written; cat /dev/null; echo x >/dev/null && head -c 4 /dev/zero | wc -c; hostname; ls /proc/1/cmdline`)
	const want = "0 3000000000 65536 0 3000000000 65536 0 0:0 0 4 userns /proc/1/cmdline"
	if got := strings.Join(strings.Fields(out), " "); code != 0 || got != want {
		t.Fatalf("in the user namespace (exit %d): %q, want %q", code, got, want)
	}
	// Outside: the init is the mapped root, the file the host's root's.
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", sb.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), "\nUid:\t3000000000\t3000000000\t3000000000\t3000000000\n") {
		t.Errorf("the init's host ids:\n%s", status)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(src, "written"), &st); err != nil || st.Uid != 0 || st.Gid != 0 {
		t.Errorf("the written file on the host: uid %d gid %d, %v", st.Uid, st.Gid, err)
	}
	// Root in the namespace is nobody to the host: a file of a host user
	// outside its range is nobody's to it, and beyond its reach even with
	// CAP_DAC_OVERRIDE, while the same file of the host's root is its own.
	for _, f := range []struct {
		uid  int
		want string
	}{{70000, "65534 cannot read"}, {0, "0 s"}} {
		p := filepath.Join(src, "secret")
		if err := os.WriteFile(p, []byte("s"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, f.uid, f.uid); err != nil {
			t.Fatal(err)
		}
		out, _ := sh(t, sb, `stat -c %u /secret; cat /secret 2>/dev/null || echo cannot read`)
		if got := strings.Join(strings.Fields(out), " "); got != f.want {
			t.Errorf("a 0600 file of host uid %d, in the namespace: %q, want %q", f.uid, got, f.want)
		}
	}
	if out, code := sh(t, sb, `mknod /dev/sda b 8 0`); code == 0 {
		t.Errorf("root in the namespace made a device: %q", out)
	}
}

// TestInitBinary: DSEC_INIT wins (an absolute path to an executable, else
// an error that names it); without it, a dsec-init next to this binary;
// else this binary.
func TestInitBinary(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(container.InitBinaryEnv, "")
	if got, err := container.LookupInitBinary(); err != nil || got != self {
		t.Fatalf("no DSEC_INIT, no dsec-init beside the test binary: got %q, %v, want %s", got, err, self)
	}
	dir := t.TempDir()
	init := filepath.Join(dir, container.InitName)
	if err := os.WriteFile(init, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(container.InitBinaryEnv, init)
	if got, err := container.LookupInitBinary(); err != nil || got != init {
		t.Fatalf("DSEC_INIT=%s: got %q, %v", init, got, err)
	}
	for _, bad := range []string{"dsec-init", filepath.Join(dir, "missing"), dir} {
		t.Setenv(container.InitBinaryEnv, bad)
		if _, err := container.LookupInitBinary(); err == nil || !strings.Contains(err.Error(), "DSEC_INIT="+bad+": give the absolute path of an executable dsec-init") {
			t.Errorf("DSEC_INIT=%s: got %v", bad, err)
		}
	}
}

// TestInitBinarySibling: a binary with dsec-init beside it (make build's
// bin/) starts inits from that dsec-init. The test binary, copied next to
// one, reports what it would start (TestMain, in the child).
func TestInitBinarySibling(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	exe, init := filepath.Join(dir, "worker.test"), filepath.Join(dir, container.InitName)
	if err := os.WriteFile(exe, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(init, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), "DSEC_TEST_INIT_HELPER=1", container.InitBinaryEnv+"=")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "init binary: "+init+" <nil>\n") {
		t.Fatalf("%s beside %s: %v\n%s", exe, init, err, out)
	}
}

// BenchmarkPrestart: starting a spare init with the host bare, then with
// 2000 more mounts on it (a packed host: each sandbox adds its overlay,
// lowers and disk image), then bare again (how far the two bare figures
// differ is what the run resolves). An init starts from a namespace of
// its own, not the host's, so the mounts should cost nothing.
func BenchmarkPrestart(b *testing.B) {
	layertest.RequireRoot(b)
	spare := func() time.Duration {
		start := time.Now()
		sp, err := container.Prestart(nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		sp.Discard()
		return d
	}
	spare() // the spawner's namespace, made once per process
	base := b.TempDir()
	var mounted []string
	defer func() {
		for _, d := range slices.Backward(mounted) {
			unix.Unmount(d, unix.MNT_DETACH)
		}
	}()
	var times [3][]time.Duration
	b.ResetTimer()
	for phase, n := range []int{0, 2000, 0} {
		for len(mounted) < n {
			d := filepath.Join(base, strconv.Itoa(len(mounted)))
			if err := os.MkdirAll(d, 0o700); err != nil {
				b.Fatal(err)
			}
			if err := unix.Mount("tmpfs", d, "tmpfs", 0, "size=4k"); err != nil {
				b.Fatal(err)
			}
			mounted = append(mounted, d)
		}
		for len(mounted) > n {
			if err := unix.Unmount(mounted[len(mounted)-1], 0); err != nil {
				b.Fatal(err)
			}
			mounted = mounted[:len(mounted)-1]
		}
		for range b.N {
			times[phase] = append(times[phase], spare())
		}
	}
	p50 := func(ds []time.Duration) float64 {
		slices.Sort(ds)
		return float64(ds[len(ds)/2].Microseconds()) / 1000
	}
	b.ReportMetric(p50(times[0]), "bare-p50-ms")
	b.ReportMetric(p50(times[1]), "mounts2000-p50-ms")
	b.ReportMetric(p50(times[2]), "bare-again-p50-ms")
}
