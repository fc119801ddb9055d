package container

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// A new mount namespace starts as a copy of its creator's: every mount
// of the host, every sandbox's overlay, lower and disk image among them.
// A sandbox init forked from the worker's namespace would hold those
// copies until it leaves them (leaveHostMounts), and an init in a user
// namespace holds them for as long as it lives: the kernel locks the
// copies to each other there, and a detached old root keeps its locked
// children with it. Meanwhile a sandbox removed on the host cannot free
// its disk image's loop device, and a file system unmounted on the host
// lives on, so an image checked or resized offline could be changed
// under a live superblock.
//
// So inits are forked from a namespace of their own: a tmpfs root with
// the init binary, /proc, /sys and the device nodes an init clones (and
// the host's library directories for an init linked dynamically), and
// nothing else. The spawner's thread made it by leaving the worker's
// (unshare, pivot_root, detach, while the worker's other threads keep
// the host's); every init is forked on that thread. Copying it costs the
// same whatever the host has mounted. The binary is bound once: one
// installed over it later is what the next worker starts.

// spawnInit is the init binary's path in the spawner's namespace.
const spawnInit = "/" + InitName

type spawner struct {
	reqs chan func()
}

// theSpawner is made at the first init's start (and again at the next
// after a failure).
var (
	spawnerMu  sync.Mutex
	theSpawner *spawner
)

// spawn runs fn on the spawner's thread (fn forks an init there).
func spawn(fn func()) error {
	spawnerMu.Lock()
	s := theSpawner
	if s == nil {
		var err error
		if s, err = newSpawner(); err != nil {
			spawnerMu.Unlock()
			return err
		}
		theSpawner = s
	}
	spawnerMu.Unlock()
	done := make(chan struct{})
	s.reqs <- func() { defer close(done); fn() }
	<-done
	return nil
}

func newSpawner() (*spawner, error) {
	self, err := InitBinary()
	if err != nil {
		return nil, err
	}
	s := &spawner{reqs: make(chan func())}
	ready := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		serveSpawns(s, self, ready)
	}()
	return s, <-ready
}

// serveSpawns makes the spawner's namespace on the locked thread and
// runs what spawn sends, for as long as the process lives. Never on
// the main thread: its namespace is what /proc/self shows.
func serveSpawns(s *spawner, self string, ready chan<- error) {
	if unix.Gettid() == unix.Getpid() {
		go func() {
			runtime.LockOSThread()
			serveSpawns(s, self, ready)
		}()
		runtime.UnlockOSThread()
		return
	}
	if err := spawnNamespace(self); err != nil {
		ready <- fmt.Errorf("the namespace sandbox inits start from: %w", err)
		return // the thread, left half-made, ends with this goroutine
	}
	ready <- nil
	for fn := range s.reqs {
		fn()
	}
}

// spawnNamespace moves the calling thread into a new mount namespace
// whose root holds only what an init needs before it makes its own.
func spawnNamespace(self string) error {
	if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	// What is bound into the root, cloned first: the tmpfs may cover it.
	srcs := map[string]string{spawnInit: self}
	for _, d := range Devices {
		srcs["/dev/"+d.Name] = "/dev/" + d.Name
	}
	// A dynamically linked init (a test binary; dsec built with cgo)
	// loads its interpreter and libraries from the host's directories.
	var links map[string]string
	if dynamic(self) {
		links = map[string]string{}
		for _, p := range []string{"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache"} {
			if l, err := os.Readlink(p); err == nil {
				links[p] = l
			} else if _, err := os.Stat(p); err == nil {
				srcs[p] = p
			}
		}
	}
	trees := map[string]int{}
	defer func() {
		for _, fd := range trees {
			unix.Close(fd)
		}
	}()
	for target, src := range srcs {
		fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		trees[target] = fd
	}
	// Any directory: the tmpfs covers it in this namespace only.
	const dir = "/tmp"
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755,size=64k"); err != nil {
		return fmt.Errorf("mount its root: %w", err)
	}
	for _, d := range []string{"/dev", "/etc"} {
		if err := os.Mkdir(dir+d, 0o755); err != nil {
			return err
		}
	}
	for p, l := range links {
		if err := os.Symlink(l, dir+p); err != nil {
			return err
		}
	}
	for target, fd := range trees {
		var err error
		if fi, serr := os.Stat(srcs[target]); serr == nil && fi.IsDir() {
			err = os.Mkdir(dir+target, 0o755)
		} else {
			err = os.WriteFile(dir+target, nil, 0o755)
		}
		if err != nil {
			return err
		}
		if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dir+target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("bind %s: %w", srcs[target], err)
		}
	}
	if err := unix.Mount("", dir+spawnInit, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("bind %s read-only: %w", self, err)
	}
	// The host's pid namespace's /proc (Go writes an init's uid_map
	// there; an init in a user namespace may mount its own only while
	// one is fully visible), a read-only /sys for the same reason, the
	// device nodes an init in a user namespace binds (cloneDevices).
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	for _, m := range []mnt{{"proc", "/proc", "proc", nodev, ""}, {"sysfs", "/sys", "sysfs", nodev | unix.MS_RDONLY, ""}} {
		if err := os.Mkdir(dir+m.target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, dir+m.target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
	}
	if err := os.Mkdir(dir+"/tmp", 0o755); err != nil { // where an init mounts its own root
		return err
	}
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_RDONLY, ""); err != nil {
		return fmt.Errorf("make its root read-only: %w", err)
	}
	return pivot(dir)
}

// dynamic reports whether the ELF file at p names an interpreter (a
// PT_INTERP program header): it is linked dynamically.
func dynamic(p string) bool {
	f, err := os.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	var h [64]byte // the ELF64 header
	if _, err := io.ReadFull(f, h[:]); err != nil || string(h[:4]) != "\x7fELF" || h[4] != 2 || h[5] != 1 {
		return false // not a little-endian ELF64: nothing of it is read
	}
	phoff, phentsize, phnum := binary.LittleEndian.Uint64(h[32:]), binary.LittleEndian.Uint16(h[54:]), binary.LittleEndian.Uint16(h[56:])
	if phentsize < 4 || phnum > 256 {
		return false
	}
	ph := make([]byte, int(phentsize)*int(phnum))
	if _, err := f.ReadAt(ph, int64(phoff)); err != nil {
		return false
	}
	const ptInterp = 3
	for i := 0; i < len(ph); i += int(phentsize) {
		if binary.LittleEndian.Uint32(ph[i:]) == ptInterp {
			return true
		}
	}
	return false
}
