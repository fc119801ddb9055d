// Package runtimetest helps tests of the sandbox runtime: a store with
// busybox layers, a worker in a process of its own (so that a test can
// kill -9 it), cleanup, and the list of what a root leaked.
package runtimetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/internal/snap"
	"github.com/dsec-project/dsec/sdk"
)

// workerEnv makes a test binary a worker (see MaybeWorker);
// workerConfigEnv, if set, is its worker.Config as JSON.
const (
	workerEnv       = "DSEC_TEST_WORKER_ROOT"
	workerConfigEnv = "DSEC_TEST_WORKER_CONFIG"
	// fetcherArg starts a test binary as a worker's fetcher (of a lazy
	// layer from its remote): TEST-BINARY fetcherArg DIR.
	fetcherArg = "-dsec-test-fetcher"
)

// MaybeWorker runs a worker and exits if the test binary was started as
// one by StartWorker; a TestMain calls it (after container.MaybeInit).
// drivers are backends of the test's own, which a worker runs when its
// Config names them (Drivers).
func MaybeWorker(drivers ...worker.Driver) {
	testDrivers = drivers
	if len(os.Args) == 3 && os.Args[1] == fetcherArg { // a worker's lazy layer's fetcher
		err := lazy.Serve(context.Background(), os.Args[2], 300*time.Millisecond, slog.Default())
		if err != nil && !errors.Is(err, lazy.ErrBusy) {
			os.Stderr.WriteString("fetcher: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	root := os.Getenv(workerEnv)
	if root == "" {
		return
	}
	cfg := worker.Config{Root: root, Version: "test", Cache: lazy.Tuning{ReadAheadKB: lazy.DefaultReadAheadKB}}
	if b := os.Getenv(workerConfigEnv); b != "" {
		if err := json.Unmarshal([]byte(b), &cfg); err != nil {
			os.Stderr.WriteString("worker config: " + err.Error() + "\n")
			os.Exit(1)
		}
	}
	var names struct {
		Drivers   []string
		RemoteURL string
		Pod       string
	}
	json.Unmarshal([]byte(os.Getenv(workerConfigEnv)), &names)
	if names.Pod != "" {
		if err := cgroup.Join(names.Pod); err != nil {
			os.Stderr.WriteString("join the pod's groups: " + err.Error() + "\n")
			os.Exit(1)
		}
	}
	if names.RemoteURL != "" {
		t, err := remote.Open(names.RemoteURL, remote.Options{})
		if err != nil {
			os.Stderr.WriteString("worker remote: " + err.Error() + "\n")
			os.Exit(1)
		}
		cfg.Remote = t
		cfg.Fetcher = lazy.Start{Path: os.Args[0], Args: []string{fetcherArg}}
	}
	for _, d := range testDrivers {
		if slices.Contains(names.Drivers, d.Name()) {
			cfg.Drivers = append(cfg.Drivers, d)
		}
	}
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	// As dsec daemon does: SIGTERM and SIGINT stop it on purpose.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := worker.Serve(ctx, cfg); err != nil {
		os.Stderr.WriteString("worker: " + err.Error() + "\n")
		os.Exit(1)
	}
	os.Exit(0)
}

// testDrivers are the test's own backends (MaybeWorker's), which Clean
// takes down too.
var testDrivers []worker.Driver

// host is what takes down root's sandboxes: the built-in drivers and
// the test's own, their groups where root's worker made them (treeOf).
func host(root string) *runtime.Host {
	return &runtime.Host{Root: root, Drivers: runtime.NewDrivers(runtime.DriverConfig{Root: root, Extra: testDrivers, Groups: treeOf(root)})}
}

// parents are the cgroup parents of the workers this process started,
// by root (none: the default).
var parents sync.Map

// treeOf is the tree of the groups of root's sandboxes.
func treeOf(root string) *cgroup.Tree {
	p, _ := parents.Load(root)
	s, _ := p.(string)
	return cgroup.NewTree(s)
}

// Layers builds into root's store bb:1, a busybox base with
// /etc/answer, and ws:1, a workspace with /work/hello.
func Layers(t testing.TB, root string) {
	t.Helper()
	layertest.RequireRoot(t)
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	base := layertest.BusyboxRoot(t, t.TempDir())
	for _, d := range []string{"proc", "sys", "dev", "tmp", "root", "work"} {
		os.MkdirAll(filepath.Join(base, d), 0o755)
	}
	os.WriteFile(filepath.Join(base, "etc", "answer"), []byte("42\n"), 0o644)
	ws := t.TempDir()
	os.MkdirAll(filepath.Join(ws, "work"), 0o755)
	os.WriteFile(filepath.Join(ws, "work", "hello"), []byte("from the workspace\n"), 0o644)
	for tag, src := range map[string]string{"bb:1": base, "ws:1": ws} {
		// Every root's layers alike, whenever built (as a fleet's hosts
		// get one layer from its remote): the trees' times fixed.
		stamp(t, src)
		ref, _ := layer.ParseRef(tag)
		if _, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref}); err != nil {
			t.Fatal(err)
		}
	}
}

// stamp sets the times of everything under dir, links too, to one
// instant.
func stamp(t testing.TB, dir string) {
	t.Helper()
	at := []unix.Timespec{unix.NsecToTimespec(layerTime), unix.NsecToTimespec(layerTime)}
	err := filepath.WalkDir(dir, func(path string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return unix.UtimesNanoAt(unix.AT_FDCWD, path, at, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// layerTime is the test layers' files' time (2026-01-01 UTC).
const layerTime = 1767225600 * int64(time.Second)

// Worker is a worker process a test started.
type Worker struct {
	Root string
	cmd  *exec.Cmd
	done chan struct{}
}

// StartWorker starts the test binary as root's worker and waits until
// it answers.
func StartWorker(t testing.TB, root string) *Worker {
	t.Helper()
	return StartWorkerWith(t, root, Config{})
}

// Config is what a test sets of a worker's configuration.
type Config struct {
	Admission worker.Admission
	Reclaim   worker.Reclaim
	Pools     []worker.PoolConfig
	// KeepLayers: worker.Config's (0 here: unmounted at once).
	KeepLayers time.Duration
	Defaults   worker.Defaults
	// CgroupParent: worker.Config's (a test's own, to bound).
	CgroupParent string
	// Listen and TLS: worker.Config's (the TCP API).
	Listen []string
	TLS    worker.TLS
	// E2B: worker.Config's (the E2B front).
	E2B worker.E2B
	// MicroVM: worker.Config's (microvmtest.Settings).
	MicroVM microvm.Settings
	// VM: worker.Config's (its Agent microvmtest.Agent, static).
	VM vms.Settings `json:",omitempty"`
	// DNS: worker.Config's (the upstream of domain rules' resolvers).
	DNS egress.Config
	// MaxRequests and MaxRequestsPerToken: worker.Config's (the TCP
	// API's and the E2B front's requests at once).
	MaxRequests, MaxRequestsPerToken int
	// SnapLimits: worker.Config's (pack-diff's bounds).
	SnapLimits snap.Limits
	// MaxOutput: worker.Config's (exec.max_output).
	MaxOutput int64
	// Drivers names the test's own backends (MaybeWorker's) the worker
	// runs beside the built-in ones.
	Drivers []string `json:",omitempty"`
	// RemoteURL is the worker's remote (worker.Config.Remote, opened
	// from this URL); PublishSnapshots: worker.Config's (snap.publish).
	RemoteURL        string `json:",omitempty"`
	PublishSnapshots bool   `json:",omitempty"`
	// MountNS starts the worker in a mount namespace of its own, whose
	// mounts are copies of the test's (peers of shared ones), as a
	// container's are; Pod places it in that group in every cgroup
	// hierarchy (cgroup.Join), as a pod's container is.
	MountNS bool   `json:",omitempty"`
	Pod     string `json:",omitempty"`
	// NetNS starts the worker in that network namespace (ip netns's
	// name; entered with nsenter: ip netns exec would remount /sys, and
	// the cgroup file systems under it with it): with MountNS, a host of
	// its own on one kernel.
	NetNS string `json:",omitempty"`
}

// StartWorkerWith is StartWorker with cfg.
func StartWorkerWith(t testing.TB, root string, cfg Config) *Worker {
	t.Helper()
	b, _ := json.Marshal(cfg)
	args := []string{os.Args[0]}
	if cfg.MountNS {
		args = append([]string{"unshare", "--mount", "--propagation", "unchanged"}, args...)
	}
	if cfg.NetNS != "" {
		args = append([]string{"nsenter", "--net=/run/netns/" + cfg.NetNS}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), workerEnv+"="+root, workerConfigEnv+"="+string(b))
	log, err := os.OpenFile(filepath.Join(root, "worker.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if cfg.CgroupParent != "" {
		parents.Store(root, cfg.CgroupParent)
	}
	w := &Worker{Root: root, cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(w.done) }()
	t.Cleanup(w.Kill)
	if _, told := dumped.LoadOrStore(dumpKey{t, root}, true); !told {
		t.Cleanup(func() { dumpLog(t, root) })
	}
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if c, err := sdk.New(sdk.Options{Root: root}); err == nil {
			if v, err := c.Version(context.Background()); err == nil && v.Pid == cmd.Process.Pid {
				return w
			}
		}
		select {
		case <-w.done:
			b, _ := os.ReadFile(filepath.Join(root, "worker.log"))
			t.Fatalf("worker exited: %s", b)
		default:
		}
	}
	t.Fatal("worker does not answer")
	return nil
}

// dumped holds the tests and roots whose worker log a failure shows.
var dumped sync.Map

type dumpKey struct {
	t    testing.TB
	root string
}

// dumpLog shows the end of root's worker log if t failed: the workers'
// side of a failure.
func dumpLog(t testing.TB, root string) {
	dumped.Delete(dumpKey{t, root})
	if !t.Failed() {
		return
	}
	b, _ := os.ReadFile(filepath.Join(root, "worker.log"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	t.Logf("the end of %s/worker.log:\n%s", root, strings.Join(lines[max(0, len(lines)-40):], "\n"))
}

// Pid is the worker's pid.
func (w *Worker) Pid() int { return w.cmd.Process.Pid }

// Kill kills the worker with SIGKILL and reaps it; its spares' groups
// are swept as the next worker would.
func (w *Worker) Kill() {
	w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
	sweepSpares(w.Root)
}

// Crash kills the worker with SIGKILL and reaps it, and sweeps nothing:
// what a kill -9 leaves, for the next worker to find.
func (w *Worker) Crash() {
	w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
}

// Stop stops the worker on purpose, as a supervisor or an operator
// does (SIGTERM, or the shutdown request of dsec daemon stop), and
// waits until it has exited, which it does once it has taken down what
// it made ahead.
func (w *Worker) Stop(t testing.TB, shutdown bool) {
	t.Helper()
	if shutdown {
		c, err := sdk.New(sdk.Options{Root: w.Root})
		if err == nil {
			err = c.Shutdown(context.Background())
		}
		if err != nil {
			t.Fatalf("the shutdown request: %v", err)
		}
	} else if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("the worker has not exited 3 minutes after it was stopped")
	}
	if code := w.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("the worker stopped on purpose exited %d", code)
	}
}

// Processes lists the live processes of root's sandboxes: those in a
// group of its (the suffix its groups' names end with), and those whose
// command line or environment names root (a fetcher's --root, a test
// worker's). Zombies hold nothing and are left out. Each is "PID
// COMMAND (GROUP)".
func Processes(root string) []string {
	abs, _ := filepath.Abs(root)
	suffix := runtime.CgroupSuffix(root)
	procs, _ := os.ReadDir("/proc")
	var out []string
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		dir := filepath.Join("/proc", p.Name())
		stat, _ := os.ReadFile(filepath.Join(dir, "stat"))
		if _, state, _ := strings.Cut(string(stat), ") "); state == "" || strings.HasPrefix(state, "Z") {
			continue
		}
		cg, _ := os.ReadFile(filepath.Join(dir, "cgroup"))
		cmdline, _ := os.ReadFile(filepath.Join(dir, "cmdline"))
		environ, _ := os.ReadFile(filepath.Join(dir, "environ"))
		group := ""
		for _, line := range strings.Split(string(cg), "\n") {
			if strings.HasSuffix(line, suffix) {
				group = line[strings.LastIndex(line, "/")+1:]
			}
		}
		if group == "" && !names(cmdline, abs) && !names(environ, abs) {
			continue
		}
		out = append(out, fmt.Sprintf("%d %s (%s)", pid, strings.ReplaceAll(strings.TrimRight(string(cmdline), "\x00"), "\x00", " "), group))
	}
	return out
}

// names says whether a NUL-separated list names path, or a path in it.
func names(list []byte, path string) bool {
	for _, f := range strings.Split(string(list), "\x00") {
		if _, v, ok := strings.Cut(f, "="); ok {
			f = v
		}
		if f == path || strings.HasPrefix(f, path+"/") {
			return true
		}
	}
	return false
}

// Children lists the worker's child processes (zombies included) but
// its spare inits while they wait.
func (w *Worker) Children() []string {
	var out []string
	primed := primedPids(w.Root)
	for _, pid := range w.children() {
		if !waitingSpare(pid) && !slices.Contains(primed, pid) {
			out = append(out, pid)
		}
	}
	return out
}

// primedPids lists the inits of the sandboxes root's worker made ahead
// of need (runtime.Primed): its own while it runs, as its spares are.
func primedPids(root string) []string {
	var out []string
	for _, id := range runtime.Unnamed(root) {
		var st runtime.State
		if b, err := os.ReadFile(filepath.Join(root, "sandboxes", id, "state.json")); err == nil && json.Unmarshal(b, &st) == nil && st.Pid > 0 {
			out = append(out, strconv.Itoa(st.Pid))
		}
	}
	return out
}

// Spares lists the worker's spare inits that wait: alive, in a spare's
// group, on the tmpfs root a spare waits on (a sandbox's is its overlay).
func (w *Worker) Spares() []string {
	var out []string
	for _, pid := range w.children() {
		if waitingSpare(pid) {
			out = append(out, pid)
		}
	}
	return out
}

func (w *Worker) children() []string {
	tasks, _ := filepath.Glob(filepath.Join("/proc", strconv.Itoa(w.Pid()), "task", "*", "children"))
	var out []string
	for _, t := range tasks {
		b, _ := os.ReadFile(t)
		out = append(out, strings.Fields(string(b))...)
	}
	return out
}

func waitingSpare(pid string) bool {
	stat, _ := os.ReadFile(filepath.Join("/proc", pid, "stat"))
	cg, _ := os.ReadFile(filepath.Join("/proc", pid, "cgroup"))
	var fs unix.Statfs_t
	err := unix.Statfs(filepath.Join("/proc", pid, "root"), &fs)
	_, state, _ := strings.Cut(string(stat), ") ")
	return err == nil && fs.Type == unix.TMPFS_MAGIC && !strings.HasPrefix(state, "Z") && strings.Contains(string(cg), "/sb-_")
}

// Clean removes every sandbox under root, as a test's cleanup: after
// the worker is gone, through the runtime directly.
func Clean(root string) {
	h := host(root)
	names, _ := runtime.List(root)
	for _, n := range names {
		if sb, err := h.Load(n); err == nil {
			sb.Remove()
		}
	}
	if serving(root) { // the rest is a running worker's own
		return
	}
	// What a dead worker made ahead, as the next worker would sweep it.
	// Every sandbox is gone now, so a spare's group that still holds a
	// process is one the worker had claimed for a sandbox it did not
	// finish making (a primed one, say): killed too.
	h.SweepUnnamed()
	h.SweepSpares(nil, false)
	h.Lowers().Sweep(nil)
	disk.SweepUppers(root, nil)
	disk.ReleaseUppers(root)
	waitFetchers(root)
}

// waitFetchers waits (5 s at most) for the fetchers of root's lazy
// layers to go: each exits, unmounting its file, once no mount of its
// layer is left (lazy.Serve's idle time after).
func waitFetchers(root string) {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile("/proc/thread-self/mountinfo")
		if !strings.Contains(string(b), " "+root+"/cache/") {
			return
		}
	}
}

// sweepSpares removes the groups of a dead worker's spares, as the next
// worker on root would: once its spares exited (they do as it dies), the
// empty groups. A group that still holds a process is a sandbox's (or
// a leak Leftovers reports). A running worker's spares are its own.
func sweepSpares(root string) {
	if serving(root) {
		return
	}
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if !anySpareWaits(root) {
			break
		}
	}
	host(root).SweepSpares(nil, true)
}

// anySpareWaits reports whether a spare of root is still alive.
func anySpareWaits(root string) bool {
	t := treeOf(root)
	groups, _ := runtime.Groups(t, root)
	for _, name := range groups {
		g, err := t.Open(name)
		if err != nil {
			continue
		}
		pids, _ := g.Pids()
		for _, pid := range pids {
			// A sandbox's init is on its overlay; a spare, waiting,
			// starting or exiting, on anything else.
			var fs unix.Statfs_t
			if unix.Statfs(filepath.Join("/proc", strconv.Itoa(pid), "root"), &fs) != nil || fs.Type != unix.OVERLAYFS_SUPER_MAGIC {
				return true
			}
		}
	}
	return false
}

// serving reports whether a worker runs on root (worker.Serving): a
// killed worker's lock can outlive it for a moment, in a child it was
// starting, and a cleanup that took it for a running worker's would
// leave the dead one's mounts.
func serving(root string) bool { return worker.Serving(root) }

// Leftovers lists what the sandboxes of root left on the host: mounts
// below root, cgroups of its sandboxes, nat addresses, loop devices on
// its files, sandbox directories.
func Leftovers(root string) []string {
	var out []string
	spares := serving(root) // a running worker's spare inits and primed sandboxes are its own
	var primed []string     // their directories, and those of the layers they hold
	var primedIDs []string
	if spares {
		primedIDs = runtime.Unnamed(root)
		for _, id := range primedIDs {
			primed = append(primed, filepath.Join(root, "sandboxes", id))
			users, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", id))
			for _, u := range users {
				primed = append(primed, filepath.Dir(filepath.Dir(u)))
			}
		}
	}
	// A running worker keeps the uppers file system mounted; every
	// upper on it is a sandbox's.
	var named []string
	states, _ := filepath.Glob(filepath.Join(root, "sandboxes", "*", "state*"))
	for _, st := range states {
		var s struct {
			UpperFS string `json:"upper_fs"`
		}
		if b, err := os.ReadFile(st); err == nil && json.Unmarshal(b, &s) == nil {
			named = append(named, s.UpperFS)
		}
	}
	ups, _ := os.ReadDir(disk.UppersDir(root))
	for _, u := range ups {
		if !slices.Contains(named, u.Name()) {
			out = append(out, "upper "+u.Name())
		}
	}
	b, _ := os.ReadFile("/proc/thread-self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], root+"/") && !(spares && f[4] == disk.UppersDir(root)) &&
			!slices.ContainsFunc(primed, func(d string) bool { return strings.HasPrefix(f[4], d+"/") }) {
			out = append(out, "mount "+f[4])
		}
	}
	abs, _ := filepath.Abs(root)
	suffix := runtime.CgroupSuffix(root)
	for _, pattern := range []string{filepath.Join(cgroup.Root, "*", treeOf(root).Parent(), "*"+suffix), filepath.Join(cgroup.Root, treeOf(root).Parent(), "*"+suffix),
		filepath.Join(cgroup.Root, "*", treeOf(root).IdleParent(), "*"+suffix), filepath.Join(cgroup.Root, treeOf(root).IdleParent(), "*"+suffix)} {
		dirs, _ := filepath.Glob(pattern) // v1 controllers, unified, pure v2
		for _, d := range dirs {
			// A running worker's spare's group names an ID no sandbox
			// has; a primed sandbox's, an unnamed one.
			id := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(d), "sb-"), suffix)
			if _, err := os.Stat(filepath.Join(root, "sandboxes", id)); spares && (os.IsNotExist(err) || slices.Contains(primedIDs, id)) {
				continue
			}
			out = append(out, "cgroup "+strings.TrimPrefix(d, cgroup.Root+"/"))
		}
	}
	for what, pattern := range map[string]string{"nat address": "/run/dsec/nat/[0-9]*", "user namespace ids": "/run/dsec/userns/[0-9]*"} {
		held, _ := filepath.Glob(pattern)
		for _, h := range held {
			if b, _ := os.ReadFile(h); strings.HasPrefix(string(b), abs+"/") {
				out = append(out, what+" "+h+" of "+string(b))
			}
		}
	}
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file") // disk quotas' images
	for _, l := range loops {
		if b, _ := os.ReadFile(l); strings.HasPrefix(string(b), abs+"/") && !(spares && strings.TrimSpace(string(b)) == filepath.Join(abs, "uppers.img")) {
			out = append(out, "loop device "+strings.Split(l, "/")[3]+" on "+strings.TrimSpace(string(b)))
		}
	}
	ents, _ := os.ReadDir(filepath.Join(root, "sandboxes"))
	for _, e := range ents {
		if !slices.Contains(primed, filepath.Join(root, "sandboxes", e.Name())) {
			out = append(out, "sandbox dir "+e.Name())
		}
	}
	names, _ := os.ReadDir(filepath.Join(root, "names"))
	for _, e := range names {
		out = append(out, "sandbox name "+e.Name())
	}
	return out
}

// KillPod does to the groups of pod (cgroup.Join's) what a kubelet does
// to a pod it deletes: kills every process left in them, in every
// hierarchy, and removes them. It fails if a group will not go (a
// process in it that outlives its kill).
func KillPod(pod string) error {
	var errs []error
	for _, h := range cgroup.Hierarchies() {
		d := filepath.Join(h, pod)
		var err error
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, perr := strconv.Atoi(f); perr == nil {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			if err = os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
				err = nil
				break
			}
		}
		if err != nil {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			errs = append(errs, fmt.Errorf("%s (holds %q): %w", d, strings.Fields(string(b)), err))
		}
	}
	return errors.Join(errs...)
}

// VMImage builds into root's store deb-vm:1, a VM image of a Debian
// tree that boots (layertest.DebianBootable) under a tree of the suite's
// own, stacked: /etc/answer ("42\n") and an empty /work, as bb:1 has.
// It returns the image's name.
func VMImage(t testing.TB, root string) string {
	t.Helper()
	layertest.RequireRoot(t)
	deb, err := layertest.DebianBootable()
	if err != nil {
		t.Skipf("no bootable Debian tree (debootstrap needs Debian's mirror): %v", err)
	}
	top := t.TempDir()
	for _, d := range []string{"etc", "work"} {
		os.MkdirAll(filepath.Join(top, d), 0o755)
	}
	os.WriteFile(filepath.Join(top, "etc", "answer"), []byte("42\n"), 0o644)
	return buildVMImage(t, root, "deb-vm:1", top, deb)
}

// buildVMImage builds trees (topmost first) into root's store as the VM
// image tag, and returns tag.
func buildVMImage(t testing.TB, root, tag string, trees ...string) string {
	t.Helper()
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef(tag)
	if _, err := vm.Build(context.Background(), s, trees, ref, vm.BuildOptions{DiskOptions: vm.DiskOptions{Seed: "runtimetest"}}); err != nil {
		t.Fatal(err)
	}
	return tag
}

// DesktopUnit is the systemd unit of a desktop image (docs/vm.md has the
// same): Xfce on the screen, root logged in, started with the machine.
const DesktopUnit = `[Unit]
Description=Xfce on the screen, logged in
After=systemd-user-sessions.service

[Service]
Environment=HOME=/root
ExecStart=/usr/bin/xinit /usr/bin/startxfce4 -- /usr/bin/Xorg :0 vt7 -nolisten tcp -s 0 -dpms
Restart=on-failure

[Install]
WantedBy=multi-user.target
`

// DesktopImage builds into root's store desk-vm:1, a VM image of a
// Debian tree with Xfce (layertest.DebianDesktop) under a tree that
// starts it at boot, logged in (DesktopUnit), its panel's default
// layout taken (no first-run question). It returns the image's name.
func DesktopImage(t testing.TB, root string) string {
	t.Helper()
	layertest.RequireRoot(t)
	deb, err := layertest.DebianDesktop()
	if err != nil {
		t.Skipf("no Debian tree with Xfce (debootstrap needs Debian's mirror): %v", err)
	}
	top := t.TempDir()
	panel, err := os.ReadFile(filepath.Join(deb, "etc/xdg/xfce4/panel/default.xml"))
	if err != nil {
		t.Fatal(err)
	}
	for p, body := range map[string]string{"etc/systemd/system/dsec-desktop.service": DesktopUnit,
		"root/.config/xfce4/xfconf/xfce-perchannel-xml/xfce4-panel.xml": string(panel)} {
		os.MkdirAll(filepath.Join(top, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(top, p), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(top, "root"), 0o700)
	wants := filepath.Join(top, "etc/systemd/system/multi-user.target.wants")
	os.MkdirAll(wants, 0o755)
	if err := os.Symlink("../dsec-desktop.service", filepath.Join(wants, "dsec-desktop.service")); err != nil {
		t.Fatal(err)
	}
	return buildVMImage(t, root, "desk-vm:1", top, deb)
}
