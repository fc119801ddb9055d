package container

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/journal"
)

// MaybeInit runs the sandbox init and never returns if this process was
// started as one; otherwise it returns at once. (The same binary is a
// microVM's shim and its guest's agent: vmm.MaybeRun, agent.MaybeRun.)
func MaybeInit() {
	if os.Getenv(initEnv) == "1" {
		initproto.Run("dsec init", initSandbox)
	}
}

// initSandbox waits, as a spare, for its sandbox; then sets the root up,
// serves requests and reaps.
func initSandbox() error {
	spec, listener, tree, err := awaitSandbox()
	if err != nil {
		return err
	}
	l, err := net.FileListener(os.NewFile(uintptr(listener), "ctl"))
	if err != nil {
		return err
	}
	ul := l.(*net.UnixListener)
	fc, err := net.FileConn(os.NewFile(3, "claim"))
	if err != nil {
		return err
	}
	first := fc.(*net.UnixConn)
	devNull, err := enterSandbox(spec, tree)
	if err != nil {
		return err
	}
	// The worker that claimed the init hears it is ready from this
	// thread, before anything else: no goroutine needs to be scheduled
	// first. Its first request waits in the socket meanwhile.
	first.Write(initproto.Greeting)
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	in, gone := make(chan initproto.Incoming), make(chan *initproto.ConnPeer)
	// The worker that claimed the init, then later ones, one after
	// another or at once.
	go initproto.Serve(first, in, gone)
	go func() {
		for {
			c, err := ul.AcceptUnix()
			if err != nil {
				continue
			}
			c.Write(initproto.Greeting)
			go initproto.Serve(c, in, gone)
		}
	}()
	jobs := initproto.NewLoop()
	jobs.DevNull, jobs.Ends = devNull, make(chan initproto.Ending)
	for {
		select {
		case r := <-in:
			jobs.Handle(r)
			for _, f := range r.Files {
				f.Close() // those handle did not take
			}
		case c := <-gone:
			c.C.Close()
			jobs.Forget(c)
		case x := <-jobs.Ends:
			jobs.Ended(x)
		case <-sigs:
		}
		jobs.Reap()
	}
}

// awaitSandbox readies the init as a spare (out of the host's mounts,
// its loopback up, its bounding set dropped), tells the worker, and
// waits for its sandbox: its spec, and the descriptors of its control
// socket's listener and of its root's tree; the sandbox's log becomes
// the init's stdout and stderr. A spare the worker discards exits here.
func awaitSandbox() (spec Spec, listener, tree int, err error) {
	// The copier of its commands' output keeps a thread, blocked in a
	// system call: one more spare, so that initThreads stay idle.
	if err := journal.StartCopier(); err != nil {
		return spec, 0, 0, err
	}
	initproto.SpareThreads(initproto.InitThreads + 1)
	// Out of the host's mounts before anything: a spare may wait long,
	// and must pin none of them meanwhile.
	if err := leaveHostMounts(os.Getenv(usernsEnv) == "1"); err != nil {
		return spec, 0, 0, err
	}
	if err := initproto.LoopbackUp(); err != nil {
		return spec, 0, 0, err
	}
	// The bounding set limits only what commands exec into: dropped
	// while the spare waits, off the claim's path; the init keeps its
	// own capabilities for the claim's mounts.
	if err := DropBounding(); err != nil {
		return spec, 0, 0, err
	}
	if _, err := unix.Write(3, initproto.ReadyMessage); err != nil {
		return spec, 0, 0, err
	}
	// A spec is a few KiB; the largest, a seccomp program of
	// BPF_MAXINSNS instructions, under 64 KiB as JSON.
	buf, oob := make([]byte, 256<<10), make([]byte, unix.CmsgSpace(3*4))
	n, oobn, _, _, err := unix.Recvmsg(3, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil || n == 0 { // discarded: the worker closed its end
		os.Exit(0)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
		fds, _ = unix.ParseUnixRights(&msgs[0])
	}
	if len(fds) != 3 {
		return spec, 0, 0, fmt.Errorf("the sandbox came with %d descriptors, not 3", len(fds))
	}
	listener, tree, logfd := fds[0], fds[1], fds[2]
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(logfd, fd, 0); err != nil {
			return spec, 0, 0, err
		}
	}
	unix.Close(logfd)
	if err := json.Unmarshal(buf[:n], &spec); err != nil {
		return spec, 0, 0, fmt.Errorf("read spec: %w", err)
	}
	return spec, listener, tree, nil
}

// enterSandbox sets the sandbox's root up from tree and the init as
// spec says, then drops what no command may inherit (descriptors,
// privileges, the init's dumpability) and applies spec's restrictions
// to this thread, which forks every command. It returns the sandbox's
// /dev/null, the stdin of a command without one.
func enterSandbox(spec Spec, tree int) (*os.File, error) {
	if err := setupRoot(tree); err != nil {
		return nil, err
	}
	// The stdin of a command without one: the sandbox's own /dev/null,
	// opened once while the init alone runs there.
	devNull, err := os.OpenFile("/dev/null", os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("the sandbox's /dev/null: %w", err)
	}
	if spec.Hostname != "" {
		if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
			return nil, fmt.Errorf("sethostname: %w", err)
		}
	}
	// Both are inherited by every command forked from this thread.
	if spec.Idle {
		if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
			return nil, fmt.Errorf("SCHED_IDLE: %w", err)
		}
		if err := initproto.CoreSchedule(); err != nil {
			return nil, err
		}
	}
	if spec.MergeMemory {
		if err := unix.Prctl(unix.PR_SET_MEMORY_MERGE, 1, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("let KSM merge the sandbox's memory: %w", err)
		}
	}
	// Nothing the worker, the host or the init holds reaches a command:
	// commands get exactly the three descriptors of their request.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return nil, err
	}
	if err := DropPrivileges(); err != nil {
		return nil, err
	}
	// On this thread, which forks every command: they inherit it.
	if err := initproto.ApplyRestrictions(spec.Restrictions); err != nil {
		return nil, err
	}
	// Its other threads still hold the host's capabilities: no process
	// of the sandbox may ptrace the init or read its /proc entries.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return nil, fmt.Errorf("make the init undumpable: %w", err)
	}
	return devNull, nil
}
