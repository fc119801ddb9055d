package vmm

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/journal"
	"github.com/dsec-project/dsec/internal/runtime/sparse"
)

// A microVM's shim: the dsec-init binary again, as the host's side of a
// guest. It starts QEMU as its child (which dies with it), waits for
// the guest's agent, sets the guest up, and then serves the init
// protocol on the sandbox's socket as a container's init does: the
// worker cannot tell them apart but by the requests only a guest
// answers. Each request becomes a stream to the agent (initproto's frames); an
// exec's stdio descriptors stay with the shim, which copies the
// command's output into them as it comes, so a command's output and
// result outlive the worker as a container's do. The shim is the
// sandbox's init as the host sees it: its pid, its death the sandbox's.

// vmmEnv marks the re-executed binary as a microVM's shim.
const vmmEnv = "_DSEC_VMM"

// VMMName is the name a shim runs under (ps shows it).
const VMMName = "dsec-vmm"

// VMSpec describes a microVM to start.
type VMSpec struct {
	// Argv is QEMU's command line: the agent's socket is its fd 3 and
	// QMP's its fd 4 (microvm.Machine's AgentFD and QMPFD).
	Argv  []string            `json:"argv"`
	Guest initproto.GuestSpec `json:"guest"`
	// BootTimeout bounds the wait for the guest's agent to set up.
	BootTimeout time.Duration `json:"boot_timeout"`
	// Accel names the accelerator, for what the shim says of a guest
	// that did not come up.
	Accel string `json:"accel"`
	// Socket and FilesSocket are where the shim serves the init
	// protocol and the file protocol; Console is the file the guest's
	// serial console is written to (up to maxConsole bytes).
	Socket      string `json:"-"`
	FilesSocket string `json:"-"`
	Console     string `json:"-"`
	// Stderr gets the shim's own complaints.
	Stderr io.Writer `json:"-"`
	// Setup runs with the shim's host pid before it starts QEMU (the
	// place to put it in the sandbox's cgroup).
	Setup func(pid int) error `json:"-"`
	// Tap, if set, is the guest's NIC's host side, which QEMU gets as
	// its fd 5 (microvm.Machine's NetFD); Net says there is one.
	Tap *os.File `json:"-"`
	Net bool     `json:"net,omitempty"`
	// Idle runs QEMU under SCHED_IDLE (class batch); MergeMemory lets
	// KSM merge its memory, the guest's RAM (reclaim.ksm).
	Idle        bool `json:"idle,omitempty"`
	MergeMemory bool `json:"merge_memory,omitempty"`
	// RAM: the guest's memory is a memory file the shim makes, which
	// QEMU gets as the fd after the tap's (microvm.Machine's RAMFD),
	// shared: a memory snapshot copies it whole. Disk is the upper's
	// image, which a memory snapshot copies too.
	RAM  bool   `json:"ram,omitempty"`
	Disk string `json:"disk,omitempty"`
	// Restore starts the guest from a memory snapshot, whose device
	// state State holds (QEMU waits for it: microvm.Machine's Incoming).
	Restore *initproto.VMRestore `json:"restore,omitempty"`
	State   *os.File             `json:"-"`
	// Display: the machine has a screen, a keyboard and a tablet (a
	// full VM's), which OpScreen and OpInput reach through QMP.
	Display bool `json:"display,omitempty"`
}

// maxConsole bounds the console file: a guest printing without end
// fills nothing.
const maxConsole = 4 << 20

// runVMM is the shim's life.
func runVMM() error {
	buf, oob := make([]byte, 1<<20), make([]byte, unix.CmsgSpace(5*4))
	n, oobn, _, _, err := unix.Recvmsg(3, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil || n == 0 {
		os.Exit(0)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
		fds, _ = unix.ParseUnixRights(&msgs[0])
	}
	if len(fds) < 4 || len(fds) > 6 {
		return fmt.Errorf("the microVM came with %d descriptors, not 4 to 6", len(fds))
	}
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(fds[3], fd, 0); err != nil {
			return err
		}
	}
	unix.Close(fds[3])
	var spec VMSpec
	if err := json.Unmarshal(buf[:n], &spec); err != nil {
		return fmt.Errorf("read the microVM's spec: %w", err)
	}
	fc, err := net.FileConn(os.NewFile(3, "claim"))
	if err != nil {
		return err
	}
	first := fc.(*net.UnixConn)
	v := &vmm{running: map[string]*forward{}, done: map[string]initproto.Exit{}}
	// Then the tap (spec.Net), then the snapshot's state (spec.Restore).
	extra := fds[4:]
	var tap *os.File
	if spec.Net {
		if len(extra) == 0 {
			return errors.New("the microVM's network came without its tap")
		}
		tap, extra = os.NewFile(uintptr(extra[0]), "tap"), extra[1:]
	}
	if spec.Restore != nil {
		if len(extra) == 0 {
			return errors.New("the microVM's snapshot came without its state")
		}
		spec.State, extra = os.NewFile(uintptr(extra[0]), "state"), extra[1:]
	}
	if len(extra) > 0 {
		return errors.New("the microVM came with descriptors it cannot place")
	}
	// Asked to end, it ends its guest first (VM.Destroy).
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	v.started = make(chan struct{})
	go func() {
		<-term
		select {
		case <-v.started:
			v.qemu.Process.Kill()
			<-v.exited
		default:
		}
		os.Exit(0)
	}()
	if err := v.boot(spec, os.NewFile(uintptr(fds[2]), "console"), tap); err != nil {
		msg, _ := json.Marshal(map[string]string{"error": err.Error()})
		first.Write(msg)
		return err
	}
	l, err := net.FileListener(os.NewFile(uintptr(fds[0]), "ctl"))
	if err != nil {
		return err
	}
	fl, err := net.FileListener(os.NewFile(uintptr(fds[1]), "files"))
	if err != nil {
		return err
	}
	first.Write(initproto.Greeting)
	in, gone := make(chan initproto.Incoming), make(chan *initproto.ConnPeer)
	go initproto.Serve(first, in, gone)
	go func() {
		for {
			c, err := l.(*net.UnixListener).AcceptUnix()
			if err != nil {
				continue
			}
			c.Write(initproto.Greeting)
			go initproto.Serve(c, in, gone)
		}
	}()
	go v.serveFiles(fl)
	for {
		select {
		case r := <-in:
			v.handle(r)
		case c := <-gone:
			c.C.Close()
			v.forget(c)
		case <-v.exited:
			return fmt.Errorf("the microVM ended (%v); its console's end:\n%s", v.qemuErr, v.console.tail())
		}
	}
}

// vmm is the shim's state: the guest and the commands it runs.
type vmm struct {
	spec    VMSpec
	qemu    *exec.Cmd
	started chan struct{} // closed once qemu is set
	exited  chan struct{} // closed once QEMU has exited
	qemuErr error
	console *ring
	link    *initproto.Link
	qmp     *qmp
	ram     *os.File // the guest's memory (nil: anonymous)

	mu        sync.Mutex
	sess      *yamux.Session            // the agent's session now (nil: none, a snapshot replaces it)
	running   map[string]*forward       // execs not ended, by id
	done      map[string]initproto.Exit // exits kept, as the guest keeps them
	doneOrder []string
}

// session is the agent's session now.
func (v *vmm) session() (*yamux.Session, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.sess == nil {
		return nil, errors.New("the guest's agent is between sessions (a snapshot)")
	}
	return v.sess, nil
}

// use makes sess the agent's session. A session that ends while it is
// the one in use ends the guest (the guest wrote what is no session,
// and serves nothing more): the sandbox dies.
func (v *vmm) use(sess *yamux.Session) {
	v.mu.Lock()
	v.sess = sess
	v.mu.Unlock()
	go func() {
		<-sess.CloseChan()
		v.mu.Lock()
		cur := v.sess
		v.mu.Unlock()
		if cur == sess {
			v.qemu.Process.Kill()
		}
	}()
}

// drop ends the session in use (a snapshot will replace it).
func (v *vmm) drop() {
	v.mu.Lock()
	sess := v.sess
	v.sess = nil
	v.mu.Unlock()
	if sess != nil {
		v.link.End(sess)
	}
}

// boot starts QEMU, and sets the guest up once its agent is there.
func (v *vmm) boot(spec VMSpec, console, tap *os.File) error {
	agent, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	qmp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	agentTheirs, qmpTheirs := os.NewFile(uintptr(agent[1]), "agent"), os.NewFile(uintptr(qmp[1]), "qmp")
	v.console = &ring{max: 16 << 10, done: make(chan struct{})}
	files := []*os.File{agentTheirs, qmpTheirs}
	if tap != nil {
		files = append(files, tap)
	}
	if spec.RAM {
		if v.ram, err = guestRAM(spec); err != nil {
			closeAll(files)
			return err
		}
		files = append(files, v.ram)
	}
	out, err := v.startQEMU(spec, files)
	for _, f := range files {
		if f != v.ram {
			f.Close()
		}
	}
	if err != nil {
		return err
	}
	go v.console.copy(out, console)
	v.spec = spec
	qc, err := net.FileConn(os.NewFile(uintptr(qmp[0]), "qmp"))
	if err != nil {
		return err
	}
	agentConn, err := net.FileConn(os.NewFile(uintptr(agent[0]), "agent"))
	if err != nil {
		return err
	}
	v.link = initproto.NewLink(agentConn)
	spec.Guest.Time = time.Now().UnixNano()
	setup := make(chan error, 1)
	go func() {
		if v.qmp, err = newQMP(qc.(*net.UnixConn)); err != nil {
			setup <- err
			return
		}
		if err := v.pollBalloon(); err != nil {
			setup <- err
			return
		}
		if spec.Restore != nil {
			setup <- v.restore(spec)
			return
		}
		sess, err := v.link.Start(false)
		if err != nil {
			setup <- err
			return
		}
		v.use(sess)
		setup <- v.setup(spec.Guest)
	}()
	ended := func() error {
		return fmt.Errorf("the microVM ended before its guest came up (%v, accelerator %s); its console ends: %s", v.qemuErr, spec.Accel, v.console.tail())
	}
	select {
	case err := <-setup:
		if err == nil {
			return nil
		}
		select { // the agent gone: the guest's end, most likely
		case <-v.exited:
			return ended()
		case <-time.After(2 * time.Second):
		}
		return fmt.Errorf("the microVM's guest failed its setup: %v; its console ends: %s", err, v.console.tail())
	case <-v.exited:
		return ended()
	case <-time.After(spec.BootTimeout):
		v.qemu.Process.Kill()
		<-v.exited
		return fmt.Errorf("the microVM's guest did not come up within %v (accelerator %s); its console ends: %s", spec.BootTimeout, spec.Accel, v.console.tail())
	}
}

// guestRAM makes the guest's memory, a memory file (the shim's, so its
// pages are the sandbox's group's): empty, or a snapshot's RAM read
// into it. QEMU maps it shared; its free pages the guest reports are
// holes punched in it, given back to the host.
func guestRAM(spec VMSpec) (*os.File, error) {
	fd, err := unix.MemfdCreate("dsec-guest-ram", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("the guest's memory: %w", err)
	}
	f := os.NewFile(uintptr(fd), "ram")
	if spec.Restore == nil || spec.Restore.RAM == "" {
		return f, nil
	}
	img, err := os.Open(spec.Restore.RAM)
	if err == nil {
		_, err = sparse.Read(f, img)
		img.Close()
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("read the snapshot's memory: %w", err)
	}
	return f, nil
}

// startQEMU starts QEMU, with files as its fds 3 on, and no capabilities (it needs none: its files
// are the sandbox's, owned by root, and the devices it opens are
// allowed to the sandbox's group), as a child that dies with the shim;
// its stdout and stderr (the serial console) come out of the pipe it
// returns.
func (v *vmm) startQEMU(spec VMSpec, files []*os.File) (io.Reader, error) {
	argv := spec.Argv
	if len(argv) == 0 {
		return nil, errors.New("no QEMU command line")
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer w.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.ExtraFiles = files // fds 3, 4 and 5
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	// On a thread of its own whose bounding set is empty, inheritable
	// and ambient sets clear: what it execs, root or not, has no
	// capability. The thread waits for QEMU to end: QEMU's parent-death
	// signal comes when the thread that forked it ends.
	errc := make(chan error, 1)
	v.exited = make(chan struct{})
	go func() {
		runtime.LockOSThread()
		err := func() error {
			for c := 0; c <= 63; c++ {
				if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
					return fmt.Errorf("drop capability %d for QEMU: %w", c, err)
				}
			}
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var data [2]unix.CapUserData
			if err := unix.Capget(&hdr, &data[0]); err != nil {
				return err
			}
			data[0].Inheritable, data[1].Inheritable = 0, 0
			if err := unix.Capset(&hdr, &data[0]); err != nil {
				return err
			}
			unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
			if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
				return err
			}
			// Both are inherited by QEMU and every thread it makes.
			if spec.Idle {
				if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
					return fmt.Errorf("SCHED_IDLE: %w", err)
				}
			}
			if spec.MergeMemory {
				if err := unix.Prctl(unix.PR_SET_MEMORY_MERGE, 1, 0, 0, 0); err != nil {
					return fmt.Errorf("let KSM merge the guest's memory: %w", err)
				}
			}
			if err := cmd.Start(); err != nil {
				return fmt.Errorf("start QEMU (%s): %w", argv[0], err)
			}
			return nil
		}()
		errc <- err
		if err != nil {
			return
		}
		v.qemuErr = cmd.Wait()
		if v.qemuErr == nil {
			v.qemuErr = errors.New("QEMU exited")
		}
		close(v.exited)
	}()
	if err := <-errc; err != nil {
		r.Close()
		return nil, err
	}
	// The guest's memory is QEMU's: a sandbox over its limit loses its
	// VM before its shim, which then says so.
	os.WriteFile("/proc/"+strconv.Itoa(cmd.Process.Pid)+"/oom_score_adj", []byte("0"), 0)
	v.qemu = cmd
	close(v.started)
	return r, nil
}

// setup sends the guest its spec and waits for it to be the sandbox.
func (v *vmm) setup(g initproto.GuestSpec) error {
	_, err := v.ask(initproto.Request{Op: initproto.OpSetup, ID: "#setup", Setup: &g})
	return err
}

// ask sends the agent a request that has one reply, on a stream of its
// own, and returns the reply.
func (v *vmm) ask(req initproto.Request) (initproto.Reply, error) {
	var r initproto.Reply
	sess, err := v.session()
	if err != nil {
		return r, err
	}
	st, err := sess.OpenStream()
	if err != nil {
		return r, err
	}
	defer st.Close()
	fw, fr := initproto.NewFrameWriter(st), initproto.NewFrameReader(st)
	if err := fw.JSON(initproto.FrameRequest, req); err != nil {
		return r, err
	}
	kind, b, err := fr.Next()
	if err != nil {
		return r, fmt.Errorf("the guest's agent went away: %v", err)
	}
	if kind != initproto.FrameReply || json.Unmarshal(b, &r) != nil {
		return r, errors.New("the guest's agent answered no reply")
	}
	if r.Error != "" {
		return r, errors.New(r.Error)
	}
	return r, nil
}

// handle answers a worker's request, from the shim's own table where it
// can (commands it is copying), else from the guest's.
func (v *vmm) handle(r initproto.Incoming) {
	switch r.Req.Op {
	case initproto.OpSnapshot: // in this loop: no other request meanwhile
		v.snapshot(r)
		return
	case initproto.OpBalloon:
		closeAll(r.Files)
		if err := v.balloon(r.Req.Balloon); err != nil {
			initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Error: err.Error()})
			return
		}
		zero := 0
		initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero})
		return
	case initproto.OpScreen, initproto.OpInput:
		closeAll(r.Files)
		if err := v.screen(r.Req); err != nil {
			initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Error: err.Error()})
			return
		}
		zero := 0
		initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero})
		return
	case initproto.OpDiskSnap:
		closeAll(r.Files)
		if err := v.diskSnapshot(r.Req.Current, r.Req.Node, r.Req.Path); err != nil {
			initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Error: err.Error()})
			return
		}
		zero := 0
		initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero})
		return
	case initproto.OpMemory:
		closeAll(r.Files)
		m, err := v.guestMemory()
		if err != nil {
			initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Error: err.Error()})
			return
		}
		zero := 0
		initproto.Send(r.Conn, initproto.Reply{ID: r.Req.ID, Exit: &zero, Memory: m})
		return
	}
	id := r.Req.ID
	v.mu.Lock()
	f := v.running[id]
	x, ended := v.done[id]
	switch {
	case r.Req.Op == initproto.OpExec && (f != nil || ended):
		v.mu.Unlock()
		closeAll(r.Files)
		initproto.Send(r.Conn, initproto.Reply{ID: id, Error: "exec id " + id + " was used already"})
		return
	case (r.Req.Op == initproto.OpResult || r.Req.Op == initproto.OpProbe) && ended:
		v.mu.Unlock()
		initproto.Send(r.Conn, initproto.Reply{ID: id, Exit: &x.Code, Truncated: x.Truncated})
		return
	case r.Req.Op == initproto.OpProbe && f != nil:
		v.mu.Unlock()
		initproto.Send(r.Conn, initproto.Reply{ID: id, Running: true})
		return
	case r.Req.Op == initproto.OpResult && f != nil:
		f.hearer = r.Conn // the exit goes to whoever asks last
		v.mu.Unlock()
		return
	}
	if r.Req.Op == initproto.OpExec {
		files := r.Files
		if r.Req.NullStdin && len(files) == 2 {
			files = append([]*os.File{nil}, files...) // stdin's end at once
		}
		if len(files) != 3 || files[0] == nil && !r.Req.NullStdin {
			v.mu.Unlock()
			closeAll(r.Files)
			initproto.Send(r.Conn, initproto.Reply{ID: id, Error: "bad exec request"})
			return
		}
		// The shim writes the output the guest sends, bounded, and
		// none after the exit: the guest's agent is the sandbox's.
		f = &forward{id: id, files: files, hearer: r.Conn, sink: journal.NewSink(journal.Cap(r.Req.MaxOutput), files[1], files[2])}
		v.running[id] = f
	}
	v.mu.Unlock()
	if f == nil {
		closeAll(r.Files)
	}
	go v.forward(r.Req, r.Conn, f)
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}
