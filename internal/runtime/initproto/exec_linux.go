package initproto

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// CoreScheduling reports whether the kernel has core scheduling and the
// CPUs have SMT siblings for it to keep apart (CoreSched).
func CoreScheduling() bool { return CoreSched.Have() }

// CoreSchedule gives the calling thread (and so every command forked
// from it) a core-scheduling cookie of its own where the kernel has core
// scheduling: the sandbox's batch work then never runs on the SMT
// sibling of another sandbox's task, so it cannot slow a latency step
// sharing the core (or read its state through the core's caches).
// Without it (CONFIG_SCHED_CORE unset, as on these VMs, or no SMT)
// there is nothing to do.
func CoreSchedule() error {
	if !CoreScheduling() {
		return nil
	}
	if err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_CREATE, 0, 0 /* PIDTYPE_PID */, 0); err != nil {
		return fmt.Errorf("core scheduling cookie: %w", err)
	}
	return nil
}

// start starts a request's command from the init's thread, so it
// inherits the dropped capabilities and no_new_privs.
func start(r Request, stdio []*os.File) (int, error) {
	if len(stdio) != 3 || len(r.Args) == 0 {
		return 0, errors.New("bad exec request")
	}
	path := r.Args[0]
	if !strings.Contains(path, "/") {
		p, err := lookPath(path, envPath(r.Env))
		if err != nil {
			return 0, err
		}
		path = p
	}
	cwd, env := r.Cwd, r.Env
	var cred *syscall.Credential
	if r.User != "" {
		a, err := lookupUser(r.User)
		if err != nil {
			return 0, err
		}
		cred, env = &a.cred, asUser(env, a)
		if cwd == "" {
			cwd = a.home
		}
	}
	if cwd == "" {
		cwd = "/"
	}
	if r.MakeCwd {
		os.MkdirAll(cwd, 0o755) // in the sandbox's root: the init has pivoted into it
	}
	// The directory is opened here, never through a magic link (a
	// /proc/self/fd/N, or a symbolic link to one, would name one of the
	// init's descriptors: runc's CVE-2024-21626), and the command starts
	// in exactly it: its descriptor, which the child holds until exec.
	dir, err := unix.Openat2(unix.AT_FDCWD, cwd, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return 0, fmt.Errorf("working directory %s: %v: give a directory of the sandbox (or create it first)", cwd, err)
	}
	defer unix.Close(dir)
	pid, err := syscall.ForkExec(path, r.Args, &syscall.ProcAttr{
		Dir:   fmt.Sprintf("/proc/self/fd/%d", dir),
		Env:   env,
		Files: []uintptr{stdio[0].Fd(), stdio[1].Fd(), stdio[2].Fd()},
		// A terminal's command leads its session with stdin as its
		// controlling terminal, as a login shell does.
		Sys: &syscall.SysProcAttr{Setsid: true, Setctty: r.TTY, Ctty: 0, Credential: cred},
	})
	switch {
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.ENOEXEC), errors.Is(err, syscall.EISDIR):
		return 0, &cannotExec{path, err}
	case errors.Is(err, syscall.ENOENT):
		return 0, &notFound{path}
	case errors.Is(err, syscall.EAGAIN):
		return 0, fmt.Errorf("cannot start %s: the sandbox is at its limit of processes and threads (pids): wait for some to end, or raise the limit (a policy's resources.pids)", path)
	}
	if err == nil {
		// A command that runs the sandbox out of memory is what the OOM
		// killer must take, never the init, whose death ends the
		// sandbox. Raising a score needs no privilege (lowering the
		// init's would need CAP_SYS_RESOURCE, which hosts may withhold).
		score := r.OOMScore
		if score == 0 {
			score = 1000
		}
		os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte(strconv.Itoa(score)), 0)
	}
	return pid, err
}

// initOOMScore is the sandbox init's oom_score_adj where the worker may
// lower it: the last process of its group the OOM killer takes. The
// commands it starts get 1000, which alone does not always do: a task's
// badness is its resident pages (mapped file pages too) plus adj times
// the limit's pages/1000, rounded down, so an init whose pages come near
// its limit outscores what is left of a command the killer has just
// taken, and the sandbox dies. dsec-init keeps some 3 MiB resident
// (limits start at 4 MiB); a test binary built with -race, serving as
// the init, keeps 30. Not -1000: an init alone over its limit must stay
// killable, or the group would stall.
const initOOMScore = -999

// ProtectInit lowers the init's oom_score_adj from outside. That needs
// CAP_SYS_RESOURCE, which some hosts withhold (a worker in a container,
// these CI machines); without it the init keeps the worker's score.
func ProtectInit(pid int) {
	os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte(strconv.Itoa(initOOMScore)), 0)
}

// lookPath finds a command in a PATH of the sandbox.
func lookPath(name, path string) (string, error) {
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", &notFound{name}
}

type notFound struct{ name string }

func (e *notFound) Error() string { return e.name + ": command not found in the sandbox" }

// cannotExec is a command that is there but cannot run: not executable,
// or no format the kernel runs (a shell says 126).
type cannotExec struct {
	name string
	err  error
}

func (e *cannotExec) Error() string {
	return fmt.Sprintf("%s: %v: it cannot be run in the sandbox (not an executable file)", e.name, e.err)
}

func envPath(env []string) string {
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "PATH="); ok {
			return v
		}
	}
	return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
}
