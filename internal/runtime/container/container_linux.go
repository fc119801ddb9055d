package container

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Process is a started sandbox process.
type Process struct {
	cmd *exec.Cmd
}

// Pid is the process's pid in the host's pid namespace.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Wait waits for the sandbox's pid 1 to exit and returns its exit code.
func (p *Process) Wait() (int, error) {
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal()), nil
		}
		return ee.ExitCode(), nil
	}
	if err != nil {
		return -1, err
	}
	return 0, nil
}

// Start starts spec's command as pid 1 of new namespaces on spec.Root.
func Start(spec Spec) (*Process, error) {
	if len(spec.Args) == 0 {
		return nil, errors.New("container: no command")
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	cmd := exec.Command(self)
	cmd.Env = []string{initEnv + "=1"}
	cmd.ExtraFiles = []*os.File{r}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = spec.Stdin, spec.Stdout, spec.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWUTS | syscall.CLONE_NEWIPC | syscall.CLONE_NEWNET,
		Pdeathsig:  syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, fmt.Errorf("start sandbox: %w", err)
	}
	if spec.Setup != nil {
		if err := spec.Setup(cmd.Process.Pid); err != nil {
			w.Close()
			cmd.Process.Kill()
			cmd.Wait()
			return nil, err
		}
	}
	err = json.NewEncoder(w).Encode(spec)
	w.Close()
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	return &Process{cmd: cmd}, nil
}

// MaybeInit runs the sandbox init and never returns if this process was
// started by Start; otherwise it returns at once.
func MaybeInit() {
	if os.Getenv(initEnv) != "1" {
		return
	}
	runtime.LockOSThread() // capabilities and no_new_privs are per thread
	err := initSandbox()
	fmt.Fprintf(os.Stderr, "dsec init: %v\n", err)
	os.Exit(127)
}

func initSandbox() error {
	var spec Spec
	f := os.NewFile(3, "spec")
	if err := json.NewDecoder(f).Decode(&spec); err != nil {
		return fmt.Errorf("read spec: %w", err)
	}
	f.Close()
	if err := setupRoot(spec.Root); err != nil {
		return err
	}
	if spec.Hostname != "" {
		if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	cwd := spec.Cwd
	if cwd == "" {
		cwd = "/"
	}
	if err := os.Chdir(cwd); err != nil {
		return fmt.Errorf("working directory: %w", err)
	}
	path := spec.Args[0]
	if !strings.Contains(path, "/") {
		os.Setenv("PATH", envPath(spec.Env))
		p, err := exec.LookPath(path)
		if err != nil {
			return fmt.Errorf("%s: command not found in the sandbox", path)
		}
		path = p
	}
	if err := dropPrivileges(); err != nil {
		return err
	}
	// Nothing the worker or the host left open reaches the command.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("close inherited descriptors: %w", err)
	}
	return unix.Exec(path, spec.Args, spec.Env)
}

func envPath(env []string) string {
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "PATH="); ok {
			return v
		}
	}
	return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}

type mnt struct {
	src, target, fstype string
	flags               uintptr
	data                string
}

// setupRoot mounts /proc, /dev and /sys in root, pivots into it and
// masks what a sandbox must not see or change.
func setupRoot(root string) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind root: %w", err)
	}
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	for _, m := range []mnt{
		{"proc", "proc", "proc", nodev, ""},
		{"tmpfs", "dev", "tmpfs", unix.MS_NOSUID | unix.MS_STRICTATIME, "mode=755,size=65536k"},
		{"devpts", "dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
		{"shm", "dev/shm", "tmpfs", nodev, "mode=1777,size=65536k"},
		{"mqueue", "dev/mqueue", "mqueue", nodev, ""},
		{"sysfs", "sys", "sysfs", nodev | unix.MS_RDONLY, ""},
	} {
		target := filepath.Join(root, m.target)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
	}
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}} {
		if err := unix.Mknod(filepath.Join(root, "dev", d.name), unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("mknod /dev/%s: %w", d.name, err)
		}
		os.Chmod(filepath.Join(root, "dev", d.name), 0o666)
	}
	for link, target := range map[string]string{"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		if err := os.Symlink(target, filepath.Join(root, "dev", link)); err != nil {
			return err
		}
	}
	old := filepath.Join(root, ".oldroot")
	if err := os.MkdirAll(old, 0o700); err != nil {
		return err
	}
	if err := unix.PivotRoot(root, old); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Unmount("/.oldroot", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host root: %w", err)
	}
	os.Remove("/.oldroot")
	return maskProc()
}

// maskProc hides kernel interfaces a sandbox has no business reading and
// makes the ones that change the host read-only, as runc's defaults do.
func maskProc() error {
	for _, p := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/sysrq-trigger",
		"/proc/latency_stats", "/proc/kallsyms", "/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup"} {
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount("/dev/null", p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/acpi", "/proc/scsi", "/sys/firmware"} {
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY, "size=0"); err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range []string{"/proc/sys", "/proc/irq", "/proc/bus", "/proc/fs"} {
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", p, err)
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make %s read-only: %w", p, err)
		}
	}
	return nil
}

// loopbackUp brings up lo, the only interface of the new net namespace.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	return nil
}

// dropPrivileges shrinks the bounding set and the thread's capabilities
// to KeptCaps and sets no_new_privs; exec carries both to the command.
func dropPrivileges() error {
	last := 40
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		last, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	keep := map[int]bool{}
	var mask [2]uint32
	for _, c := range KeptCaps {
		keep[c] = true
		mask[c/32] |= 1 << (c % 32)
	}
	for c := 0; c <= last; c++ {
		if !keep[c] {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d: %w", c, err)
			}
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: mask[0], Permitted: mask[0], Inheritable: 0},
		{Effective: mask[1], Permitted: mask[1], Inheritable: 0},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}
