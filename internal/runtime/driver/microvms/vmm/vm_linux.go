package vmm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// VM is the worker's handle on a running microVM: the connection to its
// shim, which speaks the init protocol as a container's init does, and
// what only a guest does from the inside (its files, reached through its
// agent; the host name, read-only and hidden paths set by it; its upper's
// file system frozen for a consistent pack).
type VM struct {
	c     *initproto.Conn
	files string
}

var (
	_ backend.Instance   = (*VM)(nil)
	_ backend.Restricter = (*VM)(nil)
	_ backend.Protecter  = (*VM)(nil)
	_ backend.Renamer    = (*VM)(nil)
	_ backend.Signaler   = (*VM)(nil)
	_ backend.Terminaler = (*VM)(nil)
)

// Terminal allocates a terminal from the devpts its shim sees, the
// host's: the guest's command gets it through the agent.
func (v *VM) Terminal() (master, tty *os.File, err error) { return container.TerminalOf(v.Pid()) }

// StartVM starts a microVM's shim, which starts QEMU, and returns once
// the guest is the sandbox spec describes: a guest that fails, or does
// not come up within spec.BootTimeout, is an error that ends with its
// console's last lines, and leaves no process.
func StartVM(spec VMSpec) (_ *VM, err error) {
	if spec.Socket == "" || spec.FilesSocket == "" {
		return nil, errors.New("microvm: no control socket path")
	}
	self, err := container.InitBinary()
	if err != nil {
		return nil, err
	}
	var closers []*os.File
	defer func() {
		for _, f := range closers {
			f.Close()
		}
	}()
	ctl, err := listenFile(spec.Socket, "unixpacket")
	if err != nil {
		return nil, err
	}
	closers = append(closers, ctl)
	files, err := listenFile(spec.FilesSocket, "unix")
	if err != nil {
		return nil, err
	}
	closers = append(closers, files)
	console, err := os.OpenFile(spec.Console, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	closers = append(closers, console)
	logf, done, err := container.LogFile(spec.Stderr)
	if err != nil {
		return nil, err
	}
	closers = append(closers, logf)

	cmd, ours, err := startShim(self)
	if err != nil {
		return nil, err
	}
	initproto.ProtectInit(cmd.Process.Pid)
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	kill := func() {
		ours.Close()
		cmd.Process.Kill()
		<-exited
		logf.Close() // our copy: the copier ends once the shim's is gone
		<-done
		os.Remove(spec.Socket)
		os.Remove(spec.FilesSocket)
	}
	if spec.Setup != nil {
		if err := spec.Setup(cmd.Process.Pid); err != nil {
			kill()
			return nil, err
		}
	}
	spec.Net = spec.Tap != nil
	if err := sendSpec(ours, spec, ctl, files, console, logf); err != nil {
		kill()
		return nil, fmt.Errorf("%w: the microVM's shim is gone: %v", initproto.ErrSandboxDied, err)
	}
	fc, err := net.FileConn(ours)
	if err != nil {
		kill()
		return nil, err
	}
	conn := fc.(*net.UnixConn)
	h, n, err := readHello(conn, spec.BootTimeout)
	switch {
	case err != nil || n == 0:
		conn.Close()
		kill()
		return nil, fmt.Errorf("the microVM's shim failed (exit %d): see its log", cmd.ProcessState.ExitCode())
	case h.Error != "":
		conn.Close()
		kill()
		return nil, errors.New(h.Error)
	}
	ours.Close()
	s := initproto.NewConn(conn, cmd.Process.Pid, h.Hello)
	s.Spawned(cmd, exited)
	return &VM{c: s, files: spec.FilesSocket}, nil
}

// listenFile is a listening socket of network at path (anything there
// removed first), as a file for the shim; the socket file stays when it
// closes.
func listenFile(path, network string) (*os.File, error) {
	os.Remove(path)
	l, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
	if err != nil {
		return nil, fmt.Errorf("microvm socket %s: %w", path, err)
	}
	l.SetUnlinkOnClose(false)
	f, err := l.File()
	l.Close()
	return f, err
}

// startShim starts the microVM's shim, self (this binary) in a network
// namespace of its own, and returns it with our end of the socket pair
// it was given.
func startShim(self string) (*exec.Cmd, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "vmm"), os.NewFile(uintptr(fds[1]), "vmm")
	cmd := exec.Command(self)
	cmd.Args = []string{VMMName} // its /proc/PID/cmdline names no host path
	cmd.Env = []string{vmmEnv + "=1"}
	cmd.ExtraFiles = []*os.File{theirs}
	// A network namespace of its own: QEMU reaches no network but a tap
	// the sandbox's network puts there.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWNET}
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		ours.Close()
		return nil, nil, fmt.Errorf("start the microVM's shim: %w", err)
	}
	return cmd, ours, nil
}

// sendSpec sends the shim, on ours, spec and the descriptors it works
// with: the control and files sockets, the console, the log, and the
// tap and the saved state when spec has them.
func sendSpec(ours *os.File, spec VMSpec, ctl, files, console, logf *os.File) error {
	b, err := json.Marshal(spec)
	if err == nil && spec.Restore != nil && spec.State == nil {
		err = errors.New("microvm: a restore without its state")
	}
	if err == nil {
		fds := []int{int(ctl.Fd()), int(files.Fd()), int(console.Fd()), int(logf.Fd())}
		if spec.Tap != nil {
			fds = append(fds, int(spec.Tap.Fd()))
		}
		if spec.Restore != nil {
			fds = append(fds, int(spec.State.Fd()))
		}
		err = unix.Sendmsg(int(ours.Fd()), b, unix.UnixRights(fds...), nil, 0)
	}
	return err
}

// shimHello is what the shim answers once the guest is up, or why it is
// not.
type shimHello struct {
	initproto.Hello
	Error string `json:"error"`
}

// readHello reads the shim's answer on conn (n bytes of it): the shim
// bounds the boot, this bounds the shim.
func readHello(conn *net.UnixConn, boot time.Duration) (h shimHello, n int, err error) {
	conn.SetReadDeadline(time.Now().Add(boot + 30*time.Second))
	buf := make([]byte, 64<<10)
	n, err = conn.Read(buf)
	conn.SetReadDeadline(time.Time{})
	if err == nil {
		json.Unmarshal(buf[:n], &h)
	}
	return h, n, err
}

// AttachVM connects to the shim of a running microVM, whose host pid is
// pid: how a restarted worker takes it back.
func AttachVM(socket, files string, pid int) (*VM, error) {
	c, err := initproto.Attach(socket, pid)
	if err != nil {
		return nil, err
	}
	return &VM{c: c, files: files}, nil
}

func (v *VM) Pid() int              { return v.c.Pid() }
func (v *VM) Done() <-chan struct{} { return v.c.Done() }
func (v *VM) Close() error          { return v.c.Close() }

// Destroy ends the guest. Its shim, asked first (SIGTERM), kills QEMU
// and reaps it before it exits: a QEMU orphaned as it died would be a
// zombie of the host's init until that reaped it, and the sandbox's
// group, which a zombie still holds, could not be removed meanwhile. A
// shim that does not end within 5 s is killed.
func (v *VM) Destroy() error {
	if v.c.SignalInit(syscall.SIGTERM) == nil {
		select {
		case <-v.c.Done():
		case <-time.After(5 * time.Second):
		}
	}
	return v.c.Destroy()
}
func (v *VM) Exec(ctx context.Context, cmd initproto.Cmd) (int, error) {
	return v.c.Exec(ctx, cmd)
}
func (v *VM) Result(ctx context.Context, id string) (backend.Exit, error) {
	return v.c.Result(ctx, id)
}
func (v *VM) Probe(ctx context.Context, id string) (bool, backend.Exit, error) {
	return v.c.Probe(ctx, id)
}
func (v *VM) Restrict(ctx context.Context, r initproto.Restrictions) error {
	return v.c.Restrict(ctx, r)
}
func (v *VM) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	return v.c.Signal(ctx, id, sig)
}

// simple sends a request that only a guest answers.
func (v *VM) simple(ctx context.Context, r initproto.Request) (initproto.Reply, error) {
	r.ID = fmt.Sprintf("#%s-%d", r.Op, initproto.RestrictSeq.Add(1))
	return v.c.Do(ctx, r, nil, nil)
}

// Protect makes paths of the guest read-only or hidden, as a container's
// Protect does, from inside the guest.
func (v *VM) Protect(readOnly, hidden []string) ([]string, error) {
	if len(readOnly) == 0 && len(hidden) == 0 {
		return nil, nil
	}
	r, err := v.simple(context.Background(), initproto.Request{Op: initproto.OpProtect, ReadOnly: readOnly, Hidden: hidden})
	return r.Missing, err
}

// SetHostname names the guest's host.
func (v *VM) SetHostname(name string) error {
	_, err := v.simple(context.Background(), initproto.Request{Op: initproto.OpHostname, Hostname: name})
	return err
}

// FreezeFS flushes the guest's upper file system to its disk and freezes
// it: the disk image is then consistent, and stays so until ThawFS.
func (v *VM) FreezeFS(ctx context.Context) error {
	_, err := v.simple(ctx, initproto.Request{Op: initproto.OpFreezeFS})
	return err
}

// ThawFS thaws what FreezeFS froze.
func (v *VM) ThawFS(ctx context.Context) error {
	_, err := v.simple(ctx, initproto.Request{Op: initproto.OpThawFS})
	return err
}

// Snapshot saves the guest's memory and device state and its disk, to
// state, ram and disk (files the caller made; ram is left empty when the
// guest's memory is anonymous, which state then holds), with the guest
// paused for as short a time as it takes; no command may run meanwhile.
// The guest runs on; with stop, it stays stopped (to be killed: it is
// being evicted) and disk may be nil (its own image is the disk).
func (v *VM) Snapshot(ctx context.Context, state, ram, disk *os.File, stop bool) (*initproto.SnapshotInfo, error) {
	fds := []int{int(state.Fd()), int(ram.Fd())}
	if disk != nil {
		fds = append(fds, int(disk.Fd()))
	}
	r, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpSnapshot, ID: fmt.Sprintf("#snapshot-%d", initproto.RestrictSeq.Add(1)), Stop: stop}, unix.UnixRights(fds...), nil)
	if err != nil {
		return nil, err
	}
	if r.Snapshot == nil {
		return nil, errors.New("the microVM's shim answered a snapshot with nothing (an older dsec's: stop and start the sandbox)")
	}
	return r.Snapshot, nil
}

// Memory is the guest's memory as its balloon last reported it.
func (v *VM) Memory(ctx context.Context) (*initproto.GuestMemory, error) {
	r, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpMemory, ID: fmt.Sprintf("#memory-%d", initproto.RestrictSeq.Add(1))}, nil, nil)
	if err != nil {
		return nil, err
	}
	if r.Memory == nil {
		return nil, errors.New("the microVM's shim reported no memory")
	}
	return r.Memory, nil
}

// Balloon sets the memory the guest keeps (0: all it was given); the
// balloon inflates over the rest, as the guest gives it up.
func (v *VM) Balloon(ctx context.Context, target int64) error {
	_, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpBalloon, ID: fmt.Sprintf("#balloon-%d", initproto.RestrictSeq.Add(1)), Balloon: target}, nil, nil)
	return err
}

// Files opens the guest's files, through its agent.
func (v *VM) Files() (*initproto.RemoteFiles, error) { return initproto.DialFiles(v.files) }
