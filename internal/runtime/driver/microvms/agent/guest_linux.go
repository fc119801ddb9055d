package agent

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// A microVM guest's agent: dsec-init as the guest's pid 1. It loads the
// modules its initramfs holds, finds its devices, and serves the
// sandbox over the agent's virtio-serial port: first the setup (its
// layers, each a virtio-pmem device mounted EROFS with DAX, under an
// overlay whose upper is on the virtio-blk disk, which becomes its
// root), then the init protocol (package initproto), request by request, each a
// stream of the port's yamux session (initproto's frames). Commands run as in a
// container: forked from one thread that dropped to the sandbox's
// capabilities and restrictions, reaped by the same loop, their exits
// kept for the same ids; their stdio are pipes (or a terminal) the agent
// copies to and from the stream, since a port passes no descriptors.

// guestDevWait bounds the wait for the guest's devices to appear.
const guestDevWait = 60 * time.Second

// runGuest is the agent's life; it returns only on a failure, which
// ends the guest (pid 1 exits: the kernel panics, and QEMU ends).
func runGuest() error {
	if err := guestMounts(); err != nil {
		return err
	}
	if err := LoadModules("/modules"); err != nil {
		return err
	}
	// What the guest writes reaches its disk within a second (not the
	// kernel's 30): QEMU killed, or the host down, loses at most that.
	for k, v := range map[string]string{"dirty_expire_centisecs": "100", "dirty_writeback_centisecs": "100"} {
		os.WriteFile("/proc/sys/vm/"+k, []byte(v), 0)
	}
	return serve(setupGuest, true)
}

// serve serves the host over the agent's port: the setup first (setup
// makes the guest its spec describes), then request by request. drop:
// commands run with a container's capabilities (a microVM's); else with
// the agent's own (a full VM's, whose root is the guest's root).
func serve(setup func(*initproto.GuestSpec) (*guest, error), drop bool) error {
	port, err := agentPort()
	if err != nil {
		return err
	}
	l := &guestLink{l: initproto.NewLink(port)}
	sess, err := l.l.Start(true)
	if err != nil {
		return err
	}
	l.sess = sess
	st, err := sess.AcceptStream()
	if err != nil {
		return fmt.Errorf("the host never asked for the guest: %w", err)
	}
	fr, fw := initproto.NewFrameReader(st), initproto.NewFrameWriter(st)
	kind, b, err := fr.Next()
	var req initproto.Request
	if err == nil && (kind != initproto.FrameRequest || json.Unmarshal(b, &req) != nil || req.Op != initproto.OpSetup || req.Setup == nil) {
		err = errors.New("the host's first request is not the guest's setup")
	}
	if err != nil {
		return err
	}
	g, err := setup(req.Setup)
	if g != nil {
		g.link = l
	}
	if err != nil {
		fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Error: "guest setup: " + err.Error()})
		st.Close()
		time.Sleep(time.Second) // for the reply to leave
		return err
	}
	// Commands fork from this thread: it holds what they run under.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return err
	}
	if drop {
		if err := container.DropBounding(); err != nil {
			return err
		}
		if err := container.DropPrivileges(); err != nil {
			return err
		}
	}
	if err := initproto.ApplyRestrictions(req.Setup.Restrictions); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return err
	}
	zero := 0
	fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Exit: &zero})
	st.Close()

	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	in := make(chan initproto.Incoming)
	go g.accept(in)
	jobs := initproto.NewLoop()
	jobs.OOMKills = guestOOMKills
	for {
		select {
		case r := <-in:
			jobs.Handle(r)
			for _, f := range r.Files {
				f.Close()
			}
		case <-sigs:
		}
		jobs.Reap()
	}
}

// guestOOMKills is how many processes the guest's OOM killer took.
func guestOOMKills() int64 {
	b, _ := os.ReadFile("/proc/vmstat")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "oom_kill "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// guestMounts mounts what the agent needs of the kernel in the
// initramfs.
func guestMounts() error {
	for _, m := range []struct {
		src, target, fstype string
		flags               uintptr
		data                string
	}{
		{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0700"},
	} {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
	}
	return nil
}

// LoadModules loads the modules in dir in the order of their names
// (the initramfs numbers them so).
func LoadModules(dir string) error {
	names, err := filepath.Glob(filepath.Join(dir, "*.ko"))
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, p := range names {
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		err = unix.FinitModule(int(f.Fd()), "", 0)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("load module %s: %w", filepath.Base(p), err)
		}
	}
	return nil
}

// agentPort opens the virtio-serial port named AgentPort.
func agentPort() (*os.File, error) {
	const name = "dsec.agent"
	var last error
	for deadline := time.Now().Add(guestDevWait); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		ports, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
		for _, p := range ports {
			b, err := os.ReadFile(p)
			if err != nil || strings.TrimSpace(string(b)) != name {
				continue
			}
			f, err := os.OpenFile("/dev/"+filepath.Base(filepath.Dir(p)), os.O_RDWR, 0)
			if err == nil {
				return f, nil
			}
			last = err
		}
	}
	return nil, fmt.Errorf("no virtio-serial port %s after %v (%v)", name, guestDevWait, last)
}

// guest is what the agent keeps of its setup.
type guest struct {
	upper int // the upper's file system (its mount's root), for FIFREEZE
	link  *guestLink
}

// guestLink is the agent's end of the link (initproto.Link) and its session
// now, which a memory snapshot replaces.
type guestLink struct {
	l    *initproto.Link
	mu   sync.Mutex
	sess *yamux.Session
	// quiesced is the nonce the next session comes after ("": the
	// session's end is the guest's).
	quiesced string
}

// accept serves the session's streams; a quiesced session is followed
// by the next one.
func (g *guest) accept(in chan<- initproto.Incoming) {
	for {
		g.link.mu.Lock()
		sess := g.link.sess
		g.link.mu.Unlock()
		st, err := sess.AcceptStream()
		if err == nil {
			go g.serveStream(st, in)
			continue
		}
		g.link.mu.Lock()
		nonce := g.link.quiesced
		g.link.mu.Unlock()
		if nonce == "" {
			fmt.Fprintf(os.Stderr, "dsec guest: the host's session ended: %v\n", err)
			os.Exit(1)
		}
		next, err := g.link.l.Next()
		if err != nil {
			fmt.Fprintf(os.Stderr, "dsec guest: the agent's port, waiting for the host: %v\n", err)
			os.Exit(1)
		}
		g.link.mu.Lock()
		g.link.sess, g.link.quiesced = next, ""
		g.link.mu.Unlock()
	}
}

// quiesce flushes and freezes the upper's file system (a snapshot's disk
// is then consistent) and ends the session once its answer, the nonce
// the next session will come after, is out.
func (g *guest) quiesce(st *yamux.Stream, fw *initproto.FrameWriter, req initproto.Request) {
	unix.Sync()
	err := unix.IoctlSetInt(g.upper, fiFreeze, 0)
	frozen := errors.Is(err, unix.EBUSY)
	if err != nil && !frozen {
		fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Error: fmt.Sprintf("freeze the upper: %v", err)})
		st.Close()
		return
	}
	b := make([]byte, 16)
	rand.Read(b)
	nonce := hex.EncodeToString(b)
	// The nonce is awaited before it is told: the host may snapshot
	// the guest as soon as it has the answer.
	g.link.mu.Lock()
	g.link.quiesced = nonce
	sess := g.link.sess
	g.link.mu.Unlock()
	g.link.l.Expect(nonce)
	zero := 0
	fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Exit: &zero, Nonce: nonce, Frozen: frozen})
	st.Close()
	sess.Close()
}

// resume makes the guest the one spec describes after a snapshot, its
// own or another's (a branch): the clock from the host, entropy from the
// host and its RNG reseeded at once, its host name and network, its
// upper thawed.
func (g *guest) resume(spec *initproto.GuestSpec) error {
	if spec.Time > 0 {
		ts := unix.NsecToTimespec(spec.Time)
		unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
	}
	if len(spec.Seed) > 0 {
		addEntropy(spec.Seed)
		if f, err := os.Open("/dev/urandom"); err == nil {
			// Not at the next interval: now, before a command reads it.
			unix.IoctlSetInt(int(f.Fd()), unix.RNDRESEEDCRNG, 0)
			f.Close()
		}
	}
	if spec.Hostname != "" {
		if err := unix.Sethostname([]byte(spec.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	if spec.Net != nil {
		if err := guestReNet(spec.Net); err != nil {
			return err
		}
	}
	if !spec.Thaw {
		return nil
	}
	if err := unix.IoctlSetInt(g.upper, fiThaw, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("thaw the upper: %w", err)
	}
	return nil
}

// pciSlot is compiled on first use: every sandbox's init links this
// package.
var pciSlot = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`/0000:00:([0-9a-f]{2})\.0/`) })

// slotOf is the PCI slot of block device dev (its /sys/block path).
func slotOf(dev string) int {
	p, err := filepath.EvalSymlinks("/sys/block/" + dev)
	if err != nil {
		return -1
	}
	m := pciSlot().FindStringSubmatch(p)
	if m == nil {
		return -1
	}
	n, _ := strconv.ParseUint(m[1], 16, 8)
	return int(n)
}

// guestDevices waits for the layers' devices (pmem, or with disks
// virtio-blk) and the upper's disk: layer i's device, by its PCI slot,
// and the disk.
func guestDevices(layers int, disks bool) ([]string, string, error) {
	prefix := "pmem"
	if disks {
		prefix = "vd"
	}
	var out []string
	upper := ""
	for deadline := time.Now().Add(guestDevWait); ; time.Sleep(10 * time.Millisecond) {
		out = make([]string, layers)
		found := 0
		upper = ""
		devs, _ := os.ReadDir("/sys/block")
		for _, d := range devs {
			n, slot := d.Name(), slotOf(d.Name())
			switch {
			case strings.HasPrefix(n, prefix) && slot >= initproto.FirstLayerSlot && slot < initproto.FirstLayerSlot+layers:
				if _, err := os.Stat("/dev/" + n); err == nil {
					out[slot-initproto.FirstLayerSlot] = "/dev/" + n
					found++
				}
			case strings.HasPrefix(n, "vd") && slot == initproto.UpperSlot:
				if _, err := os.Stat("/dev/" + n); err == nil {
					upper = "/dev/" + n
				}
			}
		}
		if found == layers && upper != "" {
			return out, upper, nil
		}
		if time.Now().After(deadline) {
			return nil, "", fmt.Errorf("after %v the guest has %d of its %d layer devices and upper disk %q", guestDevWait, found, layers, upper)
		}
	}
}

// setupGuest mounts the sandbox's root and moves into it.
func setupGuest(s *initproto.GuestSpec) (*guest, error) {
	setClock(s)
	if s.Layers < 1 || s.Layers > initproto.MaxLayers {
		return nil, fmt.Errorf("%d layers: a guest takes 1 to %d", s.Layers, initproto.MaxLayers)
	}
	layers, disk, err := guestDevices(s.Layers, s.LayerDisks)
	if err != nil {
		return nil, err
	}
	var lowers []string
	for i, dev := range layers {
		dir := fmt.Sprintf("/run/layers/%d", i)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		// DAX: the guest reads the host's page cache of the image, with
		// no page cache of its own.
		opts := "dax=always"
		if s.LayerDisks {
			opts = ""
		}
		if err := unix.Mount(dev, dir, "erofs", unix.MS_RDONLY|unix.MS_NODEV, opts); err != nil {
			return nil, fmt.Errorf("mount layer %d (%s): %w", i, dev, err)
		}
		lowers = append(lowers, dir)
	}
	if err := os.MkdirAll("/run/upper", 0o755); err != nil {
		return nil, err
	}
	if err := unix.Mount(disk, "/run/upper", "ext4", unix.MS_NODEV|unix.MS_NOSUID|unix.MS_NOATIME, ""); err != nil {
		return nil, fmt.Errorf("mount the upper's disk %s: %w", disk, err)
	}
	for _, d := range []string{"upper", "work"} {
		if err := os.Mkdir("/run/upper/"+d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, err
		}
	}
	g := &guest{}
	if g.upper, err = unix.Open("/run/upper", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	const root = "/run/root"
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	ov := mount.Overlay(lowers, "/run/upper/upper", "/run/upper/work")
	ov.Options = append(ov.Options, "nodev") // a node made in the sandbox never opens
	if err := ov.Mount(root); err != nil {
		return nil, err
	}
	if err := container.StageKernelFS(root, nil); err != nil {
		return nil, err
	}
	if s.Hostname != "" {
		if err := unix.Sethostname([]byte(s.Hostname)); err != nil {
			return nil, fmt.Errorf("sethostname: %w", err)
		}
	}
	if err := initproto.LoopbackUp(); err != nil {
		return nil, err
	}
	if s.Net != nil {
		if err := guestNet(s.Net); err != nil {
			return nil, err
		}
	}
	// The initramfs is memory: what is left of it once the modules are
	// in goes (the agent runs on from its inode).
	for _, p := range []string{"/init", "/bin", "/modules"} {
		os.RemoveAll(p)
	}
	if err := switchRoot(root); err != nil {
		return nil, err
	}
	if _, err := container.ProtectPaths(os.Getpid(), s.ReadOnly, s.Hidden); err != nil {
		return nil, fmt.Errorf("policy files: %w", err)
	}
	return g, nil
}

// switchRoot makes dir the root: the initramfs cannot be pivoted away
// from, so dir is moved over it, as switch_root(8) does.
func switchRoot(dir string) error {
	if err := unix.Chdir(dir); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	return unix.Chdir("/")
}

// setClock sets the guest's clock from the host's, and adds the host's
// entropy to its pool, as s gives them.
func setClock(s *initproto.GuestSpec) {
	if s.Time > 0 {
		ts := unix.NsecToTimespec(s.Time)
		unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
	}
	if len(s.Seed) > 0 {
		addEntropy(s.Seed)
	}
}

// addEntropy credits b to the kernel's pool (RNDADDENTROPY).
func addEntropy(b []byte) {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return
	}
	defer f.Close()
	// struct rand_pool_info: entropy_count (bits), buf_size, buf.
	buf := make([]byte, 8+len(b))
	binary.NativeEndian.PutUint32(buf, uint32(8*len(b)))
	binary.NativeEndian.PutUint32(buf[4:], uint32(len(b)))
	copy(buf[8:], b)
	unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&buf[0])))
}

// serveStream answers the request a stream opens with.
func (g *guest) serveStream(st *yamux.Stream, in chan<- initproto.Incoming) {
	fr, fw := initproto.NewFrameReader(st), initproto.NewFrameWriter(st)
	kind, b, err := fr.Next()
	var req initproto.Request
	if err != nil || kind != initproto.FrameRequest || json.Unmarshal(b, &req) != nil {
		st.Close()
		return
	}
	answer := func(err error) {
		r := initproto.Reply{ID: req.ID}
		if err != nil {
			r.Error = err.Error()
		} else {
			zero := 0
			r.Exit = &zero
		}
		fw.JSON(initproto.FrameReply, r)
		st.Close()
	}
	switch req.Op {
	case initproto.OpExec:
		guestExec(st, fr, fw, req, in)
	case initproto.OpResult, initproto.OpProbe, initproto.OpRestrict, initproto.OpSignal:
		in <- initproto.Incoming{Req: req, Conn: &streamPeer{st: st, fw: fw}}
	case initproto.OpFiles:
		initproto.ServeFiles(st, fr, fw)
		st.Close()
	case initproto.OpProtect:
		var missing []string
		container.OnSpentThread(func() { missing, err = container.ProtectPaths(os.Getpid(), req.ReadOnly, req.Hidden) })
		if err != nil {
			answer(err)
			return
		}
		zero := 0
		fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Exit: &zero, Missing: missing})
		st.Close()
	case initproto.OpHostname:
		answer(unix.Sethostname([]byte(req.Hostname)))
	case initproto.OpFreezeFS:
		unix.Sync()
		answer(unix.IoctlSetInt(g.upper, fiFreeze, 0))
	case initproto.OpQuiesce:
		g.quiesce(st, fw, req)
	case initproto.OpResume:
		if req.Setup == nil {
			answer(errors.New("resume without a spec"))
			return
		}
		err := g.resume(req.Setup)
		if err == nil && req.Setup.Forget {
			in <- initproto.Incoming{Req: initproto.Request{Op: initproto.OpForget}}
		}
		answer(err)
	case initproto.OpThawFS:
		err := unix.IoctlSetInt(g.upper, fiThaw, 0)
		if errors.Is(err, unix.EINVAL) { // not frozen
			err = nil
		}
		answer(err)
	default:
		fw.JSON(initproto.FrameReply, initproto.Reply{ID: req.ID, Error: fmt.Sprintf("unknown request %q: the guest's agent and the worker are of different dsec versions", req.Op)})
		st.Close()
	}
}

// streamPeer hears the replies of a request on its stream, which closes
// after the last.
type streamPeer struct {
	st *yamux.Stream
	fw *initproto.FrameWriter
}

func (p *streamPeer) Send(r initproto.Reply) {
	p.fw.JSON(initproto.FrameReply, r)
	if r.Last() {
		p.st.Close()
	}
}

var _ net.Conn = (*yamux.Stream)(nil)
