package container

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"golang.org/x/sys/unix"
)

// Spare is a sandbox init started ahead of need: its namespaces made, its
// runtime up, out of every host mount (it waits on an empty tmpfs root),
// nothing of a sandbox yet. Claim makes it one; Discard kills it.
// Starting the re-executed binary is most of what starting a sandbox
// costs, so a worker keeps spares and a create only hands one its root.
type Spare struct {
	cmd    *exec.Cmd
	ctl    *os.File // our end of the socket pair the init waits on
	exited chan struct{}
}

// Prestart starts a spare init and waits until it is ready. setup, if not
// nil, runs with its host pid first (the place to put it in its cgroup).
// With ids the init gets a user namespace of its own mapped to them; the
// root it is then claimed with must show the sandbox's files through
// mounts idmapped into that namespace (UserNamespace).
func Prestart(setup func(pid int) error, ids *IDMap) (*Spare, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "spare"), os.NewFile(uintptr(fds[1]), "spare")
	// The binary as the spawner's namespace has it (spawn_linux.go),
	// where the namespace's root may search the way to it (a 0700 build
	// or test directory on the host would stop it).
	cmd := exec.Command(spawnInit)
	cmd.Args = []string{InitName} // its /proc/PID/cmdline names no host path
	cmd.Env = []string{initEnv + "=1"}
	cmd.ExtraFiles = []*os.File{theirs}
	// What it says if it fails before it is ready: a file of no name
	// (an init that lives says nothing there, and keeps it alone).
	said, _ := os.CreateTemp("", "dsec-init-")
	if said != nil {
		os.Remove(said.Name())
		defer said.Close()
		cmd.Stderr = said
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWUTS | syscall.CLONE_NEWIPC | syscall.CLONE_NEWNET,
		Setsid:     true,
	}
	if ids != nil {
		cmd.Env = append(cmd.Env, usernsEnv+"=1")
		m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(ids.Host), Size: int(ids.Size)}}
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings, cmd.SysProcAttr.GidMappings = m, m
		cmd.SysProcAttr.GidMappingsEnableSetgroups = true
		// Root of the namespace (not the host's root, which it does not
		// map): the exec then gives it the namespace's capabilities.
		cmd.SysProcAttr.Credential = &syscall.Credential{}
	}
	if serr := spawn(func() { err = cmd.Start() }); serr != nil {
		err = serr
	}
	theirs.Close()
	if err != nil {
		ours.Close()
		return nil, fmt.Errorf("start sandbox init: %w", err)
	}
	initproto.ProtectInit(cmd.Process.Pid)
	sp := &Spare{cmd: cmd, ctl: ours, exited: make(chan struct{})}
	// Reap the init whenever it exits, whether or not this process still
	// holds a connection: a long-lived worker must not collect zombies.
	go func() { cmd.Wait(); close(sp.exited) }()
	if setup != nil {
		if err := setup(cmd.Process.Pid); err != nil {
			sp.Discard()
			return nil, fmt.Errorf("%w%s", err, saidOf(said))
		}
	}
	if n, err := ours.Read(make([]byte, 16)); err != nil || n == 0 {
		<-sp.exited // its end closes when it exits
		ours.Close()
		return nil, fmt.Errorf("sandbox init exited before it was ready (exit %d)%s", cmd.ProcessState.ExitCode(), saidOf(said))
	}
	return sp, nil
}

// InitBinaryEnv names the variable that picks the program sandbox inits run.
const InitBinaryEnv = "DSEC_INIT"

// InitName is the sandbox init's own binary (cmd/dsec-init).
const InitName = "dsec-init"

// InitBinary is the program sandbox inits run, found once per process:
// $DSEC_INIT if set, else dsec-init next to this executable, else this
// executable (any binary that calls MaybeInit first serves). dsec-init is
// this package alone, static: it starts in a third of the time the
// complete dsec does (no other package's initialisers, a quarter of the
// pages to fault in) and keeps less memory per sandbox for as long as the
// sandbox lives.
var InitBinary = sync.OnceValues(lookupInitBinary)

func lookupInitBinary() (string, error) {
	if p := os.Getenv(InitBinaryEnv); p != "" {
		if !filepath.IsAbs(p) || !executable(p) {
			return "", fmt.Errorf("%s=%s: give the absolute path of an executable dsec-init (or unset it)", InitBinaryEnv, p)
		}
		return p, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	if p := filepath.Join(filepath.Dir(self), InitName); p != self && executable(p) {
		return p, nil
	}
	return self, nil
}

func executable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// UserNamespace opens the spare's user namespace (O_CLOEXEC): what the
// mounts of its root are idmapped into.
func (sp *Spare) UserNamespace() (int, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", sp.cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the sandbox init's user namespace: %w", err)
	}
	return fd, nil
}

// Pid is the spare's pid on the host.
func (sp *Spare) Pid() int { return sp.cmd.Process.Pid }

// Alive reports whether the spare still waits for a sandbox.
func (sp *Spare) Alive() bool {
	select {
	case <-sp.exited:
		return false
	default:
		return true
	}
}

// Discard kills a spare that was not claimed.
func (sp *Spare) Discard() {
	sp.ctl.Close()
	sp.cmd.Process.Kill()
	<-sp.exited
}

// Claim makes the spare the sandbox spec describes (spec.Setup is not
// run: the spare is where Prestart's setup put it). The spare is used
// up either way; on an error it is gone.
func (sp *Spare) Claim(spec Spec) (_ *Conn, err error) {
	defer func() {
		if err != nil {
			sp.Discard()
			os.Remove(spec.Socket)
		}
	}()
	if spec.Socket == "" {
		return nil, errors.New("container: no control socket path")
	}
	os.Remove(spec.Socket)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: spec.Socket, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	l.SetUnlinkOnClose(false)
	lf, err := l.File()
	l.Close()
	if err != nil {
		return nil, err
	}
	// Only the init may hold the listener: if it dies, a connection
	// waiting for its greeting must see the socket go.
	defer lf.Close()
	// The root travels as a detached copy of its mount, which the init
	// attaches in its own namespace: it never shared the host's mounts.
	tree, err := unix.OpenTree(unix.AT_FDCWD, spec.Root, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return nil, fmt.Errorf("clone the sandbox root %s: %w", spec.Root, err)
	}
	defer unix.Close(tree)
	logf, done, err := LogFile(spec.Stderr)
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(spec)
	if err != nil {
		logf.Close()
		return nil, err
	}
	err = unix.Sendmsg(int(sp.ctl.Fd()), b, unix.UnixRights(int(lf.Fd()), tree, int(logf.Fd())), nil, 0)
	logf.Close()
	if err != nil {
		return nil, fmt.Errorf("%w: the spare init is gone: %v", ErrSandboxDied, err)
	}
	// The pair is the first worker's connection: no dial, no accept.
	fc, err := net.FileConn(sp.ctl)
	if err != nil {
		return nil, err
	}
	c, err := initproto.Greet(fc.(*net.UnixConn), sp.cmd.Process.Pid)
	if err != nil {
		<-sp.exited
		<-done
		return nil, fmt.Errorf("sandbox init failed (exit %d)", sp.cmd.ProcessState.ExitCode())
	}
	sp.ctl.Close()
	c.Spawned(sp.cmd, sp.exited)
	return &Conn{c}, nil
}

// LogFile is a file whose writes reach w: w itself when it is one, else a
// pipe copied into w until done closes; /dev/null without w.
func LogFile(w io.Writer) (_ *os.File, done chan struct{}, err error) {
	done = make(chan struct{})
	if f, ok := w.(*os.File); ok {
		close(done)
		g, err := dupFile(f)
		return g, done, err
	}
	if w == nil {
		close(done)
		f, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		return f, done, err
	}
	r, pw, err := os.Pipe()
	if err != nil {
		return nil, nil, err
	}
	go func() { io.Copy(w, r); r.Close(); close(done) }()
	return pw, done, nil
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// Create starts a sandbox's init on spec.Root, listening on spec.Socket:
// a spare started and claimed at once.
func Create(spec Spec) (*Conn, error) {
	sp, err := Prestart(spec.Setup, nil)
	if err != nil {
		return nil, err
	}
	return sp.Claim(spec)
}

// saidOf is the last line an init wrote to said, as ": LINE" (none: "").
func saidOf(said *os.File) string {
	if said == nil {
		return ""
	}
	st, err := said.Stat()
	if err != nil {
		return ""
	}
	b := make([]byte, min(st.Size(), 4096))
	n, _ := said.ReadAt(b, st.Size()-int64(len(b)))
	lines := strings.Split(strings.TrimSpace(string(b[:n])), "\n")
	if last := lines[len(lines)-1]; last != "" {
		return ": " + last
	}
	return ""
}

// LastWords is the last line an init wrote to the log at path, as
// ": LINE" (none: ""): what to say of one that failed.
func LastWords(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	return saidOf(f)
}
