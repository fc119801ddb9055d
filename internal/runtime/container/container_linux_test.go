package container_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/runtime/container"
)

func TestMain(m *testing.M) {
	container.MaybeInit()
	os.Exit(m.Run())
}

// busyboxRoot makes a root file system of Debian's busybox-static.
func busyboxRoot(t *testing.T) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox-static is missing: make deps installs it")
	}
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "bin"), 0o755)
	b, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "bin", "busybox"), b, 0o755)
	out, _ := exec.Command(bb, "--list").Output()
	for _, a := range strings.Fields(string(out)) {
		if a != "busybox" {
			os.Symlink("busybox", filepath.Join(root, "bin", a))
		}
	}
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	return root
}

func run(t *testing.T, root, script string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	p, err := container.Start(container.Spec{Root: root, Args: []string{"/bin/sh", "-c", script},
		Env: []string{"PATH=/bin"}, Hostname: "sandbox", Stdout: &out, Stderr: &out})
	if err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	return out.String(), code
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
		echo pid=$$
		echo host=$(hostname)
		echo ifs=$(ls /sys/class/net)
		echo lo=$(cat /sys/class/net/lo/flags)
		echo kallsyms=$(wc -c < /proc/kallsyms)
		echo timers=$(wc -c < /proc/timer_list)
		echo fds=$(ls /proc/self/fd | tr '\n' ' ')
		grep -E '^(CapBnd|CapEff|NoNewPrivs)' /proc/self/status
		echo procs=$(ls /proc | grep -c '^[0-9]')
		echo init=$(cat /proc/1/comm)
		mount -t tmpfs tmpfs /tmp 2>/dev/null && echo mount=yes || echo mount=no
		echo 1 > /proc/sys/kernel/hostname 2>/dev/null && echo sysctl=yes || echo sysctl=no
		ls /dev | tr '\n' ' '; echo
		exit 7`)
	if code != 7 {
		t.Fatalf("exit code %d, want 7\n%s", code, out)
	}
	// The kept set: chown dac_override fowner fsetid kill setgid setuid
	// setpcap net_bind_service sys_chroot mknod audit_write setfcap.
	for _, want := range []string{"pid=1\n", "init=sh\n", "host=sandbox\n", "ifs=lo\n", "lo=0x9\n", "kallsyms=0\n", "timers=0\n",
		"mount=no\n", "sysctl=no\n", "NoNewPrivs:\t1\n", "CapBnd:\t00000000a80405fb\n", "CapEff:\t00000000a80405fb\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if f, ok := strings.CutPrefix(line, "fds="); ok && strings.TrimSpace(f) != "0 1 2 3" { // 3: ls's own directory
			t.Errorf("sandbox sees descriptors %q, want only 0 1 2 (and ls's own)", f)
		}
		// sh, the $(...) subshell, ls and grep: the host has hundreds.
		if n, ok := strings.CutPrefix(line, "procs="); ok && len(n) > 1 {
			t.Errorf("sandbox sees %s processes: the host's pid namespace leaks", n)
		}
	}
}

func TestCommandNotFound(t *testing.T) {
	layertest.RequireRoot(t)
	var out bytes.Buffer
	p, err := container.Start(container.Spec{Root: busyboxRoot(t), Args: []string{"no-such-tool"}, Stderr: &out})
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := p.Wait(); code != 127 || !strings.Contains(out.String(), "command not found") {
		t.Fatalf("exit %d, %q", code, out.String())
	}
}
