package runtime_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/policy"
	dsecrt "github.com/dsec-project/dsec/internal/runtime"
)

// copyWithLibs copies the host's program bin, and the shared libraries
// ldd names for it, to the same paths under dir.
func copyWithLibs(t *testing.T, dir, bin string) {
	t.Helper()
	files := []string{bin}
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", bin, err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		for _, f := range strings.Fields(l) {
			if strings.HasPrefix(f, "/") {
				files = append(files, f)
			}
		}
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, f)
		os.MkdirAll(filepath.Dir(dst), 0o755)
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// buildCompat builds compat:1: the compat program (static) at
// /opt/compat/compat, the host's git and, where the host has Debian's
// python3, python3 with its standard library, each with its libraries.
func buildCompat(t *testing.T, f *snapFixture) (python bool) {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "opt", "compat", "compat"), "github.com/dsec-project/dsec/internal/policy/compat")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the compat program: %v: %s", err, out)
	}
	git, err := exec.LookPath("git")
	if err != nil {
		t.Fatal("git is missing on the host")
	}
	copyWithLibs(t, dir, git)
	os.MkdirAll(filepath.Join(dir, "usr", "share", "git-core", "templates"), 0o755)
	if py, err := filepath.EvalSymlinks("/usr/bin/python3"); err == nil {
		copyWithLibs(t, dir, py)
		os.Symlink(filepath.Base(py), filepath.Join(dir, "usr", "bin", "python3"))
		lib := "/usr/lib/" + filepath.Base(py)
		os.MkdirAll(filepath.Join(dir, "usr", "lib"), 0o755)
		if out, err := exec.Command("cp", "-a", lib, filepath.Join(dir, "usr", "lib")).CombinedOutput(); err != nil {
			t.Fatalf("copy %s: %v: %s", lib, err, out)
		}
		python = true
	} else {
		t.Log("LOUD: no Debian python3 on this host (/usr/bin/python3): the python3 check is left out")
	}
	ref, _ := layer.ParseRef("compat:1")
	if _, err := layer.Build(context.Background(), f.s, layer.BuildOptions{Source: dir, Kind: layer.KindWorkspace, Ref: ref}); err != nil {
		t.Fatal(err)
	}
	return python
}

// TestCompatibility: what agents commonly run keeps working in a sandbox
// under the default policy (its seccomp profile, device allowlist and
// nodev mounts), each check held to its output: reading interfaces over
// NETLINK_ROUTE (busybox ip, Go's net.Interfaces, Python's
// socket.if_nameindex), inotify, eventfd, timerfd, epoll, POSIX shared
// memory in /dev/shm, loopback TCP, git init and commit, and a shell's
// job control on a terminal.
func TestCompatibility(t *testing.T) {
	f := newSnapFixture(t)
	python := buildCompat(t, f)
	sb := f.create(dsecrt.Spec{Name: "compat", Layers: []string{"compat:1", "bb:1"}, Env: []string{"HOME=/root"}})

	out, code := sh(t, sb, "compat", "/opt/compat/compat")
	if code != 0 {
		t.Fatalf("compat: exit %d: %s", code, out)
	}
	for _, want := range []string{"interfaces\tlo=127.0.0.1/8 lo=::1/128\n", "inotify\tcreated compat-inotify\n", "eventfd\tcounter 3\n",
		"timerfd\texpired 1\n", "epoll\t1 ready\n", "shm\tshared memory\n", "tcp loopback\techo\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("compat lacks %q:\n%s", want, out)
		}
	}
	if out, _ := sh(t, sb, "ip", "ip addr show lo; ip route show table local"); !strings.Contains(out, "inet 127.0.0.1/8") || !strings.Contains(out, "local 127.0.0.1") {
		t.Errorf("busybox ip: %q", out)
	}
	const gitScript = `cd /tmp && git init -q repo && cd repo && echo hello > f && git add f &&
git -c user.name=agent -c user.email=agent@example.invalid commit -qm "first step" && git log --format=%s && git status --short | wc -l`
	if out, code := sh(t, sb, "git", gitScript); code != 0 || out != "first step\n0\n" {
		t.Errorf("git init/commit: exit %d: %q", code, out)
	}
	if python {
		out, code := sh(t, sb, "python", `python3 -c 'import socket, json, subprocess; print(socket.if_nameindex()); print(json.dumps({"ok": subprocess.run(["echo", "42"], capture_output=True, text=True).stdout.strip()}))'`)
		if code != 0 || !strings.Contains(out, "(1, 'lo')") || !strings.Contains(out, `{"ok": "42"}`) {
			t.Errorf("python3: exit %d: %q", code, out)
		}
	}

	// File operations on an upper on the shared uppers file system
	// (btrfs under overlay): hard links, renames, a lower directory moved
	// (overlay says EXDEV; mv copies), a lower file removed (a whiteout),
	// fsync, a file over 4 GiB sparse, and pack-diff of the result.
	const fsScript = `cd /tmp && echo a > x && ln x y && mv y z && cat z &&
cp -a /opt/compat /opt/moved && rm -r /opt/compat && mv /opt/moved /opt/compat && ls /opt/compat | wc -l &&
rm /etc/answer && [ ! -e /etc/answer ] && dd if=/dev/zero of=big bs=1 count=1 seek=5G 2>/dev/null && ls -l big | awk '{print $5}' && sync && echo fs-ok`
	if out, code := sh(t, sb, "fs", fsScript); code != 0 || out != "a\n1\n5368709121\nfs-ok\n" {
		t.Errorf("file operations on the upper: exit %d: %q", code, out)
	}
	f.mustPack(sb, "compat-fs:1")

	// Job control needs a terminal: the exec's pty, as dsec exec -t gives.
	m, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	e, _, err := sb.Run(context.Background(), dsecrt.ExecSpec{ID: "jobs", TTY: true, Stdin: tty, Terminal: m,
		Args: []string{"/bin/sh", "-c", "set -m; sleep 30 & jobs; kill %1; wait; echo JOBS-DONE"}})
	tty.Close()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := e.Result(ctx)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("job control: %v %+v", err, res)
	}
	b, _ := os.ReadFile(e.StdoutPath()) // the terminal, as the exec's journal has it
	screen := bytes.NewBuffer(b)
	if s := screen.String(); !strings.Contains(s, "Running") || !strings.Contains(s, "sleep 30") || !strings.Contains(s, "JOBS-DONE") {
		t.Errorf("job control on a terminal: %q", s)
	}

	// In network mode nat the sandbox's eth0 is listed too.
	natPol, err := policy.Parse([]byte("apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n"))
	if err != nil {
		t.Fatal(err)
	}
	nat := f.create(dsecrt.Spec{Name: "compat-nat", Layers: []string{"compat:1", "bb:1"}, Policy: natPol})
	if out, _ := sh(t, nat, "compat", "/opt/compat/compat | grep interfaces"); !strings.Contains(out, "eth0="+nat.Current().NAT.Sandbox+"/30") {
		t.Errorf("interfaces in nat mode: %q", out)
	}
}
